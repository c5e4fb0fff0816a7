"""The one benchmark harness (DESIGN §8): tidy rows with provenance, never prints-only.

    python -m mok.bench moe  [--shapes ...] [--levels torch] [--precisions bf16 mxfp8] [--passes ...]
    python -m mok.bench moe --levels torch fused --mx-weight-cache   (-> data/bench/moe_mx_cache.csv)
    python -m mok.bench moe --levels torch fused --routing rounded   (-> data/bench/moe_rounded.csv)
    python -m mok.bench quant                      (the MXFP8 quantization kernels, mok.bench_quant)
    python -m mok.bench parts  [--shapes ...]      (the L2 passes kernel by kernel, mok.bench_parts)
    python -m mok.bench ab MOK_GEMM_MULTICAST=1    (a build switch against the default, in one process: mok.bench_ab)
    python -m mok.bench route                      (the router with and without rounding to the tile, mok.bench_route)
    python -m mok.bench summary [data/bench/moe.csv] [--precision mxfp8]   (the README's tables, in markdown)
    python -m mok.bench summary CSV CSV ...        (the fused level's fraction of the ceiling in each run, and
                                                    its min / median / max over them)

Per (shape, level, precision, pass) one row: time_ms (median of CUDA-event timings of calls queued back to back,
after warm-up: 3 calls, then more until 1 s has passed, --warmup-ms; the row's warmup_ms and timing say how),
tflops (MoK's FLOP convention, mok.config), the cuBLAS dense ceiling measured in the same process
on the same aggregate GEMM shapes, frac_of_ceiling, speedup_vs_torch (L1), peak_mem_gb (memory the
pass allocates on top of its inputs), saved_gb (the activations a forward keeps for the backward,
mok.testing.saved_nbytes; mok levels only), and provenance: gpu, torch, cuda, commit, date.
With --mx-weight-cache the fused level's mxfp8 rows are timed inside mok.mxfp8_weight_cache(), which the
warm-up fills (the steady state of a gradient-accumulation step: no weight round trips); their notes say
`mxfp8_weight_cache`, peak_mem_gb is on top of the warm cache and mx_cache_gb is the cache's size. KEY has no
notes, so such rows go to their own CSV by default (moe_mx_cache.csv) instead of replacing moe.csv's.
With the fused level, each pass also gets a `bound` row (level cublas-executed): the ceiling's GEMMs over the
rows that level executes, each expert's routes rounded up to its tiles (--bound-block-m), so its
frac_of_ceiling is the most any kernel that multiplies those padding rows can reach. With --routing rounded the
draw's routes are rounded to that tile first (mok.routing.round_to_tiles), so no expert needs padding rows (the
routing column says which).
Peers (Liger-Kernel's Triton fused MoE) run side by side when importable.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from mok import clocks, fused, mx_cache
from mok.config import PASSES, PRECISIONS, STANDARD_SHAPES, MoEConfig, get_shape
from mok.layer import get_level
from mok.ops.gemm import GEMM_BLOCK_K
from mok.testing import make_inputs, moe_args, routing_of, saved_nbytes

DATA = Path(__file__).resolve().parent.parent / "data" / "bench"
KEY = ["shape", "level", "precision", "pass"]
# The method of record times every call as a training step runs it. WARMUP_MS: the warm-up beyond 3 calls. Sustained
# calls put the GPU under its power cap, where a dense GEMM runs 6-18% slower than in the first milliseconds; the
# cap averages power over about a second, and after 100 ms the shortest ceilings still ran partly above it (dsv4pro's
# forward: 743 TFLOP/s at 100 ms, 618 at 1 s; docs/l2_fused_log.md, "The ceiling under a sustained load" and "What the
# forward goal needs"). QUEUED: the timed calls go back to back, one sync at the end, so the host's launch time hides
# behind the previous call as it does in a training loop (a call from an idle GPU also paid it: qwen3-30b's forward
# 5% more, "Host time on the path to GEMM1"); a host slower than the GPU still shows, as the GPU's idle time.
WARMUP_MS = 1000.0
QUEUED = True


# --- timing and provenance ------------------------------------------------------------------------

def time_ms(fn, iters: int = 20, warmup: int = 3, warmup_ms: float = 0.0, during=None, queued: bool = QUEUED) -> float:
    """Median wall time of fn() in ms: CUDA events on a GPU, perf_counter on the CPU. The warm-up is `warmup`
    calls, then more until `warmup_ms` of wall time have passed since the first (0: none more): after an idle
    spell a GPU's clocks may take longer to rise than 3 calls of a short GEMM (docs/l2_fused.md, "Next" 6).
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


