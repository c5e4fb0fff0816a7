"""An A/B of one build switch in one process (`python -m mok.bench ab NAME=VALUE`).

Two processes timed one after the other (`MOK_GEMM_MULTICAST=1 python -m mok.bench parts`) differ by the GPU's
clock and temperature as much as by the switch: the same build's whole forward moved 8% between two such runs
(dsv4pro, parts at c25bf99 and f23e1b7). Here both builds are loaded side by side (mok.ops.core.built_with) and
each pass is timed in rounds, the two builds back to back within a round and their order alternating between
rounds, so drift hits both alike. One row per (shape, pass, build, round); the printed table is the medians
over rounds and variant / default.

    python -m mok.bench ab MOK_GEMM_MULTICAST=1 [--shapes ...] [--passes ...] [--rounds 7] [--out data/bench/ab.csv]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

from mok import bench
from mok.checks import fail
from mok.config import PASSES, PRECISIONS, STANDARD_SHAPES, MoEConfig
from mok.ops.core import BUILD_SWITCHES, build_switches, built_with
from mok.testing import make_inputs

KEY = ["shape", "precision", "pass", "build", "round"]
DEFAULT = "default"


def parse_switch(text: str) -> dict:
    """'NAME=VALUE' -> {NAME: VALUE}, checked against mok.ops.core.BUILD_SWITCHES (name and value)."""
    name, sep, value = text.partition("=")
    if not sep or name not in BUILD_SWITCHES:
        fail("switch", f"NAME=VALUE with NAME from {sorted(BUILD_SWITCHES)}", repr(text))
    return dict(build_switches({name: value}))


def ab_shape(cfg: MoEConfig, switch: dict, passes, rounds: int, iters: int, precision="bf16", level="fused",
             device="cuda", time_fn=bench.time_ms, seed: int = 0) -> list[dict]:
    """Rows for one shape: each pass of `level`, on the default build and on `switch`, `rounds` times.
    time_fn(fn, iters) -> ms (mok.bench.time_ms; tests inject their own)."""
    inputs = make_inputs(cfg, device=device, seed=seed, draw_on=device)
    variant = ",".join(f"{k}={v}" for k, v in switch.items())
    builds = {DEFAULT: {}, variant: switch}
    fns = {}
    for build, switches in builds.items():
        with built_with(switches):  # a bwd fn runs its forward now: each build saves its own state
            fns[build] = {pass_: bench.level_pass_fn(level, inputs, precision, pass_) for pass_ in passes}
    rows = []
    for r in range(rounds):
        order = list(builds) if r % 2 == 0 else list(builds)[::-1]
        for pass_ in passes:
            for build in order:
                with built_with(builds[build]):
                    ms = time_fn(fns[build][pass_], bench.timings(pass_, iters))
                rows.append({"shape": cfg.name, "precision": precision, "pass": pass_, "build": build, "round": r,
                             "time_ms": ms})
    return rows


def ab_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Median time per (shape, precision, pass, build) over rounds, one column per build, and variant / default."""
    med = rows.pivot_table(index=["shape", "precision", "pass"], columns="build", values="time_ms", aggfunc="median")
    (variant,) = [c for c in med.columns if c != DEFAULT]
    med["ratio"] = med[variant] / med[DEFAULT]
    return med.reset_index()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok.bench ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("switch", help="NAME=VALUE, a build switch (mok.ops.core.BUILD_SWITCHES)")
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES), help="names from mok.config")
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    p.add_argument("--precision", default="bf16", choices=PRECISIONS)
    p.add_argument("--rounds", type=int, default=7, help="timings of each pass and build (the median is kept)")
    p.add_argument("--iters", type=int, default=20, help="timed runs per forward timing (half, ≥ 10, with backward)")
    p.add_argument("--out", type=Path, default=bench.DATA / "ab.csv")
    args = p.parse_args(argv)
    try:
        switch = parse_switch(args.switch)
    except ValueError as e:
        p.error(str(e))
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def rows_of(cfg):
        rows = ab_shape(cfg, switch, args.passes, args.rounds, args.iters, args.precision, device=device)
        return [{**r, "iters": args.iters, **bench.provenance()} for r in rows]

    all_rows = bench.sweep(args.shapes, rows_of, args.out, KEY)
    print(ab_table(pd.DataFrame(all_rows)).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"wrote {args.out}")
    return 0
