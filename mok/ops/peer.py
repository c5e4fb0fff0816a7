"""Rows of other ranks (csrc/include/mok/moe/peer_rows.cuh): the megakernel's pull and combine bodies as kernels,
reading every rank's buffer through a table of base addresses (docs/megakernel.md). A `Peers` is one such buffer
on every rank: symmetric memory's peer pointers across GPUs, CUDA IPC between processes on one GPU, or tensors of
this process (`Peers.of`, what the one-GPU tests use). The kernels cannot tell which.

    pull_rows(x_peers, pull_rank, pull_token)                  the megakernel's pull_x: rank r's rows, zeros in padding
    pull_rows(d_out_peers, ..., weights=w_peers, pull_k=...)   pull_dy: bf16(d_out·w), L0's dy
    combine_peers(y_peers, combine_rank, combine_row, w, shared)   combine (combine_dx without weights)

The tables are mok.ep_build's (int32): pull_* per row of the rank, combine_* per route of its tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mok.checks import check_cuda, check_layout, fail
from mok.ops.core import load_extension
from mok.ops.gemm import GEMM_K_ALIGN


@dataclass(frozen=True)
class Peers:
    """One buffer on each of R ranks, as this process reaches it: `addresses` int64 [R] on `device` (rank s's
    base address), each buffer [capacity, width] of `dtype`, row-major, 16-byte aligned. `keep` holds what
    owns the memory (this process's tensors, or a symmetric-memory handle) for as long as the table lives."""

    addresses: torch.Tensor
    capacity: int
    width: int
    dtype: torch.dtype
    keep: tuple = field(default=(), repr=False, compare=False)

    @property
    def num_ranks(self) -> int:
        return self.addresses.numel()

    def tokens(self, split: list, cols: slice = slice(None), num_rows: int | None = None) -> torch.Tensor:
        """Every rank's first split[s] rows (their columns cols), rank-major (a per-token buffer: the tokens of all
        ranks in global order), in one copy; with num_rows, as the first rows of that many, the rest zeros."""
        parts = [b[:n, cols] for b, n in zip(self.keep, split)]
        if num_rows is None:
            return torch.cat(parts)
        out = parts[0].new_zeros(num_rows, parts[0].shape[1])
        torch.cat(parts, out=out[: sum(split)])
        return out

    @staticmethod
    def of(buffers: list[torch.Tensor]) -> Peers:
        """The table of this process's tensors, one per rank: the same shape, dtype and device each (a CPU
        table serves mok.twins' pull_rows and combine_peers, which read `keep`)."""
        if not isinstance(buffers, (list, tuple)) or not buffers:
            fail("buffers", "a non-empty list of tensors, one per rank", type(buffers).__name__)
        first = buffers[0]
        for s, b in enumerate(buffers):
            name = f"buffers[{s}]"
            check_layout(name, b, first.dtype, tuple(first.shape), "buffers[0]'s dtype and shape [capacity, width]")
            if b.device != first.device:
                fail(name, f"device {first.device} (buffers[0]'s)", b.device)
            if not b.is_contiguous() or b.data_ptr() % 16:
                fail(name, "a contiguous tensor at a 16-byte aligned address", f"strides {b.stride()}, "
                     f"address {b.data_ptr():#x}")
        if first.dim() != 2:
            fail("buffers[0]", "a 2D tensor [capacity, width]", tuple(first.shape))
        table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64).to(first.device)  # [R]
        return Peers(table, first.shape[0], first.shape[1], first.dtype, tuple(buffers))


def _check_peers(name: str, peers, dtype: torch.dtype, device) -> None:
    if not isinstance(peers, Peers):
        fail(name, "a mok.ops.Peers", type(peers).__name__)
    if peers.dtype != dtype:
        fail(name, f"buffers of {dtype}", peers.dtype)
    check_layout(f"{name}.addresses", peers.addresses, torch.int64, (None,), "[num_ranks]")
    check_cuda(f"{name}.addresses", peers.addresses, device, "the tables'")


