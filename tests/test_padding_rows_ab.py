"""tools/padding_rows_ab.py on the CPU: the ways multiply the row buffers they name (padding rows zeroed or not, at the
schedule's positions) with the same weights, and every round times every way."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import torch

from mok.config import TINY_SHAPES
from mok.schedule import make_schedule
from mok.testing import make_inputs

spec = importlib.util.spec_from_file_location("padding_rows_ab",
                                              Path(__file__).parents[1] / "tools" / "padding_rows_ab.py")
padding_rows_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(padding_rows_ab)


def test_each_way_multiplies_its_rows():
    cfg = TINY_SHAPES["tiny"]
    calls = padding_rows_ab.ways(cfg, "cpu")
    topk_idx = make_inputs(cfg)["topk_idx"]
    w1, w2 = calls["routes"].args[2:]
    for way, (block_m, zero) in padding_rows_ab.LAYOUTS.items():
        if block_m is None:
            continue  # the routes alone: checked below
        a1, a2, v1, v2 = calls[way].args
        assert v1 is w1 and v2 is w2, "every way multiplies the same weights"
        padding = make_schedule(topk_idx, cfg.num_experts, block_m).row_to_token < 0
        assert a1.shape == (len(padding), cfg.hidden) and a2.shape == (len(padding), cfg.intermediate)
        for a in (a1, a2):
            assert bool((a[padding] == 0).all()) == zero and bool((a[~padding] != 0).any())
    assert calls["routes"].args[0].shape[0] == topk_idx.numel()
    real = make_schedule(topk_idx, cfg.num_experts, 128).row_to_token >= 0
    assert torch.equal(calls["pad128_zero"].args[0][real], calls["pad128_random"].args[0][real]), \
        "the two 128-row ways differ in their padding rows alone"


def test_rows_per_shape_way_and_round(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert padding_rows_ab.main(["--shapes", "tiny", "--rounds", "2", "--iters", "2"]) == 0
    df = pd.read_csv(tmp_path / "padding_rows_ab.csv")
    assert len(df) == 2 * len(padding_rows_ab.WAYS) and set(df["way"]) == set(padding_rows_ab.WAYS)
    assert (df["time_ms"] > 0).all() and "pad64_zero/pad128_zero" in capsys.readouterr().out
