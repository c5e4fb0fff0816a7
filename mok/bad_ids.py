"""Expert ids outside [0, num_experts) found on the GPU, raised without a host sync (DESIGN §9).

The fused level builds its schedule with `mok.ops.make_schedule_cuda(..., sync=False)`: no host read, so a
bad id cannot raise in the call that receives it. What happens instead, so that nothing is silently wrong:

1. On the device: the schedule kernels skip the route (no row; its `route_to_row` is -1), so its token's
   output and `d_x` are NaN (combine_rows: a row id out of range reads nothing and gives NaN), and
   `sched.counts[1]` counts the bad ids.
2. `defer(sched)` queues a non-blocking copy of that count into pinned host memory and records an event
   behind it.
3. `raise_landed()` runs at the end of every fused forward and backward, after their launches (at the start,
   its host time delayed the first kernel): for each queued copy whose event has completed (`Event.query()`,
   which never blocks) it drops the entry, and raises ValueError naming `topk_idx` if the count was not zero.
   In practice the error comes from the backward of the same step; at the latest from the first fused call
   that ends after the GPU ran the schedule.

`mok.moe(..., check=True)` keeps the old behaviour instead: a host read of min/max before anything runs, and
the error in that call. `raise_landed(wait=True)` waits for every queued check (a host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok.checks import fail

__all__ = ["PendingIdCheck", "defer", "pending", "raise_landed"]


@dataclass
class PendingIdCheck:
    count: torch.Tensor  # int32 [1] on the host (pinned), filled by a non-blocking copy of sched.counts[1]
    event: object  # torch.cuda.Event recorded after the copy (anything with .query() and .synchronize())
    num_experts: int
    num_routes: int


_PENDING: list[PendingIdCheck] = []


def pending() -> list[PendingIdCheck]:
    """The queued checks whose copies have not been seen complete yet (oldest first)."""
    return list(_PENDING)


def _raise_bad(num_bad: int, num_experts: int, num_routes: int) -> None:
    fail("topk_idx", f"expert ids in [0, {num_experts})",
         f"{num_bad} of {num_routes} ids outside it (found on the GPU by the fused level's schedule and raised at "
         "the next fused call without a host sync; those routes were skipped and their tokens' outputs and d_x "
         "are NaN; mok.moe(..., check=True) raises in the call instead)")


def defer(sched) -> None:
    """Queue the check of sched.counts[1] (ids make_schedule_cuda(..., sync=False) skipped) without blocking.
    A schedule on the CPU (the L0 twins) is checked at once: reading it costs no sync."""
    counts = sched.counts  # int32 [2]: (padded rows, bad ids)
    num_routes = sched.num_tokens * sched.num_topk
    if counts.device.type != "cuda":
        if int(counts[1]):
            _raise_bad(int(counts[1]), sched.num_experts, num_routes)
        return
    host = torch.empty(1, dtype=torch.int32, pin_memory=True)  # [1]
    host.copy_(counts[1:], non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(counts.device))
    _PENDING.append(PendingIdCheck(host, event, sched.num_experts, num_routes))


def raise_landed(wait: bool = False) -> None:
    """Drop every queued check whose copy has landed; raise ValueError (topk_idx) if one of them counted bad
    ids. Never blocks unless wait=True (then it synchronizes on every queued event first: a host sync)."""
    landed, still = [], []
    for check in _PENDING:
        if wait:
            check.event.synchronize()
        (landed if check.event.query() else still).append(check)
    _PENDING[:] = still
    for check in landed:
        num_bad = int(check.count[0])  # host memory: no sync
        if num_bad:
            _raise_bad(num_bad, check.num_experts, check.num_routes)
