"""What rounding the routes to the tile costs the router (`python -m bench route`).

Per shape, on the GPU when there is one: the time of `routing.softmax_topk` on random logits [T, E], plain and with
`tile=` (mok.routing.round_to_tiles; docs/routing.md), the rounding alone in mok's kernels (`round_kernel_ms`,
mok.ops.route_round_to_tiles) and in PyTorch ops (`round_twin_ms`, device_rounds=False: a sync a round; on a CPU
both columns time the twins), the kernels' rounding replayed from a CUDA graph (`round_graph_ms`, its GPU time
without the host's time per op; a GPU only, as a training step captured in a graph runs it), and
the share of routes the rounding moves. Times are medians of `--iters` calls after 3 warm-up calls (time_ms,
no sustained warm-up: the router is host-bound, not under the power cap). One row per (shape, tile) →
data/bench/route.csv, with provenance; compare `round_ms` with the layer's forward in data/bench/moe_rounded*.csv.

    python -m bench route [--shapes ...] [--tile 128] [--iters 10] [--out data/bench/route.csv]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

from bench.timing import DATA, graph_time_ms, provenance, sweep, time_ms
from mok import rounding, routing
from mok.config import STANDARD_SHAPES, MoEConfig
from mok.ops.gemm import GEMM_BLOCK_M

KEY = ["shape", "tile", "gpu"]


def route_rows(cfg: MoEConfig, tile: int, iters: int, device, seed: int = 0) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(cfg.num_tokens, cfg.num_experts, generator=g, device=device)  # [T, E]
    k = cfg.num_topk
    plain_ms = time_ms(lambda: routing.softmax_topk(logits, k), iters)
    rounded_ms = time_ms(lambda: routing.softmax_topk(logits, k, tile=tile), iters)
    plain, rounded = routing.softmax_topk(logits, k)[0], routing.softmax_topk(logits, k, tile=tile)[0]
    probs = logits.float().softmax(dim=-1)  # [T, E]: what softmax_topk rounds on
    # the routers' path (no range check of their own topk_idx: on a GPU no host read with the kernels)
    round_kernel_ms, round_twin_ms = (time_ms(lambda rounds=rounds: rounding._round_to_tiles(plain, probs, tile,
                                                                                                rounds), iters)
                                      for rounds in (True, False))
    round_graph_ms = (graph_time_ms([lambda: rounding._round_to_tiles(plain, probs, tile)], 5, iters)
                      if plain.is_cuda else float("nan"))
    moved = routing.moved_routes(plain, rounded)  # [T, K]
    return [{"shape": cfg.name, "tile": tile, "num_tokens": cfg.num_tokens, "num_experts": cfg.num_experts,
             "num_topk": k, "plain_ms": plain_ms, "rounded_ms": rounded_ms, "round_ms": rounded_ms - plain_ms,
             "round_kernel_ms": round_kernel_ms, "round_twin_ms": round_twin_ms, "round_graph_ms": round_graph_ms,
             "routes_moved_pct": 100 * float(moved.float().mean()), "iters": iters, **provenance()}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench route", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES), help="names from mok.config")
    p.add_argument("--tile", type=int, default=GEMM_BLOCK_M, help="the tile the routes are rounded to")
    p.add_argument("--iters", type=int, default=10, help="timed calls per median")
    p.add_argument("--out", type=Path, default=DATA / "route.csv")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = sweep(args.shapes, lambda cfg: route_rows(cfg, args.tile, args.iters, device), args.out, KEY)
    cols = ["shape", "tile", "plain_ms", "rounded_ms", "round_ms", "round_kernel_ms", "round_twin_ms",
            "round_graph_ms", "routes_moved_pct"]
    print(pd.DataFrame(rows)[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
