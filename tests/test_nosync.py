"""No host sync in the Hopper levels' passes (L2 `fused`, L3 `megakernel`): the static row bound, spare rows, and
the deferred bad-id check.

CPU: `max_num_rows` is the most padded rows any routing needs (against a brute force over every routing of
small problems); a schedule with spare rows (`Schedule.extended`) trims back to make_schedule's and works
with the L0 helpers; the level's wiring on the L0 twins, whose spare rows are NaN (what the kernels leave
there is unspecified), gives L0's bits on irregular routings (empty experts, one hot expert), so nothing reads
a spare row; mok.bad_ids raises only once a count has landed; mok.moe reads the ids on the host only with
check=True or on a level that does not check them on the device.
GPU (Hopper): the fused forward and backward give the same bits with the no-sync schedule as with a synced
one (the level before this change) on irregular shapes, in both precisions; neither pass syncs
(torch.cuda.set_sync_debug_mode("error")); the row-wise kernels leave spare rows untouched; a bad expert id on
the default path (mok.moe, backend auto) makes its tokens NaN and raises ValueError from the backward.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch

import mok
from mok import bad_ids, fused, megakernel, ops, testing, twins
from mok import reference as L0
from mok.config import STANDARD_SHAPES, TINY_SHAPES
from mok.routing import hot_expert_routing, random_routing
from mok.schedule import ROW_FIELDS, TILE_FIELDS, gather_rows, make_schedule, max_num_rows, scatter_routes
from mok.testing import GRAD_NAMES, bitwise_equal, fresh_seed, make_inputs, moe_args, run_level

# ---- the static bound --------------------------------------------------------------------------------------


def _most_rows(num_routes: int, num_experts: int, block_m: int) -> int:
    """The most padded rows over every way to spread num_routes routes over num_experts experts (brute force)."""
    best = 0
    for counts in itertools.product(range(num_routes + 1), repeat=num_experts):
        if sum(counts) == num_routes:
            best = max(best, sum(math.ceil(c / block_m) * block_m for c in counts))
    return best


@pytest.mark.parametrize("block_m", [1, 2, 3, 4, 128])
@pytest.mark.parametrize("num_experts", [1, 2, 3, 4])
def test_max_num_rows_is_the_most_any_routing_needs(num_experts, block_m):
    """Exact (not just a bound) for every routes count up to 9, including fewer routes than experts."""
    for num_routes in range(10):
        got = max_num_rows(num_routes, 1, num_experts, block_m)
        assert got == _most_rows(num_routes, num_experts, block_m), (num_routes, num_experts, block_m)
        assert got % block_m == 0
        assert got <= num_routes + num_experts * (block_m - 1)  # never above the simple bound


def test_max_num_rows_at_the_standard_shapes():
    """qwen3-30b: 65,536 routes + 128 experts × 127 rows of padding at most; dsv4pro's (48 experts) likewise."""
    assert max_num_rows(8192, 8, 128, 128) == 65536 + 128 * 127
    assert max_num_rows(2048, 6, 48, 128) == (12288 + 48 * 127) // 128 * 128
    assert max_num_rows(3, 1, 100, 128) == 3 * 128  # 3 routes fill at most 3 tiles, however many experts


# ---- spare rows --------------------------------------------------------------------------------------------


def _irregular_routing(kind: str):
    """routing_fn(T, E, K, g) for mok.testing.make_inputs: one hot expert, or most experts empty."""
    if kind == "hot":
        return lambda T, E, K, g: hot_expert_routing(T, E, K, hot_expert=E - 1, hot_fraction=0.97, generator=g)
    return lambda T, E, K, g: random_routing(T, min(E, K + 1), K, generator=g)  # experts K + 1.. stay empty


