"""The fused level's passes with segments padded to 128 rows and to 64 (mok.fused.BLOCK_M), in one process, in
alternating rounds, every timing after mok.bench.WARMUP_MS of sustained calls, its calls queued (the method of
record). The kernels are the same in both ways: with 128-row segments no kernel tile straddles two experts, with
64-row ones some run in two passes (docs/l2_fused.md, "The 64-row schedule").

    python tools/block_m_ab.py [--shapes ...] [--passes fwd bwd fwd+bwd] [--rounds 3]
    (device step `block_m_ab`; rows to $OUT/block_m_ab.csv when OUT is set, with mok.clocks' columns)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import pandas as pd
import torch

from mok import bench, fused
from mok.config import PASSES, STANDARD_SHAPES, get_shape
from mok.testing import make_inputs

WAYS = (128, 64)  # block_m; the second is the level's


def use_block_m(block_m: int) -> None:
    """The fused level pads its segments (routed and shared) to block_m from its next call on."""
    fused.BLOCK_M = block_m
    fused.shared_schedule.cache_clear()  # the shared expert's schedule is cached per (T, device)


def ab_rows(cfg, passes, rounds: int, iters: int, device: str, time_fn=bench.time_ms) -> list[dict]:
    inputs = make_inputs(cfg, device=device, draw_on=device)
    fns = {}
    for block_m in WAYS:
        use_block_m(block_m)  # a bwd fn runs its forward now: each way saves its own state
        fns[block_m] = {p: bench.level_pass_fn("fused", inputs, "bf16", p) for p in passes}
    rows = []
    for r in range(rounds):
        for pass_ in passes:
            for block_m in WAYS[:: 1 if r % 2 == 0 else -1]:
                use_block_m(block_m)
                timed = functools.partial(time_fn, warmup_ms=bench.WARMUP_MS)
                ms, clock = bench.clocked(timed, fns[block_m][pass_], bench.timings(pass_, iters))
                rows.append({"shape": cfg.name, "pass": pass_, "way": f"block_m={block_m}", "round": r,
                             "time_ms": ms, **clock, **bench.provenance()})
    use_block_m(WAYS[-1])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES))
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in args.shapes:
        rows += ab_rows(get_shape(name), args.passes, args.rounds, args.iters, device)
    df = pd.DataFrame(rows)
    print(f"median ms over {args.rounds} rounds\n" + bench.ab_table(df, ["shape", "pass"], *(f"block_m={b}"
                                                                                               for b in WAYS)))
    if df["sm_mhz"].notna().any():
        print("median SM clock, MHz\n" + bench.ab_table(df, ["shape", "pass"], *(f"block_m={b}" for b in WAYS),
                                                         value="sm_mhz"))
    if os.environ.get("OUT"):
        df.to_csv(os.path.join(os.environ["OUT"], "block_m_ab.csv"), index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
