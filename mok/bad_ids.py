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

Inside a CUDA graph capture nothing may query an event: there `defer` adds the count to a device total instead
(a captured add, so every replay adds its own), and `raise_landed` returns at once. The next eager `defer` queues
the total's check like any other count and resets it; `mok.check_errors()` reads it now (a host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok.checks import fail

__all__ = ["PendingIdCheck", "check_errors", "defer", "pending", "raise_landed"]


@dataclass
class PendingIdCheck:
    count: torch.Tensor  # int32 [1] on the host (pinned), filled by a non-blocking copy of sched.counts[1]
    event: object  # torch.cuda.Event recorded after the copy (anything with .query() and .synchronize())
    num_experts: int
    num_routes: int


_PENDING: list[PendingIdCheck] = []
_CAPTURED: dict[torch.device, tuple] = {}  # device -> (int32 [1] total of bad ids counted in graphs, E, routes)


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is being captured into a graph (no event may be queried then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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
    if _capturing():  # every replay adds its count; the next eager call or check_errors() reads the total
        total = _CAPTURED.get(counts.device, (None,))[0]
        if total is None:
            total = torch.zeros(1, dtype=torch.int32, device=counts.device)  # [1], kept across replays
        total.add_(counts[1:])
        _CAPTURED[counts.device] = (total, sched.num_experts, num_routes)
        return
    _queue(counts[1:], sched.num_experts, num_routes)
    if counts.device in _CAPTURED:  # what graph replays counted since the last eager call
        total, num_experts, num_routes = _CAPTURED[counts.device]
        _queue(total, num_experts, num_routes)
        total.zero_()  # after the copy on the same stream: a replay after this adds from zero


def _queue(count: torch.Tensor, num_experts: int, num_routes: int) -> None:
    """A non-blocking copy of `count` (int32 [1] on the GPU) into pinned memory, and an event behind it."""
    host = torch.empty(1, dtype=torch.int32, pin_memory=True)  # [1]
    host.copy_(count, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(count.device))
    _PENDING.append(PendingIdCheck(host, event, num_experts, num_routes))


def raise_landed(wait: bool = False) -> None:
    """Drop every queued check whose copy has landed; raise ValueError (topk_idx) if one of them counted bad
    ids. Never blocks unless wait=True (then it synchronizes on every queued event first: a host sync). Inside a
    CUDA graph capture it does nothing (no event may be queried there)."""
    if _capturing():
        return
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


def check_errors() -> None:
    """Raise ValueError (topk_idx) if any fused call so far, eager or replayed from a CUDA graph, met expert ids
    outside [0, num_experts): waits for every queued check and reads the graphs' totals (a host sync). Call it
    where a sync costs nothing, e.g. after an optimizer step of a captured training loop."""
    for total, num_experts, num_routes in list(_CAPTURED.values()):
        num_bad = int(total.item())  # a sync
        total.zero_()
        if num_bad:
            raise_landed(wait=True)  # drop what is queued: one error for all of it
            _raise_bad(num_bad, num_experts, num_routes)
    raise_landed(wait=True)
