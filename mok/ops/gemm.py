"""Grouped BF16 GEMMs over the route schedule (csrc/gemm_bf16.cu; L2 building blocks, docs/gemm.md).

Rows follow mok.schedule (expert-major segments padded to the schedule's block_m, which must be a
multiple of the kernels' 128-row tile). Outputs stay in that row layout, `sched.num_rows` rows; the kernels
run the schedule's real tiles only (their count read on the device from `sched.counts`), so the spare rows of
a schedule built without a sync are left as allocated (torch.empty): never read, never written. Bitwise
deterministic: every output is one fp32 sum over the full K in a fixed order, whatever `num_sms` (the
persistent grid size; None = the device's SM count).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mok.checks import check_cuda, check_layout, check_optional_int, fail
from mok.ops.core import load_extension
from mok.ops.quant import BLOCK_SIZE

GEMM_BLOCK_M = 128  # rows per kernel tile: BLOCK_M of csrc/include/mok/gemm/config.cuh
GEMM_BLOCK_K = 64  # k per pipeline stage: BLOCK_K; the weight gradients' K is each segment's real rows rounded up to it
GEMM_K_ALIGN = 8  # k and n multiples of 8 elements: 16-byte rows for TMA and cp.async
GEMM_DOWN_TILE_N = 256  # output columns of a GEMM2 (kDown) task: Tile<kDown>::kTaskN


class GemmSchedule(NamedTuple):
    """The schedule as the GEMM kernels read it (struct RowSchedule, mok/api.h)."""

    row_to_token: torch.Tensor  # int32 [num_rows], -1 = padding
    tile_to_expert: torch.Tensor  # int32 [num_rows / 128], one entry per 128-row kernel tile


def gemm_schedule_tensors(sched, device) -> GemmSchedule:
    """The schedule as the GEMM kernels read it, on `device`: (row_to_token int32 [num_rows],
    tile_to_expert int32 [num_rows / 128], one entry per 128-row kernel tile)."""
    if sched.block_m % GEMM_BLOCK_M:
        fail("sched", f"block_m a multiple of {GEMM_BLOCK_M} (make_schedule(..., block_m=128), the default)",
              f"block_m={sched.block_m}")
    ready = getattr(sched, "gemm_tensors", None)  # written by make_schedule_cuda's own launches
    if ready is not None and ready[0].device == torch.device(device):
        return GemmSchedule(*ready)
    row_to_token = sched.row_to_token.to(device=device, dtype=torch.int32).contiguous()  # [num_rows]
    tile_to_expert = sched.tile_to_expert.to(device=device, dtype=torch.int32)  # [num_tiles]
    tile_to_expert = tile_to_expert.repeat_interleave(sched.block_m // GEMM_BLOCK_M)  # [num_rows / 128]
    return GemmSchedule(row_to_token, tile_to_expert.contiguous())


def gemm_schedule_kwargs(sched, device) -> dict:
    """The schedule's arguments of a row-wise GEMM binding, by name: row_to_token, tile_to_expert, counts."""
    row_to_token, tile_to_expert = gemm_schedule_tensors(sched, device)
    return {"row_to_token": row_to_token, "tile_to_expert": tile_to_expert, "counts": real_num_rows(sched, device)}


