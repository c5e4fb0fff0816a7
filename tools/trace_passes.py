"""Where a whole L2 pass spends its wall time on the GPU: each kernel's time inside the pass, and the time the
GPU sits idle (waiting for the host to launch). `bench parts` times each step alone, from an idle GPU, so its
times include each step's host overhead; this traces the passes as `bench moe` times them (mok.bench.time_ms:
start event, the pass, end event, sync) under torch.profiler. A device-side tool, not a benchmark of record:
CUPTI tracing adds a little to every launch, so idle time here is an upper bound.

    python tools/trace_passes.py [SHAPE ...] [--iters 5] [--precision mxfp8 [--mx-weight-cache]]

--mx-weight-cache traces the mxfp8 passes inside mok.mxfp8_weight_cache(), filled by the warm-up calls (as
`bench moe --mx-weight-cache` times them): the weights' round trips drop out of the trace.

Per shape and pass, medians over the iterations: span (the pass's first host call to its last kernel's end:
what time_ms measures, less the event overhead), busy (the union of kernel intervals), lead (the host time
before the first kernel starts), idle = span - busy; then every kernel in launch order: its median start in the
pass, the idle gap before it, and its median duration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mok import bench, mx_cache
from mok.config import PRECISIONS, STANDARD_SHAPES, get_shape
from mok.testing import make_inputs


def short_name(kernel: str) -> str:
    """`void mok::gemm::grouped_gemm_bf16_kernel<(mok::gemm::Gemm)4>(...)` -> `grouped_gemm_bf16_kernel<4>`."""
    name = kernel.replace("(mok::gemm::Gemm)", "").replace("(anonymous namespace)::", "")
    name = re.sub(r"^void |\(.*", "", name)  # no return type, no parameters
    base, sep, args = name.partition("<")
    return (base.split("::")[-1] + sep + args)[:60]


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def trace(fn, iters: int) -> list[dict]:
    """One dict per iteration: span, busy, lead (µs) and its kernels [(name, start, duration)] in launch order,
    from a torch.profiler trace of fn()."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            with record_function(f"mok_iter_{i}"):
                fn()
                torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("mok_iter_"))
    kernels = [e for e in events if e.get("cat") == "kernel"]
    out = []
    for t0, t1 in ranges:
        mine = sorted((k for k in kernels if t0 <= k["ts"] < t1), key=lambda k: k["ts"])
        if not mine:
            continue
        end = max(k["ts"] + k["dur"] for k in mine)
        out.append({"span": end - t0, "busy": union_us([(k["ts"], k["ts"] + k["dur"]) for k in mine]),
                    "lead": mine[0]["ts"] - t0,
                    "kernels": [(short_name(k["name"]), k["ts"] - t0, k["dur"]) for k in mine]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", default=list(STANDARD_SHAPES))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--precision", default="bf16", choices=PRECISIONS)
    ap.add_argument("--mx-weight-cache", action="store_true", help="mxfp8: trace inside mok.mxfp8_weight_cache()")
    args = ap.parse_args(argv)
    if args.mx_weight_cache and args.precision != "mxfp8":
        ap.error(f"--mx-weight-cache: expected --precision mxfp8, got {args.precision}")
    for name in args.shapes:
        inputs = make_inputs(get_shape(name), device="cuda", draw_on="cuda")
        for pass_ in ("fwd", "bwd"):
            with mx_cache.mxfp8_weight_cache() if args.mx_weight_cache else contextlib.nullcontext():
                its = trace(bench.level_pass_fn("fused", inputs, args.precision, pass_), args.iters)
            med = {k: statistics.median(i[k] for i in its) for k in ("span", "busy", "lead")}
            print(f"{name} {args.precision} {pass_}: span {med['span']:.0f} us, busy {med['busy']:.0f}, idle "
                  f"{med['span'] - med['busy']:.0f} ({1 - med['busy'] / med['span']:.1%}), lead {med['lead']:.0f}")
            its = [i for i in its if len(i["kernels"]) == len(its[0]["kernels"])]  # the same launches each time
            prev_end = 0.0
            for j, (kernel, _, _) in enumerate(its[0]["kernels"]):
                start = statistics.median(i["kernels"][j][1] for i in its)
                dur = statistics.median(i["kernels"][j][2] for i in its)
                print(f"    at {start:8.1f} us  gap {start - prev_end:7.1f}  {dur:8.1f} us  {dur / med['span']:6.1%}  "
                      f"{kernel}")
                prev_end = max(prev_end, start + dur)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
