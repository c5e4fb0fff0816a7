"""The megakernel's tables (mok.ep_tables) of one rank and pass, built with tensor ops from the gathered routing: what
a rank computes every step, on its GPU, where mok.ep_plan's Python builds task by task (0.9 s at dsv4pro × 8). The
same tables as plan_tables(make_ep_plan(...), rank, pass_), table by table (tests/test_ep_build.py).

Every task kind is a regular grid (row tiles m, token tiles c, output tiles n, experts), every counter id its family's
base plus an index (mok.ep_plan.COUNTERS), and every target a count: the only data-dependent lists are the rows
(the single-GPU schedule cut at the owners' experts) and the feeds, which combine tiles each row tile feeds, one
`unique` over the routes. Loops run over ranks and kinds, never over rows, tokens, tiles or tasks. Tensors stay on
topk_idx's device; the host reads the R + 1 row offsets (each rank's table sizes).
"""

from __future__ import annotations

import torch

from mok.checks import check_int, check_topk_idx, fail
from mok.ep_plan import PHASE_OF, PHASES, counter_bases, expert_ranges, rank_rows, route_tiles, split_of
from mok.ep_tables import DIMS, TABLES, TASK_KINDS
from mok.schedule import make_schedule

__all__ = ["build_tables"]


class _Tasks:
    """A rank's task list, block by block in ticket order: per task (kind, m, n, e, w, wait) and its signals."""

    def __init__(self, rank: int, device):
        self.rank, self.device, self.blocks, self.signals = rank, device, [], []

    def add(self, kind: str, m, n=-1, e=-1, w=-1, wait=-1, signals=(), counts=None):
        """Tasks of one kind: m a tensor [L], the other fields tensors [L] or ints; signals: (rank, counter) tensors
        [L] each, every task signalling each pair once in the order given; or, with counts [L], one flat pair of
        tensors in task order, counts[i] of them task i's."""
        full = lambda v: v if isinstance(v, torch.Tensor) else torch.full_like(m, v)  # noqa: E731
        fields = [torch.full_like(m, TASK_KINDS.index(kind)), full(m), full(n), full(e), full(w), full(wait)]
        self.blocks.append(torch.stack(fields, 1) if m.numel() else m.new_zeros(0, 6))
        if counts is None:
            ranks = [full(r) for r, _ in signals]
            ctrs = [full(c) for _, c in signals]
            counts = torch.full_like(m, len(signals))
            signals = (torch.stack(ranks, 1).flatten(), torch.stack(ctrs, 1).flatten()) if signals else None
        self.signals.append((counts, signals))

    def tables(self, counter_target: torch.Tensor) -> dict:
        t = torch.cat(self.blocks)  # [num_tasks, 6]
        kind, wait = t[:, 0], t[:, 5]
        phase = torch.tensor([PHASE_OF[k] for k in TASK_KINDS], device=self.device)[kind]
        counts = torch.cat([c for c, _ in self.signals])
        pairs = [s for _, s in self.signals if s is not None]
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        return {"task_kind": kind, "task_phase": phase, "task_m": t[:, 1], "task_n": t[:, 2], "task_expert": t[:, 3],
                "task_which": t[:, 4], "task_wait": wait,
                "task_target": torch.where(wait >= 0, counter_target[wait.clamp(min=0)], 0),
                "task_signal_offsets": torch.cat([counts.new_zeros(1), counts.cumsum(0)]),
                "signal_rank": torch.cat([r for r, _ in pairs]) if pairs else empty,
                "signal_counter": torch.cat([c for _, c in pairs]) if pairs else empty}


def _grid(a: int, b: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j) over [0, a) × [0, b), i-major: the order of two nested loops."""
    i = torch.arange(a, device=device).repeat_interleave(b)
    return i, torch.arange(b, device=device).repeat(a)


def _tiles_then_notify(tasks: _Tasks, kind: str, notify: str, m_count: int, n_count: int, expert, wait_tile,
                       signal_tile, wait_notify, feeds: tuple) -> None:
    """For each row tile m: n_count tasks of `kind` (tile n, expert[m], waiting on wait_tile + m, signalling
    signal_tile + m on this rank), then one `notify` waiting on wait_notify + m and signalling its feeds, tensors
    (row tile, rank, counter) sorted by row tile: the plan's interleaved loop, as one block."""
    per = n_count + 1
    m, slot = _grid(m_count, per, tasks.device)
    is_notify = slot == n_count
    f_m, f_rank, f_ctr = feeds
    counts = torch.where(is_notify, torch.bincount(f_m, minlength=m_count)[m], 1)
    own = ~is_notify
    task_of = torch.cat([(m * per + slot)[own], f_m * per + n_count])  # each signal's task, in a stable sort
    order = torch.sort(task_of, stable=True).indices
    rank = torch.cat([torch.full_like(m[own], tasks.rank), f_rank])[order]
    ctr = torch.cat([signal_tile + m[own], f_ctr])[order]
    tasks.add(kind, m, torch.where(is_notify, -1, slot), torch.where(is_notify, -1, expert[m]), -1,
              torch.where(is_notify, wait_notify + m, wait_tile + m), counts=counts, signals=(rank, ctr))
    tasks.blocks[-1][is_notify, 0] = TASK_KINDS.index(notify)


