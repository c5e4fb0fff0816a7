"""MXFP8 steps both ways in one process, per standard shape: the way the level ran them before against the way
it runs them today. Every timing after mok.bench.WARMUP_MS of sustained calls, in alternating rounds.

    x_rows  the backward's x rows: gather_rows_cuda then the column-wise round trip (two kernels, the gathered copy
            written and read back) against mxfp8_fake_quantize_gathered
    gemm1   the forward's GEMM1: the BF16 kernel, then h's row-wise round trip and gate/up's row-wise quantizations
            (four kernels) against grouped_gemm_bf16_swiglu_gather_mxfp8_out (its epilogue writes all three)
    dgrad   the backward's down dgrad: the saved MXFP8 gate/up dequantized, then the BF16 op (GEMM + SwiGLU
            backward: four kernels) against grouped_gemm_bf16_dgrad_swiglu_mxfp8 (its SwiGLU kernel reads them)
    row_round_trips  the backward's round trips over row buffers of a no-sync schedule (dy, d_gate, d_up dual;
            h column-wise) over every row against stopping at the real rows (counts=sched.counts)
    weights the routed weights' two round trips (row-wise, column-wise: 4 + 4 bytes per element) against one dual
            kernel (6 bytes), what mok.mxfp8_weight_cache computes at a weight's first use
    cache_step  one forward + backward of the level in mxfp8: uncached against inside a fresh
            mok.mxfp8_weight_cache() (an optimizer step of one micro-batch; the cache then holds 2x the weights)

    python tools/mx_steps_ab.py [--steps x_rows gemm1 dgrad row_round_trips weights cache_step] [--rounds 5]
    (device step `mx_steps_ab`; rows to $OUT/mx_steps_ab.csv when OUT is set)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys

import pandas as pd
import torch

from mok import bench, fused, mx_cache, ops
from mok.config import STANDARD_SHAPES, get_shape
from mok.testing import make_inputs, run_level

WEIGHTS = ("w_gate", "w_up", "w_down")  # the routed weights


def _gemm1_then_quantizers(x, w_gate, w_up, sched):
    h, gate, up = ops.grouped_gemm_bf16_swiglu_gather(x, w_gate, w_up, sched)  # [R, I] each
    return ops.mxfp8_fake_quantize(h, -1), ops.mxfp8_quantize_rowwise(gate), ops.mxfp8_quantize_rowwise(up)


def _dequantize_then_dgrad(dy_rows, w_down, gate_mx, up_mx, sched):
    return ops.grouped_gemm_bf16_dgrad_swiglu(dy_rows, w_down, ops.mxfp8_dequantize(*gate_mx),
                                              ops.mxfp8_dequantize(*up_mx), sched)  # [R, I] each


def _row_round_trips(i, counts):
    """The MXFP8 backward's round trips over the row buffers of the level's no-sync schedule, as mok.fused runs
    them: dy [R, H], d_gate and d_up [R, I] dual, h [R, I] column-wise."""
    dy, a = i["spare"]["dy_rows"], i["spare"]["a_rows"]
    return (ops.mxfp8_fake_quantize_dual(dy, counts=counts), ops.mxfp8_fake_quantize_dual(a, counts=counts),
            ops.mxfp8_fake_quantize_dual(a, counts=counts), ops.mxfp8_fake_quantize(a, -2, counts=counts))


def _weights_per_direction(i):
    return [ops.mxfp8_fake_quantize(i[w], d) for w in WEIGHTS for d in (-1, -2)]


def _weights_dual(i):
    return [t for w in WEIGHTS for t in ops.mxfp8_fake_quantize_dual(i[w])]


def _layer_step(i, cached: bool):
    """(out, grads) of the fused level's mxfp8 forward + backward, inside a fresh weight cache if `cached`."""
    with mx_cache.mxfp8_weight_cache() if cached else contextlib.nullcontext():
        return run_level(fused, i, precision="mxfp8")


def with_backward_operands(inputs: dict, sched) -> dict:
    """inputs plus what the dgrad step reads: dy_rows (x's rows in the schedule's order: zeros in padding rows)
    and the MXFP8 gate/up of the forward's GEMM1; and the row_round_trips step's: a no-sync schedule of the same
    routing (max_num_rows rows) with row buffers of its size."""
    _, gate_mx, up_mx = ops.grouped_gemm_bf16_swiglu_gather_mxfp8_out(inputs["x"], inputs["w_gate"], inputs["w_up"],
                                                                      sched)
    nosync = ops.make_schedule_cuda(inputs["topk_idx"], sched.num_experts, sync=False)
    x = inputs["x"]
    spare = {"sched": nosync, "dy_rows": ops.gather_rows_cuda(x, nosync),  # [R', H]
             "a_rows": torch.randn(nosync.num_rows, inputs["w_gate"].shape[1], device=x.device).to(x.dtype)}
    return {**inputs, "dy_rows": ops.gather_rows_cuda(x, sched), "gate_mx": gate_mx, "up_mx": up_mx, "spare": spare}


# step -> {way: fn(inputs, sched)}, the separate kernels first
STEPS = {
    "x_rows": {"gather_then_round_trip": lambda i, s: ops.mxfp8_fake_quantize(ops.gather_rows_cuda(i["x"], s), -2),
               "gathered_round_trip": lambda i, s: ops.mxfp8_fake_quantize_gathered(i["x"], s)},
    "gemm1": {"gemm1_then_quantizers": lambda i, s: _gemm1_then_quantizers(i["x"], i["w_gate"], i["w_up"], s),
              "gemm1_mxfp8_out": lambda i, s: ops.grouped_gemm_bf16_swiglu_gather_mxfp8_out(i["x"], i["w_gate"],
                                                                                           i["w_up"], s)},
    "dgrad": {"dequantize_then_dgrad": lambda i, s: _dequantize_then_dgrad(i["dy_rows"], i["w_down"], i["gate_mx"],
                                                                           i["up_mx"], s),
              "dgrad_swiglu_mxfp8": lambda i, s: ops.grouped_gemm_bf16_dgrad_swiglu_mxfp8(i["dy_rows"], i["w_down"],
                                                                                          i["gate_mx"], i["up_mx"], s)},
    "row_round_trips": {"every_row": lambda i, s: _row_round_trips(i, None),
                        "real_rows": lambda i, s: _row_round_trips(i, i["spare"]["sched"].counts)},
    "weights": {"per_direction": lambda i, s: _weights_per_direction(i), "dual": lambda i, s: _weights_dual(i)},
    "cache_step": {"uncached": lambda i, s: _layer_step(i, False), "fresh_cache": lambda i, s: _layer_step(i, True)},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    rows = []
    for name in STANDARD_SHAPES:
        cfg = get_shape(name)
        inputs = make_inputs(cfg, device="cuda", draw_on="cuda")
        sched = ops.make_schedule_cuda(inputs["topk_idx"], cfg.num_experts)
        inputs = with_backward_operands(inputs, sched)
        for step in args.steps:
            ways = {way: functools.partial(fn, inputs, sched) for way, fn in STEPS[step].items()}
            rows += [{"shape": name, "step": step, **row, "num_rows": sched.num_rows, **bench.provenance()}
                     for row in bench.alternating_rounds(ways, args.rounds)]
    df = pd.DataFrame(rows)
    for step in args.steps:
        before, after = STEPS[step]
        table = bench.ab_table(df[df.step == step], "shape", before, after)
        print(f"{step}: median ms over {args.rounds} rounds\n{table}")
    if os.environ.get("OUT"):
        df.to_csv(os.path.join(os.environ["OUT"], "mx_steps_ab.csv"), index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
