"""round_to_tiles' map steps on a GPU (csrc/include/mok/moe/round_steps.cuh; mok.ops.route_round_prep and
route_round_to_tiles) against their twins (rounding._prep, receiver-major: mok.twins.route_round_prep; the CPU's
routing), bit for bit.

On the CPU the steps' bodies run on the host (round_steps.cuh's run_round_step_on_host, built here with nvcc as a
small shared library), driven by route_round_prep and route_round_to_tiles themselves: their sorts, running count,
buffers and order of steps are the GPU's (the rounds and swaps: their twins, which their kernels match). On a GPU
the kernels run. Both on the same problems: ties, -inf, negative scores with ±0.0, NaN, bf16 and fp16 scores,
all-zero scores, tokens stuck (no receiver may take them), the pool exact, padded to its bound, and short.
"""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from mok import ops, rounding, twins
from mok.ops import ARCH_FLAGS, CSRC
from mok.ops.moe import ROUND_BUFFERS, ROUND_STEPS
from mok.testing import poison_allocator
from tests.test_csrc_compile import NVCC


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _problem(T: int, E: int, K: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx [T, K], scores [T, E]): the top K of the scores (-inf and NaN last), as a router's."""
    g = gen(seed)
    logits = torch.randn(T, E, generator=g)
    if kind == "ties":
        scores = ((logits * 2).round() / 2).softmax(-1)
    elif kind == "signed-zeros":  # negative scores, ties, -0.0 and +0.0
        scores = (logits * 2).round() / 2
        scores = torch.where(scores == 0, torch.where(torch.rand(T, E, generator=g) < 0.5, -0.0, 0.0), scores)
    elif kind == "inf":  # experts a token may not take: many tokens stuck
        scores = logits.masked_fill(torch.rand(T, E, generator=g) < 0.6, float("-inf"))
        scores[torch.arange(T), torch.randint(0, E, (T,), generator=g)] = 0.5
    elif kind == "nan":
        scores = logits.masked_fill(torch.rand(T, E, generator=g) < 0.05, float("nan"))
    elif kind in ("bf16", "fp16"):
        scores = (logits * 4).to(torch.bfloat16 if kind == "bf16" else torch.float16)
    elif kind == "zeros":
        scores = torch.zeros(T, E)
    else:
        scores = logits.softmax(-1)
    finite = torch.where(scores.float() > float("-inf"), scores.float().nan_to_num(nan=-1e30), -1e30)
    return torch.sort(finite, dim=-1, descending=True, stable=True).indices[:, :K], scores


KINDS = ("softmax", "ties", "signed-zeros", "inf", "nan", "bf16", "fp16", "zeros")
SHAPES = [(1000, 16, 2, 16), (1024, 14, 7, 64), (300, 2, 1, 16), (333, 9, 2, 8), (777, 33, 5, 8),
          (2048, 48, 6, 128), (8192, 128, 8, 128)]


def _num_pools(idx: torch.Tensor, scores: torch.Tensor, tile: int) -> tuple[int, int, int]:
    """The pool exact (the CPU's size), padded to its bound (the GPU's), and 3 entries short (the last routes that
    would move left out: never so in round_to_tiles, whose bound holds them all, but the same in both)."""
    exact = twins.route_round_prep(idx, scores, tile, None)[0].numel()
    return exact, min(idx.numel(), rounding.pool_bound(scores.shape[1], tile)), max(exact - 3, 0)


def _assert_same(got: tuple, expected: tuple, label: str) -> None:
    names = ("pool", "order", "may", "inv", "need", "num_real")
    for name, a, b in zip(names, got, expected):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), f"{label}: {name} differs"


# ---- the bodies on the host ----------------------------------------------------------------------------

class _RouteRound(ctypes.Structure):  # struct RouteRound (mok/api.h)
    _fields_ = [(name, ctypes.c_void_p) for name in ROUND_BUFFERS] + [
        (name, ctypes.c_int64) for name in ("num_tokens", "num_topk", "num_experts", "num_pool", "tile")]


# the buffers the steps (and torch between them) write, bytes 0x55 before the first step that may write them (no
# value they should hold: not -1, 0 or 1): the others are inputs, or preset by design (counts zeroed, pool padding,
# routes a copy of idx)
POISONED_BEFORE = {"count": ("plan", "keys", "by_expert", "chosen", "slots", "num_real", "inv", "may", "pool_scores"),
                   "apply": ("left",), "order": ("out",)}


