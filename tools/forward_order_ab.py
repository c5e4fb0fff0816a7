"""Two measurements of the fused forward's host overhead, in one process (device-side; docs/l2_fused_log.md, "Host
time on the path to GEMM1"):

1. The shared expert's GEMMs first (mok.fused.forward) against last (`routed_first` below: the order before
   78e54ea, the same kernels and bits), in 7 alternating rounds of mok.bench.time_ms; the median of the
   rounds' ratios. Shapes with a shared expert only.
2. The forward timed from an idle GPU (mok.bench.time_ms: what `bench moe` reports) against back to back (20
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


def main(shapes: list[str]) -> None:
    for name in shapes:
        args = moe_args(make_inputs(get_shape(name), device="cuda", draw_on="cuda"))
        new = lambda: fused.forward(*args)  # noqa: E731, B023 (used within the iteration)
        if args[6] is not None:  # w_shared_gate
            old = lambda: routed_first(*args)  # noqa: E731, B023
            times = {"shared_first": [], "routed_first": []}
            for r in range(7):  # alternate which goes first
                for label, fn in (("shared_first", new), ("routed_first", old))[:: 1 if r % 2 == 0 else -1]:
                    times[label].append(bench.time_ms(fn, 20))
            ratio = statistics.median(a / b for a, b in zip(times["shared_first"], times["routed_first"]))
            print(f"{name}: shared_first {statistics.median(times['shared_first']):.3f} ms, routed_first "
                  f"{statistics.median(times['routed_first']):.3f} ms, median ratio of rounds {ratio:.3f}", flush=True)
        idle = statistics.median(bench.time_ms(new, 20) for _ in range(3))
        queued = statistics.median(back_to_back_ms(new) for _ in range(3))
        print(f"{name}: forward from idle {idle:.3f} ms, back to back {queued:.3f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(STANDARD_SHAPES))
