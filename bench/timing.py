"""Timing, provenance and tidy rows: what every benchmark of the package shares (DESIGN §8).

`time_ms` is the method of record: CUDA events around calls queued back to back after a sustained warm-up.
`graph_time_ms` times short kernels replayed from a CUDA graph. Rows merge into CSVs by their key columns.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import statistics
import subprocess
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from bench import clocks
from mok.config import get_shape

DATA = Path(__file__).resolve().parent.parent / "data" / "bench"  # the rows the README and notebooks read
KEY = ["shape", "level", "precision", "pass"]
# The method of record times every call as a training step runs it. WARMUP_MS: the warm-up beyond 3 calls. Sustained
# calls put the GPU under its power cap, where a dense GEMM runs 6-18% slower than in the first milliseconds; the
# cap averages power over about a second, and after 100 ms the shortest ceilings still ran partly above it (dsv4pro's
# forward: 743 TFLOP/s at 100 ms, 618 at 1 s; docs/lab/log.md, "The ceiling under a sustained load" and "What the
# forward goal needs"). QUEUED: the timed calls go back to back, one sync at the end, so the host's launch time hides
# behind the previous call as it does in a training loop (a call from an idle GPU also paid it: qwen3-30b's forward
# 5% more, "Host time on the path to GEMM1"); a host slower than the GPU still shows, as the GPU's idle time.
WARMUP_MS = 1000.0
QUEUED = True


# --- timing and provenance ------------------------------------------------------------------------

def time_ms(fn, iters: int = 20, warmup: int = 3, warmup_ms: float = 0.0, during=None, queued: bool = QUEUED) -> float:
    """Median wall time of fn() in ms: CUDA events on a GPU, perf_counter on the CPU. The warm-up is `warmup`
    calls, then more until `warmup_ms` of wall time have passed since the first (0: none more): after an idle
    spell a GPU's clocks may take longer to rise than 3 calls of a short GEMM (docs/lab/roadmap.md).
    `queued` (a GPU): the timed calls are queued back to back behind one more call, each between its own two
    events, and synchronized once at the end, so each time is the GPU's from the end of the call before; else
    each call starts from an idle GPU (start event, fn, end event, sync) and pays the host's time to its first
    kernel. `during`: a context manager entered around the timed calls only (a clocks.Sampler)."""
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    while warmup_ms > 0:
        if cuda:
            torch.cuda.synchronize()
        if (time.perf_counter() - t0) * 1e3 >= warmup_ms:
            break
        fn()
    times = []
    with during if during is not None else contextlib.nullcontext():
        if cuda and queued:
            event = functools.partial(torch.cuda.Event, enable_timing=True)
            events = [(event(), event()) for _ in range(iters)]
            fn()  # the first timed call starts behind a call, as every later one does
            for start, end in events:
                start.record()
                fn()
                end.record()
            events[-1][1].synchronize()
            return statistics.median(start.elapsed_time(end) for start, end in events)
        for _ in range(iters):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_time_ms(calls: list, calls_per_graph: int = 20, replays: int = 15) -> float:
    """Median time of one call: `calls_per_graph` calls (cycling through `calls`) captured in one CUDA
    graph, the graph replayed `replays` times with CUDA events around each replay."""
    for fn in calls:  # warm-up (and the JIT build) outside the capture
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(calls_per_graph):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_graph)
    return statistics.median(times)


def timing_name(queued: bool) -> str:
    """The rows' `timing` column: how time_ms ran the timed calls."""
    return "queued" if queued else "from_idle"


def add_timing_options(p: argparse.ArgumentParser) -> None:
    """--warmup-ms and --from-idle, the method options of every CLI that times on the GPU (moe, parts, ab)."""
    p.add_argument("--warmup-ms", type=float, default=WARMUP_MS,
                   help="after 3 warm-up calls, keep calling for this long before every timing (ceilings, levels "
                        "and peers alike): the clocks of a sustained load, under the GPU's power cap; 100 was the "
                        "method of record before 2026-12-04, 0 (3 calls only) before a012d45")
    p.add_argument("--from-idle", action="store_true",
                   help="time every call from an idle GPU (each synchronized), paying the host's time to its "
                        "first kernel: the method of record before 2026-12-04 (default: calls queued back to back)")


def timing_of(args) -> tuple:
    """(time_ms with the method `args` ask for, the columns every row records it by)."""
    queued = not args.from_idle
    return (functools.partial(time_ms, warmup_ms=args.warmup_ms, queued=queued),
            {"warmup_ms": args.warmup_ms, "timing": timing_name(queued)})


def clocked(time_fn, fn, iters: int) -> tuple[float, dict]:
    """(time_fn(fn, iters) in ms, the clocks it ran at: clocks.Sampler's summary over the timed calls)."""
    sampler = clocks.Sampler()
    return time_fn(fn, iters, during=sampler), sampler.summary()


def timings(pass_: str, iters: int) -> int:
    """Timed runs of a pass (DESIGN §8): `iters` (≥ 20) forward, half of it, at least 10, with a backward."""
    return iters if pass_ == "fwd" else max(10, iters // 2)


def peer_pass(peer, d_out: torch.Tensor, pass_: str):
    """A no-argument callable timing one pass ("fwd", "bwd", "fwd+bwd") of a peer: `peer()` runs its forward,
    `peer.grads(out, d_out, retain_graph=...)` differentiates with autograd.grad (nothing accumulates in .grad)."""
    if pass_ == "fwd":
        return peer
    if pass_ == "bwd":
        out = peer()
        return lambda: peer.grads(out, d_out, retain_graph=True)
    if pass_ == "fwd+bwd":
        return lambda: peer.grads(peer(), d_out)
    raise ValueError(f"pass_: expected one of fwd, bwd, fwd+bwd, got {pass_!r}")


def peak_mem_gb(fn) -> float:
    """GB allocated by one call of fn on top of what was allocated before it (0 on the CPU)."""
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 1e9


def provenance() -> dict:
    commit = os.environ.get("MOK_COMMIT")
    if not commit:
        try:
            git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 check=False, cwd=Path(__file__).parent, timeout=10)
            commit = git.stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            commit = "unknown"
    return dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__, cuda=torch.version.cuda or "none", commit=commit,
                date=datetime.date.today().isoformat())


def read_rows(path: Path) -> pd.DataFrame:
    """A benchmark CSV, provenance as written: a commit such as 6e81576 stays a string, not 6·10^81576."""
    return pd.read_csv(path, dtype={"commit": str})


def sweep(shape_names, rows_of, path: Path, key=KEY) -> list[dict]:
    """rows_of(cfg) for each named shape, with a progress bar, merged into the CSV at path as it goes (a killed
    sweep keeps what it measured); all the rows."""
    all_rows = []
    for name in tqdm(shape_names, desc="shapes"):
        rows = rows_of(get_shape(name))
        write_rows(rows, path, key)
        all_rows += rows
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return all_rows


def write_rows(rows: list[dict], path: Path, key=KEY) -> pd.DataFrame:
    """Merge rows into the CSV at path: a new row replaces an old one with the same key."""
    new = pd.DataFrame(rows)
    if path.exists():
        old = read_rows(path)
        new = pd.concat([old, new]).drop_duplicates(subset=key, keep="last")
    path.parent.mkdir(parents=True, exist_ok=True)
    new.to_csv(path, index=False)
    return new
