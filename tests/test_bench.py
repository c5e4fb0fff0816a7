"""The benchmark harness on the CPU: row schema of DESIGN §8, FLOP bookkeeping, CSV merging, and the L2
breakdown (bench.parts) on the kernels' L0 twins."""

import inspect
import math
from collections import Counter

import pandas as pd
import pytest
import torch

from bench import moe, parts, timing
from bench.__main__ import main as bench_main
from mok import fused, ops, twins
from mok.config import STANDARD_SHAPES, TINY_SHAPES
from mok.routing import random_routing
from mok.schedule import Schedule, make_schedule
from mok.testing import GRAD_NAMES, bitwise_equal, fresh_seed, make_inputs, moe_args, routing_of

COLUMNS = {"shape", "level", "precision", "pass", "time_ms", "tflops", "ceiling_tflops", "frac_of_ceiling",
           "speedup_vs_torch", "peak_mem_gb", "saved_gb", "gpu", "torch", "cuda", "commit", "date"}
CLOCK_COLUMNS = ("sm_mhz", "power_w", "power_capped")  # the clocks each timing ran at (mok.clocks)


@pytest.mark.parametrize("cfg", list(STANDARD_SHAPES.values()) + list(TINY_SHAPES.values()), ids=lambda c: c.name)
@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwd+bwd"])
def test_ceiling_gemms_carry_the_moe_flops(cfg, pass_):
    """The dense ceiling runs exactly the MoE's FLOPs, so its TFLOP/s are comparable."""
    flops = sum(2 * m * n * k for m, n, k in moe.gemm_shapes(cfg, pass_))
    assert flops == cfg.flops(pass_)


def test_executed_rows_round_each_expert_up():
    """Experts with 0, 1, 64, 65 and 129 routes: the row-wise GEMMs run 0 + 128 + 128 + 128 + 256 rows, the
    weight gradients' K 0 + 64 + 64 + 128 + 192; an expert's routes are counted wherever they sit in [T, K]."""
    counts = [0, 1, 64, 65, 129]
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    topk_idx = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(fresh_seed()))].view(-1, 1)
    assert moe.executed_rows(topk_idx, num_experts=6) == (640, 448)
    assert moe.executed_rows(topk_idx.view(-1, 7), num_experts=5) == (640, 448)
    assert moe.executed_rows(topk_idx, num_experts=5, block_m=64) == (448, 448)  # a schedule of 64-row tiles
    assert moe.executed_rows(topk_idx, num_experts=5, block_m=1) == (259, 259)  # no padding: the routes


@pytest.mark.parametrize("cfg", [STANDARD_SHAPES["dsv4pro-rank"], TINY_SHAPES["tiny"]], ids=lambda c: c.name)
@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_executed_gemms_scale_only_the_routed_flops(cfg, pass_):
    """With rows = (M, K): the routed row-wise GEMMs carry M / routes of their FLOPs, the routed weight
    gradients K / routes, the shared expert's GEMMs are unchanged."""
    m, k = cfg.num_routes + 128 * 5, cfg.num_routes + 64 * 3
    flops = sum(2 * a * b * c for a, b, c in moe.gemm_shapes(cfg, pass_, rows=(m, k)))
    routed = cfg.scaled(shared_intermediate=0).flops(pass_)
    shared = cfg.flops(pass_) - routed
    row_wise, wgrad = (routed, 0) if pass_ == "fwd" else (routed / 2, routed / 2)
    assert flops == pytest.approx(shared + row_wise * m / cfg.num_routes + wgrad * k / cfg.num_routes, rel=1e-12)


@pytest.mark.parametrize("warmup_ms, warm_calls", [(0.0, 1), (50.0, 5), (55.0, 6)])
def test_time_ms_warms_up_for_warmup_ms(monkeypatch, warmup_ms, warm_calls):
    """On a fake clock where each call takes 10 ms: one warm-up call, then more until warmup_ms have passed, then
    the timed calls, whose median is the call's time."""
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    calls = []

    def fn():
        calls.append(now[0])
        now[0] += 0.010

    assert timing.time_ms(fn, iters=3, warmup=1, warmup_ms=warmup_ms) == pytest.approx(10.0)
    assert len(calls) == warm_calls + 3


