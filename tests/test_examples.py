"""Smoke runs of examples/ at tiny sizes on the CPU (seconds): each writes its CSV and figure where told."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_determinism_runs_every_impl_twice_and_finds_the_cpu_deterministic(tmp_path):
    pytest.importorskip("seaborn")
    out = _example("determinism").main(
        ["--steps", "2", "--batch", "1", "--seq", "9", "--vocab", "32", "--hidden", "32", "--intermediate", "32",
         "--experts", "4", "--topk", "2", "--layers", "1", "--csv", str(tmp_path / "d.csv"),
         "--figure", str(tmp_path / "d.png")])
    assert set(out.impl) == {"mok (reference)", "torch (L1)", "index_add (grouped_mm + index_add)"}  # no Liger here
    assert list(out.columns[:5]) == ["impl", "step", "loss_run1", "loss_run2", "abs_diff"] and len(out) == 6
    assert (out.abs_diff == 0).all()  # no float atomics on the CPU
    assert (tmp_path / "d.csv").stat().st_size > 0 and (tmp_path / "d.png").stat().st_size > 0


def test_train_hf_trains_both_from_the_same_seed(tmp_path):
    pytest.importorskip("seaborn")
    pytest.importorskip("transformers")
    out = _example("train_hf").main(
        ["--steps", "2", "--batch", "2", "--seq", "8", "--vocab", "32", "--hidden", "32", "--intermediate", "32",
         "--experts", "4", "--layers", "1", "--csv", str(tmp_path / "t.csv"), "--figure", str(tmp_path / "t.png")])
    first = out[out.step == 0].set_index("impl").loss
    assert len(out) == 4 and len(first) == 2
    assert abs(first.iloc[0] - first.iloc[1]) < 1e-2 * first.iloc[0]  # the same model and batch, bf16 experts apart
    assert (tmp_path / "t.png").stat().st_size > 0
