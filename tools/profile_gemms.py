"""Every L2 GEMM launched once per shape, between cudaProfilerStart/Stop, for Nsight Compute: what bounds each
kernel (SM, tensor or memory throughput, L2 hit rate), where `bench parts` only says how long it takes. The
steps are bench.parts' (the level's kernels with the level's arguments); the MXFP8-weight GEMMs
(kGateUpMx, kDownMx) follow the BF16 forward on the first shape. A device-side tool, not a benchmark of record.

    ncu --profile-from-start off -k regex:grouped_gemm --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --csv --page details python tools/profile_gemms.py [SHAPE ...] > ncu.csv
    (`make profile` runs it so, with `--clock-control none`)
"""

from __future__ import annotations

import sys

import torch

from bench import parts as bench_parts
from mok import fused, ops
from mok.config import get_shape
from mok.testing import make_inputs, moe_args


def profile_shape(name: str, with_mx: bool) -> None:
    inputs = make_inputs(get_shape(name), device="cuda", draw_on="cuda")
    _, saved = fused.forward(*moe_args(inputs))
    fused.backward(saved, inputs["d_out"])  # warm: the build and every kernel's first launch
    steps = bench_parts.steps_of(saved)
    states = {"fwd": bench_parts.forward_state(inputs), "bwd": bench_parts.backward_state(inputs, saved)}
    for pass_, state in states.items():  # the intermediates, outside the profiled range
        bench_parts.run_steps([s for s in steps if s.pass_ == pass_], state)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for pass_, state in states.items():
        bench_parts.run_steps([s for s in steps if s.pass_ == pass_ and s.mnk is not None], state)
    if with_mx:
        s = states["fwd"]
        qg, qu, qd = (ops.mxfp8_quantize_rowwise(w) for w in (s["w_gate"], s["w_up"], s["w_down"]))
        ops.grouped_gemm_mxfp8_swiglu_gather(s["x"], qg, qu, s["sched"])
        ops.grouped_gemm_mxfp8_nt_contiguous(s["h"], qd, s["sched"])
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    for i, shape in enumerate(sys.argv[1:] or ["dsv4pro-rank", "qwen3-30b-a3b"]):
        print(f"# profiling {shape}", file=sys.stderr)
        profile_shape(shape, with_mx=i == 0)