class FakeGpu:
    """torch.cuda's timing surface on a log: each call of `fn` takes 1 ms of GPU time and the host 3 ms to launch it
    from an idle GPU (the queue hides it behind the call before); events record their time, synchronizations their
    name."""

    def __init__(self):
        self.log, self.gpu_ms, self.queue_busy = [], 0.0, False
        gpu = self

        class Event:
            def __init__(self, enable_timing):
                assert enable_timing

            def record(self):
                gpu.log.append("record")
                self.at = gpu.gpu_ms

            def synchronize(self):
                gpu.log.append("event sync")
                gpu.queue_busy = False

            def elapsed_time(self, end):
                return end.at - self.at

        self.Event = Event

    def fn(self):
        self.log.append("fn")
        self.gpu_ms += 1.0 if self.queue_busy else 4.0
        self.queue_busy = True

    def synchronize(self):
        self.log.append("sync")
        self.queue_busy = False


@pytest.mark.parametrize("queued", [True, False])
def test_time_ms_queues_the_timed_calls_or_starts_each_from_idle(monkeypatch, queued):
    """Queued (the method of record): one more call, then every timed call between its two events with no sync
    until the last event, so each time is the GPU's own (1 ms); from idle: a sync after every call, so each pays
    the host's launch (4 ms)."""
    gpu = FakeGpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", gpu.synchronize)
    ms = timing.time_ms(gpu.fn, iters=3, warmup=2, queued=queued)
    timed = gpu.log[2:]  # after the warm-up calls
    if queued:
        assert ms == 1.0 and timed == ["fn"] + ["record", "fn", "record"] * 3 + ["event sync"]
    else:
        assert ms == 4.0 and timed == ["record", "fn", "record", "event sync"] * 3


def test_bench_rows_on_cpu(tmp_path, capsys):
    cfg = TINY_SHAPES["tiny-top1"]
    rows = moe.bench_shape(cfg, ["reference", "torch"], ["bf16", "mxfp8"], ["fwd", "fwd+bwd"], peers=[],
                             iters=2, device="cpu", warmup_ms=0.0)
    assert len(rows) == 2 * (1 + 2 * 2)  # per pass: the ceiling + levels × precisions
    for r in rows:
        assert COLUMNS <= set(r), COLUMNS - set(r)
        assert r["time_ms"] > 0 and math.isclose(r["tflops"], cfg.flops(r["pass"]) / r["time_ms"] / 1e9)
        assert all(math.isnan(r[c]) for c in CLOCK_COLUMNS)  # mok.clocks: no NVML on the CPU
    torch_rows = [r for r in rows if r["level"] == "torch"]
    assert all(r["speedup_vs_torch"] == 1.0 for r in torch_rows)
    assert all(r["saved_gb"] > 0 for r in rows if r["kind"] == "mok")
    # each level's forward against L0's in its precision: L0 itself exactly, L1 within DESIGN §10's tolerance
    assert all(r["err_vs_l0"] == 0.0 for r in rows if r["level"] == "reference")
    assert all(0.0 <= r["err_vs_l0"] <= 1e-2 for r in torch_rows)

    path = tmp_path / "moe.csv"
    for r in rows:
        r["commit"] = "6e81576"  # a short hash that reads as a float (it became "inf" in a merged CSV once)
    timing.write_rows(rows, path)
    timing.write_rows(rows[:1], path)  # same key again: replaced, not duplicated
    df = timing.read_rows(path)
    assert len(df) == len(rows)
    assert (df["commit"] == "6e81576").all(), set(df["commit"])
    assert not df.duplicated(subset=timing.KEY).any()
    table = moe.summary_markdown(df)
    assert "| tiny-top1 | fwd |" in table and "cublas-dense" in table
    assert bench_main(["summary", str(path)]) == 0  # the CLI prints the same table
    assert table in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # `summary --help` is help, not a CSV named "--help"
        bench_main(["summary", "--help"])
    assert exit_.value.code == 0


