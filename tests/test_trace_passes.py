"""tools/trace_passes.py on the CPU: each pass is traced in the precision asked, inside mok.mxfp8_weight_cache() when
asked (the backward's saved forward too), and the report names the precision; the profiler itself needs a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mok import mx_cache

spec = importlib.util.spec_from_file_location("trace_passes", Path(__file__).parents[1] / "tools" / "trace_passes.py")
trace_passes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace_passes)


@pytest.fixture
def seen(monkeypatch) -> list:
    """The calls main makes, with whether a weight cache was open at each; no GPU."""
    calls = []

    def level_pass_fn(level, inputs, precision, pass_):
        calls.append(("pass", level, precision, pass_, mx_cache.active()))
        return lambda: None

    def trace(fn, iters):
        calls.append(("trace", iters, mx_cache.active()))
        return [{"span": 10.0, "busy": 8.0, "lead": 1.0, "kernels": [("kernel", 1.0, 8.0)]}] * iters

    monkeypatch.setattr(trace_passes, "make_inputs", lambda cfg, **kwargs: {})
    monkeypatch.setattr(trace_passes.bench, "level_pass_fn", level_pass_fn)
    monkeypatch.setattr(trace_passes, "trace", trace)
    return calls


@pytest.mark.parametrize("cached", [False, True])
def test_each_pass_is_traced_in_the_precision_and_cache_asked(seen, capsys, cached):
    args = ["tiny", "--precision", "mxfp8", "--iters", "2"] + (["--mx-weight-cache"] if cached else [])
    assert trace_passes.main(args) == 0
    assert seen == [("pass", "fused", "mxfp8", "fwd", cached), ("trace", 2, cached),
                    ("pass", "fused", "mxfp8", "bwd", cached), ("trace", 2, cached)]
    assert not mx_cache.active()  # closed after each pass
    out = capsys.readouterr().out
    assert "tiny mxfp8 fwd: span 10 us, busy 8, idle 2 (20.0%), lead 1" in out and "tiny mxfp8 bwd" in out


def test_the_weight_cache_needs_mxfp8(seen):
    with pytest.raises(SystemExit) as exit_:
        trace_passes.main(["tiny", "--mx-weight-cache"])
    assert exit_.value.code == 2 and seen == []
