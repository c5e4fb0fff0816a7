"""tools/forward_order_ab.py's A/B plumbing on the CPU: the routed-path switch and the alternating rounds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mok import fused

spec = importlib.util.spec_from_file_location("forward_order_ab",
                                              Path(__file__).parents[1] / "tools" / "forward_order_ab.py")
order_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(order_ab)


def test_with_one_call_sets_the_switch_only_while_it_runs():
    seen = []
    run = order_ab.with_one_call(False, lambda: seen.append(fused.ROUTED_ONE_CALL))
    assert fused.ROUTED_ONE_CALL is True
    run()
    assert seen == [False] and fused.ROUTED_ONE_CALL is True

    def boom():
        raise RuntimeError("kernel failed")
    with pytest.raises(RuntimeError):
        order_ab.with_one_call(False, boom)()
    assert fused.ROUTED_ONE_CALL is True  # restored after a failure too


def test_alternate_times_both_in_every_round(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(order_ab.bench, "time_ms", lambda fn, iters: fn())  # a "time" of 2.0 or 1.0 ms
    order_ab.alternate("shape", ("a", lambda: calls.append("a") or 2.0), ("b", lambda: calls.append("b") or 1.0),
                       rounds=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # who goes first alternates
    assert capsys.readouterr().out.strip() == "shape: a 2.000 ms, b 1.000 ms, median ratio of rounds 2.000"