@pytest.fixture(scope="module")
def host_step(tmp_path_factory):
    """The map steps' runner (route_round_to_tiles' run_step) with round_steps.cuh's bodies compiled for the host."""
    if NVCC is None:
        pytest.skip("nvcc not found: the host build of the prep's bodies needs the CUDA toolkit")
    out = tmp_path_factory.mktemp("round_steps")
    source = out / "host.cu"
    source.write_text('#include "mok/moe/round_steps.cuh"\n'
                      'extern "C" void run_round_step(const mok::RouteRound* a, int step) {\n'
                      '  mok::moe::run_round_step_on_host(*a, step);\n}\n')
    library = out / "libround_steps.so"
    cmd = [NVCC, *ARCH_FLAGS, "-std=c++17", "-O1", f"-I{CSRC / 'include'}", "-Xcompiler", "-fPIC", "-shared",
           str(source), "-o", str(library)]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"the host build failed:\n{result.stderr}"
    run = ctypes.CDLL(str(library)).run_round_step
    run.argtypes, run.restype = [ctypes.POINTER(_RouteRound), ctypes.c_int], None

    def step(name: str, b: dict, tile: int) -> None:
        for buffer in POISONED_BEFORE.get(name, ()):  # what the steps write: never a lucky zero of fresh memory
            b[buffer].view(torch.uint8).fill_(0x55)
        (num_tokens, num_topk), num_experts = b["idx"].shape, b["scores"].shape[1]
        args = _RouteRound(*(b[n].data_ptr() for n in ROUND_BUFFERS), num_tokens, num_topk, num_experts,
                           b["pool"].numel(), tile)
        run(ctypes.byref(args), ROUND_STEPS.index(name))

    return step


@pytest.mark.parametrize("T, E, K, tile", SHAPES)
def test_prep_bodies_on_the_host_give_the_twins_bits(host_step, T, E, K, tile):
    for i, kind in enumerate(KINDS):
        idx, scores = _problem(T, E, K, kind, seed=T + E + i)
        for num_pool in _num_pools(idx, scores, tile):
            got = ops.route_round_prep(idx, scores, tile, num_pool, run_step=host_step)
            _assert_same(got, twins.route_round_prep(idx, scores, tile, num_pool), f"{kind}, P={num_pool}")


def _twin_fill(order, may, inv, need, num_real):  # _fill_rounds_receiver_major's contract, by the twin
    return rounding.fill_rounds(order.t(), may.t().bool(), inv, need, num_real[0])


@pytest.mark.parametrize("T, E, K, tile", SHAPES)
def test_round_to_tiles_steps_on_the_host_give_the_cpus_routing(host_step, T, E, K, tile):
    """route_round_to_tiles, the GPU's whole path, with the map steps on the host and the twins of the rounds and
    swaps: the CPU's routing, where receivers are left short (K/E = 1/2: the end game's swaps) and where not."""
    for i, kind in enumerate(KINDS):
        idx, scores = _problem(T, E, K, kind, seed=T + E + i)
        bound = min(idx.numel(), rounding.pool_bound(E, tile))
        got = ops.route_round_to_tiles(idx, scores, tile, bound, run_step=host_step, fill=_twin_fill,
                                       swap=rounding.swap_leftovers)
        assert torch.equal(got, rounding.round_to_tiles(idx, scores, tile)), f"{kind}"


def test_route_round_prep_bad_inputs_name_the_argument():
    idx, scores = _problem(64, 8, 2, "softmax", seed=0)
    with pytest.raises(ValueError, match=r"^scores: expected dtype torch.float32 or torch.bfloat16 or torch.float16"):
        ops.route_round_prep(idx, scores.double(), 4, 16)
    with pytest.raises(ValueError, match=r"^scores: expected shape \[num_tokens, num_experts\] = \[64, \*\]"):
        ops.route_round_prep(idx, scores[:63], 4, 16)
    with pytest.raises(ValueError, match=r"^topk_idx: expected dtype torch.int64"):
        ops.route_round_prep(idx.int(), scores, 4, 16)
    with pytest.raises(ValueError, match=r"^tile: expected an int in >= 1"):
        ops.route_round_prep(idx, scores, 0, 16)
    with pytest.raises(ValueError, match=r"^topk_idx: expected a CUDA tensor"):
        ops.route_round_prep(idx, scores, 4, 16)


# ---- the kernels -----------------------------------------------------------------------------------------

def _poison(T: int, K: int, E: int, P: int) -> None:
    """Bytes 0x55 in the blocks the buffers of route_round_to_tiles are likely to get (POISONED_BEFORE's value): a
    value a step forgets to write is never a lucky one from the call before."""
    for nbytes in (8 * T * K, 4 * T * K, 8 * 3 * E, 4 * E * P, E * P, 8 * P):
        poison_allocator(nbytes, 0x55)


@pytest.mark.gpu
@pytest.mark.parametrize("T, E, K, tile", SHAPES)
def test_route_round_prep_kernels_give_the_twins_bits(T, E, K, tile):
    for i, kind in enumerate(KINDS):
        idx, scores = _problem(T, E, K, kind, seed=T + E + i)
        for num_pool in _num_pools(idx, scores, tile):
            _poison(T, K, E, num_pool)
            got = ops.route_round_prep(idx.cuda(), scores.cuda(), tile, num_pool)
            _assert_same(got, twins.route_round_prep(idx, scores, tile, num_pool), f"{kind}, P={num_pool}")


@pytest.mark.gpu
@pytest.mark.parametrize("T, E, K, tile", SHAPES)
def test_route_round_to_tiles_kernels_give_the_cpus_routing(T, E, K, tile):
    for i, kind in enumerate(KINDS):
        idx, scores = _problem(T, E, K, kind, seed=T + E + i)
        num_pool = min(idx.numel(), rounding.pool_bound(E, tile))
        _poison(T, K, E, num_pool)
        got = ops.route_round_to_tiles(idx.cuda(), scores.cuda(), tile, num_pool)
        assert torch.equal(got.cpu(), rounding.round_to_tiles(idx, scores, tile)), f"{kind}"
