"""tools/ceiling_spread.py on the CPU: one row per (shape, pass, warm-up, round), written where OUT says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

spec = importlib.util.spec_from_file_location("ceiling_spread",
                                              Path(__file__).parents[1] / "tools" / "ceiling_spread.py")
ceiling_spread = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ceiling_spread)


def test_rows_per_shape_pass_warmup_and_round(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert ceiling_spread.main(["--shapes", "tiny", "--passes", "fwd", "bwd", "--rounds", "2", "--idle-s", "0",
                                "--warmup-ms", "0", "1", "--iters", "2"]) == 0
    df = pd.read_csv(tmp_path / "ceiling_spread.csv")
    assert len(df) == 2 * 2 * 2
    assert set(df["warmup_ms"]) == {0.0, 1.0} and set(df["pass"]) == {"fwd", "bwd"}
    assert (df["ceiling_tflops"] > 0).all() and set(df["round"]) == {0, 1}
    assert "median" in capsys.readouterr().out
