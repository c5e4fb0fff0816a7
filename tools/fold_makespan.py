"""What folding short tails (MOK_GEMM_FOLD, docs/l2_fused.md "Tails folded into the previous tile") would do to the
end of the row-wise GEMMs (GEMM1, GEMM2 and both dgrads), counted on the CPU.

A model, not a measurement. Each task of the grouped row-wise order (csrc/include/mok/gemm/tasks.cuh,
decode_task: groups of 8 m-tiles, m fastest inside a group) costs 1. A task whose next m-tile is its expert's tail
of at most 32 routes costs `cost` (it folds that tail) and the tail's own task costs 0. The kernel ends with its
busiest CTA, so the model compares the largest sum over CTAs with the default's, for two ways of handing out tasks:
- `static`: CTA b runs tasks b, b + grid, ... (the default);
- `counter`: each next task goes to the CTA that frees first (MOK_GEMM_DYNAMIC).
It leaves out the L2 sharing that uneven tasks can lose, and what the tasks' bytes cost against their MMAs.

    python tools/fold_makespan.py [--costs 1.3 1.5 1.8] [--seed 0] [--shapes ...]
"""

from __future__ import annotations

import argparse
import heapq
import sys

import pandas as pd
import torch

from mok import routing
from mok.config import STANDARD_SHAPES, get_shape
from mok.schedule import make_schedule

BLOCK_M, GROUP_M, NUM_SMS, FOLD_ROWS = 128, 8, 132, 32


def task_order(num_m_tiles: int, num_n_tiles: int, group_m: int = GROUP_M) -> list[tuple[int, int]]:
    """(m_tile, n_tile) of tasks 0, 1, ... in the row-wise kinds' grouped order (decode_task)."""
    order = []
    for task in range(num_m_tiles * num_n_tiles):
        group_tasks = group_m * num_n_tiles
        m_first, in_group = task // group_tasks * group_m, task % group_tasks
        group = min(group_m, num_m_tiles - m_first)
        order.append((m_first + in_group % group, in_group // group))
    return order


def tails(tile_to_expert: list[int], tile_num_rows: list[int], fold_rows: int = FOLD_ROWS) -> list[bool]:
    """Per m-tile: whether it is a tail that would fold into the previous m-tile (a full one of the same expert; at
    most fold_rows routes): the kernel's is_short_tail."""
    return [m > 0 and tile_to_expert[m - 1] == tile_to_expert[m] and tile_num_rows[m - 1] == BLOCK_M
            and tile_num_rows[m] <= fold_rows for m in range(len(tile_to_expert))]


def makespan(costs: list[float], grid: int, counter: bool) -> float:
    """The largest sum of task costs over CTAs; tasks of cost 0 are not run."""
    if not counter:
        sums = [0.0] * grid
        for task, c in enumerate(costs):
            sums[task % grid] += c
        return max(sums)
    free = [(0.0, cta) for cta in range(grid)]  # (when it frees, CTA): ties to the lower CTA
    for c in costs:
        if c > 0:
            when, cta = heapq.heappop(free)
            heapq.heappush(free, (when + c, cta))
    return max(when for when, _ in free)


def fold_rows(cfg, costs=(1.3, 1.5, 1.8), seed: int = 0, grid: int = NUM_SMS) -> list[dict]:
    """One row per (row-wise GEMM, fold cost, order): the folded kernel's end over the default's, and the work's."""
    topk_idx, _ = routing.random_routing(cfg.num_tokens, cfg.num_experts, cfg.num_topk,
                                         generator=torch.Generator().manual_seed(seed))
    sched = make_schedule(topk_idx, cfg.num_experts, block_m=BLOCK_M)
    tail = tails(sched.tile_to_expert.tolist(), sched.tile_num_rows.tolist())
    num_m = len(tail)
    rows = []
    for gemm, n, task_n in (("gemm1", cfg.intermediate, 128), ("gemm2", cfg.hidden, 256),
                            ("down_dgrad", cfg.intermediate, 256), ("gate_up_dgrad", cfg.hidden, 256)):
        order = task_order(num_m, -(-n // task_n))
        tasks_grid = min(grid, len(order))
        for cost in costs:
            folded = [0.0 if tail[m] else cost if m + 1 < num_m and tail[m + 1] else 1.0 for m, _ in order]
            for counter in (False, True):
                rows.append({"shape": cfg.name, "gemm": gemm, "m_tiles": num_m, "tails": sum(tail), "cost": cost,
                             "order": "counter" if counter else "static",
                             "end_ratio": makespan(folded, tasks_grid, counter)
                             / makespan([1.0] * len(order), tasks_grid, counter),
                             "work_ratio": sum(folded) / len(order)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--costs", type=float, nargs="+", default=[1.3, 1.5, 1.8])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shapes", nargs="+", default=list(STANDARD_SHAPES))
    args = p.parse_args(argv)
    df = pd.DataFrame([r for s in args.shapes for r in fold_rows(get_shape(s), tuple(args.costs), args.seed)])
    table = df.pivot_table(index=["shape", "gemm", "cost"], columns="order", values="end_ratio")
    table["work"] = df.groupby(["shape", "gemm", "cost"])["work_ratio"].first()
    print(table.round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
