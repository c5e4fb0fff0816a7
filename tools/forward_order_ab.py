"""Two measurements of the fused forward's host overhead, in one process (device-side; docs/l2_fused.md, "Host
time on the path to GEMM1"):

1. The shared expert's GEMMs first (mok.fused.forward) against last (`routed_first` below: the order before
   78e54ea, the same kernels and bits), both with the routed steps as four calls (fused.ROUTED_ONE_CALL =
   False), in 7 alternating rounds of mok.bench.time_ms; the median of the rounds' ratios. Shapes with a
   shared expert only.
2. The routed steps from one binding call (ops.routed_forward_bf16, the default) against the four calls it
   stands for, the same way.
3. The forward timed from an idle GPU (mok.bench.time_ms: what `bench moe` reports) against back to back (20
   forwards queued without a sync: the host runs ahead, so its time is hidden); the difference is the host
   time a pass exposes when it starts from an idle GPU.

    python tools/forward_order_ab.py [SHAPE ...]
"""

from __future__ import annotations

import statistics
import sys

import torch

from mok import bad_ids, bench, fused, ops
from mok.config import STANDARD_SHAPES, get_shape
from mok.testing import make_inputs, moe_args


def routed_first(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down):
    """mok.fused.forward's bf16 output with the routed experts' kernels launched before the shared expert's."""
    fused._check_runs_here(x, "bf16")
    T = x.shape[0]
    sched = ops.make_schedule_cuda(topk_idx, w_gate.shape[0], block_m=fused.BLOCK_M, sync=False)
    y_rows, _, _ = fused.experts_forward(x, w_gate, w_up, w_down, sched, None, None)
    shared = fused.experts_forward(x, w_shared_gate[None], w_shared_up[None], w_shared_down[None],
                                   fused.shared_schedule(T, x.device), None, None)[0][:T]  # [T, H]
    out = ops.combine_rows(y_rows, sched.route_to_row, topk_weights, shared, check_rows=False)  # [T, H]
    bad_ids.raise_landed()  # the bookkeeping as mok.fused.forward does it: only the launch order differs
    bad_ids.defer(sched)
    return out


def back_to_back_ms(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def with_one_call(one_call: bool, fn):
    """fn with fused.ROUTED_ONE_CALL set to one_call while it runs."""
    def run():
        saved, fused.ROUTED_ONE_CALL = fused.ROUTED_ONE_CALL, one_call
        try:
            return fn()
        finally:
            fused.ROUTED_ONE_CALL = saved
    return run


def alternate(name: str, a: tuple, b: tuple, rounds: int = 7) -> None:
    """Print a's and b's median mok.bench.time_ms over `rounds` rounds (which goes first alternates) and the
    median of the rounds' ratios a / b. a, b: (label, fn)."""
    times = {a[0]: [], b[0]: []}
    for r in range(rounds):
        for label, fn in (a, b)[:: 1 if r % 2 == 0 else -1]:
            times[label].append(bench.time_ms(fn, 20))
    ratio = statistics.median(x / y for x, y in zip(times[a[0]], times[b[0]]))
    print(f"{name}: {a[0]} {statistics.median(times[a[0]]):.3f} ms, {b[0]} {statistics.median(times[b[0]]):.3f} ms, "
          f"median ratio of rounds {ratio:.3f}", flush=True)


def main(shapes: list[str]) -> None:
    for name in shapes:
        args = moe_args(make_inputs(get_shape(name), device="cuda", draw_on="cuda"))
        new = lambda: fused.forward(*args)  # noqa: E731, B023 (used within the iteration)
        four_calls = with_one_call(False, new)
        if args[6] is not None:  # w_shared_gate
            alternate(name, ("shared_first", four_calls), ("routed_first", lambda: routed_first(*args)))  # noqa: B023
        alternate(name, ("one_call", new), ("four_calls", four_calls))
        idle = statistics.median(bench.time_ms(new, 20) for _ in range(3))
        queued = statistics.median(back_to_back_ms(new) for _ in range(3))
        print(f"{name}: forward from idle {idle:.3f} ms, back to back {queued:.3f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(STANDARD_SHAPES))
