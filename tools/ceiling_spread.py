"""How much the dense ceiling of `python -m mok.bench moe` moves within one process, with the benchmark's warm-up (3
calls) and with a time-based one (mok.bench.time_ms's warmup_ms), each after an idle spell like the one before a
shape's first timing (its inputs being made). Measured at 19c02bf: after 100 ms the ceiling is lower and tighter
(the GPU's power cap), which is why mok.bench now warms up that long (docs/l2_fused_log.md, "The ceiling under a
sustained load").

    python tools/ceiling_spread.py [--rounds 4] [--idle-s 0.5] [--warmup-ms 0 100] [--shapes ...] [--passes ...]
    (device step `ceiling`; rows to $OUT/ceiling_spread.csv when OUT is set)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import pandas as pd
import torch

from mok import bench
from mok.config import STANDARD_SHAPES, get_shape


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES))
    p.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=bench.PASSES)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--idle-s", type=float, default=0.5, help="idle seconds before each ceiling")
    p.add_argument("--warmup-ms", type=float, nargs="+", default=[0.0, 100.0])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in args.shapes:
        cfg = get_shape(name)
        for pass_ in args.passes:
            for r in range(args.rounds):
                for warmup_ms in args.warmup_ms:  # alternating: both see the same drift of the machine
                    time.sleep(args.idle_s)
                    time_fn = functools.partial(bench.time_ms, warmup_ms=warmup_ms)
                    ms = bench.dense_ceiling_ms(cfg, pass_, bench.timings(pass_, args.iters), device, time_fn)
                    rows.append({"shape": name, "pass": pass_, "warmup_ms": warmup_ms, "round": r,
                                 "ceiling_tflops": cfg.flops(pass_) / ms / 1e9, **bench.provenance()})
    df = pd.DataFrame(rows)
    table = df.groupby(["shape", "pass", "warmup_ms"])["ceiling_tflops"].agg(["median", "min", "max"]).round(0)
    print(table.to_string())
    if os.environ.get("OUT"):
        df.to_csv(os.path.join(os.environ["OUT"], "ceiling_spread.csv"), index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