def test_samples_table_reads_each_run_and_the_median(tmp_path, capsys):
    """`summary` over several runs: each run's fused fraction of its own ceiling, then min / median / max."""
    def run(fracs: dict) -> pd.DataFrame:
        rows = [dict(shape=shape, level=level, precision="bf16", **{"pass": pass_}, frac_of_ceiling=frac)
                for (shape, pass_), frac in fracs.items() for level in ("fused", "liger")]
        return pd.DataFrame(rows + [dict(shape="s", level="fused", precision="mxfp8", **{"pass": "fwd"},
                                         frac_of_ceiling=0.1)])

    runs = {"a": run({("s", "fwd"): 0.70, ("s", "bwd"): 0.60}), "b": run({("s", "fwd"): 0.80, ("s", "bwd"): 0.64}),
            "c": run({("s", "fwd"): 0.75})}  # c has no backward: a blank cell, left out of its row's statistics
    table = moe.samples_markdown(runs)
    assert "| s | fwd | 0.70 | 0.80 | 0.75 | 0.70 | 0.75 | 0.80 |" in table, table
    assert "| s | bwd | 0.60 | 0.64 |  | 0.60 | 0.62 | 0.64 |" in table, table
    paths = []
    for name, df in runs.items():
        paths.append(tmp_path / f"moe_{name}.csv")
        df.to_csv(paths[-1], index=False)
    assert bench_main(["summary", *map(str, paths)]) == 0
    out = capsys.readouterr().out
    assert "| shape | pass | moe_a | moe_b | moe_c | min | median | max |" in out and "| s | fwd | 0.70 |" in out


def test_bench_warmup_ms_reaches_every_timing(monkeypatch):
    """The ceiling's GEMMs and every level take the same warm-up (by default WARMUP_MS), and the rows say which."""
    seen = []

    def spy(fn, iters=20, warmup=3, warmup_ms=0.0, during=None, queued=False):
        seen.append((warmup_ms, queued))
        return 1.0

    monkeypatch.setattr(moe, "time_ms", spy)
    cfg = TINY_SHAPES["tiny-top1"]
    rows = moe.bench_shape(cfg, ["reference"], ["bf16"], ["fwd"], peers=[], iters=2, device="cpu")
    assert len(seen) == len(moe.gemm_shapes(cfg, "fwd")) + 1
    assert set(seen) == {(timing.WARMUP_MS, timing.QUEUED)} == {(1000.0, True)}
    assert {(r["warmup_ms"], r["timing"]) for r in rows} == {(1000.0, "queued")} and len(rows) == 2
    seen.clear()
    rows = moe.bench_shape(cfg, ["reference"], ["bf16"], ["fwd"], peers=[], iters=2, device="cpu", warmup_ms=7.0,
                             queued=False)
    assert set(seen) == {(7.0, False)} and {(r["warmup_ms"], r["timing"]) for r in rows} == {(7.0, "from_idle")}


def test_committed_rows_have_provenance():
    """data/bench/moe.csv is what the README quotes: every row says where it was measured."""
    df = timing.read_rows(timing.DATA / "moe.csv")
    assert COLUMNS - {"saved_gb"} <= set(df.columns)  # saved_gb came later than some committed rows
    assert df[["gpu", "torch", "cuda", "commit", "date"]].notna().all().all()
    assert set(STANDARD_SHAPES) <= set(df["shape"])
    ceiling = df[df.level == "cublas-dense"]
    assert (ceiling.frac_of_ceiling == 1.0).all()


