"""Route placement (DESIGN §5): invariants, a naive loop as the oracle, edge shapes, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mok.config import TINY_SHAPES
from mok.routing import hot_expert_routing, random_routing
from mok.schedule import gather_routes, gather_rows, make_schedule, max_num_rows, scatter_routes, segment

cuda = pytest.mark.gpu  # skipped centrally (tests/conftest.py) without a GPU


def naive_schedule(topk_idx: list[list[int]], num_experts: int, block_m: int) -> dict:
    """The spec as a loop: per expert, its routes in (token, k) order, then padding to block_m."""
    rows, offsets = [], [0]  # rows: (token, k, expert), token = k = -1 for padding
    for e in range(num_experts):
        mine = [(t, k, e) for t, row in enumerate(topk_idx) for k, x in enumerate(row) if x == e]
        pad = -len(mine) % block_m
        rows += mine + [(-1, -1, e)] * pad
        offsets.append(len(rows))
    return {"rows": rows, "offsets": offsets}


def check_invariants(sched, topk_idx: torch.Tensor) -> None:
    T, K = topk_idx.shape
    E, bm, R = sched.num_experts, sched.block_m, T * K
    for name in (
        "tokens_per_expert",
        "padded_per_expert",
        "expert_offsets",
        "row_to_token",
        "row_to_k",
        "row_to_route",
        "row_to_expert",
        "route_to_row",
        "tile_offsets",
        "tile_to_expert",
        "tile_num_rows",
    ):
        t = getattr(sched, name)
        assert t.dtype == torch.int64 and t.device == topk_idx.device, name
    assert (sched.num_tokens, sched.num_topk) == (T, K)
    assert sched.route_to_row.shape == (T, K) and sched.row_to_route.shape == (sched.num_rows,)
    real = sched.row_to_route >= 0  # [num_rows]
    rows = torch.arange(sched.num_rows)  # [num_rows]
    # every route exactly once; the two maps are inverse to each other
    assert torch.equal(sched.row_to_route[real].sort().values, torch.arange(R))
    assert torch.equal(sched.row_to_route[sched.route_to_row.reshape(-1)], torch.arange(R))
    assert torch.equal(sched.route_to_row.reshape(-1)[sched.row_to_route[real]], rows[real])
    # token / k / route agree; padding is -1 everywhere
    assert torch.equal((sched.row_to_token * K + sched.row_to_k)[real], sched.row_to_route[real])
    for t in (sched.row_to_token, sched.row_to_k, sched.row_to_route):
        assert bool((t[~real] == -1).all())
    assert torch.equal(topk_idx.reshape(-1)[sched.row_to_route[real]], sched.row_to_expert[real])
    # counts, padding, offsets
    assert torch.equal(sched.tokens_per_expert, torch.bincount(topk_idx.reshape(-1), minlength=E))
    pad = sched.padded_per_expert - sched.tokens_per_expert  # [E]
    assert bool((pad >= 0).all() and (pad < bm).all() and (sched.padded_per_expert % bm == 0).all())
    assert torch.equal(sched.padded_per_expert == 0, sched.tokens_per_expert == 0)
    assert bool((sched.expert_offsets % bm == 0).all()) and int(sched.expert_offsets[0]) == 0
    assert int(sched.expert_offsets[-1]) == sched.num_rows <= max_num_rows(T, K, E, bm)
    assert int((~real).sum()) == int(pad.sum())
    # segments: expert-major, real rows first in ascending (token, k), then padding
    for e in range(E):
        s = segment(sched, e)
        assert bool((sched.row_to_expert[s] == e).all())
        n = int(sched.tokens_per_expert[e])
        routes = sched.row_to_route[s]  # [segment rows]
        assert bool((routes[:n] >= 0).all() and (routes[n:] == -1).all())
        assert bool((routes[:n].diff() > 0).all())
    # tiles: one expert each, real rows a prefix
    assert sched.num_tiles * bm == sched.num_rows
    tile_real = real.view(-1, bm)  # [num_tiles, block_m]
    assert torch.equal(sched.tile_num_rows, tile_real.sum(1))
    assert bool((tile_real.int().diff(dim=1) <= 0).all())
    assert bool((sched.row_to_expert.view(-1, bm) == sched.tile_to_expert[:, None]).all())
    assert torch.equal(sched.tile_offsets * bm, sched.expert_offsets)


def check_against_naive(sched, topk_idx: torch.Tensor) -> None:
    ref = naive_schedule(topk_idx.tolist(), sched.num_experts, sched.block_m)
    assert sched.expert_offsets.tolist() == ref["offsets"]
    got = list(zip(sched.row_to_token.tolist(), sched.row_to_k.tolist(), sched.row_to_expert.tolist()))
    assert got == ref["rows"]


# Small T, E, K so the naive loop is cheap; block_m 1 (no padding), 3 (odd), 4, 64 (bigger than most
# segments). Duplicates within a token are allowed by the spec, so ids are drawn independently.
@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(0, 40),
    E=st.integers(1, 9),
    K=st.integers(1, 5),
    block_m=st.sampled_from([1, 3, 4, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_naive_loop(T, E, K, block_m, seed):
    g = torch.Generator().manual_seed(seed)
    topk_idx = torch.randint(0, E, (T, K), generator=g)  # [T, K]
    sched = make_schedule(topk_idx, E, block_m)
    check_against_naive(sched, topk_idx)
    check_invariants(sched, topk_idx)


# The kernel tiles (64, 128) and the degenerate 1, on every tiny shape (T not a tile multiple, K = 1, 8).
@pytest.mark.parametrize("block_m", [1, 64, 128])
@pytest.mark.parametrize("shape", sorted(TINY_SHAPES))
@pytest.mark.parametrize("skew", [0.0, 1.5])
def test_invariants_tiny_shapes(shape, block_m, skew):
    c = TINY_SHAPES[shape]
    topk_idx, _ = random_routing(c.num_tokens, c.num_experts, c.num_topk, skew=skew)
    sched = make_schedule(topk_idx, c.num_experts, block_m)
    check_invariants(sched, topk_idx)
    check_against_naive(sched, topk_idx)


def test_empty_experts_get_zero_rows():
    topk_idx = torch.tensor([[4, 1], [1, 4], [4, 6]])  # experts 0, 2, 3, 5, 7 empty
    sched = make_schedule(topk_idx, 8, block_m=4)
    assert sched.padded_per_expert.tolist() == [0, 4, 0, 0, 4, 0, 4, 0]
    assert sched.expert_offsets.tolist() == [0, 0, 4, 4, 4, 8, 8, 12, 12]
    assert segment(sched, 0) == slice(0, 0) and segment(sched, 4) == slice(4, 8)
    assert sched.tile_to_expert.tolist() == [1, 4, 6] and sched.tile_num_rows.tolist() == [2, 3, 1]
    assert sched.row_to_route[4:8].tolist() == [0, 3, 4, -1]  # expert 4: (0,0), (1,1), (2,0)
    check_invariants(sched, topk_idx)


@pytest.mark.parametrize("num_topk", [1, 4])
def test_one_hot_expert(num_topk):
    topk_idx, _ = hot_expert_routing(301, 16, num_topk, hot_expert=9)
    sched = make_schedule(topk_idx, 16, block_m=64)
    assert int(sched.tokens_per_expert[9]) == 301
    assert int(sched.padded_per_expert[9]) == 320  # 301 rounded up to 5 tiles
    assert int((sched.tile_to_expert == 9).sum()) == 5
    check_invariants(sched, topk_idx)


def test_no_tokens():
    sched = make_schedule(torch.zeros(0, 3, dtype=torch.int64), 5, block_m=8)
    assert sched.num_rows == 0 and sched.num_tiles == 0 and sched.route_to_row.shape == (0, 3)
    assert gather_rows(torch.randn(0, 4), sched).shape == (0, 4)
    assert scatter_routes(torch.randn(0, 4), sched).shape == (0, 3, 4)


def test_gather_scatter_roundtrip_and_zero_padding():
    T, H, E, K = 45, 16, 6, 3
    topk_idx, _ = random_routing(T, E, K, skew=1.0)
    x = torch.randn(T, H, dtype=torch.bfloat16)  # [T, H]
    x[7] = float("nan")  # a NaN token must not leak into padding rows
    sched = make_schedule(topk_idx, E, block_m=16)
    rows = gather_rows(x, sched)  # [num_rows, H]
    assert rows.dtype == x.dtype and rows.shape == (sched.num_rows, H)
    pad = sched.row_to_token < 0
    assert int(pad.sum()) == int((sched.padded_per_expert - sched.tokens_per_expert).sum()) > 0
    assert bool((rows[pad] == 0).all())
    exact = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(rows[~pad], x[sched.row_to_token[~pad]], **exact)
    per_route = scatter_routes(rows, sched)  # [T, K, H]
    torch.testing.assert_close(per_route, x[:, None, :].expand(T, K, H), **exact)


def test_gather_routes_is_the_inverse_of_scatter_routes():
    T, H, E, K = 33, 8, 5, 2
    topk_idx, _ = random_routing(T, E, K, skew=0.5)
    sched = make_schedule(topk_idx, E, block_m=8)
    v = torch.randn(T * K, H)  # [T·K, H] one row per route, each different
    rows = gather_routes(v, sched)  # [num_rows, H]
    pad = sched.row_to_route < 0
    assert bool(pad.any()) and bool((rows[pad] == 0).all())
    assert torch.equal(scatter_routes(rows, sched), v.view(T, K, H))
    with pytest.raises(ValueError, match="v"):
        gather_routes(v[:-1], sched)


def test_scatter_routes_slots_follow_route_to_row():
    topk_idx = torch.tensor([[2, 0], [0, 2], [1, 0]])
    sched = make_schedule(topk_idx, 3, block_m=2)
    y_rows = torch.arange(sched.num_rows, dtype=torch.float32)[:, None] * torch.ones(1, 3)  # [rows, 3]
    out = scatter_routes(y_rows, sched)  # [T, K, 3]
    assert torch.equal(out[..., 0].long(), sched.route_to_row)
    assert sched.route_to_row.tolist() == [[6, 0], [1, 7], [4, 2]]


def test_pure_function_and_layout_independent():
    topk_idx, _ = random_routing(200, 12, 4, skew=0.8, generator=torch.Generator().manual_seed(3))
    a = make_schedule(topk_idx, 12, block_m=32)
    b = make_schedule(topk_idx.clone(), 12, block_m=32)
    c = make_schedule(topk_idx.t().contiguous().t(), 12, block_m=32)  # non-contiguous input
    assert a.equal(b) and a.equal(c)
    assert not a.equal(make_schedule(topk_idx, 12, block_m=16))


@pytest.mark.gpu
@cuda
def test_gpu_schedule_equals_cpu_bits():
    topk_idx, _ = random_routing(4099, 128, 8, skew=1.2, generator=torch.Generator().manual_seed(0))
    cpu = make_schedule(topk_idx, 128, block_m=128)
    gpu = make_schedule(topk_idx.cuda(), 128, block_m=128)
    assert gpu.row_to_route.is_cuda and cpu.equal(gpu)
    x = torch.randn(4099, 64, device="cuda")
    assert torch.equal(gather_rows(x, gpu).cpu(), gather_rows(x.cpu(), cpu))


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.zeros(4, 2, dtype=torch.int32), 4), TypeError, "topk_idx: expected dtype torch.int64"),
        ((torch.zeros(4, dtype=torch.int64), 4), ValueError, r"topk_idx: expected shape"),
        ((torch.zeros(4, 0, dtype=torch.int64), 4), ValueError, "topk_idx: expected num_topk >= 1"),
        ((torch.tensor([[0, 4]]), 4), ValueError, r"topk_idx: expected expert ids in \[0, 4\)"),
        ((torch.tensor([[0, -1]]), 4), ValueError, r"got values in \[-1, 0\]"),
        (([[0, 1]], 4), TypeError, "topk_idx: expected a torch.Tensor"),
        ((torch.tensor([[0, 1]]), 0), ValueError, "num_experts"),
        ((torch.tensor([[0, 1]]), 4, 0), ValueError, "block_m: expected an int in >= 1, got 0"),
        ((torch.tensor([[0, 1]]), 4, 64.0), TypeError, "block_m: expected an int"),
    ],
)
def test_make_schedule_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        make_schedule(*args)


def test_helpers_bad_input():
    sched = make_schedule(torch.tensor([[0, 1], [1, 2]]), 3, block_m=4)
    with pytest.raises(ValueError, match=r"x: expected shape \[num_tokens=2, hidden\], got \(3, 8\)"):
        gather_rows(torch.randn(3, 8), sched)
    with pytest.raises(ValueError, match=r"y_rows: expected shape \[num_rows=12, hidden\]"):
        scatter_routes(torch.randn(11, 8), sched)
    with pytest.raises(ValueError, match="expert: expected an int in"):
        segment(sched, 3)
