"""tools/ceiling_ab.py on the CPU, the level's kernels replaced by their L0 twins: the ceiling way multiplies exactly
the GEMM shapes `bench moe` sums, and every round times both ways."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import torch

from mok import bench, fused, ops, twins
from mok.config import TINY_SHAPES
from mok.testing import fresh_seed, make_inputs

spec = importlib.util.spec_from_file_location("ceiling_ab", Path(__file__).parents[1] / "tools" / "ceiling_ab.py")
ceiling_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ceiling_ab)


@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwd+bwd"])
@pytest.mark.parametrize("shape", ["tiny", "tiny-noshared"])
def test_ceiling_way_runs_the_benchmarks_gemm_shapes(monkeypatch, shape, pass_):
    cfg = TINY_SHAPES[shape]
    seen, mm = [], torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: seen.append((a.shape[0], b.shape[1], a.shape[1])) or mm(a, b))
    fn = ceiling_ab.ceiling_fn(cfg, pass_, "cpu")  # binds torch.mm as it builds the calls
    fn()
    assert seen == bench.gemm_shapes(cfg, pass_)
    assert sum(2 * m * n * k for m, n, k in seen) == cfg.flops(pass_)  # the FLOPs its fraction is read against


def test_main_times_both_ways_each_round(monkeypatch, capsys, tmp_path):
    for name in twins.KERNELS:
        monkeypatch.setattr(ops, name, getattr(twins, name))
    monkeypatch.setattr(fused, "_check_runs_here", lambda x, precision: None)
    monkeypatch.setattr(bench, "WARMUP_MS", 0.0)
    monkeypatch.setattr(ceiling_ab, "make_inputs", lambda cfg, **kwargs: make_inputs(cfg, seed=fresh_seed()))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert ceiling_ab.main(["--shapes", "tiny", "--passes", "fwd", "--rounds", "2", "--iters", "2"]) == 0
    rows = pd.read_csv(tmp_path / "ceiling_ab.csv")
    assert sorted(zip(rows["way"], rows["round"])) == [("ceiling", 0), ("ceiling", 1), ("fused", 0), ("fused", 1)]
    assert (rows["time_ms"] > 0).all()
    assert "fraction of the ceiling" in capsys.readouterr().out
