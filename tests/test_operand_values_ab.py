"""tools/operand_values_ab.py on the CPU: the two ways multiply the same shapes, the second on operands that are
their own MXFP8 round trips (what makes it a test of values alone), and every round times both."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import torch

from mok import mxfp8
from mok.config import TINY_SHAPES

spec = importlib.util.spec_from_file_location("operand_values_ab",
                                              Path(__file__).parents[1] / "tools" / "operand_values_ab.py")
operand_values_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(operand_values_ab)


def test_the_second_way_differs_in_values_only():
    calls = operand_values_ab.operands(TINY_SHAPES["tiny"], "cpu")["mm"]
    (a, b), (aq, bq) = (calls[w].args for w in operand_values_ab.WAYS)
    assert a.shape == aq.shape and b.shape == bq.shape and aq.dtype == bq.dtype == torch.bfloat16
    assert not torch.equal(a, aq), "the round trip changed nothing: the two ways would time the same values"
    assert torch.equal(mxfp8.fake_quantize(aq, -1), aq) and torch.equal(mxfp8.fake_quantize(bq, -2), bq)


def test_rows_per_gemm_way_and_round(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert operand_values_ab.main(["--shapes", "tiny", "--rounds", "2", "--iters", "2"]) == 0
    df = pd.read_csv(tmp_path / "operand_values_ab.csv")
    assert len(df) == 2 * 2 and set(df["gemm"]) == {"mm"}  # gemm2 needs the GPU
    assert set(df["way"]) == set(operand_values_ab.WAYS) and (df["time_ms"] > 0).all()
    assert "ratio" in capsys.readouterr().out
