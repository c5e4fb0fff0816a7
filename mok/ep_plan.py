"""The megakernel's plan (docs/megakernel.md): what each rank of an expert-parallel (EP) group of R ranks
runs in its one persistent launch per pass, computed from the all-gathered routing ids alone, the same on every rank.

- Tokens: rank-major. Rank r's local token i is global token token_offset[r] + i; route (t, k) has id t·K + k.
- Experts: contiguous blocks, rank r owns [r·E // R, (r+1)·E // R). With E % R != 0 some ranks own one expert
  more than others, and with E < R some own none (mok.comm's reference refuses E % R != 0; the plan does not).
- Rows: the single-GPU schedule (mok.schedule.make_schedule) of the global topk_idx, cut at the owners' expert
  boundaries. Segments are expert-major, so rank r's row buffer is the global rows
  [expert_offsets[lo_r], expert_offsets[hi_r]): each owned expert's routes in ascending global route id, padded to
  BLOCK_M, exactly the single-GPU order. That is what makes the bits independent of R (docs/megakernel.md).
- Pull list (dispatch): for each row, the rank holding its token and the token's local id there (-1: padding).
- Combine plan: for each local route (t, k), its owner rank and row there; the sum runs in increasing k, then
  the shared expert (DESIGN §3).
- Tasks, per rank and pass, in ticket order, each waiting on at most one counter of its own rank and incrementing
  the counters of its consumers (on any rank) when done; PHASES gives the order of the kinds. check_plan verifies
  what makes a persistent grid of any size deadlock-free; task_order runs the counters without the data.

Tiles: BLOCK_M rows (routed kinds) or BLOCK_M local tokens (shared expert, combine), BLOCK_N output columns (weight
gradients: BLOCK_N output rows). The shared expert runs on each rank's own tokens; its weight gradients, a sum over
all T tokens, are cut into output tiles spread over the ranks, each summed over every token in global order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok.checks import check_int, check_topk_idx, fail
from mok.schedule import Schedule, make_schedule

__all__ = ["COUNTERS", "PHASES", "EPPlan", "RankPlan", "Task", "check_plan", "counter_bases", "expert_ranges",
           "make_ep_plan", "task_order"]

# Task kinds of each pass, phase by phase; a rank's tickets list its phases in this order (shared expert first
# inside a phase: it needs no remote row, so it runs while the pulls land).
PHASES = {
    "forward": (("pull_x",), ("shared_gate_up", "gate_up"), ("shared_down", "down", "notify_y"), ("combine",)),
    "backward": (("pull_dy",), ("shared_dgrad_down", "dgrad_down"),
                 ("shared_dgrad_gate_up", "dgrad_gate_up", "notify_dx"), ("wgrad", "shared_wgrad"), ("combine_dx",)),
}
PHASE_OF = {kind: p for phases in PHASES.values() for p, kinds in enumerate(phases) for kind in kinds}
WHICH = ("gate", "up", "down")  # the weight gradients, in task order


@dataclass(frozen=True)
class Task:
    kind: str  # a name of PHASES
    phase: int  # PHASE_OF[kind]
    m: int  # row tile (routed kinds), local token tile (shared kinds, combines), -1 (weight gradients)
    n: int  # output column tile (weight gradients: output row tile), -1 (pulls, combines)
    expert: int  # global expert of the tile's rows or of the weight gradient, -1 otherwise
    which: str  # weight gradients: "gate", "up" or "down"; "" otherwise
    wait: int  # the counter of this task's rank it waits for (until it reaches its target), -1: none
    signals: tuple  # ((rank, counter), ...): incremented by one each when the task is done


@dataclass(eq=False)
class RankPlan:
    rank: int
    num_tokens: int  # T_r
    token_offset: int  # global id of its first token
    experts: range  # owned experts (global ids)
    row_offset: int  # its first row in the global schedule
    num_rows: int  # rows of its row buffer, a multiple of block_m
    expert_offsets: torch.Tensor  # [len(experts) + 1] owned expert i's segment: rows [off[i], off[i + 1])
    tokens_per_expert: torch.Tensor  # [len(experts)] real rows of each segment (its first ones)
    row_to_route: torch.Tensor  # [num_rows] global route id t·K + k, -1 for padding
    tile_to_expert: torch.Tensor  # [num_rows / block_m] global expert id
    tile_num_rows: torch.Tensor  # [num_rows / block_m] real rows (a prefix of the tile)
    pull_rank: torch.Tensor  # [num_rows] rank holding the row's token, -1 for padding
    pull_token: torch.Tensor  # [num_rows] the token's local id on pull_rank, -1 for padding
    combine_rank: torch.Tensor  # [T_r, K] owner rank of route (t, k)
    combine_row: torch.Tensor  # [T_r, K] the route's row in its owner's buffer
    tasks: dict  # pass -> [Task], in ticket order
    counters: dict  # pass -> [name of each counter of this rank]
    targets: dict  # pass -> [increments each counter receives from its producers]

    @property
    def num_tiles(self) -> int:
        return int(self.tile_to_expert.numel())

    def expert_rows(self, expert: int) -> slice:
        """The real rows of owned expert `expert` (a global id) in this rank's row buffer."""
        i = expert - self.experts.start
        start = int(self.expert_offsets[i])
        return slice(start, start + int(self.tokens_per_expert[i]))


