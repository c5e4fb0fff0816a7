"""The megakernel's CPU twin run from the int32 tables alone (mok.ep_tables; docs/megakernel.md): the kernel's main
loop in Python, with mok.ep_twin's task bodies and no EPPlan. Rank r's tasks read rank r's tables only, and peers'
buffers only where those tables name them; the order comes from the counters, as on the GPU.

Each rank is a persistent grid of `grid` CTAs: a free CTA takes its rank's next ticket and holds it until the
counter task_wait reaches task_target; the task's body runs, then its signals add one each to a counter of this rank
or of a peer (signal_rank, signal_counter). The first ready (rank, ticket) runs next (mok.ep_plan.task_order's
choice). Where every held task waits, the kernel's spin-wait would time out: RuntimeError naming the held task of
the earliest phase, its counter, the value and the target. At the end every counter must equal its counter_target
(past it: a producer the target did not count), the check the kernel makes before it sets its error flag.
"""

from __future__ import annotations

import torch

from mok.checks import check_int, fail
from mok.ep_plan import PHASES, WHICH, Task
from mok.ep_tables import DIMS, TASK_KINDS, check_tables
from mok.ep_twin import BODIES, PassRun

__all__ = ["TablesRun", "run_tables_pass", "run_ticket"]

TASK_COLUMNS = ("task_kind", "task_phase", "task_m", "task_n", "task_expert", "task_which", "task_wait",
                "task_target", "task_signal_offsets", "signal_rank", "signal_counter")


class TablesRun(PassRun):
    """A pass's state read from each rank's tables: the bodies' view of the plan (mok.ep_twin.PassRun's methods up
    to poison) answered from rank `rank`'s tables. self.plan is None: nothing here can read an EPPlan."""

    def __init__(self, tables: list, pass_, bufs, precision, swiglu_limit):
        self.tables = tables
        self.dims = [dict(zip(DIMS, tb["dims"].tolist())) for tb in tables]
        self.lists = [{name: tb[name].tolist() for name in TASK_COLUMNS} for tb in tables]  # the task loop's reads
        super().__init__(None, pass_, bufs, precision, swiglu_limit, dims=self.dims[0])  # PLAN_DIMS: equal on all

    def sizes(self, rank: int) -> tuple[int, int, int]:
        d = self.dims[rank]
        return d["num_tokens"], d["num_rows"], d["num_local_experts"]

    def tile_num_rows(self, rank: int, m: int) -> int:
        return int(self.tables[rank]["tile_num_rows"][m])

    def expert(self, rank: int, t) -> int:
        return t.expert  # task_expert is already the local index

    def expert_rows(self, rank: int, e: int) -> slice:
        start = int(self.tables[rank]["expert_offsets"][e])
        return slice(start, start + int(self.tables[rank]["tokens_per_expert"][e]))

    def pulls(self, rank: int, rows: slice) -> tuple:
        tb = self.tables[rank]
        return tuple(tb[name][rows].long() for name in ("pull_rank", "pull_token", "pull_k"))  # [n] each

    def routes(self, rank: int, tok: slice) -> tuple:
        tb = self.tables[rank]
        return tb["combine_rank"][tok].long(), tb["combine_row"][tok].long()  # [n, K] each


def run_ticket(run: TablesRun, rank: int, ticket: int) -> None:
    """The body of rank `rank`'s task `ticket`, from its row of the task table."""
    c = run.lists[rank]
    kind, which = TASK_KINDS[c["task_kind"][ticket]], c["task_which"][ticket]
    t = Task(kind, c["task_phase"][ticket], c["task_m"][ticket], c["task_n"][ticket], c["task_expert"][ticket],
             WHICH[which] if which >= 0 else "", c["task_wait"][ticket], ())
    BODIES[kind](run, rank, t)


def _timeout(run: TablesRun, pass_: str, rank: int, ticket: int, counters: list) -> str:
    c = run.lists[rank]
    wait = c["task_wait"][ticket]
    return (f"{pass_}: rank {rank} ticket {ticket} ({TASK_KINDS[c['task_kind'][ticket]]} m={c['task_m'][ticket]} "
            f"n={c['task_n'][ticket]}) timed out on counter {wait} at {int(counters[rank][wait])} of target "
            f"{c['task_target'][ticket]}")


def run_tables_pass(tables: list, pass_: str, bufs: list, *, precision: str = "bf16", swiglu_limit=None,
                    grid: int = 1, check: bool = True) -> list:
    """Run pass_ for every rank in one process from `tables` (plan_tables of each rank, in rank order) and the
    buffers (mok.ep_twin.rank_buffers'), each rank a persistent grid of `grid` CTAs driven by the counters; then
    the gather of the shared weight gradients' tiles (shared_wgrad_tiles). check: check_tables first (off: run
    whatever the tables say, as the kernel would). Returns bufs, filled: mok.ep_twin.run_pass's bits."""
    if pass_ not in PHASES:
        fail("pass_", f"one of {tuple(PHASES)}", repr(pass_))
    if len(bufs) != len(tables):
        fail("bufs", f"one dict per rank ({len(tables)})", len(bufs))
    check_int("grid", grid, 1)
    if check:
        check_tables(tables, pass_)
    run, R = TablesRun(tables, pass_, bufs, precision, swiglu_limit), len(tables)
    for r in range(R):
        run.poison(r)
    counters = [torch.zeros_like(tb["counter_target"]) for tb in tables]  # int32 [num_counters]: each rank's own
    next_ticket, held = [0] * R, [[] for _ in range(R)]  # per rank: the next ticket; those taken, not done
    while True:
        for r in range(R):  # a free CTA takes its rank's next ticket
            while len(held[r]) < grid and next_ticket[r] < run.dims[r]["num_tasks"]:
                held[r].append(next_ticket[r])
                next_ticket[r] += 1
        c = run.lists
        ready = next(((r, i) for r in range(R) for i in held[r] if c[r]["task_wait"][i] < 0 or
                      int(counters[r][c[r]["task_wait"][i]]) >= c[r]["task_target"][i]), None)
        if ready is None:
            if any(held):  # name the earliest stuck phase: the later ones wait on it
                _, r, i = min((c[r]["task_phase"][i], r, i) for r in range(R) for i in held[r])
                raise RuntimeError(_timeout(run, pass_, r, i, counters))
            break
        r, i = ready
        held[r].remove(i)
        run_ticket(run, r, i)
        for s in range(c[r]["task_signal_offsets"][i], c[r]["task_signal_offsets"][i + 1]):
            counters[c[r]["signal_rank"][s]][c[r]["signal_counter"][s]] += 1  # the kernel: red.release.sys.add
    for r, tb in enumerate(tables):
        if not torch.equal(counters[r], tb["counter_target"]):
            bad = int((counters[r] != tb["counter_target"]).nonzero()[0])
            raise RuntimeError(f"{pass_}: counter {bad} on rank {r} ended at {int(counters[r][bad])}, its target is "
                               f"{int(tb['counter_target'][bad])}: its producers and its target disagree")
    if pass_ == "backward" and run.shared:
        for r, tb in enumerate(tables):
            run.gather_shared_wgrads(r, [(WHICH[w], n, owner) for w, n, owner in tb["shared_wgrad_tiles"].tolist()])
    return bufs
