"""tools/block_m_ab.py on the CPU: every timing runs the level with its own way's block_m (the shared expert's cached
schedule rebuilt to match), each way's backward state made under its block_m, and the level left at its own."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mok import bench, fused
from mok.config import TINY_SHAPES

spec = importlib.util.spec_from_file_location("block_m_ab", Path(__file__).parents[1] / "tools" / "block_m_ab.py")
block_m_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(block_m_ab)


def test_each_timing_runs_under_its_ways_block_m(monkeypatch):
    made, ran = [], []

    def level_pass_fn(level, inputs, precision, pass_):
        made.append((pass_, fused.BLOCK_M))
        return lambda: ran.append((fused.BLOCK_M, fused.shared_schedule(5, "cpu").block_m))  # cached per (T, device)

    def time_fn(fn, iters, warmup_ms=0.0, during=None):
        fn()
        return float(fused.BLOCK_M)  # "ms" = the block_m the call saw

    monkeypatch.setattr(bench, "level_pass_fn", level_pass_fn)
    rows = block_m_ab.ab_rows(TINY_SHAPES["tiny"], ["fwd", "bwd"], rounds=2, iters=2, device="cpu", time_fn=time_fn)
    assert made == [("fwd", 128), ("bwd", 128), ("fwd", 64), ("bwd", 64)]
    assert len(rows) == 2 * 2 * 2 and {r["way"] for r in rows} == {"block_m=128", "block_m=64"}
    assert all(r["time_ms"] == int(r["way"].split("=")[1]) for r in rows)
    assert [r["way"] for r in rows[:2]] == ["block_m=128", "block_m=64"]  # then reversed in round 1
    assert [r["way"] for r in rows[4:6]] == ["block_m=64", "block_m=128"]
    assert all(level == shared for level, shared in ran), "a timing ran on the other way's cached shared schedule"
    assert fused.BLOCK_M == 64
