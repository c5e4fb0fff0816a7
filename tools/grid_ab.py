"""Does the fused level lose time on fewer SMs at the power cap? Its BF16 passes with the GEMMs' persistent grid on
every SM and on fewer (`num_sms`: the bits do not depend on it), in alternating rounds, every timing after
mok.bench.WARMUP_MS of sustained calls.

Asked before running memory-bound kernels beside the GEMMs on the SMs they leave (docs/l2_fused.md, "Next" 8): at the
cap a kernel's time is its energy, so a GEMM on 116 of 132 SMs may take about its time on all of them, at a higher
clock for the same power. If it does, the SMs it leaves are free for the x-row gather and the `d_x` combine.

    python tools/grid_ab.py [--sms 124 116 100] [--rounds 3] [--shapes ...]
    (device step `grid_ab`; rows to $OUT/grid_ab.csv when OUT is set, with mok.clocks' columns)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import pandas as pd
import torch

from mok import bench, fused
from mok.config import STANDARD_SHAPES, get_shape
from mok.testing import make_inputs, moe_args

ALL = "all"  # the way on every SM (num_sms None, MOK_NUM_SMS unset)


def pass_fn(inputs: dict, pass_: str, num_sms: int | None):
    """A no-argument callable running one BF16 pass of the fused level with the GEMMs on `num_sms` SMs."""
    fwd = functools.partial(fused.forward, *moe_args(inputs), precision="bf16", num_sms=num_sms)
    if pass_ == "fwd":
        return fwd
    _, saved = fwd()  # the backward takes its grid from the saved state
    return functools.partial(fused.backward, saved, inputs["d_out"])


def ways(inputs: dict, pass_: str, sms: list[int]) -> dict:
    """way -> the pass on that many SMs: "all", then each of `sms`."""
    return {ALL: pass_fn(inputs, pass_, None), **{str(n): pass_fn(inputs, pass_, n) for n in sms}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES))
    p.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--sms", nargs="+", type=int, default=[124, 116, 100], help="grid sizes beside every SM")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if os.environ.get(fused.NUM_SMS_ENV, "").strip() not in ("", "0"):
        p.error(f"{fused.NUM_SMS_ENV}: expected unset (the `{ALL}` way runs on every SM), got "
                f"{os.environ[fused.NUM_SMS_ENV]!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in args.shapes:
        inputs = make_inputs(get_shape(name), device=device, draw_on=device)
        for pass_ in args.passes:
            rows += [{"shape": name, "pass": pass_, **row, **bench.provenance()}
                     for row in bench.alternating_rounds(ways(inputs, pass_, args.sms), args.rounds, args.iters)]
    df = pd.DataFrame(rows)
    order = [ALL] + [str(n) for n in args.sms]
    table = df.pivot_table(index=["shape", "pass"], columns="way", values="time_ms", aggfunc="median")[order]
    for way in order[1:]:
        table[f"{way}/{ALL}"] = table[way] / table[ALL]
    print(f"median ms over {args.rounds} rounds\n" + table.to_string(float_format=lambda v: f"{v:.4g}"))
    if df["sm_mhz"].notna().any():
        for value in ("sm_mhz", "power_w"):
            print(f"median {value}\n" + df.pivot_table(index=["shape", "pass"], columns="way", values=value)[order]
                  .to_string())
    if os.environ.get("OUT"):
        df.to_csv(os.path.join(os.environ["OUT"], "grid_ab.csv"), index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
