"""The device route schedule (mok.ops.make_schedule_cuda) against mok.schedule.make_schedule, bit for bit.

make_schedule (torch integer ops, a stable sort) is the L0 twin: every field of the kernel's Schedule must
be equal in bits and dtype (Schedule.equal), on routings that stress each step: empty experts (segments of
length 0), one hot expert (one segment far longer than a chunk of 1024 routes), duplicates inside a token's
row, K = 1 and 8, token counts that are no multiple of anything, block_m 128 and 256 (and odd ones: the
schedule itself allows any block_m). The allocator is poisoned first, so an entry the kernels never write
cannot pass. Routings are drawn fresh every run (the seed is in each failure message).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok import ops
from mok.routing import check_topk_idx, hot_expert_routing, random_routing
from mok.schedule import ROW_FIELDS, make_schedule, max_num_rows
from mok.testing import fresh_seed, poison_allocator


def _routing(kind: str, num_tokens: int, num_experts: int, num_topk: int, seed: int) -> torch.Tensor:
    """topk_idx int64 [num_tokens, num_topk] on the CPU, drawn with `seed`."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":  # ids drawn with replacement: duplicates inside a row
        return torch.randint(0, num_experts, (num_tokens, num_topk), generator=g)
    if kind == "skewed":  # distinct per row, Zipf popularity: long and short segments
        return random_routing(num_tokens, num_experts, num_topk, skew=1.2, generator=g)[0]
    if kind == "hot":  # 95 % of the routes on expert 3 (or the last expert)
        hot = min(3, num_experts - 1)
        return hot_expert_routing(num_tokens, num_experts, num_topk, hot_expert=hot, hot_fraction=0.95,
                                  generator=g)[0]
    if kind == "sparse":  # only experts 1 and E - 2 get routes: empty segments before, between, after
        pick = torch.randint(0, 2, (num_tokens, num_topk), generator=g)
        return torch.where(pick == 0, 1 % num_experts, max(num_experts - 2, 0))
    if kind == "one-expert":  # every route on expert E - 1, the last one
        return torch.full((num_tokens, num_topk), num_experts - 1, dtype=torch.int64)
    raise ValueError(kind)


# (kind, num_tokens, num_experts, num_topk, block_m). T around the chunk (1024 routes) and fill (1024 rows)
# sizes and off every multiple; K = 1, 3, 8; E = 1 and E above 48 KB of shared memory (opt-in path) up to
# the limit; block_m 128 and 256 (the GEMMs'), 1, 7 and 64 (the schedule's generality).
CASES = [
    ("uniform", 1, 1, 1, 128),
    ("uniform", 37, 16, 8, 128),
    ("uniform", 1000, 128, 8, 128),
    ("uniform", 1025, 128, 1, 256),
    ("uniform", 129, 7, 8, 1),
    ("uniform", 333, 9, 3, 7),
    ("skewed", 4099, 128, 8, 128),
    ("skewed", 4099, 64, 6, 256),
    ("skewed", 517, 48, 6, 64),
    ("hot", 3001, 32, 8, 128),
    ("hot", 2048, 128, 1, 256),
    ("sparse", 999, 8, 2, 128),
    ("sparse", 130, 300, 4, 256),
    ("one-expert", 1500, 5, 3, 128),
    ("one-expert", 77, 1, 8, 256),
    ("uniform", 9000, 1000, 8, 128),
    ("uniform", 600, 2048, 4, 128),
    ("skewed", 2000, ops.SCHEDULE_MAX_EXPERTS, 8, 128),
]


def _check_layout(sched, expected) -> None:
    """Fields contiguous on the GPU; gemm_tensors (with block_m a multiple of 128) equal to what the GEMM
    wrappers build from make_schedule's Schedule (`expected`, which has no gemm_tensors)."""
    for name, t in vars(sched).items():
        if isinstance(t, torch.Tensor):
            assert t.is_cuda and t.is_contiguous(), name
    if sched.block_m % ops.GEMM_BLOCK_M == 0:
        want = ops.gemm_schedule_tensors(expected, expected.route_to_row.device)
        for name, got, w in zip(("row_to_token", "tile_to_expert"), sched.gemm_tensors, want):
            assert got.is_contiguous() and got.dtype == torch.int32 and torch.equal(got, w), f"gemm_tensors {name}"
    else:
        assert not hasattr(sched, "gemm_tensors")


