"""What do the schedule's padding rows cost at the power cap? The forward's two routed GEMMs (gate+up [R, H] x [H, 2I],
down [R, I] x [I, H]) as cuBLAS calls over four row buffers, in alternating rounds, every timing after
mok.bench.WARMUP_MS of sustained calls:

    pad128_random  each expert's routes padded to 128 rows, the padding rows random (the `bound` rows of mok.bench)
    pad128_zero    the same rows, the padding rows zeros (what the level multiplies: its padding rows are zeros)
    pad64_zero     padded to 64 rows, the padding rows zeros (what a 64-row schedule would multiply)
    routes         the routes alone (no padding)

Asked before building the 64-row schedule: zero operands toggle fewer bits and draw less power, so the padding may cost
less than its share of the rows; pad64_zero / pad128_zero is what that schedule could save at cuBLAS's speed. Answer
and what followed: docs/l2_fused_log.md, "Padding rows at the cap, and the 64-row schedule".

    python tools/padding_rows_ab.py [--rounds 3] [--shapes ...]
    (device step `padding_ab`; rows to $OUT/padding_rows_ab.csv when OUT is set, with mok.clocks' columns)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import pandas as pd
import torch

from mok import bench
from mok.config import STANDARD_SHAPES, get_shape
from mok.schedule import make_schedule
from mok.testing import make_inputs

# way -> (block_m the routes are padded to, None: no padding; whether the padding rows are zeros)
LAYOUTS = {"pad128_random": (128, False), "pad128_zero": (128, True), "pad64_zero": (64, True), "routes": (None, False)}
WAYS = tuple(LAYOUTS)


def _rows(topk_idx: torch.Tensor, num_experts: int, block_m: int | None, width: int, zero: bool, device):
    """[R, width] bf16 randn rows of a row buffer padded to block_m (None: the routes alone), padding rows zeroed
    when `zero`."""
    if block_m is None:
        return torch.randn(topk_idx.numel(), width, device=device).to(torch.bfloat16)
    sched = make_schedule(topk_idx.cpu(), num_experts, block_m)
    rows = torch.randn(sched.num_rows, width, device=device).to(torch.bfloat16)
    if zero:
        rows[(sched.row_to_token < 0).to(device)] = 0
    return rows


def forward_gemms(a1: torch.Tensor, a2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
    torch.mm(a1, w1)
    torch.mm(a2, w2)


def ways(cfg, device: str) -> dict:
    """way -> the forward's two routed GEMMs on that way's rows (the same weights in every way)."""
    topk_idx = make_inputs(cfg, device="cpu")["topk_idx"]
    H, I = cfg.hidden, cfg.intermediate
    w1 = torch.randn(H, 2 * I, device=device).to(torch.bfloat16)
    w2 = torch.randn(I, H, device=device).to(torch.bfloat16)
    out = {}
    for way, (block_m, zero) in LAYOUTS.items():
        torch.manual_seed(1)  # the same values wherever two ways share rows
        a1 = _rows(topk_idx, cfg.num_experts, block_m, H, zero, device)
        a2 = _rows(topk_idx, cfg.num_experts, block_m, I, zero, device)
        out[way] = functools.partial(forward_gemms, a1, a2, w1, w2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in args.shapes:
        rows += [{"shape": name, **row, **bench.provenance()}
                 for row in bench.alternating_rounds(ways(get_shape(name), device), args.rounds, args.iters)]
    df = pd.DataFrame(rows)
    table = df.pivot_table(index="shape", columns="way", values="time_ms", aggfunc="median")[list(WAYS)]
    for before, after in (("pad128_random", "pad128_zero"), ("pad128_zero", "pad64_zero"), ("pad128_zero", "routes")):
        table[f"{after}/{before}"] = table[after] / table[before]
    print(f"median ms over {args.rounds} rounds\n" + table.to_string(float_format=lambda v: f"{v:.4g}"))
    if df["sm_mhz"].notna().any():
        for value in ("sm_mhz", "power_w"):
            print(f"median {value}\n" + df.pivot_table(index="shape", columns="way", values=value).to_string())
    if os.environ.get("OUT"):
        df.to_csv(os.path.join(os.environ["OUT"], "padding_rows_ab.csv"), index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