def weight_grad_schedule_tensors(sched, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule as the weight-gradient kernel reads it, on `device`: (expert_offsets int32 [E + 1],
    tokens_per_expert int32 [E], the real rows of each segment), views of one allocation made on the first
    call and kept on the schedule (a backward runs three weight gradients over it)."""
    ready = getattr(sched, "weight_grad_tensors", None)
    if ready is not None and ready[0].device == torch.device(device):
        return ready
    both = torch.cat([sched.expert_offsets, sched.tokens_per_expert]).to(device=device, dtype=torch.int32)
    ready = both[:sched.num_experts + 1], both[sched.num_experts + 1:]  # [E + 1], [E]
    sched.weight_grad_tensors = ready
    return ready


def real_num_rows(sched, device) -> torch.Tensor | None:
    """The schedule's device counts (int32 [2], entry 0 = its real padded rows) for the kernels that run over
    its rows: they run the real tiles only, so spare rows (mok.schedule) are never read or written. None
    (every row of the buffers) for a schedule without counts."""
    counts = getattr(sched, "counts", None)
    if counts is None:
        return None
    if counts.device != torch.device(device) or counts.dtype != torch.int32:
        fail("sched.counts", f"int32 on {device} (the operands' device)", f"{counts.dtype} on {counts.device}")
    return counts


def _check_gemm_dim(name: str, size: int, what: str) -> None:
    if size < GEMM_K_ALIGN or size % GEMM_K_ALIGN:
        fail(name, f"{what} a positive multiple of {GEMM_K_ALIGN}", size)


def _check_num_sms(num_sms) -> int:
    """The kernels' num_sms: None (0: the device's SM count) or an int >= 1."""
    return check_optional_int("num_sms", num_sms, 1) or 0


def _check_limit(swiglu_limit) -> None:
    if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float)) and swiglu_limit == swiglu_limit):
        fail("swiglu_limit", "None or a float (not NaN)", repr(swiglu_limit))


def _check_devices(device: torch.device, **tensors) -> None:
    """Operands already checked by check_layout: CUDA, on the first operand's device, contiguous, 16-byte aligned."""
    for name, t in tensors.items():
        check_cuda(name, t, device, "the first operand's", aligned=True)


def _gemm1_args(x, w_gate, w_up, sched, swiglu_limit, num_sms, intermediate_multiple=GEMM_K_ALIGN,
                num_tokens=None) -> tuple:
    """GEMM1's argument checks; returns (intermediate, the binding's keyword arguments besides the operands and
    outputs: the schedule's (gemm_schedule_kwargs), swiglu_limit, has_limit, num_sms). num_tokens: x's rows (None:
    the schedule's tokens)."""
    check_layout("x", x, torch.bfloat16, (sched.num_tokens if num_tokens is None else num_tokens, None),
                 "[num_tokens, hidden]")
    hidden = x.shape[1]
    _check_gemm_dim("x", hidden, "hidden (dim 1)")
    check_layout("w_gate", w_gate, torch.bfloat16, (sched.num_experts, None, hidden),
                 "[num_experts, intermediate, hidden]")
    intermediate = w_gate.shape[1]
    _check_gemm_dim("w_gate", intermediate, "intermediate (dim 1)")
    if intermediate % intermediate_multiple:
        fail("w_gate", f"intermediate (dim 1) a multiple of {intermediate_multiple} (row-wise MXFP8 blocks)",
             intermediate)
    check_layout("w_up", w_up, torch.bfloat16, tuple(w_gate.shape), "[num_experts, intermediate, hidden] (w_gate's)")
    _check_limit(swiglu_limit)
    sms = _check_num_sms(num_sms)
    _check_devices(x.device, x=x, w_gate=w_gate, w_up=w_up)
    return intermediate, {**gemm_schedule_kwargs(sched, x.device), **_limit_kwargs(swiglu_limit), "num_sms": sms}


def _limit_kwargs(swiglu_limit) -> dict:
    return {"swiglu_limit": 0.0 if swiglu_limit is None else float(swiglu_limit),
            "has_limit": swiglu_limit is not None}


def grouped_gemm_bf16_swiglu_gather(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, sched,
                                    swiglu_limit: float | None = None, num_sms: int | None = None):
    """GEMM1 of the routed experts with fused dispatch and SwiGLU, in the schedule's row layout:
    for row r with token t = row_to_token[r] and expert e, gate[r] = bf16(x[t]·w_gate[e]ᵀ),
    up[r] = bf16(x[t]·w_up[e]ᵀ), h[r] = bf16(swiglu(gate[r], up[r], swiglu_limit)) (mok.reference);
    padding rows are zeros. x [num_tokens, hidden]; w_gate, w_up [num_experts, intermediate, hidden];
    hidden and intermediate multiples of 8. Returns (h, gate, up), bf16 [num_rows, intermediate] each."""
    intermediate, kwargs = _gemm1_args(x, w_gate, w_up, sched, swiglu_limit, num_sms)
    h, gate, up = (torch.empty(sched.num_rows, intermediate, dtype=torch.bfloat16, device=x.device)
                   for _ in range(3))  # [num_rows, intermediate] each
    load_extension().grouped_gemm_bf16_swiglu_gather(x=x, w_gate=w_gate, w_up=w_up, h=h, gate=gate, up=up, **kwargs)
    return h, gate, up