@dataclass(eq=False)
class EPPlan:
    ep_size: int  # R
    num_topk: int  # K
    num_experts: int  # E
    hidden: int  # H
    intermediate: int  # I
    shared_intermediate: int  # 0: no shared expert
    block_m: int  # rows (or tokens) per tile
    block_n: int  # output columns per tile
    tokens_per_rank: list  # [R]
    sched: Schedule  # the single-GPU schedule of the global topk_idx
    ranks: list  # [R] RankPlan
    shared_wgrad_tiles: list  # [(which, n, rank)]: output tile n of d_w_shared_<which>, computed on rank

    def tiles(self, size: int) -> int:
        """Output tiles over `size` columns (or rows)."""
        return -(-size // self.block_n)

    def token_tiles(self, rank: int) -> int:
        return -(-self.ranks[rank].num_tokens // self.block_m)


def expert_ranges(num_experts: int, ep_size: int) -> list[range]:
    """Owned experts of each rank: contiguous blocks [r·E // R, (r+1)·E // R), sizes differing by at most one."""
    check_int("ep_size", ep_size, 1)
    check_int("num_experts", num_experts, 1)
    return [range(r * num_experts // ep_size, (r + 1) * num_experts // ep_size) for r in range(ep_size)]


# The counters of a rank, per pass: families in id order, each as long as what it is indexed by (m: the rank's row
# tiles, c: its token tiles, e: its experts, 1: one). Every family exists on every rank (a counter no task signals
# has target 0), so a counter's id is its family's base + its index: the kernel, or a GPU-built table, computes it.
COUNTERS = {
    "forward": (("x_ready", "m"), ("shared_h_ready", "c"), ("h_ready", "m"), ("y_ready", "c"), ("y_done", "m")),
    "backward": (("dy_ready", "m"), ("shared_dgate_ready", "c"), ("shared_wgrad_ready", "1"), ("dgate_ready", "m"),
                 ("wgrad_ready", "e"), ("dx_ready", "c"), ("dx_done", "m")),
}


def counter_bases(pass_: str, num_tiles: int, num_token_tiles: int, num_experts: int) -> dict[str, int]:
    """Family -> the id of its first counter on a rank of these sizes, and "total" -> the rank's counter count."""
    size = {"m": num_tiles, "c": num_token_tiles, "e": num_experts, "1": 1}
    bases, total = {}, 0
    for family, by in COUNTERS[pass_]:
        bases[family], total = total, total + size[by]
    return {**bases, "total": total}


@dataclass(frozen=True)
class Split:
    """Where a global schedule's routes live at R ranks (tensors on one device)."""
    owner: torch.Tensor  # [E] the rank owning each expert (expert_ranges)
    home: torch.Tensor  # [T] the rank holding each token
    token_offsets: torch.Tensor  # [R + 1] each rank's first global token
    row_offsets: torch.Tensor  # [R + 1] each rank's first global row: its first expert's segment


def split_of(sched: Schedule, tokens_per_rank: list[int], device) -> Split:
    """The Split of sched (the global topk_idx's) over len(tokens_per_rank) ranks, on `device`."""
    R, E = len(tokens_per_rank), sched.num_experts
    experts = expert_ranges(E, R)
    ranks, tpr = torch.arange(R, device=device), torch.tensor(list(tokens_per_rank), device=device)
    return Split(owner=torch.repeat_interleave(ranks, torch.tensor([len(g) for g in experts], device=device)),
                 home=torch.repeat_interleave(ranks, tpr), token_offsets=torch.cat([tpr.new_zeros(1), tpr.cumsum(0)]),
                 row_offsets=sched.expert_offsets[[g.start for g in experts] + [E]].to(device))


def route_tiles(sched: Schedule, split: Split, num_topk: int) -> tuple:
    """Per route (in row order): (owner rank, its row tile there, home rank, its token tile there), [T·K] each. Rows
    past expert_offsets[-1] (a GPU schedule's spare rows) are left out."""
    row_to_route = sched.row_to_route.to(split.home.device)[: int(split.row_offsets[-1])]
    real = row_to_route >= 0
    row, token = real.nonzero().squeeze(1), row_to_route[real] // num_topk
    o, h = split.owner[sched.row_to_expert.to(row.device)[row]], split.home[token]
    return o, (row - split.row_offsets[o]) // sched.block_m, h, (token - split.token_offsets[h]) // sched.block_m


def rank_rows(sched: Schedule, topk_idx: torch.Tensor, split: Split, rank: int) -> dict:
    """Rank `rank`'s row lists: row_to_route (global route ids, -1 on padding), pull_rank and pull_token (the row's
    token: its rank, its local id there), combine_rank and combine_row ([T_r, K]: each local route's owner and row
    there); on split's device."""
    dev, K = split.home.device, topk_idx.shape[1]
    lo, hi = int(split.row_offsets[rank]), int(split.row_offsets[rank + 1])
    route = sched.row_to_route.to(dev)[lo:hi]  # [num_rows_r]
    src = torch.where(route >= 0, split.home[(route // K).clamp(min=0)], -1)
    tokens = slice(int(split.token_offsets[rank]), int(split.token_offsets[rank + 1]))
    owner = split.owner[topk_idx[tokens].to(dev)]  # [T_r, K]
    return {"row_to_route": route, "pull_rank": src,
            "pull_token": torch.where(route >= 0, route // K - split.token_offsets[src.clamp(min=0)], -1),
            "combine_rank": owner, "combine_row": sched.route_to_row.to(dev)[tokens] - split.row_offsets[owner]}


class _Counters:
    """Counter ids (rank, index) by name, "family[i]": the family's base on that rank + i (COUNTERS)."""

    def __init__(self, plan: "EPPlan", pass_: str):
        self.names = []  # per rank: every counter's name, in id order
        for r, rp in enumerate(plan.ranks):
            size = {"m": rp.num_tiles, "c": plan.token_tiles(r), "e": len(rp.experts), "1": 1}
            self.names.append([f"{family}[{i}]" for family, by in COUNTERS[pass_] for i in range(size[by])])
        self.index = [{name: i for i, name in enumerate(names)} for names in self.names]

    def __call__(self, rank: int, name: str) -> tuple[int, int]:
        return rank, self.index[rank][name]


def make_ep_plan(topk_idx: torch.Tensor, tokens_per_rank: list[int], num_experts: int, *, hidden: int,
                 intermediate: int, shared_intermediate: int = 0, block_m: int = 128, block_n: int = 128) -> EPPlan:
    """The plan of every rank from the all-gathered routing: topk_idx int64 [T, K] of all ranks in rank-major
    token order (rank r's tokens are rows [Σ_{s<r} T_s, Σ_{s<=r} T_s)), tokens_per_rank [R] the T_r.
    A pure function of its arguments (integer ops and a stable sort): every rank computes the same plan."""
    if not isinstance(tokens_per_rank, (list, tuple)) or not tokens_per_rank:
        fail("tokens_per_rank", "a non-empty list of token counts, one per rank", tokens_per_rank)
    for name, v, low in (("hidden", hidden, 1), ("intermediate", intermediate, 1),
                         ("shared_intermediate", shared_intermediate, 0), ("block_m", block_m, 1),
                         ("block_n", block_n, 1), *(("tokens_per_rank", t, 0) for t in tokens_per_rank)):
        check_int(name, v, low)
    check_topk_idx(topk_idx, num_experts)
    T, K = topk_idx.shape
    if sum(tokens_per_rank) != T:
        fail("tokens_per_rank", f"counts summing to num_tokens={T} (topk_idx's rows)", list(tokens_per_rank))
    R, bm = len(tokens_per_rank), block_m
    sched = make_schedule(topk_idx.cpu(), num_experts, block_m)
    experts = expert_ranges(num_experts, R)
    split = split_of(sched, tokens_per_rank, "cpu")

    # Which combine tiles (home rank, local token tile) each row tile (owner rank, local tile) feeds.
    keys = torch.stack(route_tiles(sched, split, K), 1).unique(dim=0)
    feeds = {}  # (owner, tile) -> [(home, token tile)], ascending
    for o_, m, h_, c in keys.tolist():
        feeds.setdefault((o_, m), []).append((h_, c))

    ranks = []
    for r in range(R):
        lo, hi = int(split.row_offsets[r]), int(split.row_offsets[r + 1])
        rows = rank_rows(sched, topk_idx.cpu(), split, r)
        ranks.append(RankPlan(
            rank=r, num_tokens=tokens_per_rank[r], token_offset=int(split.token_offsets[r]), experts=experts[r],
            row_offset=lo, num_rows=hi - lo,
            expert_offsets=sched.expert_offsets[experts[r].start: experts[r].stop + 1] - lo,
            tokens_per_expert=sched.tokens_per_expert[experts[r].start: experts[r].stop],
            row_to_route=rows["row_to_route"], tile_to_expert=sched.tile_to_expert[lo // bm: hi // bm],
            tile_num_rows=sched.tile_num_rows[lo // bm: hi // bm], pull_rank=rows["pull_rank"],
            pull_token=rows["pull_token"], combine_rank=rows["combine_rank"], combine_row=rows["combine_row"],
            tasks={}, counters={}, targets={}))
    plan = EPPlan(R, K, num_experts, hidden, intermediate, shared_intermediate, bm, block_n, list(tokens_per_rank),
                  sched, ranks, [])
    out_rows = {"gate": intermediate, "up": intermediate, "down": hidden}
    if shared_intermediate:
        out_rows_sh = {"gate": shared_intermediate, "up": shared_intermediate, "down": hidden}
        tiles = [(which, n) for which in WHICH for n in range(plan.tiles(out_rows_sh[which]))]
        plan.shared_wgrad_tiles = [(which, n, j % R) for j, (which, n) in enumerate(tiles)]
    for pass_, build in (("forward", _forward_tasks), ("backward", _backward_tasks)):
        ctr = _Counters(plan, pass_)
        tasks = [build(plan, r, feeds, ctr, out_rows) for r in range(R)]
        for r, rp in enumerate(ranks):
            rp.tasks[pass_], rp.counters[pass_] = tasks[r], ctr.names[r]
            rp.targets[pass_] = [0] * len(ctr.names[r])
        for ts in tasks:  # a counter's target: the increments its producers make
            for t in ts:
                for rank, c in t.signals:
                    ranks[rank].targets[pass_][c] += 1
    return plan


def _adder(tasks: list):
    def add(kind, m=-1, n=-1, expert=-1, which="", wait=None, signals=()):  # wait: (this rank, counter)
        tasks.append(Task(kind, PHASE_OF[kind], m, n, expert, which, -1 if wait is None else wait[1], tuple(signals)))
    return add


def _forward_tasks(plan: EPPlan, r: int, feeds: dict, ctr: _Counters, out_rows: dict) -> list[Task]:
    rp, tasks = plan.ranks[r], []
    add = _adder(tasks)
    n_i, n_h, n_s = plan.tiles(plan.intermediate), plan.tiles(plan.hidden), plan.tiles(plan.shared_intermediate)
    experts = rp.tile_to_expert.tolist()
    for m in range(rp.num_tiles):  # x rows pulled from their tokens' ranks (peer loads)
        add("pull_x", m, signals=[ctr(r, f"x_ready[{m}]")])
    for c in range(plan.token_tiles(r)):
        for n in range(n_s):
            add("shared_gate_up", c, n, signals=[ctr(r, f"shared_h_ready[{c}]")])
    for m, e in enumerate(experts):
        for n in range(n_i):
            add("gate_up", m, n, e, wait=ctr(r, f"x_ready[{m}]"), signals=[ctr(r, f"h_ready[{m}]")])
    for c in range(plan.token_tiles(r) if n_s else 0):
        for n in range(n_h):  # K of the down GEMM is the whole intermediate row: every gate/up tile of c
            add("shared_down", c, n, wait=ctr(r, f"shared_h_ready[{c}]"), signals=[ctr(r, f"y_ready[{c}]")])
    for m, e in enumerate(experts):
        for n in range(n_h):
            add("down", m, n, e, wait=ctr(r, f"h_ready[{m}]"), signals=[ctr(r, f"y_done[{m}]")])
        # one remote signal per combine tile the row tile feeds, not one per n tile (see notify in docs/megakernel.md)
        add("notify_y", m, wait=ctr(r, f"y_done[{m}]"),
            signals=[ctr(h, f"y_ready[{c}]") for h, c in feeds.get((r, m), ())])
    for c in range(plan.token_tiles(r)):  # y rows pulled from their owners, summed in increasing k, then shared
        add("combine", c, wait=ctr(r, f"y_ready[{c}]"))
    return tasks


def _backward_tasks(plan: EPPlan, r: int, feeds: dict, ctr: _Counters, out_rows: dict) -> list[Task]:
    rp, tasks = plan.ranks[r], []
    add = _adder(tasks)
    n_i, n_h, n_s = plan.tiles(plan.intermediate), plan.tiles(plan.hidden), plan.tiles(plan.shared_intermediate)
    experts = rp.tile_to_expert.tolist()
    shared_wgrad_ranks = sorted({rank for _, _, rank in plan.shared_wgrad_tiles})
    for m in range(rp.num_tiles):  # dy = bf16(d_out·w) from the tokens' ranks (the reverse of combine)
        add("pull_dy", m, signals=[ctr(r, f"dy_ready[{m}]")])
    for c in range(plan.token_tiles(r)):
        for n in range(n_s):  # every rank's shared weight-gradient tiles sum over every token
            add("shared_dgrad_down", c, n, signals=[ctr(r, f"shared_dgate_ready[{c}]")] +
                [ctr(s, "shared_wgrad_ready[0]") for s in shared_wgrad_ranks])
    for m, e in enumerate(experts):
        for n in range(n_i):
            add("dgrad_down", m, n, e, wait=ctr(r, f"dy_ready[{m}]"),
                signals=[ctr(r, f"dgate_ready[{m}]"), ctr(r, f"wgrad_ready[{e - rp.experts.start}]")])
    for c in range(plan.token_tiles(r) if n_s else 0):
        for n in range(n_h):
            add("shared_dgrad_gate_up", c, n, wait=ctr(r, f"shared_dgate_ready[{c}]"),
                signals=[ctr(r, f"dx_ready[{c}]")])
    for m, e in enumerate(experts):
        for n in range(n_h):  # K = 2·intermediate: every dgrad_down tile of m
            add("dgrad_gate_up", m, n, e, wait=ctr(r, f"dgate_ready[{m}]"), signals=[ctr(r, f"dx_done[{m}]")])
        add("notify_dx", m, wait=ctr(r, f"dx_done[{m}]"),
            signals=[ctr(h, f"dx_ready[{c}]") for h, c in feeds.get((r, m), ())])
    for e in rp.experts:  # an expert without rows waits on a counter of target 0 and writes zeros
        for which in WHICH:
            for n in range(plan.tiles(out_rows[which])):
                add("wgrad", -1, n, e, which, wait=ctr(r, f"wgrad_ready[{e - rp.experts.start}]"))
    for which, n, rank in plan.shared_wgrad_tiles:
        if rank == r:
            add("shared_wgrad", -1, n, -1, which, wait=ctr(r, "shared_wgrad_ready[0]"))
    for c in range(plan.token_tiles(r)):  # dx rows pulled from their owners: d_x in increasing k, then shared
        add("combine_dx", c, wait=ctr(r, f"dx_ready[{c}]"))
    return tasks


# ---- the no-deadlock property and the orders it allows -------------------------------------------------------


def _name(plan: EPPlan, pass_: str, rank: int, ticket: int) -> str:
    t = plan.ranks[rank].tasks[pass_][ticket]
    return f"rank {rank} ticket {ticket} ({t.kind} m={t.m} n={t.n})"


def check_plan(plan: EPPlan) -> None:
    """Raise ValueError unless, in each pass: (1) every counter's target equals the increments its producers make
    (more would hang, fewer would let a consumer read early); (2) each rank's tickets run in non-decreasing phase;
    (3) every producer precedes its consumer: on the consumer's rank by a smaller ticket, on another rank by a
    smaller phase. (1)-(3) make a persistent grid of any size on each rank, taking tickets in order and spinning
    on counters, free of deadlock (the argument: docs/megakernel.md)."""
    for pass_ in PHASES:
        tasks = [rp.tasks[pass_] for rp in plan.ranks]
        producers = {}  # (rank, counter) -> [(rank, ticket)]
        for r, ts in enumerate(tasks):
            for i, t in enumerate(ts):
                if i and t.phase < ts[i - 1].phase:
                    fail(f"{pass_} plan", "each rank's tickets in non-decreasing phase",
                         f"{_name(plan, pass_, r, i)} in phase {t.phase} after phase {ts[i - 1].phase}")
                for rank, c in t.signals:
                    if not (0 <= rank < plan.ep_size and 0 <= c < len(plan.ranks[rank].targets[pass_])):
                        fail(f"{pass_} plan", "signals to existing counters", f"{_name(plan, pass_, r, i)}: {rank, c}")
                    producers.setdefault((rank, c), []).append((r, i))
        for r, rp in enumerate(plan.ranks):
            for c, target in enumerate(rp.targets[pass_]):
                got = len(producers.get((r, c), ()))
                if got != target:
                    fail(f"{pass_} counter {rp.counters[pass_][c]} on rank {r}",
                         f"a target equal to its producers' increments, {got}", target)
            for i, t in enumerate(tasks[r]):
                for pr, pi in producers.get((r, t.wait), ()) if t.wait >= 0 else ():
                    if (pi >= i) if pr == r else (tasks[pr][pi].phase >= t.phase):
                        fail(f"{pass_} plan", "every producer before its consumer (same rank: a smaller ticket; "
                             "another rank: an earlier phase)",
                             f"{_name(plan, pass_, pr, pi)} feeding {_name(plan, pass_, r, i)}")


def task_order(plan: EPPlan, pass_: str, *, grid: int | None = 1, generator=None) -> list[tuple[int, int]]:
    """An order of (rank, ticket) in which the pass's tasks can run, from the counters alone.
    grid=g: each rank a persistent grid of g CTAs, each taking the next ticket when free and holding it until its
    counter reaches the target (the kernel's model); grid=None: any ready task, whatever its ticket (an
    asynchronous world). Among ready tasks: the first (rank, ticket), or one at random with `generator`.
    Raises RuntimeError on a deadlock, naming the tasks that wait."""
    if pass_ not in PHASES:
        fail("pass_", f"one of {tuple(PHASES)}", repr(pass_))
    if grid is not None:
        check_int("grid", grid, 1)
    tasks = [rp.tasks[pass_] for rp in plan.ranks]
    counts = [[0] * len(rp.targets[pass_]) for rp in plan.ranks]
    next_ticket = [0] * plan.ep_size
    held = [[] if grid else list(range(len(ts))) for ts in tasks]  # tickets taken, not done
    order = []
    while len(order) < sum(map(len, tasks)):
        for r, ts in enumerate(tasks):
            while grid and len(held[r]) < grid and next_ticket[r] < len(ts):
                held[r].append(next_ticket[r])
                next_ticket[r] += 1
        ready = [(r, i) for r in range(plan.ep_size) for i in held[r] if tasks[r][i].wait < 0 or
                 counts[r][tasks[r][i].wait] >= plan.ranks[r].targets[pass_][tasks[r][i].wait]]
        if not ready:
            waiting = "; ".join(_name(plan, pass_, r, i) for r in range(plan.ep_size) for i in held[r][:2])
            raise RuntimeError(f"{pass_} deadlock with grid={grid}: every held task waits: {waiting}")
        r, i = ready[0] if generator is None else ready[int(torch.randint(len(ready), (), generator=generator))]
        held[r].remove(i)
        for rank, c in tasks[r][i].signals:
            counts[rank][c] += 1
        order.append((r, i))
    return order
