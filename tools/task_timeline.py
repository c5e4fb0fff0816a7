"""Where a GEMM's time goes task by task, from a MOK_GEMM_TRACE build (csrc/include/mok/gemm/config.cuh):
every consumer warpgroup records, per task, its SM clock at the task's start, after its mainloop and after its
epilogue. For the trace build and for the trace build with each NAME=VALUE switch, this runs the shape's forward
steps (mok.bench_parts) once to warm, then GEMM1 once, and prints per build and per kind of tile (`half_padding`:
1 if rows 64..127 are padding) the median cycles of a task, its mainloop and its epilogue, the wait before the
CTA's next task, the CTAs' spans, and how far apart the CTAs' n-th tasks start (their drift). A device-side probe, not a
benchmark: the records' stores cost a little.

    python tools/task_timeline.py [SHAPE] [NAME=VALUE ...]     (device step `timeline`; $OUT/timeline.csv)
"""

from __future__ import annotations

import os
import sys

import pandas as pd
import torch

from mok import bench_parts, fused
from mok.bench_ab import parse_switch
from mok.config import get_shape
from mok.ops import core
from mok.testing import make_inputs, moe_args

COLUMNS = ["kind", "cta", "group", "unit", "half_padding", "start", "mainloop_end", "end"]
MAX_RECORDS = 1 << 18  # kTraceRecords


def read_records(ext) -> pd.DataFrame:
    """The records since the last read (and clears them on the device)."""
    buf = torch.empty((MAX_RECORDS, len(COLUMNS)), dtype=torch.int64)
    n = ext.grouped_gemm_bf16_trace(buf)
    return pd.DataFrame(buf[:n].numpy(), columns=COLUMNS)


def gemm1_records(shape: str, switches: dict) -> pd.DataFrame:
    ext = core.load_extension(switches)
    with core.built_with(switches):
        inputs = make_inputs(get_shape(shape), device="cuda", draw_on="cuda")
        _, saved = fused.forward(*moe_args(inputs))
        steps = [s for s in bench_parts.steps_of(saved) if s.pass_ == "fwd"]
        state = bench_parts.forward_state(inputs)
        bench_parts.run_steps(steps, state)  # the intermediates, and every kernel's first launch
        torch.cuda.synchronize()
        read_records(ext)
        next(s for s in steps if s.name == "gemm1").run(state)
        torch.cuda.synchronize()
        return read_records(ext)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    df = df.sort_values(["cta", "group", "start"]).copy()
    df["task"] = df["end"] - df["start"]
    df["mainloop"] = df["mainloop_end"] - df["start"]
    df["epilogue"] = df["end"] - df["mainloop_end"]
    df["wait_next"] = df.groupby(["cta", "group"])["start"].shift(-1) - df["end"]
    df["after_padding"] = df.groupby(["cta", "group"])["half_padding"].shift(1).fillna(0).astype(int)
    cols = ["task", "mainloop", "epilogue", "wait_next"]
    table = df.groupby(["group", "half_padding", "after_padding"])[cols].median().round().astype("Int64")
    table["tasks"] = df.groupby(["group", "half_padding", "after_padding"]).size()
    return table


def start_spread(df: pd.DataFrame) -> pd.Series:
    """How far the CTAs drift apart: per n (a CTA's n-th task, first consumer warpgroup), the 90th minus the 10th
    percentile over CTAs of that task's start, each counted from the CTA's first start (SM clocks are per SM)."""
    df = df[df["group"] == 0].sort_values(["cta", "start"])
    since_first = df["start"] - df.groupby("cta")["start"].transform("min")
    nth = df.groupby("cta").cumcount()
    return since_first.groupby(nth).agg(lambda x: x.quantile(0.9) - x.quantile(0.1)).astype("int64")


def main(argv: list[str]) -> int:
    shape = argv[0] if argv and "=" not in argv[0] else "dsv4pro-rank"
    builds = {"trace": {"MOK_GEMM_TRACE": 1}}
    for text in (a for a in argv if "=" in a):
        builds[f"trace + {text}"] = {"MOK_GEMM_TRACE": 1, **parse_switch(text)}
    frames = []
    for name, switches in builds.items():
        df = gemm1_records(shape, switches)
        frames.append(df.assign(build=name, shape=shape))
        if os.environ.get("OUT"):
            pd.concat(frames).to_csv(os.path.join(os.environ["OUT"], "timeline.csv"), index=False)
        span = df.groupby("cta")["end"].max() - df.groupby("cta")["start"].min()
        print(f"== {shape} gemm1, {name}: {len(df)} records; CTA span max {span.max()}, median {span.median():.0f}")
        print("   cycles (medians) by consumer warpgroup, rows 64.. padding, the CTA's previous tile so:")
        print(summarize(df).to_string())
        spread = start_spread(df)
        print("   start spread over CTAs (cycles) at their n-th task:",
              ", ".join(f"{n}: {v}" for n, v in spread.iloc[::4].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
