"""Notebook 03's megakernel section: a model of the forward of a `mok.ep_plan` plan on a persistent grid of CTAs
(each task's time from its FLOPs or bytes; not a measurement) and the figures of its task graph and its grid.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from plots import goal_line, label, value_ticks

from mok.checks import fail
from mok.comm import bytes_per_row

# ---- a model of its forward on a persistent grid ------------------------------------------------------------------

def task_cost_ns(plan, rank: int, task, *, flops_per_ns: float, bytes_per_ns: float, notify_ns: float) -> float:
    """Model of one forward task's time on one CTA (ns): a GEMM tile its FLOPs (every BLOCK_M row, padding too) at
    flops_per_ns, a pull or a combine the BF16 rows it moves at bytes_per_ns, a notify notify_ns (it moves no data)."""
    rp, bm, row = plan.ranks[rank], plan.block_m, bytes_per_row(plan.hidden, "bf16")

    def width(size):  # the columns of output tile n
        return min(plan.block_n, size - task.n * plan.block_n)

    def tokens(c):  # real tokens of token tile c
        return min(bm, rp.num_tokens - c * bm)

    gemm = {"gate_up": 2 * 2 * bm * plan.hidden * width(plan.intermediate) if task.n >= 0 else 0,  # gate and up
            "shared_gate_up": 2 * 2 * bm * plan.hidden * width(plan.shared_intermediate) if task.n >= 0 else 0,
            "down": 2 * bm * plan.intermediate * width(plan.hidden) if task.n >= 0 else 0,
            "shared_down": 2 * bm * plan.shared_intermediate * width(plan.hidden) if task.n >= 0 else 0}
    if task.kind in gemm:
        return gemm[task.kind] / flops_per_ns
    if task.kind == "pull_x":  # the tile's real rows
        return int(rp.tile_num_rows[task.m]) * row / bytes_per_ns
    if task.kind == "combine":  # K routed rows per token, and the shared expert's
        return tokens(task.m) * (plan.num_topk + (plan.shared_intermediate > 0)) * row / bytes_per_ns
    if task.kind == "notify_y":
        return notify_ns
    fail("task.kind", "a forward kind of mok.ep_plan.PHASES", task.kind)


def simulate_grid(plan, pass_: str, grid: int, cost) -> pd.DataFrame:
    """Every rank a persistent grid of `grid` CTAs: a free CTA takes its rank's next ticket, holds it until the
    task's counter reaches its target (seen the moment the last producer ends), then runs it for cost(rank, task)
    ns. Tidy rows, one per task: rank, cta, ticket, kind, phase, take_ns, start_ns, end_ns (the CTA waits on the
    counter from take to start). Raises RuntimeError on a deadlock."""
    tasks = [rp.tasks[pass_] for rp in plan.ranks]
    counts = [[0] * len(rp.targets[pass_]) for rp in plan.ranks]
    free = [list(range(grid)) for _ in tasks]  # idle CTAs of each rank
    next_ticket, held, running, rows, now = [0] * len(tasks), [], [], [], 0.0  # held: [rank, cta, ticket, take]
    while len(rows) < sum(map(len, tasks)):
        for r, ts in enumerate(tasks):
            while free[r] and next_ticket[r] < len(ts):
                held.append((r, free[r].pop(0), next_ticket[r], now))
                next_ticket[r] += 1
        for h in [h for h in held if tasks[h[0]][h[2]].wait < 0 or counts[h[0]][tasks[h[0]][h[2]].wait]
                  >= plan.ranks[h[0]].targets[pass_][tasks[h[0]][h[2]].wait]]:
            held.remove(h)
            running.append((now + cost(h[0], tasks[h[0]][h[2]]), *h, now))
        if not running:
            raise RuntimeError(f"{pass_} deadlock with grid={grid} at {now:.1f} ns: {len(held)} CTAs wait")
        now = min(run[0] for run in running)
        for run in sorted(run for run in running if run[0] == now):
            end, r, cta, i, take, start = run
            running.remove(run)
            free[r] = sorted(free[r] + [cta])
            for rank, c in tasks[r][i].signals:
                counts[rank][c] += 1
            rows.append({"rank": r, "cta": cta, "ticket": i, "kind": tasks[r][i].kind, "phase": tasks[r][i].phase,
                         "take_ns": take, "start_ns": start, "end_ns": end})
    return pd.DataFrame(rows)


def critical_path_ns(plan, pass_: str, cost, order) -> float:
    """The longest chain of producer → consumer through the pass (ns): no grid finishes sooner. order: a
    topological order of (rank, ticket), e.g. mok.ep_plan.task_order(plan, pass_, grid=None)."""
    tasks = [rp.tasks[pass_] for rp in plan.ranks]
    ready = {}  # (rank, counter) -> time its last producer so far ends
    end = 0.0
    for r, i in order:
        t = tasks[r][i]
        done = ready.get((r, t.wait), 0.0) + cost(r, t)
        for rank, c in t.signals:
            ready[(rank, c)] = max(ready.get((rank, c), 0.0), done)
        end = max(end, done)
    return end


def overlap_share(runs: pd.DataFrame, kinds_a, kinds_b) -> float:
    """Share of the time some CTA of a rank runs a task of kinds_a while another CTA of the same rank runs one of
    kinds_b (e.g. pulls against GEMM tiles), over all ranks."""
    def union(df):  # merged [start, end) intervals
        out = []
        for s, e in sorted(zip(df.start_ns, df.end_ns)):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    both = total = 0.0
    for _, g in runs.groupby("rank"):
        a, b = union(g[g.kind.isin(kinds_a)]), union(g[g.kind.isin(kinds_b)])
        total += sum(e - s for s, e in a)
        both += sum(max(0.0, min(e, f) - max(s, t)) for s, e in a for t, f in b)
    return both / total if total else 0.0


# ---- drawing: the task graph and the grid ---------------------------------------------------------------------------

TASK_COLORS = ("#0173b2", "#029e73", "#cc78bc", "#de8f05")  # forward phases 0-3: pull, gate/up, down, combine
CROSS_RANK = "#d55e00"
_COLUMN = {"pull_x": 0, "shared_gate_up": 1, "gate_up": 1, "shared_down": 2, "down": 2, "notify_y": 3, "combine": 5}
_KIND_NOTE = {"pull_x": "pull_x (dispatch)", "gate_up": "gate_up + SwiGLU"}


def _task_color(task) -> tuple:
    """Its phase's colour; the shared expert's mixed half with white."""
    rgb = np.array(plt.matplotlib.colors.to_rgb(TASK_COLORS[task.phase]))
    return tuple(0.5 * rgb + 0.5) if task.kind.startswith("shared") else tuple(rgb)


def _task_legend(ax, tasks, extra, **kw):
    """Phase colours named by their routed kinds (in ticket order), the shared expert's shade, then extra
    [(handle, label)]."""
    kinds = {}  # phase -> {kind: None}
    for t in tasks:
        if not t.kind.startswith("shared"):
            kinds.setdefault(t.phase, {})[t.kind] = None
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in TASK_COLORS]
    labels = [f"phase {p}: {', '.join(_KIND_NOTE.get(k, k) for k in kinds.get(p, ()))}"
              for p in range(len(TASK_COLORS))]
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="0.8"))
    labels.append("lighter: shared expert (no remote rows)")
    for h, text in extra:
        handles.append(h)
        labels.append(text)
    return ax.legend(handles, labels, fontsize=8, **kw)


def _task_places(plan) -> dict:
    """(rank, ticket) -> (x, y) of the forward's boxes: a column per step, a block of slots per row tile m (routed
    kinds) or token tile c (shared expert, combine), the n tiles stacked in the block's slots."""
    slots = max(plan.tiles(plan.intermediate), plan.tiles(plan.hidden), plan.tiles(plan.shared_intermediate), 1)
    places, y0 = {}, 0.0
    for r, rp in enumerate(plan.ranks):
        for i, t in enumerate(rp.tasks["forward"]):
            block = t.m if t.kind in ("pull_x", "gate_up", "down", "notify_y") else rp.num_tiles + t.m
            slot = t.n if t.n >= 0 else (slots - 1) / 2
            places[r, i] = (1.7 * _COLUMN[t.kind], y0 + block * (slots + 0.6) + slot)
        y0 += (rp.num_tiles + plan.token_tiles(r)) * (slots + 0.6) + 1.6
    return places


