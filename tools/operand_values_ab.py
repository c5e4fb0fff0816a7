"""Does a GEMM's time depend on its operands' values? The same BF16 GEMM timed on random bf16 operands and on their
MXFP8 round trips (3-bit mantissas, the operands every GEMM of the level sees in mxfp8), in alternating rounds,
every timing after mok.bench.WARMUP_MS of sustained calls (the H200 then runs under its power cap). Asked by the
cached MXFP8 forward running at 0.92-0.95x BF16's time with the same kernels (docs/l2_fused.md, "Measured").

    mm     torch.mm of the shape's down projection as one dense GEMM: [T·K, I] x [I, H] (the ceiling's kind)
    gemm2  the level's down GEMM (ops.grouped_gemm_bf16_nt_contiguous) on the shape's schedule (CUDA only)

    python tools/operand_values_ab.py [--gemms mm gemm2] [--rounds 5] [--shapes ...]
    (device step `values_ab`; rows to $OUT/operand_values_ab.csv when OUT is set, with the SM clock, power and
    power-cap fraction of each timing: mok.clocks)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import pandas as pd
import torch

from mok import bench, mxfp8, ops
from mok.config import STANDARD_SHAPES, get_shape
from mok.testing import make_inputs

WAYS = ("bf16_values", "mxfp8_values")


def _round_trip(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t's MXFP8 round trip along dim (the kernel on CUDA, L0 elsewhere: the same bits)."""
    return ops.mxfp8_fake_quantize(t, dim) if t.is_cuda else mxfp8.fake_quantize(t, dim)


def operands(cfg, device: str) -> dict:
    """gemm -> way -> a GEMM call on operands with those values; K = intermediate in both GEMMs."""
    inputs = make_inputs(cfg, device=device, draw_on=device)
    routes = cfg.num_tokens * cfg.num_topk
    a = torch.randn(routes, cfg.intermediate, device=device).to(torch.bfloat16)  # [T·K, I]
    b = inputs["w_down"][0].T.contiguous()  # [I, H]: one expert's weight, K-major like the ceiling's
    values = {"bf16_values": (a, b), "mxfp8_values": (_round_trip(a, -1), _round_trip(b, -2))}
    gemms = {"mm": {w: functools.partial(torch.mm, *ab) for w, ab in values.items()}}
    if device == "cuda":
        sched = ops.make_schedule_cuda(inputs["topk_idx"], cfg.num_experts)
        h = torch.randn(sched.num_rows, cfg.intermediate, device=device).to(torch.bfloat16)  # [R, I]
        w_down = inputs["w_down"]  # [E, H, I]
        down = {"bf16_values": (h, w_down), "mxfp8_values": (_round_trip(h, -1), _round_trip(w_down, -1))}
        gemms["gemm2"] = {w: functools.partial(ops.grouped_gemm_bf16_nt_contiguous, *hw, sched)
                          for w, hw in down.items()}
    return gemms


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemms", nargs="+", choices=["mm", "gemm2"], default=["mm", "gemm2"])
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in args.shapes:
        gemms = operands(get_shape(name), device)
        for gemm in [g for g in args.gemms if g in gemms]:
            rows += [{"shape": name, "gemm": gemm, **row, **bench.provenance()}
                     for row in bench.alternating_rounds(gemms[gemm], args.rounds, args.iters)]
    df = pd.DataFrame(rows)
    print(f"median ms over {args.rounds} rounds\n" + bench.ab_table(df, ["shape", "gemm"], *WAYS))
    if df["sm_mhz"].notna().any():  # the clocks the timings ran at (NVML; NaN off a GPU)
        for value, what in (("sm_mhz", "SM clock, MHz"), ("power_w", "power, W"),
                            ("power_capped", "fraction of samples under the software power cap")):
            print(f"median {what}\n" + bench.ab_table(df, ["shape", "gemm"], *WAYS, value=value))
    if os.environ.get("OUT"):
        df.to_csv(os.path.join(os.environ["OUT"], "operand_values_ab.csv"), index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