def _check_table(name: str, t: torch.Tensor, shape: tuple, what: str, device=None) -> None:
    check_layout(name, t, torch.int32, shape, what)
    check_cuda(name, t, device)


def pull_rows(src: Peers, pull_rank: torch.Tensor, pull_token: torch.Tensor, *, weights: Peers | None = None,
              pull_k: torch.Tensor | None = None, num_topk: int = 1) -> torch.Tensor:
    """bf16 [num_rows, width]: row r = src[pull_rank[r]] row pull_token[r], zeros where pull_rank[r] < 0; with
    weights (fp32 [capacity, num_topk] on every rank), bf16(fp32(row) · weights[pull_rank[r]][pull_token[r],
    pull_k[r]]). A rank, token or k out of bounds gives a NaN row (nothing is read)."""
    _check_peers("src", src, torch.bfloat16, None)
    device = src.addresses.device
    if src.width % GEMM_K_ALIGN:
        fail("src", f"rows of a multiple of {GEMM_K_ALIGN} elements (16 bytes)", src.width)
    _check_table("pull_rank", pull_rank, (None,), "[num_rows]", device)
    num_rows = pull_rank.shape[0]
    _check_table("pull_token", pull_token, (num_rows,), "[num_rows] (pull_rank's)", device)
    if weights is not None:
        _check_peers("weights", weights, torch.float32, device)
        if weights.num_ranks != src.num_ranks or weights.width != num_topk or weights.capacity != src.capacity:
            fail("weights", f"{src.num_ranks} buffers of [{src.capacity}, num_topk={num_topk}]",
                 f"{weights.num_ranks} of [{weights.capacity}, {weights.width}]")
        if pull_k is None:
            fail("pull_k", "int32 [num_rows] with weights", None)
        _check_table("pull_k", pull_k, (num_rows,), "[num_rows] (pull_rank's)", device)
    out = torch.empty(num_rows, src.width, dtype=torch.bfloat16, device=device)  # [num_rows, width]
    load_extension().pull_rows(src=src.addresses, weights=None if weights is None else weights.addresses,
                               pull_rank=pull_rank, pull_token=pull_token,
                               pull_k=pull_rank if pull_k is None else pull_k, out=out, capacity=src.capacity,
                               num_topk=num_topk)
    return out


def combine_peers(rows: Peers, combine_rank: torch.Tensor, combine_row: torch.Tensor,
                  topk_weights: torch.Tensor | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
    """mok.ops.combine_rows with route (t, k)'s row at rows[combine_rank[t, k]] row combine_row[t, k]: out bf16
    [num_tokens, width] = bf16(Σ_k w[t,k]·row + shared[t]), fp32, increasing k, the same bits. A rank or row out
    of bounds gives its token NaN (nothing is read)."""
    _check_peers("rows", rows, torch.bfloat16, None)
    device = rows.addresses.device
    if rows.width % GEMM_K_ALIGN:
        fail("rows", f"rows of a multiple of {GEMM_K_ALIGN} elements (16 bytes)", rows.width)
    _check_table("combine_rank", combine_rank, (None, None), "[num_tokens, num_topk]", device)
    T, K = combine_rank.shape
    _check_table("combine_row", combine_row, (T, K), "[num_tokens, num_topk] (combine_rank's)", device)
    if topk_weights is not None:
        check_layout("topk_weights", topk_weights, torch.float32, (T, K), "[num_tokens, num_topk]")
        check_cuda("topk_weights", topk_weights, device)
    if shared is not None:
        check_layout("shared", shared, torch.bfloat16, (T, rows.width), "[num_tokens, width]")
        check_cuda("shared", shared, device, aligned=True)
    out = torch.empty(T, rows.width, dtype=torch.bfloat16, device=device)  # [num_tokens, width]
    load_extension().combine_peers(rows=rows.addresses, combine_rank=combine_rank, combine_row=combine_row,
                                   topk_weights=topk_weights, shared=shared, out=out, capacity=rows.capacity)
    return out
