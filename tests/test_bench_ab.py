"""The in-process A/B of a build switch (mok.bench_ab, mok.ops.core.built_with) on the CPU: which build each
timing runs under, the interleaving, and the table of medians, for whole passes and kernel by kernel."""

import pandas as pd
import pytest

from mok import bench, bench_ab, bench_parts, fused, ops, twins
from mok.config import TINY_SHAPES
from mok.ops import core
from mok.testing import make_inputs, moe_args


@pytest.fixture
def loads(monkeypatch):
    """The switches of every extension load, instead of building one."""
    seen = []
    monkeypatch.setattr(core, "_load", lambda switches: seen.append(switches))
    return seen


def test_built_with_selects_the_build_and_restores(loads, monkeypatch):
    monkeypatch.setenv("MOK_GEMM_TMA_STORE", "0")
    core._env_switches.cache_clear()
    try:
        core.load_extension()
        with core.built_with({"MOK_GEMM_MULTICAST": 0}):
            core.load_extension()
            with core.built_with({}):  # the headers' defaults, whatever the environment says
                core.load_extension()
            core.load_extension()
            core.load_extension({"MOK_GEMM_NUM_STAGES": 3})  # explicit switches win
        with pytest.raises(RuntimeError), core.built_with({"MOK_GEMM_MULTICAST": 0}):
            raise RuntimeError("a failing op")
        core.load_extension()  # restored after an exception
    finally:
        core._env_switches.cache_clear()
    env, mc0 = (("MOK_GEMM_TMA_STORE", 0),), (("MOK_GEMM_MULTICAST", 0),)
    assert loads == [env, mc0, (), mc0, (("MOK_GEMM_NUM_STAGES", 3),), env]


def test_built_with_rejects_unknown_switches():
    with pytest.raises(ValueError, match=r"MOK_GEMM_MULTICAST: expected one of \(0, 1\)"):
        core.built_with({"MOK_GEMM_MULTICAST": 2}).__enter__()
    assert core._active is None


@pytest.mark.parametrize("text", ["MOK_GEMM_MULTICAST", "MULTICAST=0", "=0"])
def test_parse_switch_names_the_argument(text):
    with pytest.raises(ValueError, match=r"^switch: expected NAME=VALUE"):
        bench_ab.parse_switch(text)


def test_parse_switch_checks_the_value():
    assert bench_ab.parse_switch("MOK_GEMM_NUM_STAGES= 3") == {"MOK_GEMM_NUM_STAGES": 3}
    assert bench_ab.parse_switch("MOK_GEMM_GROUP_M=4,MOK_GEMM_DYNAMIC=1") == {
        "MOK_GEMM_GROUP_M": 4, "MOK_GEMM_DYNAMIC": 1}
    with pytest.raises(ValueError, match=r"^switch: expected NAME=VALUE"):
        bench_ab.parse_switch("MOK_GEMM_GROUP_M=4,SKIP=1")
    with pytest.raises(ValueError, match=r"^MOK_GEMM_MULTICAST: expected one of \(0, 1\)"):
        bench_ab.parse_switch("MOK_GEMM_MULTICAST=2")


def test_ab_interleaves_builds_and_tables_medians():
    """Each timing runs under its own build, the order alternates between rounds, and the table's ratio is
    variant / default of the medians (a fake clock: the variant takes twice as long, one outlier per build)."""
    timed = []

    def time_fn(fn, iters, during=None):
        timed.append(core._active)
        slow = 2.0 if core._active else 1.0
        return slow * (100.0 if len(timed) in (1, 2) else 1.0)  # round 0's first pass: an outlier each

    cfg = TINY_SHAPES["tiny-top1"]
    rows = bench_ab.ab_shape(cfg, {"MOK_GEMM_MULTICAST": "0"}, ["fwd", "bwd"], rounds=3, iters=2,
                             level="reference", device="cpu", time_fn=time_fn)
    assert len(rows) == 3 * 2 * 2 and len(timed) == len(rows)
    mc0 = (("MOK_GEMM_MULTICAST", 0),)
    assert timed[:4] == [(), mc0, (), mc0] and timed[4:8] == [mc0, (), mc0, ()]  # rounds 0 and 1
    assert all(r["build"] == ("default" if t == () else "MOK_GEMM_MULTICAST=0") for r, t in zip(rows, timed))
    table = bench_ab.ab_table(pd.DataFrame(rows))
    assert list(table["pass"]) == ["fwd", "bwd"] and (table["ratio"] == 2.0).all()  # in the order timed
    assert all({"sm_mhz", "power_w", "power_capped"} <= set(r) for r in rows)  # NaN here: no NVML on the CPU
    assert (table["default"] == 1.0).all()  # the outliers are not the median


