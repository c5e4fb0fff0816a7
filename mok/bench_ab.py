"""An A/B of one build switch in one process (`python -m mok.bench ab NAME=VALUE`).

Two processes timed one after the other (`MOK_GEMM_MULTICAST=1 python -m mok.bench parts`) differ by the GPU's
clock and temperature as much as by the switch: the same build's whole forward moved 8% between two such runs
(dsv4pro, parts at c25bf99 and f23e1b7). Here both builds are loaded side by side (mok.ops.core.built_with) and
each pass is timed in rounds, the two builds back to back within a round and their order alternating between
rounds, so drift hits both alike. One row per (shape, pass, build, round); the printed table is the medians
over rounds and variant / default.

With --parts, the same for every kernel of both passes (the steps of mok.bench_parts, bf16), one row per
(shape, step, build, round): a kernel change behind a switch, measured against its own default in one process.
Both builds' kernels are timed on one set of intermediates, made by the default build (every switch stores the
same bits: tests/test_ops_gemm.py).

    python -m mok.bench ab MOK_GEMM_MULTICAST=1 [--shapes ...] [--passes ...] [--rounds 7] [--out data/bench/ab.csv]
    python -m mok.bench ab MOK_GEMM_MULTICAST=1 --parts [--shapes ...] [--rounds 3] [--out data/bench/ab_parts.csv]
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import pandas as pd
import torch

from mok import bench, bench_parts, fused
from mok.checks import fail
from mok.config import PASSES, PRECISIONS, STANDARD_SHAPES, MoEConfig
from mok.ops.core import BUILD_SWITCHES, build_switches, built_with
from mok.testing import make_inputs, moe_args

KEY = ["shape", "precision", "pass", "build", "round"]
PARTS_KEY = ["shape", "pass", "step", "build", "round"]
DEFAULT = "default"


def parse_switch(text: str) -> dict:
    """'NAME=VALUE[,NAME=VALUE ...]' -> {NAME: VALUE, ...}: one build with every switch named, each checked against
    mok.ops.core.BUILD_SWITCHES (name and value)."""
    switches = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in BUILD_SWITCHES:
            fail("switch", f"NAME=VALUE[,NAME=VALUE ...] with NAME from {sorted(BUILD_SWITCHES)}", repr(text))
        switches[name.strip()] = value
    return dict(build_switches(switches))


def _builds(switch: dict) -> dict:
    """Build name -> switches: the headers' defaults, and `switch`."""
    return {DEFAULT: {}, ",".join(f"{k}={v}" for k, v in switch.items()): switch}


def _interleaved(builds: dict, rounds: int, items, timing):
    """(round, item, build, ms) for each item under every build in every round, the builds' order alternating
    between rounds; timing(item, build) -> ms runs inside built_with(builds[build])."""
    for r in range(rounds):
        order = list(builds) if r % 2 == 0 else list(builds)[::-1]
        for item in items:
            for build in order:
                with built_with(builds[build]):
                    ms = timing(item, build)
                yield r, item, build, ms


def ab_shape(cfg: MoEConfig, switch: dict, passes, rounds: int, iters: int, precision="bf16", level="fused",
             device="cuda", time_fn=bench.time_ms, seed: int = 0) -> list[dict]:
    """Rows for one shape: each pass of `level`, on the default build and on `switch`, `rounds` times, with the
    clocks of each timing (mok.bench.clocked). time_fn(fn, iters, during) -> ms (mok.bench.time_ms; tests inject
    their own)."""
    inputs = make_inputs(cfg, device=device, seed=seed, draw_on=device)
    builds = _builds(switch)
    fns = {}
    for build, switches in builds.items():
        with built_with(switches):  # a bwd fn runs its forward now: each build saves its own state
            fns[build] = {pass_: bench.level_pass_fn(level, inputs, precision, pass_) for pass_ in passes}
    timings = _interleaved(builds, rounds, passes, lambda pass_, build: bench.clocked(
        time_fn, fns[build][pass_], bench.timings(pass_, iters)))
    return [{"shape": cfg.name, "precision": precision, "pass": pass_, "build": build, "round": r, "time_ms": ms,
             **clock} for r, pass_, build, (ms, clock) in timings]


def ab_parts_shape(cfg: MoEConfig, switch: dict, rounds: int, iters: int, device="cuda", time_fn=bench.time_ms,
                   seed: int = 0) -> list[dict]:
    """Rows for one shape: every step of mok.bench_parts, on the default build and on `switch`, `rounds` times,
    interleaved as ab_shape interleaves passes, with their clocks. time_fn(fn, iters, during) -> ms (tests inject
    their own)."""
    inputs = make_inputs(cfg, device=device, seed=seed, draw_on=device)
    builds = _builds(switch)
    with built_with({}):
        _, saved = fused.forward(*moe_args(inputs))
        steps = bench_parts.steps_of(saved)
        states = {"fwd": bench_parts.forward_state(inputs), "bwd": bench_parts.backward_state(inputs, saved)}
        for pass_, state in states.items():  # the intermediates every timing reads (and the default's warm-up)
            bench_parts.run_steps([s for s in steps if s.pass_ == pass_], state)
    with built_with(switch):  # the variant's JIT build and first launches, before any timing
        for step in steps:
            step.run(states[step.pass_])
    timings = _interleaved(builds, rounds, steps, lambda step, build: bench.clocked(
        time_fn, functools.partial(step.run, states[step.pass_]), iters))
    return [{"shape": cfg.name, "pass": step.pass_, "step": step.name, "build": build, "round": r, "time_ms": ms,
             **clock} for r, step, build, (ms, clock) in timings]


def ab_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Median time per (shape, precision or step, pass, build) over rounds, one column per build, and variant /
    default."""
    index = [c for c in ("shape", "precision", "pass", "step") if c in rows.columns]
    med = rows.pivot_table(index=index, columns="build", values="time_ms", aggfunc="median", sort=False)
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
    p.add_argument("--parts", action="store_true", help="every kernel of both passes instead of the passes")
    p.add_argument("--rounds", type=int, default=None,
                   help="timings of each pass (default 7) or kernel (default 3) and build; the median is kept")
    p.add_argument("--iters", type=int, default=20, help="timed runs per forward timing (half, ≥ 10, with backward)")
    bench.add_timing_options(p)
    p.add_argument("--out", type=Path, default=None, help="default data/bench/ab.csv, with --parts ab_parts.csv")
    args = p.parse_args(argv)
    try:
        switch = parse_switch(args.switch)
    except ValueError as e:
        p.error(str(e))
    if args.parts and (args.precision != "bf16" or args.passes != list(PASSES)):
        p.error(f"--parts times the bf16 kernels of both passes: expected no --precision or --passes, got "
                f"--precision {args.precision} --passes {' '.join(args.passes)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rounds = args.rounds if args.rounds is not None else 3 if args.parts else 7
    out = args.out or bench.DATA / ("ab_parts.csv" if args.parts else "ab.csv")
    time_fn, method = bench.timing_of(args)

    def rows_of(cfg):
        if args.parts:
            rows = ab_parts_shape(cfg, switch, rounds, args.iters, device=device, time_fn=time_fn)
        else:
            rows = ab_shape(cfg, switch, args.passes, rounds, args.iters, args.precision, device=device,
                            time_fn=time_fn)
        return [{**r, "iters": args.iters, **method, **bench.provenance()} for r in rows]

    all_rows = bench.sweep(args.shapes, rows_of, out, PARTS_KEY if args.parts else KEY)
    print(ab_table(pd.DataFrame(all_rows)).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"wrote {out}")
    return 0