# ---- CPU: argument checks (all raise before the extension is built) ------------------------------------------


def test_make_schedule_cuda_bad_inputs_raise_make_schedule_errors():
    """The same exception type and text as make_schedule for every layout error; a CPU tensor is refused."""
    idx = torch.zeros(4, 2, dtype=torch.int64)
    bad = [([[0, 1]], 4), (idx[0], 4), (idx.int(), 4), (idx[:, :0], 4), (idx, 0), (idx, 2.0)]
    for topk_idx, num_experts in bad:
        with pytest.raises((TypeError, ValueError)) as want:
            make_schedule(topk_idx, num_experts)
        with pytest.raises(want.type) as got:
            ops.make_schedule_cuda(topk_idx, num_experts)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="block_m: expected an int in"):
        ops.make_schedule_cuda(idx, 4, block_m=0)
    with pytest.raises(ValueError, match="topk_idx: expected a CUDA tensor"):
        ops.make_schedule_cuda(idx, 4)


# ---- GPU ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
def test_make_schedule_cuda_arrays_are_aligned_and_disjoint():
    """The binding carves two allocations into the schedule's arrays: each 256-byte aligned, none overlapping."""
    topk_idx = _routing("uniform", 300, 7, 3, fresh_seed()).cuda()
    sched = ops.make_schedule_cuda(topk_idx, 7, sync=False)
    arrays = [t for t in (getattr(sched, f.name) for f in dataclasses.fields(sched)) if isinstance(t, torch.Tensor)]
    arrays += list(sched.gemm_tensors)
    assert len(arrays) == len(ops.moe._SCHEDULE_ARRAYS)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in arrays)
    assert all(start % 256 == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), spans


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}-T{}-E{}-K{}-bm{}".format(*c))
def test_make_schedule_cuda_equals_make_schedule(case):
    kind, num_tokens, num_experts, num_topk, block_m = case
    seed = fresh_seed()
    topk_idx = _routing(kind, num_tokens, num_experts, num_topk, seed).cuda()
    expected = make_schedule(topk_idx, num_experts, block_m)
    # 0x55...: neither -1 (0xFF... would hide a padding row left unwritten) nor a valid id or row
    poison_allocator(64 * (topk_idx.numel() + num_experts * block_m), byte=0x55)
    got = ops.make_schedule_cuda(topk_idx, num_experts, block_m)
    assert got.equal(expected), f"{case}: fields differ from make_schedule (seed {seed})"
    assert got.equal(ops.make_schedule_cuda(topk_idx, num_experts, block_m)), f"{case}: run to run (seed {seed})"
    _check_layout(got, expected)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}-T{}-E{}-K{}-bm{}".format(*c))