def _rowwise_mx_buffer(rows: int, cols: int, device) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One allocation for a row-wise MXFP8 matrix as the GEMM1 kernel writes it (E4M3 data, then the scales)
    and its views (data float8_e4m3fn [rows, cols], scales uint8 [rows, cols / 32]), as mxfp8_quantize_rowwise
    returns them."""
    buffer = torch.empty(rows * cols + rows * cols // BLOCK_SIZE, dtype=torch.uint8, device=device)
    data = buffer[:rows * cols].view(torch.float8_e4m3fn).view(rows, cols)  # [rows, cols]
    return buffer, (data, buffer[rows * cols:].view(rows, cols // BLOCK_SIZE))  # scales [rows, cols / 32]


def grouped_gemm_bf16_swiglu_gather_mxfp8_out(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, sched,
                                              swiglu_limit: float | None = None, num_sms: int | None = None):
    """GEMM1 for the MXFP8 forward: grouped_gemm_bf16_swiglu_gather with its outputs as the next steps read them,
    straight from its epilogue (no kernel between): h as its row-wise round trip (= mxfp8_fake_quantize(h, -1),
    GEMM2's operand) and gate, up quantized row-wise (each = mxfp8_quantize_rowwise(gate): (data, scales), what
    the backward saves). intermediate a multiple of 32. Returns (h bf16 [num_rows, intermediate], gate_mx,
    up_mx); in padding rows h and the data are zeros (the scales those of zeros)."""
    intermediate, kwargs = _gemm1_args(x, w_gate, w_up, sched, swiglu_limit, num_sms, intermediate_multiple=BLOCK_SIZE)
    h = torch.empty(sched.num_rows, intermediate, dtype=torch.bfloat16, device=x.device)  # [num_rows, I]
    (gate_buffer, gate_mx), (up_buffer, up_mx) = (_rowwise_mx_buffer(sched.num_rows, intermediate, x.device)
                                                  for _ in range(2))
    load_extension().grouped_gemm_bf16_swiglu_gather_mxfp8_out(x=x, w_gate=w_gate, w_up=w_up, h=h, gate_mx=gate_buffer,
                                                               up_mx=up_buffer, **kwargs)
    return h, gate_mx, up_mx


def grouped_gemm_bf16_nt_contiguous(a_rows: torch.Tensor, w: torch.Tensor, sched,
                                    num_sms: int | None = None) -> torch.Tensor:
    """GEMM2 of the routed experts, a plain grouped GEMM over the schedule's rows (no gather):
    out_rows[r] = bf16(a_rows[r]·w[e]ᵀ), e = the expert of row r's segment; padding rows are zeros.
    a_rows [num_rows, k]; w [num_experts, n, k]; k and n multiples of 8. Returns bf16 [num_rows, n]."""
    check_layout("a_rows", a_rows, torch.bfloat16, (sched.num_rows, None), "[num_rows, k]")
    k = a_rows.shape[1]
    _check_gemm_dim("a_rows", k, "k (dim 1)")
    check_layout("w", w, torch.bfloat16, (sched.num_experts, None, k), "[num_experts, n, k]")
    _check_gemm_dim("w", w.shape[1], "n (dim 1)")
    sms = _check_num_sms(num_sms)
    _check_devices(a_rows.device, a_rows=a_rows, w=w)
    out_rows = torch.empty(sched.num_rows, w.shape[1], dtype=torch.bfloat16, device=a_rows.device)  # [num_rows, n]
    load_extension().grouped_gemm_bf16_nt_contiguous(a_rows=a_rows, w=w, out=out_rows, num_sms=sms,
                                                     **gemm_schedule_kwargs(sched, a_rows.device))
    return out_rows


def grouped_gemm_bf16_dgrad_swiglu(dy_rows: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor,
                                   up: torch.Tensor, sched, swiglu_limit: float | None = None,
                                   num_sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the down projection and of SwiGLU, in the schedule's row layout (L0's
    mok.reference.expert_backward): d_h = bf16(dy_rows[r]·w_down[e]), then
    (d_gate[r], d_up[r]) = bf16(swiglu_backward(gate[r], up[r], d_h, swiglu_limit)), and h[r] =
    bf16(swiglu(gate[r], up[r], swiglu_limit)) recomputed for d_w_down: the GEMM stores d_h, then an elementwise
    kernel (mok/moe/swiglu_backward_rows.cuh) overwrites it in place with d_gate and writes d_up and h;
    padding rows are zeros. dy_rows [num_rows, hidden]; w_down [num_experts, hidden, intermediate] (read
    transposed, no copy); gate, up [num_rows, intermediate] as the forward saved them. Returns
    (d_gate, d_up, h), bf16 [num_rows, intermediate] each."""
    intermediate, kwargs = _dgrad_swiglu_args(dy_rows, w_down, sched, swiglu_limit, num_sms)
    check_layout("gate", gate, torch.bfloat16, (sched.num_rows, intermediate), "[num_rows, intermediate]")
    check_layout("up", up, torch.bfloat16, (sched.num_rows, intermediate), "[num_rows, intermediate]")
    _check_devices(dy_rows.device, dy_rows=dy_rows, w_down=w_down, gate=gate, up=up)
    d_gate, d_up, h = (torch.empty_like(gate) for _ in range(3))  # [num_rows, intermediate] each
    load_extension().grouped_gemm_bf16_dgrad_swiglu(dy_rows=dy_rows, w_down=w_down, gate=gate, up=up, d_gate=d_gate,
                                                    d_up=d_up, h=h, **gemm_schedule_kwargs(sched, dy_rows.device),
                                                    **kwargs)
    return d_gate, d_up, h


