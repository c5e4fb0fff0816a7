"""The benchmark harness on the CPU: row schema of DESIGN §8, FLOP bookkeeping, CSV merging."""

import math

import pandas as pd
import pytest

from mok import bench
from mok.config import STANDARD_SHAPES, TINY_SHAPES

COLUMNS = {"shape", "level", "precision", "pass", "time_ms", "tflops", "ceiling_tflops", "frac_of_ceiling",
           "speedup_vs_torch", "peak_mem_gb", "gpu", "torch", "cuda", "commit", "date"}


@pytest.mark.parametrize("cfg", list(STANDARD_SHAPES.values()) + list(TINY_SHAPES.values()), ids=lambda c: c.name)
@pytest.mark.parametrize("pass_", ["fwd", "bwd", "fwd+bwd"])
def test_ceiling_gemms_carry_the_moe_flops(cfg, pass_):
    """The dense ceiling runs exactly the MoE's FLOPs, so its TFLOP/s are comparable."""
    flops = sum(2 * m * n * k for m, n, k in bench.gemm_shapes(cfg, pass_))
    assert flops == cfg.flops(pass_)


def test_bench_rows_on_cpu(tmp_path):
    cfg = TINY_SHAPES["tiny-top1"]
    rows = bench.bench_shape(cfg, ["reference", "torch"], ["bf16", "mxfp8"], ["fwd", "fwd+bwd"], peers=[],
                             iters=2, device="cpu")
    assert len(rows) == 2 * (1 + 2 * 2)  # per pass: the ceiling + levels × precisions
    for r in rows:
        assert COLUMNS <= set(r), COLUMNS - set(r)
        assert r["time_ms"] > 0 and math.isclose(r["tflops"], cfg.flops(r["pass"]) / r["time_ms"] / 1e9)
    torch_rows = [r for r in rows if r["level"] == "torch"]
    assert all(r["speedup_vs_torch"] == 1.0 for r in torch_rows)

    path = tmp_path / "moe.csv"
    bench.write_rows(rows, path)
    bench.write_rows(rows[:1], path)  # same key again: replaced, not duplicated
    df = pd.read_csv(path)
    assert len(df) == len(rows)
    assert not df.duplicated(subset=bench.KEY).any()
    table = bench.summary_markdown(df)
    assert "| tiny-top1 | fwd |" in table and "cublas-dense" in table


def test_committed_rows_have_provenance():
    """data/bench/moe.csv is what the README quotes: every row says where it was measured."""
    df = pd.read_csv(bench.DATA / "moe.csv")
    assert COLUMNS <= set(df.columns)
    assert df[["gpu", "torch", "cuda", "commit", "date"]].notna().all().all()
    assert set(STANDARD_SHAPES) <= set(df["shape"])
    ceiling = df[df.level == "cublas-dense"]
    assert (ceiling.frac_of_ceiling == 1.0).all()