@pytest.fixture
def kernel_twins(monkeypatch):
    """Every mok.ops kernel replaced by its L0 twin, so the fused level runs on the CPU."""
    for name in twins.KERNELS:
        monkeypatch.setattr(ops, name, getattr(twins, name))
    monkeypatch.setattr(fused, "_check_runs_here", lambda x, precision: None)


@pytest.mark.parametrize("shape", ["tiny", "tiny-noshared"])
def test_ab_parts_times_every_step_under_both_builds(kernel_twins, shape):
    """Every step of mok.bench_parts, each timed under both builds in every round, in alternating order; the
    intermediates come from the default build, and the table has one row per step with variant / default."""
    timed = []

    def time_fn(fn, iters, during=None):
        timed.append(core._active)
        fn()  # the step runs on the intermediates it was given
        return 3.0 if core._active else 1.5

    cfg = TINY_SHAPES[shape]
    steps = [s.name for s in bench_parts.steps_of(fused.forward(*moe_args(make_inputs(cfg, device="cpu")))[1])]
    rows = bench_ab.ab_parts_shape(cfg, {"MOK_GEMM_TMA_STORE": 0}, rounds=2, iters=2, device="cpu", time_fn=time_fn)
    st0 = (("MOK_GEMM_TMA_STORE", 0),)
    assert len(rows) == 2 * 2 * len(steps) == len(timed)
    assert [r["step"] for r in rows[:2 * len(steps):2]] == steps  # the level's order, each step twice in a row
    assert timed[:2] == [(), st0] and timed[2 * len(steps):2 * len(steps) + 2] == [st0, ()]  # round 1 reversed
    assert all(r["build"] == ("default" if t == () else "MOK_GEMM_TMA_STORE=0") for r, t in zip(rows, timed))
    table = bench_ab.ab_table(pd.DataFrame(rows))
    assert list(table["step"]) == steps and (table["ratio"] == 2.0).all()


def test_ab_parts_rejects_what_it_would_ignore(capsys):
    with pytest.raises(SystemExit):
        bench_ab.main(["MOK_GEMM_TMA_STORE=0", "--parts", "--precision", "mxfp8"])
    assert "--parts times the bf16 kernels of both passes" in capsys.readouterr().err


@pytest.mark.parametrize("parts", [False, True])
@pytest.mark.parametrize("from_idle", [False, True])
def test_ab_cli_times_every_timing_alike(kernel_twins, monkeypatch, tmp_path, parts, from_idle):
    """`ab --warmup-ms [--from-idle]`: every timing of both builds gets the same method, and the rows say which."""
    seen = []
    monkeypatch.setattr(bench, "time_ms", lambda fn, iters, warmup_ms=0.0, during=None, queued=False:
                        seen.append((warmup_ms, queued)) or 1.0)
    out = tmp_path / "ab.csv"
    argv = ["MOK_GEMM_TMA_STORE=0", "--shapes", "tiny", "--rounds", "1", "--iters", "2", "--warmup-ms", "7",
            "--out", str(out), *(["--parts"] if parts else ["--passes", "fwd"]),
            *(["--from-idle"] if from_idle else [])]
    assert bench_ab.main(argv) == 0
    assert seen and set(seen) == {(7.0, not from_idle)}
    df = pd.read_csv(out)
    assert set(zip(df["warmup_ms"], df["timing"])) == {(7.0, "from_idle" if from_idle else "queued")}