def test_make_schedule_cuda_without_sync_is_make_schedule_plus_spare_rows(case):
    """sync=False: no host sync; row arrays of max_num_rows entries, the real ones make_schedule's, the spare
    ones -1 (tiles: expert -1, 0 rows); the real row count and 0 bad ids in counts, on the device."""
    kind, num_tokens, num_experts, num_topk, block_m = case
    seed = fresh_seed()
    topk_idx = _routing(kind, num_tokens, num_experts, num_topk, seed).cuda()
    expected = make_schedule(topk_idx, num_experts, block_m)
    poison_allocator(64 * (topk_idx.numel() + num_experts * block_m), byte=0x55)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # any host sync raises
    try:
        got = ops.make_schedule_cuda(topk_idx, num_experts, block_m, sync=False)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    what = f"{case} (seed {seed})"
    n, rows = expected.num_rows, max_num_rows(num_tokens, num_topk, num_experts, block_m)
    assert got.num_rows == rows >= n, what
    assert got.trimmed().equal(expected), f"{what}: the real rows differ from make_schedule"
    assert got.counts.tolist() == [n, 0], what
    for name in ROW_FIELDS:
        assert bool((getattr(got, name)[n:] == -1).all()), f"{what}: spare {name}"
    assert bool((got.tile_to_expert[n // block_m:] == -1).all() and (got.tile_num_rows[n // block_m:] == 0).all())
    if block_m % ops.GEMM_BLOCK_M == 0:
        row_to_token, tile_to_expert = got.gemm_tensors
        assert row_to_token.numel() == rows and bool((row_to_token[n:] == -1).all()), what
        assert tile_to_expert.numel() == rows // 128 and bool((tile_to_expert[n // 128:] == -1).all()), what
        want = ops.gemm_schedule_tensors(expected, expected.route_to_row.device)
        assert torch.equal(row_to_token[:n], want[0]) and torch.equal(tile_to_expert[:n // 128], want[1]), what


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("bad_id", [-1, 16, 2**40], ids=["minus-one", "E", "huge"])
def test_make_schedule_cuda_without_sync_skips_and_counts_bad_ids(bad_id):
    """sync=False does not raise: the bad routes get no row (route_to_row -1), counts[1] says how many, and
    every other route is placed as usual (its row maps back to it)."""
    topk_idx = _routing("uniform", 3000, 16, 8, fresh_seed()).cuda()
    bad = [2999 * 8 + 7, 5 * 8 + 0, 6 * 8 + 0]  # the last route, and two in the first chunk
    topk_idx.view(-1)[bad] = bad_id
    got = ops.make_schedule_cuda(topk_idx, 16, sync=False)
    assert got.counts[1].item() == len(bad)
    route_to_row = got.route_to_row.reshape(-1).cpu()  # [T * K]
    assert bool((route_to_row[bad] == -1).all())
    good = torch.ones(route_to_row.numel(), dtype=torch.bool)
    good[bad] = False
    rows = route_to_row[good]
    assert bool((rows >= 0).all() and (rows < got.counts[0].item()).all())
    assert torch.equal(got.row_to_route.cpu()[rows], torch.arange(route_to_row.numel())[good])
    assert got.counts[0].item() == int(got.expert_offsets[-1]) <= max_num_rows(3000, 8, 16, 128)


@pytest.mark.gpu
@pytest.mark.sm90
def test_make_schedule_cuda_edge_inputs():
    """No tokens; a non-contiguous topk_idx; more experts than the kernels hold (falls back, same bits)."""
    empty = torch.zeros(0, 4, dtype=torch.int64, device="cuda")
    assert ops.make_schedule_cuda(empty, 8).equal(make_schedule(empty, 8))
    strided = _routing("uniform", 300, 16, 5, fresh_seed()).cuda().T.contiguous().T  # [300, 5], column-major
    assert not strided.is_contiguous()
    assert ops.make_schedule_cuda(strided, 16, 256).equal(make_schedule(strided, 16, 256))
    many = _routing("uniform", 50, ops.SCHEDULE_MAX_EXPERTS + 1, 2, fresh_seed()).cuda()
    assert ops.make_schedule_cuda(many, ops.SCHEDULE_MAX_EXPERTS + 1).equal(
        make_schedule(many, ops.SCHEDULE_MAX_EXPERTS + 1))


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("bad_id", [-1, 16, 2**40, -(2**40)], ids=["minus-one", "E", "huge", "very-negative"])
def test_make_schedule_cuda_bad_ids_raise_the_same_error(bad_id):
    topk_idx = _routing("uniform", 3000, 16, 8, fresh_seed()).cuda()
    topk_idx[2999, 7] = bad_id  # in the last chunk, last route
    topk_idx[5, 0] = bad_id
    with pytest.raises(ValueError) as want:
        check_topk_idx(topk_idx, 16)
    with pytest.raises(ValueError) as got:
        ops.make_schedule_cuda(topk_idx, 16)
    assert str(got.value) == str(want.value)
    assert "topk_idx: expected expert ids in [0, 16), got values in" in str(got.value)