def task_graph(plan, *, title: str, figsize=(10.4, 9.0)):
    """The forward's tasks of every rank as boxes (numbered by ticket, coloured by phase, the shared expert's
    lighter), and an arrow from each producer to each consumer of a counter; arrows between ranks dashed."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    places, tasks = _task_places(plan), [rp.tasks["forward"] for rp in plan.ranks]
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    producers = {}  # (rank, counter) -> [(rank, ticket)]
    for r, ts in enumerate(tasks):
        for i, t in enumerate(ts):
            for rank, c in t.signals:
                producers.setdefault((rank, c), []).append((r, i))
    for (r, i), (x, y) in places.items():
        t = tasks[r][i]
        shared = t.kind.startswith("shared")  # lighter: dark text
        ax.add_patch(Rectangle((x - 0.45, y - 0.42), 0.9, 0.84, facecolor=_task_color(t), edgecolor="white", lw=0.5,
                               zorder=3))
        ax.text(x, y, str(i), ha="center", va="center", fontsize=7, color="black" if shared else "white",
                fontweight="bold", zorder=4)
        for pr, pi in producers.get((r, t.wait), ()) if t.wait >= 0 else ():
            px, py = places[pr, pi]
            cross = pr != r
            ax.add_patch(FancyArrowPatch((px + 0.46, py), (x - 0.46, y), arrowstyle="-|>", mutation_scale=7,
                                         color=CROSS_RANK if cross else "0.55", lw=1.1 if cross else 0.6,
                                         ls="--" if cross else "-", zorder=2 if cross else 1))
    heads = {0: "pull_x (m)", 1: "gate_up (m, n)\nshared_gate_up (c, n)", 2: "down (m, n)\nshared_down (c, n)",
             3: "notify_y (m)", 5: "combine (c)"}
    ax.set_xticks([1.7 * j for j in heads], list(heads.values()), fontsize=8)
    ax.xaxis.tick_top()
    ticks, names = [], []
    for r, rp in enumerate(plan.ranks):
        for m, e in enumerate(rp.tile_to_expert.tolist()):
            rows = int(rp.tile_num_rows[m])
            ticks.append(places[r, m][1])  # pull_x(m) is ticket m
            names.append(f"rank {r} · m{m}: e{e}, {rows} row{'s' if rows > 1 else ''}")
        for i, t in enumerate(tasks[r]):
            if t.kind == "combine":
                last = min((t.m + 1) * plan.block_m, rp.num_tokens) - 1
                ticks.append(places[r, i][1])
                names.append(f"rank {r} · c{t.m}: tokens {t.m * plan.block_m}–{last}")
    ax.set_yticks(ticks, names, fontsize=7.5)
    ax.set(xlim=(-0.6, 1.7 * max(_COLUMN.values()) + 0.6), ylim=(max(y for _, y in places.values()) + 0.8, -0.8))
    ax.grid(False)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    _task_legend(ax, tasks[0], [(plt.Line2D([], [], color="0.55", lw=0.8), "counter: producer → consumer"),
                                (plt.Line2D([], [], color=CROSS_RANK, ls="--", lw=1.1), "… on another rank (NVLink)")],
                 loc="upper center", bbox_to_anchor=(0.5, 0), ncol=3,
                 title="box = task, number = its ticket (the order its rank's CTAs take it)")
    ax.set_title(title)
    return fig


def cta_gantt(ax, runs: pd.DataFrame, *, title: str):
    """One bar per task on its (rank, CTA) row, coloured by phase (the shared expert's lighter); a black line where
    the CTA holds a ticket whose counter has not reached its target."""
    rows = sorted(set(zip(runs["rank"], runs["cta"])))
    for t in runs.itertuples():
        y = rows.index((t.rank, t.cta))
        ax.barh(y, t.end_ns - t.start_ns, left=t.start_ns, height=0.7, color=_task_color(t), edgecolor="white",
                lw=0.4, zorder=2)
        if t.start_ns > t.take_ns:
            ax.plot([t.take_ns, t.start_ns], [y, y], color="black", lw=2, solid_capstyle="butt", zorder=3)
    end = runs.end_ns.max()
    ax.axvline(end, color="black", lw=1, ls="--")
    ax.text(end, -0.45, f" {end:.0f} ns", va="bottom", fontsize=8)
    ax.set_yticks(range(len(rows)), [f"rank {r} · CTA {c}" for r, c in rows], fontsize=7.5)
    ax.set_ylim(len(rows) - 0.5, -0.8)
    ax.set_xlim(0, 1.08 * end)
    ax.set_title(title, fontsize=10, loc="left")
    return ax


def grid_timeline(plan, runs: dict, show: int, critical_ns: float, *, title: str, title_b: str, figsize=(10.2, 6.4)):
    """(a) the grid of 1 CTA per rank and (b) of `show` CTAs (title_b) as Gantt charts (simulated rows of
    timeline.simulate_grid, per grid size in runs), (c) the makespan against the grid, the critical path its floor."""
    fig = plt.figure(figsize=figsize, layout="constrained")
    gs = fig.add_gridspec(2, 2, width_ratios=[2.5, 1], height_ratios=[1, 2 + 0.25 * show])
    a, b, c = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[1, 0]), fig.add_subplot(gs[:, 1])
    cta_gantt(a, runs[1], title="(a) grid = 1 CTA per rank: one task at a time, in ticket order, and it completes")
    cta_gantt(b, runs[show], title=title_b)
    a.set_xlabel("time (ns, model)", fontsize=9)
    b.set_xlabel("time (ns, model)")
    grids = sorted(runs)
    span = [runs[g].end_ns.max() for g in grids]
    c.plot(grids, span, marker="o", color="0.2")
    c.set_xscale("log", base=2)
    value_ticks(c, grids)
    goal_line(c, critical_ns, f"critical path: {critical_ns:.0f} ns", x=0.03, ha="left", va="top")
    c.set_ylim(0, 1.05 * max(span))
    label(c, "(c) time against the grid", "CTAs per rank (grid)", "forward time (ns, model)")
    _task_legend(fig, plan.ranks[0].tasks["forward"],
                 [(plt.Line2D([], [], color="black", lw=2), "a CTA waits on its task's counter")],
                 loc="outside lower center", ncol=4)
    fig.suptitle(title, fontweight="bold")
    return fig
