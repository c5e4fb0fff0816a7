"""tools/experts_sweep.py on the CPU, the level's kernels replaced by their L0 twins: the variants it runs, that a
balanced routing at a standard shape needs no padding, and that its summary reads the rows of every variant."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pandas as pd
import pytest

from mok import bench, bench_parts, fused, ops, twins
from mok.config import STANDARD_SHAPES
from mok.testing import fresh_seed, make_inputs, routing_of

spec = importlib.util.spec_from_file_location("experts_sweep", Path(__file__).parents[1] / "tools" / "experts_sweep.py")
experts_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(experts_sweep)


def test_variants_are_the_shape_its_balanced_twin_and_fewer_experts():
    runs = experts_sweep.variants("qwen3-30b-a3b", None)
    assert [(cfg.num_experts, routing) for cfg, routing in runs] == [(128, "random"), (128, "balanced"),
                                                                    (8, "balanced"), (32, "balanced")]
    assert {cfg.num_tokens for cfg, _ in runs} == {8192}  # the same work in every variant
    assert [c.num_experts for c, _ in experts_sweep.variants("dsv4pro-rank", [12])] == [48, 48, 12]
    assert [c.num_experts for c, _ in experts_sweep.variants("dsv4pro-rank", [])] == [48, 48]  # `--experts` alone


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "dsv4pro-rank"])
def test_balanced_standard_shapes_need_no_padding(name):
    """The sweep's premise: at its expert counts every segment of the balanced routing is a whole number of tiles."""
    for cfg, routing in experts_sweep.variants(name, None)[1:]:
        idx, _ = routing_of(routing)(cfg.num_tokens, cfg.num_experts, cfg.num_topk, None)
        assert bench.executed_rows(idx, cfg.num_experts) == (cfg.num_routes, cfg.num_routes), cfg


@pytest.fixture
def on_twins(monkeypatch):
    for name in twins.KERNELS:
        monkeypatch.setattr(ops, name, getattr(twins, name))
    monkeypatch.setattr(fused, "_check_runs_here", lambda x, precision: None)
    monkeypatch.setattr(bench, "WARMUP_MS", 0.0)
    monkeypatch.setattr(bench_parts, "make_inputs",
                        lambda cfg, **kwargs: make_inputs(cfg, **{**kwargs, "seed": fresh_seed(), "draw_on": "cpu"}))


def test_main_writes_every_variant_and_its_summary(on_twins, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(experts_sweep, "get_shape", lambda name: STANDARD_SHAPES["qwen3-30b-a3b"].scaled(
        num_tokens=256, hidden=64, intermediate=32, num_experts=16))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert experts_sweep.main(["--shapes", "small", "--experts", "8", "--iters", "2"]) == 0
    df = pd.read_csv(tmp_path / "experts_sweep.csv")
    assert set(zip(df["num_experts"], df["routing"])) == {(16, "random"), (16, "balanced"), (8, "balanced")}
    assert set(zip(df["warmup_ms"], df["timing"])) == {(0.0, "queued")}  # the method of record (warm-up patched)
    table = experts_sweep.summary(df)
    assert len(table) == 3 and {"pad", "gemm1", "wgrad_down", "fwd/ceiling", "bwd/bound"} <= set(table.columns)
    assert table.xs("balanced", level="routing")["pad"].tolist() == [0.0, 0.0]  # 128 or 256 routes per expert
    gemm1 = df[(df["step"] == "gemm1") & (df["routing"] == "random")].iloc[0]
    assert math.isclose(table.xs("random", level="routing")["pad"].iloc[0], gemm1["padded_flops"] / gemm1["flops"] - 1)
    assert "fwd/ceiling" in capsys.readouterr().out