def alternating_rounds(ways: dict, rounds: int, iters: int = 20) -> list[dict]:
    """[{"way", "round", "time_ms", "sm_mhz", "power_w", "power_capped"}]: each fn() of `ways` (name -> fn) timed by
    time_ms after WARMUP_MS of sustained calls, once per round, in the given order on even rounds and reversed on
    odd ones, so that a drift of the machine over the rounds (clocks, power cap) falls on every way alike: the
    in-process A/B of the tools. The clock columns are clocks.Sampler's over the timed calls (NaN off a GPU)."""
    rows = []
    for r in range(rounds):
        for way in list(ways)[:: 1 if r % 2 == 0 else -1]:
            ms, clock = clocked(functools.partial(time_ms, warmup_ms=WARMUP_MS), ways[way], iters)
            rows.append({"way": way, "round": r, "time_ms": ms, **clock})
    return rows


def ab_table(rows: pd.DataFrame, index, before: str, after: str, value: str = "time_ms") -> str:
    """The A/B tools' printout of alternating_rounds rows: the median `value` per `index` and way, and ratio = the
    `after` way's median over the `before` way's."""
    table = rows.pivot_table(index=index, columns="way", values=value, aggfunc="median", dropna=False)
    table["ratio"] = table[after] / table[before]
    return table.to_string(float_format=lambda v: f"{v:.4g}")


