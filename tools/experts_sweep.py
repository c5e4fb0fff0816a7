"""What do the routed experts themselves cost the fused level, apart from their padding? `bench parts` on a shape
with its own random routing, then with every expert given the same routes (routing.balanced_routing: no padding
where E divides T·K into 128-row segments, as at qwen3-30b, dsv4pro and qwen3-235b; kimi-k2's keeps 12.5%) at the
shape's expert count and at fewer experts. The summary's `pad` column says how much padding each variant kept.

The ceiling and the `bound` multiply one weight matrix; an MoE reads E of them and shares each across only its
expert's m-tiles. Balanced at the shape's E, a GEMM's frac_of_executed is the kernel against cuBLAS with the
padding gone; at E = K (the fewest experts a token's K distinct routes allow) the experts' weights nearly fit in L2,
and what is left is the kernel against cuBLAS on a near-dense problem (docs/l2_fused_log.md, "What the experts cost,
apart from their padding").

    python tools/experts_sweep.py [--shapes qwen3-30b-a3b dsv4pro-rank] [--experts [8 32]]
    (device step `experts`; rows to $OUT/experts_sweep.csv when OUT is set: `bench parts`' columns and
    num_experts, routing)
"""

from __future__ import annotations

import argparse
import os
import sys

import pandas as pd
import torch

from mok import bench, bench_parts
from mok.config import get_shape
from mok.testing import routing_of

GEMMS = ["gemm1", "gemm2", "dgrad_swiglu", "dgrad_gate_up", "wgrad_gate", "wgrad_up", "wgrad_down"]


def variants(name: str, experts: list[int] | None) -> list[tuple]:
    """(config, routing) to run for a shape: its own random routing, balanced at its E, then balanced at each of
    `experts` (None: K and 4·K, the counts below E that keep the segments padding-free at the standard shapes)."""
    cfg = get_shape(name)
    counts = experts if experts is not None else [c for c in (cfg.num_topk, 4 * cfg.num_topk) if c < cfg.num_experts]
    return [(cfg, "random"), (cfg, "balanced")] + [(cfg.scaled(num_experts=e), "balanced") for e in counts]


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per variant: the padding (gemm1's padded FLOPs over its real ones, minus 1), each GEMM's frac_of_executed
    (against cuBLAS on the same rows, one weight matrix), each pass's fraction of the ceiling and of the bound."""
    key = ["shape", "num_experts", "routing"]
    steps = df.pivot_table(index=key, columns="step", values="frac_of_executed", sort=False)
    gemm1 = df[df["step"] == "gemm1"].set_index(key)
    out = pd.DataFrame({"pad": gemm1["padded_flops"] / gemm1["flops"] - 1})
    out = out.join(steps[[c for c in GEMMS if c in steps]])
    for pass_ in ("fwd", "bwd"):
        whole = df[df["step"] == f"whole_{pass_}"].set_index(key)
        out[f"{pass_}/ceiling"] = whole["frac_of_ceiling"]
        out[f"{pass_}/bound"] = whole["frac_of_executed"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "dsv4pro-rank"])
    p.add_argument("--experts", nargs="*", type=int, help="balanced expert counts besides the shape's own "
                   "(default: K and 4·K; none: the shape's own E only)")
    p.add_argument("--iters", type=int, default=20)
    bench.add_timing_options(p)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    time_fn, method = bench.timing_of(args)  # `bench parts`' method of record unless asked otherwise
    rows = []
    for name in args.shapes:
        for cfg, routing in variants(name, args.experts):
            rows += [{**r, **method, "num_experts": cfg.num_experts, "routing": routing}
                     for r in bench_parts.bench_parts_shape(cfg, args.iters, device, time_fn,
                                                            routing_fn=routing_of(routing))]
            print(f"{name} E={cfg.num_experts} {routing}: done", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    print(summary(df).to_string(float_format=lambda v: f"{v:.3f}"))
    if os.environ.get("OUT"):
        df.to_csv(os.path.join(os.environ["OUT"], "experts_sweep.csv"), index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
