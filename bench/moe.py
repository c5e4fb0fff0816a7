"""The MoE layer benchmark (DESIGN §8): `python -m bench moe`, tidy rows with provenance, never prints-only.

    python -m bench moe [--shapes ...] [--levels torch fused] [--precisions bf16 mxfp8] [--passes ...] [--peers ...]
    python -m bench moe --levels fused --mx-weight-cache     (-> data/bench/moe_mx_cache.csv)
    python -m bench moe --levels fused --routing rounded     (-> data/bench/moe_rounded.csv)

Per (shape, level, precision, pass) one row: time_ms (bench.timing.time_ms: the median of CUDA-event timings of
calls queued back to back after 1 s of sustained calls), tflops (MoK's FLOP convention, mok.config), the cuBLAS
dense ceiling on the same aggregate GEMM shapes measured in the same process, frac_of_ceiling, speedup_vs_torch
(L1), peak_mem_gb (what the pass allocates on top of its inputs), saved_gb (the activations a forward keeps for
the backward; mok levels only), and provenance: gpu, torch, cuda, commit, date.
- --mx-weight-cache: the Hopper levels' mxfp8 rows run inside mok.mxfp8_weight_cache(), filled by the warm-up
  (a gradient-accumulation step's steady state); their notes say so and mx_cache_gb is the cache's size.
- With the fused level each pass also gets a `bound` row (level cublas-executed): the ceiling's GEMMs over the
  rows the level executes, each expert's routes rounded up to its tile: the most a kernel that multiplies those
  padding rows can reach. --routing rounded rounds the draw's routes to the tile first (mok.routing.round_to_tiles).
- Peers run side by side when importable (PEERS): Liger-Kernel's Triton fused MoE and SonicMoE (bench.sonic; routed
  experts only: its rows are on the shapes' routed part, `shared_intermediate` 0) beside the bf16 rows, and TorchAO's
  FP8 rowwise grouped GEMM (bench.torchao_fp8, `torchao-fp8`, sm_90 only, routed experts only; rows with precision
  `fp8_rowwise`) beside the mxfp8 rows: the FP8 baseline that runs on Hopper. And `mok.moe`: mok itself as a user
  calls it (the custom ops and autograd, backend auto: the fused level on a Hopper GPU), beside the bf16 rows that
  time the levels' functions: the difference is the eager call's own cost.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from pathlib import Path

import pandas as pd
import torch

import mok
from bench import sonic, torchao_fp8
from bench.timing import (
    DATA,
    QUEUED,
    WARMUP_MS,
    add_timing_options,
    clocked,
    peak_mem_gb,
    peer_pass,
    provenance,
    read_rows,
    sweep,
    time_ms,
    timing_name,
    timings,
)
from mok import fused, mx_cache
from mok.config import PASSES, PRECISIONS, STANDARD_SHAPES, MoEConfig
from mok.layer import get_level
from mok.ops.gemm import GEMM_BLOCK_K
from mok.testing import make_inputs, moe_args, rel_err, routing_of, saved_nbytes

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
    from bench import clocks

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
    or None when liger_kernel is not importable. Backward passes differentiate with autograd.grad, as the levels
    return their gradients: nothing accumulates into .grad between timed calls."""
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
    leaves = [t for t in (x, w, w_gate_up, w_down, *shared) if t is not None]

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
        return lambda: torch.autograd.grad(out, leaves, inputs["d_out"], retain_graph=True)
    return lambda: torch.autograd.grad(fwd(), leaves, inputs["d_out"])


def sonic_pass_fn(inputs: dict, pass_: str):
    """SonicMoE (bench.sonic) on shapes without a shared expert, which it does not have; None when it does not
    import or the shape has one."""
    if inputs["w_shared_gate"] is not None:
        print("peer sonic skipped: the shape has a shared expert (use its -routed twin)", file=sys.stderr)
        return None
    if sonic.version() is None:
        print("peer sonic skipped: sonicmoe does not import", file=sys.stderr)
        return None
    return sonic.pass_fn(inputs, pass_)


def torchao_fp8_pass_fn(inputs: dict, pass_: str):
    """TorchAO's FP8 rowwise grouped GEMM in mok's routed experts (bench.torchao_fp8) on shapes without a shared
    expert; None, with the reason printed, where it cannot run (no torchao, not sm_90, a shared expert)."""
    if inputs["w_shared_gate"] is not None:
        print(f"peer {torchao_fp8.NAME} skipped: the shape has a shared expert (use its -routed twin)", file=sys.stderr)
        return None
    reason = torchao_fp8.unavailable_reason(inputs["x"].device)
    if reason is not None:
        print(f"peer {torchao_fp8.NAME} skipped: {reason}", file=sys.stderr)
        return None
    return torchao_fp8.pass_fn(inputs, pass_)