@pytest.mark.parametrize("level", ["fused", "megakernel"])
@pytest.mark.parametrize("cached", [False, True])
def test_mx_weight_cache_rows_on_cpu(twin_calls, monkeypatch, tmp_path, cached, level):
    """`moe --mx-weight-cache` (the Hopper levels, kernels as L0 twins): the mxfp8 rows say so in their notes, carry
    the cache's size, and go to their own CSV (KEY has no notes); the timed runs reuse the warm-up's weight
    round trips, so the weights are quantized only by the saved_gb and err_vs_l0 forwards (3 + 3, outside) and the first
    warm-up (3 dual calls) instead of in every run (3 + 3 + 13 forward + backward runs x 6)."""
    monkeypatch.setattr(moe, "DATA", tmp_path)
    argv = ["moe", "--shapes", "tiny", "--levels", level, "--precisions", "mxfp8", "--passes", "fwd+bwd",
            "--peers", "--iters", "2", "--warmup-ms", "0"] + (["--mx-weight-cache"] if cached else [])
    assert bench_main(argv) == 0
    csv = tmp_path / ("moe_mx_cache.csv" if cached else "moe.csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == [csv.name]
    row = timing.read_rows(csv).query(f"level == '{level}'").iloc[0]
    assert row.notes == "mx_weights=dequantize" + ("; mxfp8_weight_cache" if cached else "")
    weight_calls = sum(1 for name, args in twin_calls  # args: ((argument, (shape, dtype) of a tensor), ...)
                       if name in ("mxfp8_fake_quantize", "mxfp8_fake_quantize_dual")
                       and len(dict(args)["x"][0]) == 3)  # [E, *, *]: a weight
    assert weight_calls == (3 + 3 + 3 if cached else 3 + 3 + (3 + 10) * 6)
    cfg = TINY_SHAPES["tiny"]
    weight_bytes = 3 * cfg.num_experts * cfg.intermediate * cfg.hidden * 2  # w_gate, w_up, w_down in bf16
    if cached:  # one bf16 round trip per weight and direction
        assert math.isclose(row.mx_cache_gb, 2 * weight_bytes / 1e9)
    else:
        assert "mx_cache_gb" not in row


def test_bound_rows_time_the_fused_levels_executed_rows(twin_calls, monkeypatch):
    """With the fused level, each pass gets a `bound` row: the ceiling's GEMMs over the rows the level executes
    for this routing (each expert's routes rounded up to its tiles), timed like the ceiling; without it, none."""
    timed = []
    monkeypatch.setattr(moe, "dense_gemm_ms", lambda mnk, iters, device, time_fn: timed.append(mnk) or 1.0)
    cfg = TINY_SHAPES["tiny"]
    rows = moe.bench_shape(cfg, ["fused"], ["bf16"], ["fwd", "bwd"], peers=[], iters=2, device="cpu",
                             warmup_ms=0.0)
    inputs = make_inputs(cfg, device="cpu", seed=0, draw_on="cpu")  # bench_shape's inputs
    executed = moe.executed_rows(inputs["topk_idx"], cfg.num_experts)
    assert executed[0] > executed[1] > cfg.num_routes  # tiny's experts have padding rows
    expected = []
    for pass_ in ("fwd", "bwd"):
        expected += moe.gemm_shapes(cfg, pass_) + moe.gemm_shapes(cfg, pass_, rows=executed)
    assert timed == expected
    bound = [r for r in rows if r["kind"] == "bound"]
    assert [(r["level"], r["pass"]) for r in bound] == [("cublas-executed", "fwd"), ("cublas-executed", "bwd")]
    for r in bound:  # 1 ms per fake GEMM: the bound's time is its GEMM count, its fraction ceiling / bound
        assert r["time_ms"] == len(moe.gemm_shapes(cfg, r["pass"])) and r["frac_of_ceiling"] == 1.0
        assert r["notes"] == "block_m=128"
    assert "cublas-executed / ceiling" in moe.summary_markdown(pd.DataFrame(rows))
    timed.clear()
    rows = moe.bench_shape(cfg, ["reference"], ["bf16"], ["fwd"], peers=[], iters=2, device="cpu", warmup_ms=0.0)
    assert not [r for r in rows if r["kind"] == "bound"] and timed == moe.gemm_shapes(cfg, "fwd")


def test_rounded_routing_rows_pad_only_the_remainder(twin_calls, monkeypatch):
    """--routing rounded: the benchmark's draw with every expert's routes but one expert's T·K mod 128 a multiple of
    the tile, so the `bound` executes one padded tile at most; the rows say which routing they ran."""
    timed = []
    monkeypatch.setattr(moe, "dense_gemm_ms", lambda mnk, iters, device, time_fn: timed.append(mnk) or 1.0)
    cfg = TINY_SHAPES["tiny"].scaled(num_tokens=1100, num_experts=16)  # 2200 routes: 137.5 per expert
    rows = moe.bench_shape(cfg, ["fused"], ["bf16"], ["fwd"], peers=[], iters=2, device="cpu", warmup_ms=0.0,
                             routing="rounded")
    assert {r["routing"] for r in rows} == {"rounded"}
    rounded = make_inputs(cfg, routing_fn=routing_of("rounded"))["topk_idx"]  # bench_shape's routing
    random = make_inputs(cfg)["topk_idx"]  # the same draw, not rounded
    assert moe.executed_rows(rounded, cfg.num_experts)[0] == 18 * 128  # 17 full tiles and one of 24 routes
    assert moe.executed_rows(random, cfg.num_experts)[0] > 24 * 128  # 137 ± 12 each: most experts 2 tiles
    assert timed == moe.gemm_shapes(cfg, "fwd") + moe.gemm_shapes(cfg, "fwd", rows=(18 * 128, 18 * 128))


# ---- the L2 breakdown (mok.bench_parts): its steps are the fused level's, on the kernels' L0 twins ----------

FWD_STEPS = ["schedule", "gemm1", "gemm2", "combine"]
BWD_STEPS = ["gather_d_out", "dgrad_swiglu", "dgrad_gate_up", "gather_x", "wgrad_gate", "wgrad_up", "wgrad_down",
             "combine_dx"]
SHARED_FWD_STEPS = ["shared_gemm1", "shared_gemm2"]
SHARED_BWD_STEPS = ["shared_pad_rows", "shared_dgrad_swiglu", "shared_dgrad_gate_up", "shared_wgrad_gate",
                    "shared_wgrad_up", "shared_wgrad_down"]
PARTS_COLUMNS = {"shape", "pass", "step", "time_ms", "share_of_pass", "flops", "padded_flops", "tflops",
                 "ceiling_tflops", "frac_of_ceiling", "frac_of_executed", "bytes", "gbps", "gpu", "torch", "cuda",
                 "commit", "date"}


def _describe(v):
    """What a call's argument is, for comparing calls: tensors by shape and dtype, schedules by their sizes."""
    if isinstance(v, torch.Tensor):
        return tuple(v.shape), v.dtype
    if isinstance(v, Schedule):
        return "Schedule", v.num_tokens, v.num_topk, v.num_experts, v.num_rows, v.block_m
    return v


def _recorder(log: list, name: str, fn):
    def call(*args, **kwargs):
        bound = inspect.signature(fn).bind(*args, **kwargs)  # positional or keyword: the same call
        bound.apply_defaults()
        log.append((name, tuple((k, _describe(v)) for k, v in bound.arguments.items())))
        return fn(*args, **kwargs)
    return call


@pytest.fixture
def twin_calls(monkeypatch) -> list:
    """Every mok.ops kernel replaced by its L0 twin and the level's torch glue kept; each call is logged."""
    log = []
    for name in twins.KERNELS:
        monkeypatch.setattr(ops, name, _recorder(log, name, getattr(twins, name)))
    for name in ("gather_x_rows", "pad_rows"):
        monkeypatch.setattr(fused, name, _recorder(log, name, getattr(fused, name)))
    monkeypatch.setattr(fused, "_check_runs_here", lambda x, precision: None)
    return log


def _expected_steps(with_shared: bool) -> set:
    return set(FWD_STEPS + BWD_STEPS + (SHARED_FWD_STEPS + SHARED_BWD_STEPS if with_shared else []))


@pytest.mark.parametrize("limit", [None, 0.7])
@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_parts_steps_make_the_levels_calls(twin_calls, monkeypatch, shape, limit):
    """Per pass, the steps call the same kernels and glue with the same arguments as mok.fused, and give its
    outputs bit for bit: the breakdown cannot drift from the level unnoticed. A swiglu_limit and a grid size
    (num_sms) that are not the defaults must reach every kernel as they do in the level."""
    monkeypatch.setattr(fused, "DEFAULT_NUM_SMS", 7)
    cfg = TINY_SHAPES[shape]
    inputs = make_inputs(cfg, seed=fresh_seed())
    out, saved = fused.forward(*moe_args(inputs), swiglu_limit=limit)
    level_fwd = Counter(twin_calls)
    twin_calls.clear()
    grads = fused.backward(saved, inputs["d_out"])
    level_bwd = Counter(twin_calls)
    twin_calls.clear()

    steps = parts.steps_of(saved)
    assert {s.name for s in steps} == _expected_steps(cfg.has_shared)
    assert len({s.name for s in steps}) == len(steps)
    fwd = parts.run_steps([s for s in steps if s.pass_ == "fwd"], parts.forward_state(inputs))
    assert Counter(twin_calls) == level_fwd
    twin_calls.clear()
    bwd = parts.run_steps([s for s in steps if s.pass_ == "bwd"], parts.backward_state(inputs, saved))
    assert Counter(twin_calls) == level_bwd

    assert bitwise_equal(fwd["out"], out)
    mine = [bwd["d_x"], bwd["d_topk_weights"], bwd["d_w_gate"], bwd["d_w_up"], bwd["d_w_down"]]
    if cfg.has_shared:
        mine += [bwd[f"shared_d_w_{n}"][0] for n in ("gate", "up", "down")]
    for name, a, b in zip(GRAD_NAMES, mine, grads):
        assert bitwise_equal(a, b), name


def _sized_saved(cfg) -> fused.FusedSaved:
    """A FusedSaved with the sizes of `cfg` and a real schedule, its big tensors zero-stride views (no memory):
    enough for steps_of, which reads sizes only."""
    T, H, I, E, K, I_sh = (cfg.num_tokens, cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.num_topk,
                           cfg.shared_intermediate)
    topk_idx, topk_weights = random_routing(T, E, K, generator=torch.Generator().manual_seed(fresh_seed()))
    size = lambda *shape: torch.empty((), dtype=torch.bfloat16).expand(*shape)  # noqa: E731
    weights = (size(E, I, H), size(E, I, H), size(E, H, I),
               *((size(I_sh, H), size(I_sh, H), size(H, I_sh)) if I_sh else (None,) * 3))
    return fused.FusedSaved(size(T, H), topk_idx, topk_weights, weights, None, None, None, None, None, "bf16", None,
                            sched=make_schedule(topk_idx, E, block_m=fused.BLOCK_M))


@pytest.mark.parametrize("cfg", list(STANDARD_SHAPES.values()) + list(TINY_SHAPES.values()), ids=lambda c: c.name)
def test_parts_gemm_flops_are_the_moe_flops(cfg):
    """The GEMM steps' useful FLOPs are MoK's, piece by piece; padded FLOPs count the schedule's rows."""
    saved = _sized_saved(cfg)
    steps = parts.steps_of(saved)
    assert {s.name for s in steps} == _expected_steps(cfg.has_shared)
    R, H, I, T, I_sh = cfg.num_routes, cfg.hidden, cfg.intermediate, cfg.num_tokens, cfg.shared_intermediate
    rows, rows_sh = saved.sched.num_rows, fused.shared_schedule(T, "cpu").num_rows if I_sh else 0
    for pass_, times in (("fwd", 1), ("bwd", 2)):
        gemms = [s for s in steps if s.pass_ == pass_ and s.mnk is not None]
        routed = [s for s in gemms if not s.name.startswith("shared_")]
        assert sum(s.flops for s in gemms) == cfg.flops(pass_)
        assert sum(s.flops for s in routed) == times * 6 * R * H * I
        assert sum(s.flops for s in gemms) - sum(s.flops for s in routed) == times * 6 * T * H * I_sh
        assert sum(s.padded_flops for s in gemms) == times * 6 * (rows * I + rows_sh * I_sh) * H
    for s in steps:  # a step is a GEMM or moves bytes, never both
        assert (s.mnk is None) == (s.padded_mnk is None) == (s.nbytes is not None)
        assert s.mnk is None or s.padded_flops >= s.flops > 0
        # every memory step moves bytes, but for shared_pad_rows with no padding to add (it returns its input)
        assert s.nbytes is None or s.nbytes > 0 or (s.name == "shared_pad_rows" and rows_sh == T)


@pytest.mark.parametrize("shape", ["tiny", "tiny-noshared"])
def test_parts_rows_on_cpu(twin_calls, tmp_path, shape):
    """The rows of one shape (the twins on the CPU, perf_counter timings): every step once with its share of
    the pass, the whole passes and the sum of their steps, and a CSV keyed by (shape, step)."""
    cfg = TINY_SHAPES[shape]
    rows = parts.bench_parts_shape(cfg, iters=3, device="cpu")
    assert all(PARTS_COLUMNS <= set(r) for r in rows)
    assert all(set(CLOCK_COLUMNS) | {"ceiling_sm_mhz"} <= set(r) for r in rows)  # each step's clocks and its GEMM's
    names = [r["step"] for r in rows]
    assert set(names) == _expected_steps(cfg.has_shared) | {"whole_fwd", "steps_fwd", "whole_bwd", "steps_bwd"}
    assert len(set(names)) == len(names)
    for pass_ in ("fwd", "bwd"):
        mine = [r for r in rows if r["pass"] == pass_]
        steps = [r for r in mine if r["kind"] in ("gemm", "memory")]
        whole, total = (next(r for r in mine if r["step"] == f"{k}_{pass_}") for k in ("whole", "steps"))
        assert whole["share_of_pass"] == 1.0 and whole["flops"] == cfg.flops(pass_)
        assert math.isclose(total["time_ms"], sum(r["time_ms"] for r in steps))
        for r in steps:
            assert r["time_ms"] > 0 and r["share_of_pass"] > 0, r  # a step timed alone may exceed its pass
            assert math.isclose(r["share_of_pass"], r["time_ms"] / whole["time_ms"])
            if r["kind"] == "gemm":
                assert math.isclose(r["tflops"], r["flops"] / r["time_ms"] / 1e9)
                assert math.isclose(r["frac_of_ceiling"], r["tflops"] / r["ceiling_tflops"])
                assert r["frac_of_executed"] > 0 and math.isnan(r["gbps"])
            else:
                assert math.isclose(r["gbps"], r["bytes"] / r["time_ms"] / 1e6) and math.isnan(r["tflops"])
                assert math.isnan(r["frac_of_executed"])

    path = tmp_path / "parts.csv"
    timing.write_rows(rows, path, key=parts.KEY)
    timing.write_rows(rows[:2], path, key=parts.KEY)  # the same keys again: replaced, not duplicated
    df = pd.read_csv(path)
    assert len(df) == len(rows) and not df.duplicated(subset=parts.KEY).any()


@pytest.mark.parametrize("options, method", [([], (timing.WARMUP_MS, True, "queued")),
                                             (["--warmup-ms", "7", "--from-idle"], (7.0, False, "from_idle"))])
def test_parts_cli_times_every_step_alike(twin_calls, monkeypatch, tmp_path, options, method):
    """`parts --warmup-ms --from-idle`: the passes, their steps and the ceilings' GEMMs are timed by the same method,
    and the rows say which."""
    seen = []
    monkeypatch.setattr(timing, "time_ms", lambda fn, iters, warmup_ms=0.0, during=None, queued=False:
                        seen.append((warmup_ms, queued)) or 1.0)
    out = tmp_path / "parts.csv"
    assert parts.main(["--shapes", "tiny", "--iters", "2", *options, "--out", str(out)]) == 0
    assert len(seen) > 10 and set(seen) == {method[:2]}
    df = pd.read_csv(out)
    assert set(zip(df["warmup_ms"], df["timing"])) == {(method[0], method[2])}


def test_parts_time_each_gemm_on_its_padded_rows(twin_calls, monkeypatch):
    """Each GEMM step is held against cuBLAS on its useful (M, N, K) and on its padded one, each shape timed once:
    with a fake dense_gemm_ms of 1 ms per million rows of M or K, frac_of_executed is that time over the step's."""
    timed = []

    def dense_gemm_ms(mnk, iters, device, time_fn):
        timed.append(mnk)
        return min(mnk[0], mnk[2]) / 1e6

    monkeypatch.setattr(parts.moe, "dense_gemm_ms", dense_gemm_ms)
    cfg = TINY_SHAPES["tiny"]
    rows = parts.bench_parts_shape(cfg, iters=2, device="cpu")
    assert len(timed) == len(set(timed))  # each shape once
    steps = {s.name: s for s in parts.steps_of(fused.forward(*moe_args(make_inputs(cfg, device="cpu")))[1])}
    for r in rows:
        if r["kind"] == "gemm":
            s = steps[r["step"]]
            assert s.mnk in timed and s.padded_mnk in timed
            assert math.isclose(r["frac_of_executed"], min(s.padded_mnk[0], s.padded_mnk[2]) / 1e6 / r["time_ms"])
    for pass_ in ("fwd", "bwd"):
        whole = next(r for r in rows if r["step"] == f"whole_{pass_}")
        executed = sum(min(steps[r["step"]].padded_mnk[0], steps[r["step"]].padded_mnk[2]) / 1e6
                       for r in rows if r["kind"] == "gemm" and r["pass"] == pass_)
        assert math.isclose(whole["frac_of_executed"], executed / whole["time_ms"])


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("shape", ["tiny", "tiny-noshared"])
def test_parts_rows_on_hopper(shape):
    """The same rows from the real kernels: finite, every step a share of its pass."""
    cfg = TINY_SHAPES[shape]
    rows = parts.bench_parts_shape(cfg, iters=3, device="cuda")
    assert {r["step"] for r in rows} >= _expected_steps(cfg.has_shared)
    for r in rows:
        assert r["time_ms"] > 0 and math.isfinite(r["time_ms"]), r
        if r["kind"] == "gemm":
            assert r["tflops"] > 0 and r["frac_of_ceiling"] > 0, r
        if r["kind"] in ("gemm", "memory"):
            assert r["share_of_pass"] > 0, r


def test_headline_names_the_fastest_other_per_row(tmp_path, capsys):
    """`summary --headline`: mok's TFLOP/s over the fastest of SonicMoE, Liger and L1 in each row, named."""
    rows = []
    for level, tflops, mem in (("cublas-dense", 600, float("nan")), ("fused", 500, 2.0), ("sonic", 400, 1.5),
                               ("liger", 450, 3.0), ("torch", 100, 9.0)):
        rows.append(dict(shape="s", level=level, precision="bf16", **{"pass": "fwd"}, tflops=tflops, peak_mem_gb=mem,
                         gpu="g", torch="t", cuda="c", commit="abc1234", date="d"))
    pd.DataFrame(rows).to_csv(tmp_path / "moe.csv", index=False)
    assert bench_main(["summary", "--headline", str(tmp_path / "moe.csv")]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| s |")][0]
    assert line == "| s | fwd | 600 | 500 | 400 | 450 | 100 | 1.11× Liger | 2.0 / 3.0 |"


def test_mok_call_rows_time_mok_moe_beside_the_levels():
    """The `mok.moe` peer: mok as a user calls it (custom ops, autograd; backend auto is L1 on the CPU), a row per
    pass beside the level rows, its output L1's."""
    cfg = TINY_SHAPES["tiny"]
    rows = moe.bench_shape(cfg, ["torch"], ["bf16"], ["fwd", "fwd+bwd"], peers=["mok.moe"], iters=2, device="cpu",
                           warmup_ms=0.0)
    calls = [r for r in rows if r["level"] == "mok.moe"]
    assert [r["pass"] for r in calls] == ["fwd", "fwd+bwd"] and all(r["time_ms"] > 0 for r in calls)
    level = next(r for r in rows if r["level"] == "torch" and r["pass"] == "fwd")
    assert calls[0]["err_vs_l0"] == level["err_vs_l0"], "mok.moe on the CPU runs L1: the same output"
