"""The forward GEMMs with MXFP8 weights against the BF16 kernels, alone, on the standard shapes: what the
in-mainloop dequantization costs or saves per GEMM, and what the q+dq path it replaced costs. Prints one
line per (shape, GEMM); medians of mok.bench.time_ms. A device-side A/B tool, not a benchmark of record.

    python tools/mx_gemm_ab.py [--shapes dsv4pro-rank ...]
"""

from __future__ import annotations

import argparse

import torch

from mok import bench, ops
from mok.config import STANDARD_SHAPES, get_shape
from mok.testing import make_inputs


def ab_shape(name: str) -> None:
    cfg = get_shape(name)
    inp = make_inputs(cfg, device="cuda", draw_on="cuda")
    sched = ops.make_schedule_cuda(inp["topk_idx"], cfg.num_experts, block_m=128, sync=False)
    x, wg, wu, wd = inp["x"], inp["w_gate"], inp["w_up"], inp["w_down"]
    qg, qu, qd = (ops.mxfp8_quantize_rowwise(w) for w in (wg, wu, wd))
    h = ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched)[0]
    runs = {
        "gemm1": (lambda: ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched),
                  lambda: ops.grouped_gemm_mxfp8_swiglu_gather(x, qg, qu, sched), (wg, wu)),
        "gemm2": (lambda: ops.grouped_gemm_bf16_nt_contiguous(h, wd, sched),
                  lambda: ops.grouped_gemm_mxfp8_nt_contiguous(h, qd, sched), (wd,)),
    }
    for gemm, (bf16_fn, mx_fn, weights) in runs.items():
        t_bf16, t_mx = bench.time_ms(bf16_fn), bench.time_ms(mx_fn)
        t_q = sum(bench.time_ms(lambda w=w: ops.mxfp8_quantize_rowwise(w)) for w in weights)
        t_qdq = sum(bench.time_ms(lambda w=w: ops.mxfp8_dequantize(*ops.mxfp8_quantize_rowwise(w), -1))
                    for w in weights)
        print(f"{name:>14} {gemm:>5} {t_bf16:8.3f} {t_mx:8.3f} {t_mx / t_bf16:8.2f} {t_q:8.3f} {t_qdq:8.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES))
    args = p.parse_args()
    print(f"{'shape':>14} {'gemm':>5} {'bf16':>8} {'mx':>8} {'mx/bf16':>8} {'q w':>8} {'q+dq w':>8}  (ms)")
    for name in args.shapes:
        ab_shape(name)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