class _MokCall:
    """mok.moe with the float inputs as autograd leaves (backend auto), in bench.timing.peer_pass's shape."""

    def __init__(self, inputs: dict):
        self.args = [a.clone().requires_grad_() if a is not None and a.is_floating_point() else a
                     for a in moe_args(inputs)]
        self.leaves = [a for a in self.args if a is not None and a.requires_grad]

    def __call__(self) -> torch.Tensor:
        return mok.moe(*self.args)

    def grads(self, out: torch.Tensor, d_out: torch.Tensor, retain_graph: bool = False):
        return torch.autograd.grad(out, self.leaves, d_out, retain_graph=retain_graph)


def mok_call_pass_fn(inputs: dict, pass_: str):
    return peer_pass(_MokCall(inputs), inputs["d_out"], pass_)


# name -> (the mok precision its rows stand beside, its rows' precision, the L0 precision of its err_vs_l0, pass_fn,
# its rows' note). A peer runs when its mok precision is benchmarked and `peers` names it.
PEERS = {
    "liger": ("bf16", "bf16", "bf16", liger_pass_fn,
              lambda: "LIGER_FUSED_MOE_AUTOTUNE=" + os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1")),
    "sonic": ("bf16", "bf16", "bf16", sonic_pass_fn, lambda: f"sonic-moe {sonic.version()}"),
    torchao_fp8.NAME: ("mxfp8", torchao_fp8.PRECISION, torchao_fp8.REF_PRECISION, torchao_fp8_pass_fn,
                       lambda: f"torchao {torchao_fp8.version()}, FP8 e4m3 rowwise scales (not MX blocks)"),
    "mok.moe": ("bf16", "bf16", "bf16", mok_call_pass_fn, lambda: "mok.moe, backend auto, autograd"),
}


def _forward_out(fn) -> torch.Tensor:
    """The forward output of a pass callable: a level's returns (out, saved), a peer's returns out."""
    out = fn()
    return out[0] if isinstance(out, tuple) else out


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
    l0_out = {}  # precision -> L0's forward output, the reference of every row's err_vs_l0

    def err_vs_l0(fwd, precision: str) -> float:
        """Σ|Δ|/Σ|ref| of a forward's output against L0's in the same precision (DESIGN §10)."""
        if precision not in l0_out:
            l0_out[precision] = get_level("reference").forward(*moe_args(inputs), precision=precision)[0]
        return rel_err(_forward_out(fwd), l0_out[precision])

    errors = {}  # (level, precision) -> err_vs_l0, once per shape

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
                    errors[level, precision] = err_vs_l0(level_pass_fn(level, inputs, precision, "fwd"), precision)
                # the Hopper levels' mxfp8 weight path (DEFAULT_MX_WEIGHTS): noted, and cached with --mx-weight-cache
                mx_path = getattr(get_level(level), "DEFAULT_MX_WEIGHTS", None) if precision == "mxfp8" else None
                cached = mx_weight_cache and mx_path is not None
                with mx_cache.mxfp8_weight_cache() if cached else contextlib.nullcontext():
                    # cached: time_ms's warm-up computes the weights' round trips, the timed runs reuse them
                    (ms, clock), mem, cache_gb = clocked(time_fn, fn, n), peak_mem_gb(fn), mx_cache.nbytes() / 1e9
                row(level, "mok", precision, pass_, ms, ceiling_ms, mem, clock, saved[level, precision])
                rows[-1]["err_vs_l0"] = errors[level, precision]
                if mx_path is not None:
                    rows[-1]["notes"] = f"mx_weights={mx_path}"
                    if cached:
                        rows[-1]["notes"] += "; mxfp8_weight_cache"
                        rows[-1]["mx_cache_gb"] = cache_gb
                del fn
            for peer, (beside, peer_precision, ref_precision, pass_fn, note) in PEERS.items():
                fn = pass_fn(inputs, pass_) if peer in peers and beside == precision else None
                if fn is None:
                    continue
                if peer not in errors:
                    errors[peer] = err_vs_l0(pass_fn(inputs, "fwd"), ref_precision)
                ms, clock = clocked(time_fn, fn, n)
                row(peer, "peer", peer_precision, pass_, ms, ceiling_ms, peak_mem_gb(fn), clock)
                rows[-1].update(notes=note(), err_vs_l0=errors[peer])
                del fn
    torch_ms = {(r["precision"], r["pass"]): r["time_ms"] for r in rows if r["level"] == "torch"}
    for r in rows:
        base = torch_ms.get((r["precision"], r["pass"])) or torch_ms.get(("bf16", r["pass"]))
        r["speedup_vs_torch"] = base / r["time_ms"] if base else float("nan")
    return rows


# --- the README table ----------------------------------------------------------------------------

def summary_markdown(df: pd.DataFrame, precision: str = "bf16") -> str:
    """TFLOP/s per shape × pass, one column per level/peer, plus each mok level's fraction of the ceiling:
    the table the README shows, regenerated by `python -m bench summary`."""
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


def headline_markdown(df: pd.DataFrame) -> str:
    """The README's headline: per shape and pass, the fused level's TFLOP/s beside SonicMoE, Liger, L1 and the ceiling
    (bf16, one run), then mok over the fastest of the others (MoK's measure) and the peak memory of both."""
    d = df[df.precision == "bf16"]
    who = {"cublas-dense": "ceiling", "fused": "mok", "sonic": "SonicMoE", "liger": "Liger", "torch": "L1"}
    t = d.pivot_table(index=["shape", "pass"], columns="level", values="tflops", sort=False)
    mem = d.pivot_table(index=["shape", "pass"], columns="level", values="peak_mem_gb", sort=False)
    cols = [c for c in who if c in t.columns]
    others = [c for c in ("sonic", "liger", "torch") if c in t.columns]
    lines = ["| shape | pass | " + " | ".join(f"{who[c]} TFLOP/s" for c in cols)
             + " | mok / fastest other | peak GB mok / it |", "|---" * (len(cols) + 4) + "|"]
    for (shape, pass_), r in t[cols].iterrows():
        best = r[others].astype(float).idxmax()
        ratio = f"{r['fused'] / r[best]:.2f}× {who[best]}"
        mems = f"{mem.loc[(shape, pass_), 'fused']:.1f} / {mem.loc[(shape, pass_), best]:.1f}"
        lines.append(f"| {shape} | {pass_} | " + " | ".join("" if pd.isna(v) else f"{v:.0f}" for v in r)
                     + f" | {ratio} | {mems} |")
    prov = d.iloc[0]
    lines.append(f"\n{prov.gpu}, torch {prov.torch}, CUDA {prov.cuda}, commit {prov.commit}, {prov.date}")
    return "\n".join(lines)


def samples_markdown(runs: dict[str, pd.DataFrame], level: str = "fused", precision: str = "bf16") -> str:
    """One level's fraction of the same-run ceiling per shape × pass in several runs (name -> rows), then the
    min / median / max over them: a run's machine moves both its ceiling and the level (docs/lab/log.md, "Samples
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
    p = argparse.ArgumentParser(prog="python -m bench moe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES), help="names from mok.config")
    p.add_argument("--levels", nargs="+", default=["torch"], help="mok levels (reference, torch, fused, megakernel)")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS),
                   help="peers to run when importable: liger and sonic beside the bf16 rows, torchao-fp8 beside mxfp8")
    p.add_argument("--iters", type=int, default=20, help="timed runs of a forward (half, ≥ 10, with backward)")
    p.add_argument("--mx-weight-cache", action="store_true",
                   help="time the fused level's mxfp8 rows inside mok.mxfp8_weight_cache(), warmed by the warm-up")
    add_timing_options(p)
    p.add_argument("--bound-block-m", type=int, default=fused.BLOCK_M,
                   help="with --levels fused: the tile each expert's rows are rounded up to in the `bound` rows")
    p.add_argument("--routing", default="random", choices=["random", "rounded"],
                   help="random: uniform draws, each expert's routes padded to the tile; rounded: the same draw with "
                        "every expert's routes rounded to the fused level's tile (routing.round_to_tiles)")
    p.add_argument("--out", type=Path, default=None,
                   help="CSV the rows merge into (default data/bench/moe.csv, moe_mx_cache.csv with "
                        "--mx-weight-cache, moe_rounded.csv with --routing rounded)")
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


def summary_main(argv=None) -> int:
    s = argparse.ArgumentParser(prog="python -m bench summary",
                                description="the README's table, in markdown; with several CSVs, the fused level's "
                                            "fraction of the ceiling in each run and over them")
    s.add_argument("csv", type=Path, nargs="*", default=[DATA / "moe.csv"])
    s.add_argument("--precision", default="bf16", choices=PRECISIONS)
    s.add_argument("--headline", action="store_true", help="the README's headline: mok beside SonicMoE and the rest")
    s.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES, help="with --headline: these passes")
    args = s.parse_args(argv)
    if args.headline:
        rows = pd.concat([read_rows(path) for path in args.csv])
        print(headline_markdown(rows[rows["pass"].isin(args.passes)]))
    elif len(args.csv) == 1:
        print(summary_markdown(read_rows(args.csv[0]), precision=args.precision))
    else:
        print(samples_markdown({path.stem: read_rows(path) for path in args.csv}, precision=args.precision))
    return 0


if __name__ == "__main__":
    sys.exit(main())