def build_tables(topk_idx: torch.Tensor, tokens_per_rank: list[int], num_experts: int, rank: int, pass_: str, *,
                 hidden: int, intermediate: int, shared_intermediate: int = 0, block_m: int = 128,
                 block_n: int = 128, sched=None) -> dict[str, torch.Tensor]:
    """plan_tables(make_ep_plan(topk_idx, tokens_per_rank, num_experts, ...), rank, pass_), by tensor ops on
    topk_idx's device. sched: the single-GPU schedule of topk_idx with tiles of block_m (mok.ops.make_schedule_cuda
    on a GPU), or None: mok.schedule.make_schedule."""
    if pass_ not in PHASES:
        fail("pass_", f"one of {tuple(PHASES)}", repr(pass_))
    check_topk_idx(topk_idx, num_experts)
    if not isinstance(tokens_per_rank, (list, tuple)) or sum(tokens_per_rank) != topk_idx.shape[0]:
        fail("tokens_per_rank", f"a list of token counts summing to num_tokens={topk_idx.shape[0]}", tokens_per_rank)
    R = len(tokens_per_rank)
    check_int("rank", rank, 0, R - 1)
    dev, K, E, bm = topk_idx.device, topk_idx.shape[1], num_experts, block_m
    sched = make_schedule(topk_idx, E, bm) if sched is None else sched
    if sched.block_m != bm:
        fail("sched", f"a schedule with tiles of block_m={bm}", f"block_m={sched.block_m}")
    tiles = lambda size: -(-size // block_n)  # noqa: E731
    n_i, n_h, n_s = tiles(intermediate), tiles(hidden), tiles(shared_intermediate)
    experts = expert_ranges(E, R)
    split = split_of(sched, tokens_per_rank, dev)
    rows_at = split.row_offsets.tolist()  # the host's one read: every rank's row count
    num_tiles = [(b - a) // bm for a, b in zip(rows_at, rows_at[1:])]
    token_tiles = [-(-t // bm) for t in tokens_per_rank]
    bases = [counter_bases(pass_, num_tiles[s], token_tiles[s], len(experts[s])) for s in range(R)]

    # the feeds: each route's (owner, its row tile) feeds (home, its token tile); distinct pairs, as 1-D keys
    o, m_of, h, c_of = route_tiles(sched, split, K)
    m_span, c_span = max(num_tiles) + 1, max(token_tiles) + 1
    mine = ((m_of * R + h) * c_span + c_of)[o == rank].unique()  # sorted: by row tile, then home, then token tile
    f_m, f_h, f_c = mine // (R * c_span), mine // c_span % R, mine % c_span
    family = "y_ready" if pass_ == "forward" else "dx_ready"
    feed_base = torch.tensor([b[family] for b in bases], device=dev, dtype=torch.int64)
    feeds = (f_m, f_h, feed_base[f_h] + f_c)
    feeding = ((o * m_span + m_of) * c_span + c_of)[h == rank].unique()  # the row tiles feeding this rank's tiles
    fed = torch.bincount(feeding % c_span, minlength=token_tiles[rank])  # [C]: notifies per token tile

    lo, hi = rows_at[rank], rows_at[rank + 1]
    M, C, E_r, b = num_tiles[rank], token_tiles[rank], len(experts[rank]), bases[rank]
    expert = sched.tile_to_expert.to(dev)[lo // bm: hi // bm] - experts[rank].start  # [M] local expert of each tile
    ar = lambda count: torch.arange(count, device=dev)  # noqa: E731
    tasks = _Tasks(rank, dev)
    target = torch.zeros(b["total"], dtype=torch.int64, device=dev)

    def set_target(name: str, values, count: int):
        target[b[name]: b[name] + count] = values

    shared_ranks = sorted({j % R for j in range(2 * n_s + n_h)}) if n_s else []  # ranks holding shared wgrad tiles
    if pass_ == "forward":
        tasks.add("pull_x", ar(M), signals=[(rank, b["x_ready"] + ar(M))])
        c, n = _grid(C, n_s, dev)
        tasks.add("shared_gate_up", c, n, signals=[(rank, b["shared_h_ready"] + c)])
        m, n = _grid(M, n_i, dev)
        tasks.add("gate_up", m, n, expert[m], wait=b["x_ready"] + m, signals=[(rank, b["h_ready"] + m)])
        c, n = _grid(C if n_s else 0, n_h, dev)
        tasks.add("shared_down", c, n, wait=b["shared_h_ready"] + c, signals=[(rank, b["y_ready"] + c)])
        _tiles_then_notify(tasks, "down", "notify_y", M, n_h, expert, b["h_ready"], b["y_done"], b["y_done"], feeds)
        tasks.add("combine", ar(C), wait=b["y_ready"] + ar(C))
        for name, value, count in (("x_ready", 1, M), ("shared_h_ready", n_s, C), ("h_ready", n_i, M),
                                   ("y_ready", (n_h if n_s else 0) + fed, C), ("y_done", n_h, M)):
            set_target(name, value, count)
    else:
        tasks.add("pull_dy", ar(M), signals=[(rank, b["dy_ready"] + ar(M))])
        c, n = _grid(C, n_s, dev)
        tasks.add("shared_dgrad_down", c, n, signals=[(rank, b["shared_dgate_ready"] + c)] +
                  [(s, bases[s]["shared_wgrad_ready"]) for s in shared_ranks])
        m, n = _grid(M, n_i, dev)
        tasks.add("dgrad_down", m, n, expert[m], wait=b["dy_ready"] + m,
                  signals=[(rank, b["dgate_ready"] + m), (rank, b["wgrad_ready"] + expert[m])])
        c, n = _grid(C if n_s else 0, n_h, dev)
        tasks.add("shared_dgrad_gate_up", c, n, wait=b["shared_dgate_ready"] + c, signals=[(rank, b["dx_ready"] + c)])
        _tiles_then_notify(tasks, "dgrad_gate_up", "notify_dx", M, n_h, expert, b["dgate_ready"], b["dx_done"],
                           b["dx_done"], feeds)
        which = torch.cat([torch.full((n_i,), 0), torch.full((n_i,), 1), torch.full((n_h,), 2)]).to(dev)
        n_of = torch.cat([ar(n_i), ar(n_i), ar(n_h)])
        e, j = _grid(E_r, which.numel(), dev)
        tasks.add("wgrad", torch.full_like(e, -1), n_of[j], e, which[j], wait=b["wgrad_ready"] + e)
        sw = _shared_wgrad_tiles(n_s, n_h, R, dev)  # [tiles, 3]: which, n, rank
        own = sw[sw[:, 2] == rank]
        tasks.add("shared_wgrad", torch.full_like(own[:, 0], -1), own[:, 1], -1, own[:, 0],
                  wait=b["shared_wgrad_ready"])
        tasks.add("combine_dx", ar(C), wait=b["dx_ready"] + ar(C))
        for name, value, count in (
                ("dy_ready", 1, M), ("shared_dgate_ready", n_s, C),
                ("shared_wgrad_ready", sum(token_tiles) * n_s if rank in shared_ranks else 0, 1),
                ("dgate_ready", n_i, M), ("wgrad_ready", torch.bincount(expert, minlength=E_r) * n_i, E_r),
                ("dx_ready", (n_h if n_s else 0) + fed, C), ("dx_done", n_h, M)):
            set_target(name, value, count)

    rows = rank_rows(sched, topk_idx, split, rank)  # row_to_route, pull_rank/token, combine_rank/row
    route = rows["row_to_route"]  # [rows_r]
    tab = {**tasks.tables(target), "counter_target": target, **rows,
           "tile_num_rows": sched.tile_num_rows.to(dev)[lo // bm: hi // bm],
           "pull_k": torch.where(route >= 0, route % K, -1),
           "expert_offsets": sched.expert_offsets.to(dev)[experts[rank].start: experts[rank].stop + 1] - lo,
           "tokens_per_expert": sched.tokens_per_expert.to(dev)[experts[rank].start: experts[rank].stop],
           "tokens_per_rank": split.token_offsets.diff(), "shared_wgrad_tiles": _shared_wgrad_tiles(n_s, n_h, R, dev)}
    dims = {"ep_size": R, "rank": rank, "num_topk": K, "hidden": hidden, "intermediate": intermediate,
            "shared_intermediate": shared_intermediate, "block_m": bm, "block_n": block_n,
            "num_tokens": tokens_per_rank[rank], "num_rows": hi - lo, "num_local_experts": E_r,
            "num_tasks": tab["task_kind"].numel(), "num_signals": tab["signal_rank"].numel(),
            "num_counters": b["total"], "num_shared_tiles": tab["shared_wgrad_tiles"].shape[0]}
    if max(dims.values()) > torch.iinfo(torch.int32).max:  # every table's values are bounded by a dim
        fail("build_tables", "sizes that fit int32 (the kernel's tables)", dims)
    tab["dims"] = torch.tensor([dims[name] for name in DIMS], device=dev)
    return {name: tab[name].to(torch.int32).contiguous() for name in TABLES}


def _shared_wgrad_tiles(n_s: int, n_h: int, R: int, device) -> torch.Tensor:
    """[tiles, 3] (which, n, rank): the shared expert's weight-gradient tiles dealt round-robin over the ranks."""
    if not n_s:
        return torch.zeros(0, 3, dtype=torch.int64, device=device)
    which = torch.cat([torch.full((n_s,), 0), torch.full((n_s,), 1), torch.full((n_h,), 2)]).to(device)
    n = torch.cat([torch.arange(n_s), torch.arange(n_s), torch.arange(n_h)]).to(device)
    return torch.stack([which, n, torch.arange(which.numel(), device=device) % R], 1)