@pytest.mark.parametrize("block_m", [1, 4, 128])
def test_extended_schedule_trims_back_and_marks_spare_rows(block_m):
    g = torch.Generator().manual_seed(fresh_seed())
    topk_idx, _ = random_routing(37, 9, 3, skew=1.0, generator=g)  # [37, 3]
    sched = make_schedule(topk_idx, 9, block_m)
    assert sched.counts.dtype == torch.int32 and sched.counts.tolist() == [sched.num_rows, 0]
    rows = max_num_rows(37, 3, 9, block_m)
    ext = sched.extended(rows)
    assert ext.num_rows == rows and ext.num_tiles == rows // block_m
    assert not ext.equal(sched) or rows == sched.num_rows
    assert ext.trimmed().equal(sched)
    n = sched.num_rows
    for name in ROW_FIELDS:
        assert getattr(ext, name).shape == (rows,) and bool((getattr(ext, name)[n:] == -1).all()), name
    assert bool((ext.tile_to_expert[n // block_m:] == -1).all() and (ext.tile_num_rows[n // block_m:] == 0).all())
    assert all(getattr(ext, name).shape == (rows // block_m,) for name in TILE_FIELDS)
    x = torch.randn(37, 8).to(torch.bfloat16)  # [T, H]
    x_rows = gather_rows(x, ext)  # [rows, H]
    assert torch.equal(x_rows[:n], gather_rows(x, sched)) and bool((x_rows[n:] == 0).all())
    assert torch.equal(scatter_routes(x_rows, ext), scatter_routes(x_rows[:n], sched))
    if block_m > 1:
        with pytest.raises(ValueError, match="num_rows: expected a multiple of block_m"):
            sched.extended(rows + 1)
    with pytest.raises(ValueError, match="num_rows: expected an int in"):
        sched.extended(n - 1)


def test_twin_schedule_without_sync_has_spare_rows():
    topk_idx, _ = random_routing(50, 16, 4, generator=torch.Generator().manual_seed(fresh_seed()))
    sched = twins.make_schedule_cuda(topk_idx, 16, sync=False)
    assert sched.num_rows == max_num_rows(50, 4, 16, 128)
    assert sched.trimmed().equal(twins.make_schedule_cuda(topk_idx, 16))


def _use_twins(monkeypatch) -> None:
    twins.install(monkeypatch.setattr)


@pytest.mark.parametrize("level", [fused, megakernel], ids=["fused", "megakernel"])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("kind", ["hot", "empty-experts"])
def test_wiring_never_reads_spare_rows_with_twins(monkeypatch, kind, precision, level):
    """The twins leave NaN in every spare row of what they return (the kernels leave anything there): L0's
    bits on routings with many spare rows (one hot expert: E - 1 empty segments; most experts empty) show that
    no step of the level reads them into a result."""
    _use_twins(monkeypatch)
    seed = fresh_seed()
    cfg = TINY_SHAPES["tiny"].scaled(num_tokens=100, num_experts=64)  # either routing leaves most experts empty
    inputs = make_inputs(cfg, seed=seed, routing_fn=_irregular_routing(kind))
    out0, grads0 = run_level(L0, inputs, precision=precision)
    out, saved = level.forward(*moe_args(inputs), precision=precision)
    assert saved.sched.num_rows == max_num_rows(cfg.num_tokens, cfg.num_topk, cfg.num_experts, fused.BLOCK_M)
    assert saved.sched.num_rows > int(saved.sched.expert_offsets[-1]), "no spare rows to check"
    grads = level.backward(saved, inputs["d_out"])
    assert bitwise_equal(out, out0), f"{kind} {precision}: out (seed {seed})"
    assert testing.twin_level_mismatches(grads, grads0, precision) == [], f"{kind} {precision} (seed {seed})"


# ---- bad expert ids ----------------------------------------------------------------------------------------


class _FakeEvent:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@pytest.fixture
def no_pending(monkeypatch):
    monkeypatch.setattr(bad_ids, "_PENDING", [])
    return bad_ids._PENDING


def _pending(count: int, done: bool) -> bad_ids.PendingIdCheck:
    return bad_ids.PendingIdCheck(torch.tensor([count], dtype=torch.int32), _FakeEvent(done), 8, 96)


def test_bad_ids_raise_only_once_landed(no_pending):
    no_pending += [_pending(0, True), _pending(3, False)]
    bad_ids.raise_landed()  # the landed one was clean; the other has not landed: no error, no wait
    assert [c.count.item() for c in bad_ids.pending()] == [3]
    no_pending[0].event.done = True
    with pytest.raises(ValueError, match=r"topk_idx: expected expert ids in \[0, 8\), got 3 of 96 ids outside it"):
        bad_ids.raise_landed()
    assert not bad_ids.pending()  # raised once, then gone
    bad_ids.raise_landed()
    no_pending.append(_pending(1, False))
    with pytest.raises(ValueError, match="got 1 of 96"):
        bad_ids.raise_landed(wait=True)


def test_check_errors_reads_the_graphs_totals(no_pending, monkeypatch):
    """mok.check_errors: the totals that captured calls added up (here a tensor standing in for one) raise once,
    after every queued check is waited for; clean totals and no totals raise nothing."""
    total = torch.tensor([0], dtype=torch.int32)
    monkeypatch.setattr(bad_ids, "_CAPTURED", {torch.device("cpu"): (total, 8, 96)})
    no_pending.append(_pending(0, False))
    mok.check_errors()  # the queued clean check waited for, the clean total read
    assert not no_pending
    total += 5
    with pytest.raises(ValueError, match="got 5 of 96 ids outside it"):
        mok.check_errors()
    assert int(total) == 0
    mok.check_errors()


def test_bad_ids_of_a_cpu_schedule_raise_at_once(no_pending):
    sched = make_schedule(torch.zeros(4, 2, dtype=torch.int64), 3)
    bad_ids.defer(sched)  # clean: nothing queued
    sched.counts[1] = 2
    with pytest.raises(ValueError, match=r"got 2 of 8 ids outside it"):
        bad_ids.defer(sched)
    assert not no_pending


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("level", ["torch", "fused"])
def test_moe_reads_ids_on_the_host_unless_the_level_checks_them(monkeypatch, level, check):
    """mok.moe (its op) skips its min/max read (a host sync) on a level that checks ids on the device (fused), unless
    check=True; every other level keeps it."""
    _use_twins(monkeypatch)
    calls = []
    monkeypatch.setattr(mok.library, "check_expert_ids", lambda idx, e: calls.append(e))  # inside mok::moe_forward
    inputs = make_inputs(TINY_SHAPES["tiny"], seed=fresh_seed())
    mok.moe(*moe_args(inputs), backend=level, check=check)
    assert len(calls) == (1 if check or level != "fused" else 0)


def test_moe_check_true_raises_in_the_call(monkeypatch):
    _use_twins(monkeypatch)
    inputs = make_inputs(TINY_SHAPES["tiny"], seed=fresh_seed())
    inputs["topk_idx"][3, 1] = TINY_SHAPES["tiny"].num_experts
    with pytest.raises(ValueError, match=r"topk_idx: expected expert ids in \[0, \d+\), got ids in"):
        mok.moe(*moe_args(inputs), backend="fused", check=True)


# ---- GPU ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _no_host_sync():
    """Any host-device sync torch can see (.item(), a blocking copy, synchronize) raises inside."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _synced_level(monkeypatch) -> None:
    """The level as it was: make_schedule_cuda with its host sync, row buffers of exactly the real rows."""
    make = ops.make_schedule_cuda
    monkeypatch.setattr(ops, "make_schedule_cuda", lambda idx, e, block_m=128, sync=True: make(idx, e, block_m))


IRREGULAR = [(STANDARD_SHAPES["qwen3-30b-a3b"].scaled(num_tokens=300), "empty-experts"),  # 123 empty experts
             (STANDARD_SHAPES["qwen3-30b-a3b"].scaled(num_tokens=300), "hot"),
             (STANDARD_SHAPES["dsv4pro-rank"].scaled(num_tokens=257), "hot"),  # with the shared expert
             (TINY_SHAPES["tiny-top8"], "empty-experts")]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("level", [fused, megakernel], ids=["fused", "megakernel"])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("cfg,kind", IRREGULAR, ids=lambda v: getattr(v, "name", v))
def test_without_sync_gives_the_synced_bits(monkeypatch, cfg, kind, precision, level):
    seed = fresh_seed()
    inputs = make_inputs(cfg, device="cuda", seed=seed, draw_on="cuda", routing_fn=_irregular_routing(kind))
    testing.poison_allocator(256 << 20)
    out, grads = run_level(level, inputs, precision=precision, swiglu_limit=1.0)
    _synced_level(monkeypatch)
    testing.poison_allocator(256 << 20)
    out_s, grads_s = run_level(level, inputs, precision=precision, swiglu_limit=1.0)
    what = f"{cfg.name} {kind} {precision} (seed {seed})"
    assert torch.isfinite(out).all() and bitwise_equal(out, out_s), f"{what}: out"
    for name, g, g_s in zip(GRAD_NAMES, grads, grads_s):
        assert (g is None and g_s is None) or (torch.isfinite(g).all() and bitwise_equal(g, g_s)), f"{what}: {name}"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("backend", ["fused", "megakernel"])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("with_shared", [True, False], ids=["shared", "noshared"])
def test_passes_make_no_host_sync(precision, with_shared, backend):
    level = mok.layer.get_level(backend)
    inputs = make_inputs(STANDARD_SHAPES["dsv4pro-rank"].scaled(num_tokens=300), device="cuda", seed=fresh_seed(),
                         draw_on="cuda", routing_fn=_irregular_routing("hot"))
    if not with_shared:
        inputs.update(w_shared_gate=None, w_shared_up=None, w_shared_down=None)
    run_level(level, inputs, precision=precision)  # warm: the JIT build, the cached shared-expert schedule
    torch.cuda.synchronize()
    with _no_host_sync():
        out, saved = level.forward(*moe_args(inputs), precision=precision)
        level.backward(saved, inputs["d_out"])
    with _no_host_sync():  # the functional op too (its input checks included), forward and backward
        args = [a.clone().requires_grad_() if a is not None and a.is_floating_point() else a for a in moe_args(inputs)]
        mok.moe(*args, precision=precision, backend=backend).backward(inputs["d_out"])


def _raw_row_kernels(sched, x, w_gate, w_up, w_down, d_out, weights, sentinel):
    """Each row-wise kernel through its raw binding, outputs [num_rows, *] filled with `sentinel` first."""
    ext, rows = ops.load_extension(), sched.num_rows
    row_to_token, tile_to_expert = ops.gemm_schedule_tensors(sched, x.device)

    def buf(width):
        return torch.full((rows, width), sentinel, dtype=torch.bfloat16, device=x.device)  # [rows, width]

    H, I = x.shape[1], w_gate.shape[1]
    h, gate, up, y = buf(I), buf(I), buf(I), buf(H)
    schedule = {"row_to_token": row_to_token, "tile_to_expert": tile_to_expert, "counts": sched.counts}
    ext.grouped_gemm_bf16_swiglu_gather(x=x, w_gate=w_gate, w_up=w_up, h=h, gate=gate, up=up, swiglu_limit=0.0,
                                        has_limit=False, num_sms=0, **schedule)
    ext.grouped_gemm_bf16_nt_contiguous(a_rows=h, w=w_down, out=y, num_sms=0, **schedule)
    y_real = torch.where(torch.isnan(y), 0.0, y)  # route_grads_prep reads y's real rows only; keep them finite
    dy = buf(H)
    d_tw = torch.empty(sched.num_tokens, sched.num_topk, device=x.device)  # [T, K]
    ext.route_grads_prep(d_out=d_out, topk_weights=weights, y_rows=y_real, route_to_row=sched.route_to_row,
                         tile_num_rows=sched.tile_num_rows, counts=sched.counts, dy_rows=dy, d_topk_weights=d_tw,
                         block_m=sched.block_m)
    d_gate, d_up, h2, dx = buf(I), buf(I), buf(I), buf(H)
    ext.grouped_gemm_bf16_dgrad_swiglu(dy_rows=torch.where(torch.isnan(dy), 0.0, dy), w_down=w_down, gate=gate, up=up,
                                       d_gate=d_gate, d_up=d_up, h=h2, swiglu_limit=0.0, has_limit=False, num_sms=0,
                                       **schedule)
    ext.grouped_gemm_bf16_dgrad_gate_up(d_gate=d_gate, d_up=d_up, w_gate=w_gate, w_up=w_up, dx_rows=dx, num_sms=0,
                                        **schedule)
    # the bf16 backward's: d_out rows unweighted, the route gradients from the SwiGLU backward
    d_out_rows, r_gate, r_up, r_h = buf(H), buf(I), buf(I), buf(I)
    ext.gather_rows(x=d_out, row_to_token=row_to_token, row_to_k=sched.row_to_k, route_to_row=sched.route_to_row,
                    out=d_out_rows, counts=sched.counts)
    ext.grouped_gemm_bf16_dgrad_swiglu_route_grads(
        d_out_rows=torch.where(torch.isnan(d_out_rows), 0.0, d_out_rows), w_down=w_down, gate=gate, up=up,
        topk_weights=weights, row_to_route=sched.row_to_route, d_gate=r_gate, d_up=r_up, h=r_h,
        d_topk_weights=torch.empty_like(weights), swiglu_limit=0.0, has_limit=False, num_sms=0, **schedule)
    # the MXFP8 backward's round trips over row buffers (their inputs' spare rows hold the sentinel too)
    dy_row, dy_col, h_col, x_col = buf(H), buf(H), buf(I), buf(H)
    ext.mxfp8_fake_quantize(x=dy, out=dy_col, out_row=dy_row, rowwise=False, counts=sched.counts)
    ext.mxfp8_fake_quantize(x=h2, out=h_col, out_row=None, rowwise=False, counts=sched.counts)
    ext.mxfp8_fake_quantize_gathered(x=x, row_to_token=row_to_token, out=x_col, counts=sched.counts)
    x_rows = buf(H)  # the BF16 backward's x rows for the weight gradients
    ext.gather_rows(x=x, row_to_token=row_to_token, row_to_k=sched.row_to_k, route_to_row=sched.route_to_row,
                    out=x_rows, counts=sched.counts)
    return {"h": h, "gate": gate, "up": up, "y": y, "dy": dy, "d_gate": d_gate, "d_up": d_up, "h_bwd": h2, "dx": dx,
            "d_out_rows": d_out_rows, "routed_d_gate": r_gate, "routed_d_up": r_up, "routed_h": r_h,
            "dy_row_mx": dy_row, "dy_col_mx": dy_col, "h_col_mx": h_col, "x_col_mx": x_col, "x_rows": x_rows}


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("kind", ["hot", "empty-experts"])
def test_row_kernels_never_write_spare_rows(kind):
    """GEMM1, GEMM2, route_grads_prep, the down dgrad (with swiglu_backward_rows, both kinds), the gate/up dgrad,
    the row gathers and the MXFP8 round trips over row buffers on a no-sync schedule: every spare row keeps the sentinel
    its buffer was filled with (NaN), every real row (padding included) is written and finite."""
    cfg = STANDARD_SHAPES["qwen3-30b-a3b"].scaled(num_tokens=300)
    inputs = make_inputs(cfg, device="cuda", seed=fresh_seed(), draw_on="cuda", routing_fn=_irregular_routing(kind))
    sched = ops.make_schedule_cuda(inputs["topk_idx"], cfg.num_experts, sync=False)
    n = int(sched.expert_offsets[-1])
    assert sched.num_rows > n, "no spare rows to check"
    outs = _raw_row_kernels(sched, inputs["x"], inputs["w_gate"], inputs["w_up"], inputs["w_down"], inputs["d_out"],
                            inputs["topk_weights"], float("nan"))
    for name, t in outs.items():
        assert torch.isfinite(t[:n]).all(), f"{kind}: {name} has unwritten real rows"
        assert torch.isnan(t[n:]).all(), f"{kind}: {name} wrote spare rows"


@pytest.mark.gpu
@pytest.mark.sm90
def test_bad_id_on_the_default_path_is_nan_then_a_clear_error():
    """mok.moe (backend auto -> fused) with an id outside [0, E): no host read in the call; the bad routes'
    tokens come out NaN (nothing silently wrong), and the backward raises ValueError naming topk_idx."""
    cfg = TINY_SHAPES["tiny"]
    inputs = make_inputs(cfg, device="cuda", seed=fresh_seed())
    inputs["topk_idx"][5, 0] = cfg.num_experts
    inputs["topk_idx"][9, 1] = -1
    args = [a.clone().requires_grad_() if a is not None and a.is_floating_point() else a for a in moe_args(inputs)]
    try:
        out = mok.moe(*args)
        torch.cuda.synchronize()  # the count has landed: the next fused call must raise
        bad = torch.zeros(cfg.num_tokens, dtype=torch.bool, device="cuda")
        bad[[5, 9]] = True
        assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all()
        with pytest.raises(ValueError, match=rf"topk_idx: expected expert ids in \[0, {cfg.num_experts}\), got 2 of"):
            out.backward(inputs["d_out"])
        with pytest.raises(ValueError, match=r"topk_idx: expected expert ids in .*got ids in \[-1, "):
            mok.moe(*moe_args(inputs), check=True)  # today's behaviour, opt-in: the error in the call
    finally:
        with contextlib.suppress(ValueError):
            bad_ids.raise_landed(wait=True)  # leave no queued check behind for the next test
