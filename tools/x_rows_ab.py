"""The MXFP8 backward's x rows both ways in one process: the gather kernel then the column-wise round trip
(two kernels, the gathered copy written and read back) against mxfp8_fake_quantize_gathered (one kernel), per
standard shape, every timing after mok.bench.WARMUP_MS of sustained calls, alternating rounds.

    python tools/x_rows_ab.py [--rounds 5]     (device step `x_rows_ab`; rows to $OUT/x_rows_ab.csv when OUT is set)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import pandas as pd

from mok import bench, ops
from mok.config import STANDARD_SHAPES, get_shape
from mok.testing import make_inputs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    time_fn = functools.partial(bench.time_ms, warmup_ms=bench.WARMUP_MS)
    ways = {"gather_then_round_trip": lambda x, s: ops.mxfp8_fake_quantize(ops.gather_rows_cuda(x, s), -2),
            "gathered_round_trip": ops.mxfp8_fake_quantize_gathered}
    rows = []
    for name in STANDARD_SHAPES:
        cfg = get_shape(name)
        inputs = make_inputs(cfg, device="cuda", draw_on="cuda")
        x, sched = inputs["x"], ops.make_schedule_cuda(inputs["topk_idx"], cfg.num_experts)
        for r in range(args.rounds):
            for way in (ways if r % 2 == 0 else reversed(list(ways))):
                ms = time_fn(functools.partial(ways[way], x, sched), 20)
                rows.append({"shape": name, "way": way, "round": r, "time_ms": ms,
                             "gb_one_kernel": 4 * sched.num_rows * cfg.hidden / 1e9, **bench.provenance()})
    df = pd.DataFrame(rows)
    table = df.pivot_table(index="shape", columns="way", values="time_ms", aggfunc="median")
    table["ratio"] = table["gathered_round_trip"] / table["gather_then_round_trip"]
    print(table.to_string(float_format=lambda v: f"{v:.4g}"))
    if os.environ.get("OUT"):
        df.to_csv(os.path.join(os.environ["OUT"], "x_rows_ab.csv"), index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
