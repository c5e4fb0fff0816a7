"""The host's time in each call of an L2 pass: what keeps the GPU idle when a pass starts from an idle GPU, as
`bench moe` times it (tools/trace_passes.py shows the idle gaps; this says which Python call they come from).
Every mok.ops entry point, the fused level's helpers and mok.bad_ids are wrapped with perf_counter; the GPU work
is asynchronous, so a call's time is its host time (a call that waited on the GPU would show its wait).

    python tools/host_time.py [SHAPE ...] [--iters 20]

Per shape and pass: the pass's host time to return, then every wrapped call in order (nested calls indented):
its median start in the pass and its median host time, in µs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from mok import bad_ids, bench, fused, ops
from mok.config import get_shape
from mok.testing import make_inputs

_RECORD: list[tuple[str, int, float, float]] = []  # (name, depth, start, end) of the calls in the current pass
_DEPTH = [0]


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        _DEPTH[0] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1
            _RECORD.append((name, _DEPTH[0], t0, time.perf_counter()))
    return wrapper


def wrap_all() -> None:
    """Replace the entry points the fused level calls with timed ones (module attributes: fused looks them up
    at call time as ops.<name>, bad_ids.<name>, or as its own globals)."""
    for name in ops.__all__:
        fn = getattr(ops, name)
        if callable(fn) and not isinstance(fn, type):
            setattr(ops, name, _timed(name, fn))
    for name in ("defer", "raise_landed"):
        setattr(bad_ids, name, _timed(f"bad_ids.{name}", getattr(bad_ids, name)))
    for name in ("experts_forward", "shared_schedule", "gather_x_rows", "pad_rows", "_experts_dgrad",
                 "_shared_backward", "_weight_grads", "_check_runs_here", "_saved_gate_up"):
        setattr(fused, name, _timed(name, getattr(fused, name)))


def host_times(fn, iters: int) -> tuple[float, list[tuple[str, int, float, float]]]:
    """Median host time of fn() (µs) and, per wrapped call in order, (name, depth, median start, median time)."""
    for _ in range(3):
        fn()
    totals, runs = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        _RECORD.clear()
        t0 = time.perf_counter()
        fn()
        totals.append((time.perf_counter() - t0) * 1e6)
        runs.append(sorted(((n, d, (a - t0) * 1e6, (b - a) * 1e6) for n, d, a, b in _RECORD), key=lambda r: r[2]))
    torch.cuda.synchronize()
    runs = [r for r in runs if [c[0] for c in r] == [c[0] for c in runs[0]]]
    calls = [(name, depth, statistics.median(r[j][2] for r in runs), statistics.median(r[j][3] for r in runs))
             for j, (name, depth, _, _) in enumerate(runs[0])]
    return statistics.median(totals), calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", default=["qwen3-30b-a3b", "dsv4pro-rank"])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    wrap_all()
    for name in args.shapes:
        inputs = make_inputs(get_shape(name), device="cuda", draw_on="cuda")
        for pass_ in ("fwd", "bwd"):
            total, calls = host_times(bench.level_pass_fn("fused", inputs, "bf16", pass_), args.iters)
            print(f"{name} {pass_}: host {total:.0f} us to return")
            for call, depth, start, us in calls:
                print(f"    at {start:7.1f} us  {us:7.1f} us  {'  ' * depth}{call}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
