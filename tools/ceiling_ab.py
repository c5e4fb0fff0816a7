"""Does the order of timings bias the fused level's fraction of the ceiling? `python -m mok.bench moe` times each
shape's ceiling first and the level after it, each after mok.bench.WARMUP_MS of sustained calls; a GPU that warms
up over the shape's timings (its leakage, at the power cap, takes clock) would read the level slower than the
ceiling for the order's sake alone. Here the two alternate, round by round, in both orders (mok.bench's
alternating_rounds), so a drift of the machine falls on both alike: the ceiling way runs the pass's dense cuBLAS
GEMMs (mok.bench.gemm_shapes, the same shapes `bench moe` sums) back to back as one call.

    python tools/ceiling_ab.py [--shapes qwen3-30b-a3b dsv4pro-rank] [--passes fwd bwd] [--rounds 5]
    (device step `ceiling_ab`; rows to $OUT/ceiling_ab.csv when OUT is set)
"""

from __future__ import annotations

import argparse
import os
import sys

import pandas as pd
import torch

from mok import bench
from mok.config import get_shape
from mok.testing import make_inputs


def ceiling_fn(cfg, pass_: str, device):
    """A no-argument callable running the pass's dense GEMMs (mok.bench.dense_gemm_fn's) back to back."""
    gemms = [bench.dense_gemm_fn(mnk, device) for mnk in bench.gemm_shapes(cfg, pass_)]
    return lambda: [gemm() for gemm in gemms]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "dsv4pro-rank"])
    p.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=bench.PASSES)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in args.shapes:
        cfg = get_shape(name)
        inputs = make_inputs(cfg, device=device, draw_on=device)
        for pass_ in args.passes:
            ways = {"ceiling": ceiling_fn(cfg, pass_, device),
                    "fused": bench.level_pass_fn("fused", inputs, "bf16", pass_)}
            rows += [{"shape": name, "pass": pass_, **row, **bench.provenance()}
                     for row in bench.alternating_rounds(ways, args.rounds, args.iters)]
    df = pd.DataFrame(rows)
    times = df.pivot_table(index=["shape", "pass", "round"], columns="way", values="time_ms")
    fractions = (times["ceiling"] / times["fused"]).groupby(["shape", "pass"]).agg(["median", "min", "max"])
    print("fused's fraction of the ceiling, each round's pair\n"
          + fractions.to_string(float_format=lambda v: f"{v:.3f}"))
    if df["sm_mhz"].notna().any():
        print("median sm_mhz\n" + df.pivot_table(index=["shape", "pass"], columns="way", values="sm_mhz").to_string())
    if os.environ.get("OUT"):
        df.to_csv(os.path.join(os.environ["OUT"], "ceiling_ab.csv"), index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
