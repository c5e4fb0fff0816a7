"""The megakernel's CPU twin on the ranks of a process group (gloo): each rank holds only its own tokens, experts and
buffers, and runs its share of a pass phase by phase (docs/megakernel.md; tests/test_ep_plan.py).

Where the kernel loads a peer's row through symmetric memory, a rank here reads a NaN mirror of the peer's buffer,
filled before the phase by one all_to_all_single of exactly the rows the plan names (READS): a row the plan forgot
stays NaN and shows in the result. Phase by phase with collectives between is one of the orders the counters allow
(check_plan: every producer on another rank sits in an earlier phase), so the bits are run_pass's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mok.checks import fail
from mok.ep_plan import PHASES, EPPlan
from mok.ep_twin import BODIES, SHARED_GRADS, PassRun

# (pass, phase) -> the peer buffers that phase's tasks read, and which of their rows: "pull" (the pull list's
# tokens), "combine" (the combine plan's rows), "all" (every row, to the ranks that own shared weight-gradient tiles).
READS = {
    ("forward", 0): (("x", "pull"),),
    ("forward", 3): (("y_rows", "combine"),),
    ("backward", 0): (("d_out", "pull"), ("topk_weights", "pull")),
    ("backward", 3): (("x", "all"), ("d_out", "all"), ("shared_h", "all"), ("shared_d_gate", "all"),
                      ("shared_d_up", "all")),
    ("backward", 4): (("dx_rows", "combine"),),
}


def _read_rows(plan: EPPlan, reader: int, source: int, how: str) -> torch.Tensor:
    """Rows of `source`'s buffer that `reader`'s tasks read (ascending, each once)."""
    rp = plan.ranks[reader]
    if how == "pull":
        return rp.pull_token[rp.pull_rank == source].unique()
    if how == "combine":
        return rp.combine_row[rp.combine_rank == source].unique()
    owns = any(rank == reader for _, _, rank in plan.shared_wgrad_tiles)
    return torch.arange(plan.ranks[source].num_tokens if owns else 0)


def _exchange(run: PassRun, me: int, name: str, how: str, group) -> None:
    """One all_to_all_single: every rank sends the rows of `name` its peers read; they land in NaN mirrors."""
    R, own = run.plan.ep_size, run.bufs[me][name]
    send = [_read_rows(run.plan, d, me, how) if d != me else torch.arange(0) for d in range(R)]
    recv = [_read_rows(run.plan, me, s, how) if s != me else torch.arange(0) for s in range(R)]
    width = math.prod(own.shape[1:])
    out = own.new_empty(sum(map(len, recv)), width)  # [rows received, width]
    dist.all_to_all_single(out, torch.cat([own[i].reshape(len(i), width) for i in send]),
                           [len(i) for i in recv], [len(i) for i in send], group=group)
    for s, (rows, chunk) in enumerate(zip(recv, out.split([len(i) for i in recv]))):
        if s != me and len(rows):
            run.bufs[s][name][rows] = chunk.view(len(rows), *own.shape[1:])


def _mirror(plan: EPPlan, source: int, name: str, like: torch.Tensor) -> torch.Tensor:
    """A NaN stand-in for `source`'s buffer `name`: rows nobody sent stay NaN, so reading them shows."""
    rp = plan.ranks[source]
    n = rp.num_rows if name.endswith("_rows") else rp.num_tokens
    return torch.full((n, *like.shape[1:]), float("nan"), dtype=like.dtype)


def run_rank_pass(plan: EPPlan, pass_: str, rank: int, buf: dict, *, precision: str = "bf16", swiglu_limit=None,
                  group=None) -> dict:
    """Rank `rank`'s share of pass_ inside a process group (every rank calls it with the same plan): buf holds only
    this rank's tokens, experts and buffers. Phase by phase: the peer rows the phase reads (READS), then this
    rank's tasks of the phase in ticket order; at the end of the backward, an all_gather of the shared weight
    gradients' tiles. Returns buf, filled (bitwise run_pass's bufs[rank])."""
    if pass_ not in PHASES:
        fail("pass_", f"one of {tuple(PHASES)}", repr(pass_))
    if dist.get_world_size(group) != plan.ep_size or dist.get_rank(group) != rank:
        fail("group", f"a group of {plan.ep_size} ranks in which this is rank {rank}",
             f"{dist.get_world_size(group)} ranks, this one {dist.get_rank(group)}")
    bufs = [buf if s == rank else {} for s in range(plan.ep_size)]  # peers: mirrors, filled by the exchanges
    run = PassRun(plan, pass_, bufs, precision, swiglu_limit)
    run.poison(rank)
    for phase in range(len(PHASES[pass_])):
        for name, how in READS.get((pass_, phase), ()):
            if how == "all" and not run.shared:
                continue
            for s in range(plan.ep_size):
                if s != rank:
                    bufs[s][name] = _mirror(plan, s, name, buf[name])
            _exchange(run, rank, name, how, group)
        for t in plan.ranks[rank].tasks[pass_]:
            if t.phase == phase:
                BODIES[t.kind](run, rank, t)
    if pass_ == "backward" and run.shared:
        for name in SHARED_GRADS:
            parts = [torch.empty_like(buf[name]) for _ in range(plan.ep_size)]
            dist.all_gather(parts, buf[name], group=group)
            for which, n, owner in plan.shared_wgrad_tiles:
                if f"d_w_shared_{which}" == name:
                    rows = run.cols(n, buf[name].shape[0])
                    buf[name][rows] = parts[owner][rows]
    return buf


def all_gather_routing(topk_idx_local: torch.Tensor, group=None) -> tuple[torch.Tensor, list[int]]:
    """The plan's only collective: (topk_idx [T, K] of every rank, rank-major; tokens_per_rank [R])."""
    R = dist.get_world_size(group)
    n = torch.tensor([topk_idx_local.shape[0]])
    counts = [torch.empty_like(n) for _ in range(R)]
    dist.all_gather(counts, n, group=group)
    counts = [int(c) for c in counts]
    padded = topk_idx_local.new_zeros(max(counts), topk_idx_local.shape[1])  # gloo gathers equal sizes only
    padded[: topk_idx_local.shape[0]] = topk_idx_local
    parts = [torch.empty_like(padded) for _ in range(R)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)]), counts