def grouped_gemm_bf16_dgrad_swiglu_route_grads(d_out_rows: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor,
                                               up: torch.Tensor, topk_weights: torch.Tensor, sched,
                                               swiglu_limit: float | None = None, num_sms: int | None = None
                                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grouped_gemm_bf16_dgrad_swiglu from *unweighted* rows, with the route gradients and no saved y (DESIGN §3):
    g = bf16(d_out_rows[r]·w_down[e]); with w = topk_weights of row r's route (t, k), (d_gate[r], d_up[r]) =
    bf16(swiglu_backward(gate[r], up[r], w·g)), h[r] = bf16(w·swiglu(gate[r], up[r])) (d_w_down's operand beside
    the unweighted rows), and d_topk_weights[t, k] = Σ_i g[i]·bf16(swiglu(...))[i] (= Σ_h d_out[t, h]·y[t, k, h]),
    fp32 in a fixed order: per lane in column order, then a butterfly over the warp. d_out_rows [num_rows, hidden]
    (gather_rows_cuda(d_out)); topk_weights fp32 [num_tokens, num_topk]. Returns (d_gate, d_up, h) bf16
    [num_rows, intermediate] each and d_topk_weights fp32 [num_tokens, num_topk], NaN for a route without a row
    (an expert id outside [0, E))."""
    intermediate, kwargs = _dgrad_swiglu_args(d_out_rows, w_down, sched, swiglu_limit, num_sms, "d_out_rows")
    check_layout("gate", gate, torch.bfloat16, (sched.num_rows, intermediate), "[num_rows, intermediate]")
    check_layout("up", up, torch.bfloat16, (sched.num_rows, intermediate), "[num_rows, intermediate]")
    check_layout("topk_weights", topk_weights, torch.float32, (sched.num_tokens, sched.num_topk),
                 "[num_tokens, num_topk]")
    _check_devices(d_out_rows.device, d_out_rows=d_out_rows, w_down=w_down, gate=gate, up=up,
                   topk_weights=topk_weights)
    d_gate, d_up, h = (torch.empty_like(gate) for _ in range(3))  # [num_rows, intermediate] each
    d_topk_weights = torch.full_like(topk_weights, float("nan"))  # [T, K]: every route with a row is written
    load_extension().grouped_gemm_bf16_dgrad_swiglu_route_grads(
        d_out_rows=d_out_rows, w_down=w_down, gate=gate, up=up, topk_weights=topk_weights,
        row_to_route=sched.row_to_route.to(d_out_rows.device).contiguous(), d_gate=d_gate, d_up=d_up, h=h,
        d_topk_weights=d_topk_weights, **gemm_schedule_kwargs(sched, d_out_rows.device), **kwargs)
    return d_gate, d_up, h, d_topk_weights


def _dgrad_swiglu_args(dy_rows, w_down, sched, swiglu_limit, num_sms, rows_name="dy_rows") -> tuple:
    """The down dgrad's argument checks but gate/up's and the devices: (intermediate, the binding's swiglu_limit,
    has_limit and num_sms by name). rows_name: what the caller calls dy_rows."""
    check_layout(rows_name, dy_rows, torch.bfloat16, (sched.num_rows, None), "[num_rows, hidden]")
    hidden = dy_rows.shape[1]
    _check_gemm_dim(rows_name, hidden, "hidden (dim 1)")
    check_layout("w_down", w_down, torch.bfloat16, (sched.num_experts, hidden, None),
                 "[num_experts, hidden, intermediate]")
    intermediate = w_down.shape[2]
    _check_gemm_dim("w_down", intermediate, "intermediate (dim 2)")
    _check_limit(swiglu_limit)
    sms = _check_num_sms(num_sms)
    return intermediate, {**_limit_kwargs(swiglu_limit), "num_sms": sms}


def _check_rowwise_mx(name: str, mx, rows: int, cols: int) -> None:
    """(data float8_e4m3fn [rows, cols], scales uint8 [rows, cols / 32]), as mxfp8_quantize_rowwise returns them
    (devices are checked after every shape, as check_layout's)."""
    if not (isinstance(mx, tuple) and len(mx) == 2 and all(isinstance(t, torch.Tensor) for t in mx)):
        fail(name, "a (data, scales) pair of tensors (mxfp8_quantize_rowwise's)", type(mx).__name__)
    data, scales = mx
    if data.dtype != torch.float8_e4m3fn or tuple(data.shape) != (rows, cols):
        fail(name, f"data float8_e4m3fn of shape ({rows}, {cols})", f"{data.dtype} {tuple(data.shape)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (rows, cols // BLOCK_SIZE):
        fail(name, f"scales uint8 of shape ({rows}, {cols // BLOCK_SIZE})", f"{scales.dtype} {tuple(scales.shape)}")


def grouped_gemm_bf16_dgrad_swiglu_mxfp8(dy_rows: torch.Tensor, w_down: torch.Tensor, gate_mx, up_mx, sched,
                                         swiglu_limit: float | None = None, num_sms: int | None = None):
    """grouped_gemm_bf16_dgrad_swiglu for the MXFP8 backward: gate_mx, up_mx are the saved row-wise MXFP8
    (data, scales) as the forward's GEMM1 wrote them, and the SwiGLU kernel dequantizes them as it reads them
    (no bf16 copy in memory): the bits of the BF16 op on mxfp8_dequantize(*gate_mx), mxfp8_dequantize(*up_mx).
    intermediate a multiple of 32. Returns (d_gate, d_up, h), bf16 [num_rows, intermediate] each."""
    intermediate, kwargs = _dgrad_swiglu_args(dy_rows, w_down, sched, swiglu_limit, num_sms)
    if intermediate % BLOCK_SIZE:
        fail("w_down", f"intermediate (dim 2) a multiple of {BLOCK_SIZE} (MXFP8 blocks)", intermediate)
    _check_rowwise_mx("gate_mx", gate_mx, sched.num_rows, intermediate)
    _check_rowwise_mx("up_mx", up_mx, sched.num_rows, intermediate)
    _check_devices(dy_rows.device, dy_rows=dy_rows, w_down=w_down)
    for name, t in (("gate_mx", gate_mx[0]), ("gate_mx", gate_mx[1]), ("up_mx", up_mx[0]), ("up_mx", up_mx[1])):
        check_cuda(name, t, dy_rows.device, "dy_rows'", aligned=True)
    d_gate, d_up, h = (torch.empty(sched.num_rows, intermediate, dtype=torch.bfloat16, device=dy_rows.device)
                       for _ in range(3))  # [num_rows, intermediate] each
    load_extension().grouped_gemm_bf16_dgrad_swiglu_mxfp8(
        dy_rows=dy_rows, w_down=w_down, gate_data=gate_mx[0], gate_scales=gate_mx[1], up_data=up_mx[0],
        up_scales=up_mx[1], d_gate=d_gate, d_up=d_up, h=h, **gemm_schedule_kwargs(sched, dy_rows.device), **kwargs)
    return d_gate, d_up, h


def grouped_gemm_bf16_dgrad_gate_up(d_gate: torch.Tensor, d_up: torch.Tensor, w_gate: torch.Tensor,
                                    w_up: torch.Tensor, sched, num_sms: int | None = None) -> torch.Tensor:
    """Backward of the gate/up projections in the schedule's row layout: dx_rows[r] =
    bf16(d_gate[r]·w_gate[e] + d_up[r]·w_up[e]), one fp32 sum over K = 2·intermediate (L0 rounds once too);
    padding rows are zeros. d_gate, d_up [num_rows, intermediate]; w_gate, w_up [num_experts, intermediate,
    hidden] (read transposed, no copy). Returns dx_rows bf16 [num_rows, hidden]."""
    check_layout("d_gate", d_gate, torch.bfloat16, (sched.num_rows, None), "[num_rows, intermediate]")
    intermediate = d_gate.shape[1]
    _check_gemm_dim("d_gate", intermediate, "intermediate (dim 1)")
    check_layout("d_up", d_up, torch.bfloat16, tuple(d_gate.shape), "[num_rows, intermediate] (d_gate's)")
    check_layout("w_gate", w_gate, torch.bfloat16, (sched.num_experts, intermediate, None),
                 "[num_experts, intermediate, hidden]")
    _check_gemm_dim("w_gate", w_gate.shape[2], "hidden (dim 2)")
    check_layout("w_up", w_up, torch.bfloat16, tuple(w_gate.shape), "[num_experts, intermediate, hidden] (w_gate's)")
    sms = _check_num_sms(num_sms)
    _check_devices(d_gate.device, d_gate=d_gate, d_up=d_up, w_gate=w_gate, w_up=w_up)
    dx_rows = torch.empty(sched.num_rows, w_gate.shape[2], dtype=torch.bfloat16, device=d_gate.device)
    load_extension().grouped_gemm_bf16_dgrad_gate_up(d_gate=d_gate, d_up=d_up, w_gate=w_gate, w_up=w_up,
                                                     dx_rows=dx_rows, num_sms=sms,
                                                     **gemm_schedule_kwargs(sched, d_gate.device))
    return dx_rows


def grouped_gemm_bf16_weight_grad(a_rows: torch.Tensor, b_rows: torch.Tensor, sched,
                                  num_sms: int | None = None) -> torch.Tensor:
    """Weight gradients as one k-grouped GEMM over the schedule's segments: d_w[e] = bf16(Σ_r a_rows[r]ᵀ·b_rows[r])
    over expert e's rows, one fp32 sum in row order (an expert without tokens gets zeros). a_rows [num_rows, m],
    b_rows [num_rows, n] with zeros in padding rows (as the forward and the dgrad kernels write them); m and n
    multiples of 8. d_w_down = (dy_rows, h); d_w_gate = (d_gate, x_rows); d_w_up = (d_up, x_rows).
    Returns bf16 [num_experts, m, n]."""
    check_layout("a_rows", a_rows, torch.bfloat16, (sched.num_rows, None), "[num_rows, m]")
    _check_gemm_dim("a_rows", a_rows.shape[1], "m (dim 1)")
    check_layout("b_rows", b_rows, torch.bfloat16, (sched.num_rows, None), "[num_rows, n]")
    _check_gemm_dim("b_rows", b_rows.shape[1], "n (dim 1)")
    if sched.block_m % GEMM_BLOCK_M:
        fail("sched", f"block_m a multiple of {GEMM_BLOCK_M}", f"block_m={sched.block_m}")
    sms = _check_num_sms(num_sms)
    _check_devices(a_rows.device, a_rows=a_rows, b_rows=b_rows)
    offsets, expert_rows = weight_grad_schedule_tensors(sched, a_rows.device)  # [E + 1], [E]
    d_w = torch.empty(sched.num_experts, a_rows.shape[1], b_rows.shape[1], dtype=torch.bfloat16,
                      device=a_rows.device)  # [E, m, n]
    load_extension().grouped_gemm_bf16_weight_grad(a_rows=a_rows, b_rows=b_rows, expert_offsets=offsets,
                                                   expert_rows=expert_rows, d_w=d_w, num_sms=sms)
    return d_w
