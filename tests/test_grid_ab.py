"""tools/grid_ab.py on the CPU, the level's kernels replaced by their L0 twins: each way runs the pass with the GEMMs on
its grid (and only that grid), the ways give the same bits, and every round times every way."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

from mok import bench, fused, ops, twins
from mok.config import TINY_SHAPES
from mok.testing import bitwise_equal, fresh_seed, make_inputs

spec = importlib.util.spec_from_file_location("grid_ab", Path(__file__).parents[1] / "tools" / "grid_ab.py")
grid_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grid_ab)


@pytest.fixture
def grids(monkeypatch) -> list:
    """The level on its twins; the grids (num_sms) two of its GEMMs were called with (GEMM2 runs in the forward,
    the weight gradients in the backward)."""
    for name in twins.KERNELS:
        monkeypatch.setattr(ops, name, getattr(twins, name))
    monkeypatch.setattr(fused, "_check_runs_here", lambda x, precision: None)
    monkeypatch.delenv(fused.NUM_SMS_ENV, raising=False)
    seen = []

    def spied(kernel):
        def spy(*args, num_sms=None, **kwargs):
            seen.append(num_sms)
            return kernel(*args, num_sms=num_sms, **kwargs)
        return spy

    for name in ("grouped_gemm_bf16_nt_contiguous", "grouped_gemm_bf16_weight_grad"):  # one per pass, at least
        monkeypatch.setattr(ops, name, spied(getattr(twins, name)))
    return seen


@pytest.mark.parametrize("pass_", ["fwd", "bwd"])
def test_each_way_runs_its_grid_and_the_same_bits(grids, pass_):
    seed = fresh_seed()
    inputs = make_inputs(TINY_SHAPES["tiny"], seed=seed)
    ways = grid_ab.ways(inputs, pass_, [3, 1])
    assert list(ways) == ["all", "3", "1"]
    outs = {}
    for way, fn in ways.items():
        grids.clear()
        outs[way] = fn()
        assert grids and set(grids) == {None if way == "all" else int(way)}, (way, grids)
    results = {way: [out[0]] if pass_ == "fwd" else [g for g in out if g is not None]  # out; the gradients
               for way, out in outs.items()}
    assert results["all"]
    for way in ("3", "1"):
        assert len(results[way]) == len(results["all"])
        for a, b in zip(results["all"], results[way]):
            assert bitwise_equal(a, b), f"{pass_}: {way} SMs differ from all (seed {seed})"


def test_main_times_every_way_each_round(grids, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, "WARMUP_MS", 0.0)
    monkeypatch.setattr(grid_ab, "make_inputs", lambda cfg, **kwargs: make_inputs(cfg, seed=fresh_seed()))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert grid_ab.main(["--shapes", "tiny", "--passes", "fwd", "--sms", "2", "--rounds", "2", "--iters", "2"]) == 0
    rows = pd.read_csv(tmp_path / "grid_ab.csv", dtype={"way": str})
    assert sorted(zip(rows["way"], rows["round"])) == [("2", 0), ("2", 1), ("all", 0), ("all", 1)]
    assert (rows["time_ms"] > 0).all() and (rows["shape"] == "tiny").all()
    assert "2/all" in capsys.readouterr().out  # the ratio to every SM


def test_a_grid_from_the_environment_is_refused(grids, monkeypatch):
    monkeypatch.setenv(fused.NUM_SMS_ENV, "8")
    with pytest.raises(SystemExit) as exit_:
        grid_ab.main(["--shapes", "tiny"])
    assert exit_.value.code == 2