def timings(pass_: str, iters: int) -> int:
    """Timed runs of a pass (DESIGN §8): `iters` (≥ 20) forward, half of it, at least 10, with a backward."""
    return iters if pass_ == "fwd" else max(10, iters // 2)


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


# --- the dense ceiling ------------------------------------------------------------------------------

def gemm_shapes(cfg: MoEConfig, pass_: str, rows: tuple[int, int] | None = None) -> list[tuple[int, int, int]]:
    """(M, N, K) of the dense GEMMs with the MoE's aggregate shapes; their FLOPs are cfg.flops(pass_).
    rows: the routed experts' (rows of the row-wise GEMMs, K of the weight gradients) if not the routes
    (cfg.num_routes), e.g. the rows a level executes, padding included (executed_rows)."""
    routed_rows, routed_k = rows or (cfg.num_routes, cfg.num_routes)
    out = []
    for m, k, width in ((routed_rows, routed_k, cfg.intermediate),
                        (cfg.num_tokens, cfg.num_tokens, cfg.shared_intermediate)):
        if width == 0:
            continue
        H = cfg.hidden
        fwd = [(m, 2 * width, H), (m, H, width)]  # gate+up, down
        bwd = [(m, width, H), (m, H, 2 * width),  # dgrad of down, of gate+up
               (H, width, k), (2 * width, H, k)]  # wgrad of down, of gate+up
        out += {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_]
    return out


def executed_rows(topk_idx: torch.Tensor, num_experts: int, block_m: int = fused.BLOCK_M) -> tuple[int, int]:
    """The routed rows the fused level's GEMMs execute for this routing: each expert's routes rounded up to
    the schedule's tile (block_m, fused.BLOCK_M) in the row-wise GEMMs, and to the k-block (GEMM_BLOCK_K, or the
    tile if smaller) as the weight gradients' K. For the `bound` rows: cuBLAS on these rows is the best time any
    kernel that multiplies the padding rows can reach, at the ceiling's own speed."""
    counts = torch.bincount(topk_idx.flatten().cpu(), minlength=num_experts)  # [E]
    return tuple(int(((counts + b - 1) // b * b).sum()) for b in (block_m, min(block_m, GEMM_BLOCK_K)))


def dense_gemm_fn(mnk: tuple[int, int, int], device):
    """A no-argument callable: cuBLAS (torch.mm) on bf16 randn [M, K] · [K, N], the ceiling's GEMM of one shape."""
    M, N, K = mnk
    a = torch.randn(M, K, device=device, dtype=torch.bfloat16)  # [M, K]
    b = torch.randn(N, K, device=device, dtype=torch.bfloat16)  # [N, K]
    return functools.partial(torch.mm, a, b.T)


def dense_gemm_ms(mnk: tuple[int, int, int], iters: int, device, time_fn=time_ms) -> float:
    """The ceiling of one GEMM shape: dense_gemm_fn timed."""
    return time_fn(dense_gemm_fn(mnk, device), iters)


def dense_ceiling_ms(cfg: MoEConfig, pass_: str, iters: int, device, time_fn=time_ms) -> float:
    return sum(dense_gemm_ms(mnk, iters, device, time_fn) for mnk in gemm_shapes(cfg, pass_))


def clocked_dense_ms(mnks, iters: int, device, time_fn=time_ms) -> tuple[float, dict]:
    """(cuBLAS's summed time over the GEMM shapes `mnks`, the clocks over all of them: clocks.Sampler's summary)."""
    sampler = clocks.Sampler()
    timed = functools.partial(time_fn, during=sampler)
    return sum(dense_gemm_ms(mnk, iters, device, timed) for mnk in mnks), sampler.summary()


# --- levels and peers -------------------------------------------------------------------------------

def level_pass_fn(level_name: str, inputs: dict, precision: str, pass_: str):
    """A no-argument callable running one pass of a mok level."""
    level = get_level(level_name)
    args = moe_args(inputs)
    fwd = functools.partial(level.forward, *args, precision=precision)
    if pass_ == "fwd":
        return fwd
    if pass_ == "bwd":
        _, saved = fwd()  # the backward is a pure function of the saved state: repeatable
        return lambda: level.backward(saved, inputs["d_out"])
    return lambda: level.backward(fwd()[1], inputs["d_out"])


def saved_gb(level_name: str, inputs: dict, precision: str) -> float:
    """GB of activations one forward of the level saves for its backward (its inputs not counted)."""
    _, saved = get_level(level_name).forward(*moe_args(inputs), precision=precision)
    return saved_nbytes(saved) / 1e9


def liger_pass_fn(inputs: dict, pass_: str):
    """Liger-Kernel's Triton fused MoE (routed experts; the shared expert through cuBLAS, as L1 does),
    or None when liger_kernel is not importable."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as e:
        print(f"peer liger skipped: {e}", file=sys.stderr)
        return None
    w_gate_up = torch.cat([inputs["w_gate"], inputs["w_up"]], dim=1).requires_grad_()  # [E, 2I, H]
    w_down = inputs["w_down"].clone().requires_grad_()
    x = inputs["x"].clone().requires_grad_()
    idx, w = inputs["topk_idx"].int(), inputs["topk_weights"].clone().requires_grad_()
    shared = [inputs[n].clone().requires_grad_() if inputs[n] is not None else None
              for n in ("w_shared_gate", "w_shared_up", "w_shared_down")]

    def fwd():
        out = LigerFusedMoEFunction.apply(x, w_gate_up, w_down, idx, w)
        if shared[0] is not None:
            lin = torch.nn.functional.linear
            h = torch.nn.functional.silu(lin(x, shared[0])) * lin(x, shared[1])
            out = out + lin(h, shared[2])
        return out

    if pass_ == "fwd":
        return fwd
    if pass_ == "bwd":
        out = fwd()
        return lambda: out.backward(inputs["d_out"], retain_graph=True)
    return lambda: fwd().backward(inputs["d_out"])


def bench_shape(cfg: MoEConfig, levels, precisions, passes, peers, iters: int, device, seed=0,
                mx_weight_cache=False, warmup_ms=WARMUP_MS, queued=QUEUED, bound_block_m=fused.BLOCK_M,
                routing="random") -> list[dict]:
    inputs = make_inputs(cfg, device=device, seed=seed, draw_on=device, routing_fn=routing_of(routing))
    prov = provenance()
    time_fn = functools.partial(time_ms, warmup_ms=warmup_ms, queued=queued)  # every row alike: ceiling, levels, peers
    rows = []
    executed = executed_rows(inputs["topk_idx"], cfg.num_experts, bound_block_m)  # the `bound` rows' GEMMs

    def row(level, kind, precision, pass_, ms, ceiling_ms, mem, clock: dict, saved_gb=float("nan")):
        tflops = cfg.flops(pass_) / ms / 1e9
        ceiling = cfg.flops(pass_) / ceiling_ms / 1e9
        rows.append(dict(shape=cfg.name, level=level, kind=kind, precision=precision, **{"pass": pass_},
                         time_ms=ms, tflops=tflops, ceiling_tflops=ceiling, frac_of_ceiling=tflops / ceiling,
                         peak_mem_gb=mem, saved_gb=saved_gb, num_tokens=cfg.num_tokens, hidden=cfg.hidden,
                         intermediate=cfg.intermediate, num_experts=cfg.num_experts, num_topk=cfg.num_topk,
                         shared_intermediate=cfg.shared_intermediate, routing=routing, iters=timings(pass_, iters),
                         warmup_ms=warmup_ms, timing=timing_name(queued), **clock, **prov))

    saved = {}  # (level, precision) -> saved_gb: the same for every pass, so one extra forward each

    for pass_ in passes:
        n = timings(pass_, iters)
        ceiling_ms, clock = clocked_dense_ms(gemm_shapes(cfg, pass_), n, device, time_fn)
        row("cublas-dense", "ceiling", "bf16", pass_, ceiling_ms, ceiling_ms, float("nan"), clock)
        if "fused" in levels:  # the fused level's padding rows at the ceiling's speed: the most it can reach
            bound_ms, clock = clocked_dense_ms(gemm_shapes(cfg, pass_, executed), n, device, time_fn)
            row("cublas-executed", "bound", "bf16", pass_, bound_ms, ceiling_ms, float("nan"), clock)
            rows[-1]["notes"] = f"block_m={bound_block_m}"
        for precision in precisions:
            for level in levels:
                fn = level_pass_fn(level, inputs, precision, pass_)
                if (level, precision) not in saved:
                    saved[level, precision] = saved_gb(level, inputs, precision)
                cached = mx_weight_cache and level == "fused" and precision == "mxfp8"
                with mx_cache.mxfp8_weight_cache() if cached else contextlib.nullcontext():
                    # cached: time_ms's warm-up computes the weights' round trips, the timed runs reuse them
                    (ms, clock), mem, cache_gb = clocked(time_fn, fn, n), peak_mem_gb(fn), mx_cache.nbytes() / 1e9
                row(level, "mok", precision, pass_, ms, ceiling_ms, mem, clock, saved[level, precision])
                if level == "fused" and precision == "mxfp8":  # the forward's weight path (mok.fused)
                    rows[-1]["notes"] = f"{fused.MX_WEIGHTS_ENV}={fused.mx_weights_from_env()}"
                    if cached:
                        rows[-1]["notes"] += "; mxfp8_weight_cache"
                        rows[-1]["mx_cache_gb"] = cache_gb
                del fn
            if "liger" in peers and precision == "bf16":
                fn = liger_pass_fn(inputs, pass_)
                if fn is not None:
                    ms, clock = clocked(time_fn, fn, n)
                    row("liger", "peer", "bf16", pass_, ms, ceiling_ms, peak_mem_gb(fn), clock)
                    rows[-1]["notes"] = f"LIGER_FUSED_MOE_AUTOTUNE={os.environ.get('LIGER_FUSED_MOE_AUTOTUNE', '1')}"
                    del fn
    torch_ms = {(r["precision"], r["pass"]): r["time_ms"] for r in rows if r["level"] == "torch"}
    for r in rows:
        base = torch_ms.get((r["precision"], r["pass"])) or torch_ms.get(("bf16", r["pass"]))
        r["speedup_vs_torch"] = base / r["time_ms"] if base else float("nan")
    return rows


# --- the README table ----------------------------------------------------------------------------

def summary_markdown(df: pd.DataFrame, precision: str = "bf16") -> str:
    """TFLOP/s per shape × pass, one column per level/peer, plus each mok level's fraction of the ceiling:
    the table the README shows, regenerated by `python -m mok.bench summary`."""
    d = df[(df.precision == precision) | (df.level == "cublas-dense")]  # the ceiling runs in bf16
    t = d.pivot_table(index=["shape", "pass"], columns="level", values="tflops", sort=False)
    cols = ["cublas-dense"] + [c for c in t.columns if c != "cublas-dense"]
    mok_levels = [c for c in cols if c in d[d.kind.isin(["mok", "bound"])].level.unique()]
    frac = d.pivot_table(index=["shape", "pass"], columns="level", values="frac_of_ceiling", sort=False)
    lines = ["| shape | pass | " + " | ".join(f"{c} TFLOP/s" for c in cols) + " | "
             + " | ".join(f"{c} / ceiling" for c in mok_levels) + " |",
             "|---" * (len(cols) + len(mok_levels) + 2) + "|"]
    for (shape, pass_), r in t[cols].iterrows():
        cells = [("" if pd.isna(v) else f"{v:.0f}") for v in r]
        cells += [("" if pd.isna(frac.loc[(shape, pass_), c]) else f"{frac.loc[(shape, pass_), c]:.2f}")
                  for c in mok_levels]
        lines.append(f"| {shape} | {pass_} | " + " | ".join(cells) + " |")
    prov = d.iloc[0]
    lines.append(f"\n{prov.gpu}, torch {prov.torch}, CUDA {prov.cuda}, commit {prov.commit}, {prov.date}")
    return "\n".join(lines)


def samples_markdown(runs: dict[str, pd.DataFrame], level: str = "fused", precision: str = "bf16") -> str:
    """One level's fraction of the same-run ceiling per shape × pass in several runs (name -> rows), then the
    min / median / max over them: a run's machine moves both its ceiling and the level (docs/l2_fused_log.md, "Samples
    of the fractions"), so a goal reads off the median of several runs, not off one."""
    fracs = pd.DataFrame({name: df[(df.level == level) & (df.precision == precision)]
                          .set_index(["shape", "pass"]).frac_of_ceiling for name, df in runs.items()})
    stats = {"min": fracs.min(axis=1), "median": fracs.median(axis=1), "max": fracs.max(axis=1)}
    lines = ["| shape | pass | " + " | ".join([*runs, *stats]) + " |", "|---" * (len(runs) + len(stats) + 2) + "|"]
    for (shape, pass_), r in pd.concat([fracs, pd.DataFrame(stats)], axis=1).iterrows():
        lines.append(f"| {shape} | {pass_} | " + " | ".join("" if pd.isna(v) else f"{v:.2f}" for v in r) + " |")
    lines.append(f"\n{level} {precision} / the same run's ceiling, {len(runs)} runs")
    return "\n".join(lines)


# --- CLI --------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["quant"]:
        from mok import bench_quant
        return bench_quant.main(argv[1:])
    if argv[:1] == ["parts"]:
        from mok import bench_parts
        return bench_parts.main(argv[1:])
    if argv[:1] == ["ab"]:
        from mok import bench_ab
        return bench_ab.main(argv[1:])
    if argv[:1] == ["route"]:
        from mok import bench_route
        return bench_route.main(argv[1:])
    if argv[:1] == ["summary"]:
        s = argparse.ArgumentParser(prog="python -m mok.bench summary",
                                    description="the README's table, in markdown; with several CSVs, the fused "
                                                "level's fraction of the ceiling in each run and over them")
        s.add_argument("csv", type=Path, nargs="*", default=[DATA / "moe.csv"])
        s.add_argument("--precision", default="bf16", choices=PRECISIONS)
        args = s.parse_args(argv[1:])
        if len(args.csv) == 1:
            print(summary_markdown(read_rows(args.csv[0]), precision=args.precision))
        else:
            print(samples_markdown({path.stem: read_rows(path) for path in args.csv}, precision=args.precision))
        return 0
    p = argparse.ArgumentParser(prog="python -m mok.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["moe", "quant", "parts", "ab", "route", "summary"],
                   help="moe: the MoE layer; quant: MXFP8 quantizers; parts: the L2 passes kernel by kernel; "
                        "ab NAME=VALUE: a build switch's A/B; route: the router's rounding to the tile; "
                        "summary [CSV]: the README table")
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES), help="names from mok.config")
    p.add_argument("--levels", nargs="+", default=["torch"], help="mok levels (reference, torch, ...)")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    p.add_argument("--peers", nargs="*", default=["liger"], help="peers to run when importable")
    p.add_argument("--iters", type=int, default=20, help="timed runs of a forward (half, ≥ 10, with backward)")
    p.add_argument("--mx-weight-cache", action="store_true",
                   help="time the fused level's mxfp8 rows inside mok.mxfp8_weight_cache(), warmed by the warm-up "
                        "(a gradient-accumulation step's steady state)")
    add_timing_options(p)
    p.add_argument("--bound-block-m", type=int, default=fused.BLOCK_M,
                   help="with --levels fused: the tile each expert's rows are rounded up to in the `bound` rows "
                        "(cuBLAS on the rows executed); another value than the level's asks what a schedule padded "
                        "to it could reach")
    p.add_argument("--routing", default="random", choices=["random", "rounded"],
                   help="random: the benchmark's (uniform, each expert's routes padded to the tile); rounded: the same "
                        "draw with every expert's routes rounded to the fused level's tile (routing.round_to_tiles: "
                        "1-3%% of the routes move at the standard shapes), the rows `rounded` in the routing column")
    p.add_argument("--out", type=Path, default=None,
                   help="CSV the rows merge into (default: data/bench/moe.csv; with --mx-weight-cache "
                        "data/bench/moe_mx_cache.csv, since KEY has no notes and would replace the uncached rows; "
                        "with --routing rounded data/bench/moe_rounded.csv)")
    args = p.parse_args(argv)
    out = args.out or DATA / ("moe_mx_cache.csv" if args.mx_weight_cache else
                              "moe_rounded.csv" if args.routing == "rounded" else "moe.csv")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    all_rows = sweep(args.shapes, lambda cfg: bench_shape(cfg, args.levels, args.precisions, args.passes, args.peers,
                                                          args.iters, device, mx_weight_cache=args.mx_weight_cache,
                                                          warmup_ms=args.warmup_ms, queued=not args.from_idle,
                                                          bound_block_m=args.bound_block_m, routing=args.routing),
                     out)
    cols = ["shape", "level", "precision", "pass", "time_ms", "tflops", "frac_of_ceiling", "speedup_vs_torch"]
    print(pd.DataFrame(all_rows)[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
