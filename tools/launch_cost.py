"""The host's cost of each launch on the forward's path, through the raw bindings with their outputs already
allocated (docs/l2_fused.md, "Next" 1d: what the ~70 µs between the schedule's kernels and GEMM1 is made of).
Each call is timed alone with perf_counter while the GPU works through the queue (a sync every 25 calls keeps
the queue short), so a call's time is its host time: argument checks, tensor maps, cudaFuncSetAttribute, the
launch. Beside them: the mok.ops wrapper of GEMM1 (its checks and three allocations on top) and three
torch.empty of GEMM1's outputs. Measured at 51cc0c5 (data/profile/launch_cost_51cc0c5.txt, with the one-call
forward's binding that was then removed).

    python tools/launch_cost.py [SHAPE ...] [--calls 200]

Per shape: one line per call, its median host time in µs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mok import ops
from mok.config import get_shape
from mok.ops.core import load_extension
from mok.ops.gemm import gemm_schedule_tensors, real_num_rows
from mok.testing import make_inputs, moe_args


def host_us(fn, calls: int) -> float:
    """Median host time of fn() in µs over `calls` calls, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % 25 == 24:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def time_shape(name: str, calls: int) -> None:
    """Print each call's median host time at shape `name`."""
    ext = load_extension()
    x, topk_idx, topk_weights, w_gate, w_up, w_down = moe_args(make_inputs(get_shape(name), device="cuda",
                                                                            draw_on="cuda"))[:6]
    sched = ops.make_schedule_cuda(topk_idx, w_gate.shape[0], sync=False)
    row_to_token, tile_to_expert = gemm_schedule_tensors(sched, x.device)  # [num_rows], [num_rows / 128]
    counts = real_num_rows(sched, x.device)
    rows, inter, hidden = sched.num_rows, w_gate.shape[1], x.shape[1]
    h, gate, up = (torch.empty(rows, inter, dtype=x.dtype, device=x.device) for _ in range(3))
    y_rows = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    route_to_row = sched.route_to_row  # int64 [num_tokens, num_topk]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    cases = {
        "make_schedule (binding)": lambda: ext.make_schedule(topk_idx, w_gate.shape[0], 128, rows, True),
        "gemm1 (binding)": lambda: ext.grouped_gemm_bf16_swiglu_gather(
            x, w_gate, w_up, row_to_token, tile_to_expert, counts, h, gate, up, 0.0, False, sms),
        "gemm1 (mok.ops)": lambda: ops.grouped_gemm_bf16_swiglu_gather(x, w_gate, w_up, sched),
        "gemm2 (binding)": lambda: ext.grouped_gemm_bf16_nt_contiguous(h, w_down, row_to_token, tile_to_expert,
                                                                       counts, y_rows, sms),
        "combine (binding)": lambda: ext.combine_rows(y_rows, route_to_row, topk_weights, None, out),
        "3 x torch.empty [rows, intermediate]": lambda: [torch.empty(rows, inter, dtype=x.dtype, device=x.device)
                                                         for _ in range(3)],
    }
    for label, fn in cases.items():
        print(f"{name}: {label:40s} {host_us(fn, calls):7.1f} us", flush=True)


def main(shapes: list[str], calls: int) -> None:
    for name in shapes:
        time_shape(name, calls)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", default=["qwen3-30b-a3b", "dsv4pro-rank"])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    main(args.shapes, args.calls)
