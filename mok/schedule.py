"""Route placement (DESIGN §5): where each route (t, k) lives in the expert-major row buffer.

A pure function of `topk_idx` (integer ops and a stable sort only), so the same `topk_idx` gives the
same schedule bits on CPU and GPU, run to run, whatever the kernel's grid size.

Layout of the `num_rows` row buffer, for `block_m = 4`, three experts with 5, 0 and 2 routes:

    rows   0..4  expert 0, routes in ascending (token, k)      segment [0, 8)
    rows   5..7  expert 0, padding (token -1)
    (expert 1 has no route: an empty segment [8, 8), no tile)
    rows   8..9  expert 2, routes                              segment [8, 12)
    rows 10..11  expert 2, padding

Every segment is padded up to a multiple of `block_m` (the kernel's M tile, BLOCK_M), so each tile
of `block_m` rows belongs to one expert and its real rows come first (`tile_num_rows` of them).
Duplicate experts within a token are allowed: they are simply two routes with two rows.

Spare rows. A schedule built without a host sync (mok.ops.make_schedule_cuda(..., sync=False), what the
fused level runs) cannot know the padded row count on the host, so its row arrays, and every row buffer
sized from `num_rows`, have `max_num_rows(...)` rows: the padded rows [0, expert_offsets[-1]) as above,
then spare rows (token, k, route and expert -1; spare tiles: expert -1, 0 real rows). The real count lives
on the device (`expert_offsets[-1]`, and `counts[0]` in int32 for the kernels, which never read or write a
spare row). `trimmed()` cuts such a schedule to make_schedule's (one host read); `extended(n)` pads one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mok.checks import check_int, check_topk_idx, fail

__all__ = ["ROW_FIELDS", "TILE_FIELDS", "Schedule", "gather_rows", "make_schedule", "max_num_rows", "scatter_routes",
           "schedule_like", "segment"]

ROW_FIELDS = ("row_to_token", "row_to_k", "row_to_route", "row_to_expert")  # [num_rows] each
TILE_FIELDS = ("tile_to_expert", "tile_num_rows")  # [num_rows / block_m] each


@dataclass(eq=False)
class Schedule:
    """Route placement. Tensors are int64 on topk_idx's device; padding rows hold -1."""

    num_tokens: int  # T
    num_topk: int  # K
    num_experts: int  # E
    block_m: int  # rows per tile (BLOCK_M)
    num_rows: int  # rows of the row arrays and row buffers: expert_offsets[-1], or max_num_rows (spare rows)
    tokens_per_expert: torch.Tensor  # [E], real routes per expert
    padded_per_expert: torch.Tensor  # [E], rounded up to a multiple of block_m (0 stays 0)
    expert_offsets: torch.Tensor  # [E + 1], expert e owns rows [off[e], off[e + 1])
    row_to_token: torch.Tensor  # [num_rows], token id, -1 for padding (and spare rows)
    row_to_k: torch.Tensor  # [num_rows], k slot, -1 for padding
    row_to_route: torch.Tensor  # [num_rows], route id t * K + k, -1 for padding
    row_to_expert: torch.Tensor  # [num_rows], padding rows belong to their segment's expert (spare rows: -1)
    route_to_row: torch.Tensor  # [T, K], the row of each route
    tile_offsets: torch.Tensor  # [E + 1], expert e owns tiles [tile_off[e], tile_off[e + 1])
    tile_to_expert: torch.Tensor  # [num_tiles] (spare tiles: -1)
    tile_num_rows: torch.Tensor  # [num_tiles], real rows of each tile (a prefix of the tile; spare tiles: 0)
    # int32 [2] on the schedule's device: (padded rows = expert_offsets[-1], ids outside [0, E) that were
    # skipped: 0 unless built by make_schedule_cuda(..., sync=False)); the kernels read the row count here
    counts: torch.Tensor | None = None

    @property
    def num_tiles(self) -> int:
        """Tiles of the row arrays (spare tiles included)."""
        return self.num_rows // self.block_m

    def trimmed(self) -> Schedule:
        """This schedule without its spare rows: num_rows = expert_offsets[-1] (one host read when the
        schedule has spare rows), every row and tile array cut to it: make_schedule's result."""
        n = int(self.expert_offsets[-1])  # host sync on a GPU schedule
        if n == self.num_rows:
            return self
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw.update({name: kw[name][:n] for name in ROW_FIELDS}, num_rows=n)
        kw.update({name: kw[name][: n // self.block_m] for name in TILE_FIELDS})
        return Schedule(**kw)

    def extended(self, num_rows: int) -> Schedule:
        """This schedule with spare rows up to num_rows (a multiple of block_m, >= self.num_rows): the layout
        of make_schedule_cuda(..., sync=False) with row arrays of num_rows entries (tests and twins)."""
        check_int("num_rows", num_rows, self.num_rows)
        if num_rows % self.block_m:
            fail("num_rows", f"a multiple of block_m={self.block_m}", num_rows)
        spare, spare_tiles = num_rows - self.num_rows, (num_rows - self.num_rows) // self.block_m
        kw = {f.name: getattr(self, f.name) for f in fields(self)}

        def pad(t: torch.Tensor, n: int, value: int) -> torch.Tensor:
            return torch.cat([t, t.new_full((n,), value)])  # [len(t) + n]

        kw.update({name: pad(kw[name], spare, -1) for name in ROW_FIELDS}, num_rows=num_rows)
        kw.update(tile_to_expert=pad(self.tile_to_expert, spare_tiles, -1),
                  tile_num_rows=pad(self.tile_num_rows, spare_tiles, 0))
        return Schedule(**kw)

    @property
    def num_routes(self) -> int:
        return self.num_tokens * self.num_topk

    def equal(self, other: Schedule) -> bool:
        """Bitwise equality of every field (tensors compared on CPU, so devices may differ)."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                if a is None or b is None or a.dtype != b.dtype or not torch.equal(a.cpu(), b.cpu()):
                    return False
            elif a != b:
                return False
        return True

    def to(self, device) -> Schedule:
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return Schedule(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})


def max_num_rows(num_tokens: int, num_topk: int, num_experts: int, block_m: int) -> int:
    """The most padded rows any routing of num_tokens x num_topk routes over num_experts experts needs: the
    size of a row buffer allocated without a sync. Exact: a segment of c > 0 routes takes ceil(c / block_m)
    <= (c + block_m - 1) / block_m tiles and at most b = min(E, T·K) segments are non-empty, so the tiles
    number at most floor((T·K + b·(block_m - 1)) / block_m); b - 1 experts with one route each and the rest
    on one more expert reach it. (The same formula as schedule_max_num_rows in csrc/include/mok/api.h.)"""
    num_routes = num_tokens * num_topk
    busy = min(num_experts, num_routes)  # experts that can have a segment
    return (num_routes + busy * (block_m - 1)) // block_m * block_m


def make_schedule(topk_idx: torch.Tensor, num_experts: int, block_m: int = 128) -> Schedule:
    """Expert-major segments, routes in ascending (token, k) inside, each padded to block_m rows.

    topk_idx: int64 `[num_tokens, num_topk]`, ids in [0, num_experts); duplicates allowed.
    NOTE: one host sync (reading num_rows) and the validation's min/max read.
    """
    check_topk_idx(topk_idx, num_experts)
    check_int("block_m", block_m, 1)
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device
    flat = topk_idx.reshape(-1)  # [R], route r = t * K + k
    num_routes = flat.numel()

    # ---- per-expert counts and offsets (integer-only: deterministic on every device) ----
    tokens_per_expert = torch.bincount(flat, minlength=num_experts)  # [E]
    padded_per_expert = (tokens_per_expert + block_m - 1) // block_m * block_m  # [E]
    zero = torch.zeros(1, dtype=torch.int64, device=device)  # [1]
    expert_offsets = torch.cat([zero, padded_per_expert.cumsum(0)])  # [E + 1]
    real_offsets = torch.cat([zero, tokens_per_expert.cumsum(0)])  # [E + 1], unpadded starts
    num_rows = int(expert_offsets[-1])  # host sync

    # ---- place routes: a stable sort by expert keeps ascending route id = (token, k) order ----
    sorted_expert, order = torch.sort(flat, stable=True)  # [R] each; order[i] = route at rank i
    rank = torch.arange(num_routes, dtype=torch.int64, device=device)  # [R]
    rank_in_segment = rank - real_offsets[sorted_expert]  # [R]
    rows = expert_offsets[sorted_expert] + rank_in_segment  # [R], row of route order[i]
    route_to_row = torch.empty(num_routes, dtype=torch.int64, device=device)  # [R]
    route_to_row[order] = rows
    row_to_route = torch.full((num_rows,), -1, dtype=torch.int64, device=device)  # [num_rows]
    row_to_route[rows] = order

    real = row_to_route >= 0  # [num_rows]
    row_to_token = torch.where(real, row_to_route // num_topk, -1)  # [num_rows]
    row_to_k = torch.where(real, row_to_route % num_topk, -1)  # [num_rows]
    experts = torch.arange(num_experts, dtype=torch.int64, device=device)  # [E]
    row_to_expert = experts.repeat_interleave(padded_per_expert, output_size=num_rows)  # [num_rows]

    # ---- tiles: block_m rows each, one expert per tile, real rows first ----
    num_tiles = num_rows // block_m
    tile_offsets = expert_offsets // block_m  # [E + 1]
    tile_to_expert = row_to_expert[::block_m].contiguous()  # [num_tiles]
    tile_num_rows = real.view(num_tiles, block_m).sum(dim=1)  # [num_tiles]

    counts = torch.cat([expert_offsets[-1:], zero]).to(torch.int32)  # [2]: (num_rows, no bad ids)
    return Schedule(
        num_tokens=num_tokens,
        num_topk=num_topk,
        num_experts=num_experts,
        block_m=block_m,
        num_rows=num_rows,
        tokens_per_expert=tokens_per_expert,
        padded_per_expert=padded_per_expert,
        expert_offsets=expert_offsets,
        row_to_token=row_to_token,
        row_to_k=row_to_k,
        row_to_route=row_to_route,
        row_to_expert=row_to_expert,
        route_to_row=route_to_row.view(num_tokens, num_topk),
        tile_offsets=tile_offsets,
        tile_to_expert=tile_to_expert,
        tile_num_rows=tile_num_rows,
        counts=counts,
    )


def schedule_like(num_tokens: int, num_topk: int, num_experts: int, block_m: int, num_rows: int, device) -> Schedule:
    """A Schedule of empty tensors with the shapes and dtypes of one with `num_rows` rows (spare rows included): what
    a level's saved_like holds for its schedule (mok.levels). The ints may be symbolic (torch.compile's fake)."""
    def empty(*shape, dtype=torch.int64):
        return torch.empty(shape, dtype=dtype, device=device)

    num_tiles = num_rows // block_m
    return Schedule(
        num_tokens=num_tokens, num_topk=num_topk, num_experts=num_experts, block_m=block_m, num_rows=num_rows,
        tokens_per_expert=empty(num_experts), padded_per_expert=empty(num_experts),
        expert_offsets=empty(num_experts + 1), row_to_token=empty(num_rows), row_to_k=empty(num_rows),
        row_to_route=empty(num_rows), row_to_expert=empty(num_rows), route_to_row=empty(num_tokens, num_topk),
        tile_offsets=empty(num_experts + 1), tile_to_expert=empty(num_tiles), tile_num_rows=empty(num_tiles),
        counts=empty(2, dtype=torch.int32))


# ---- helpers for the reference -----------------------------------------------------------------


def _check_rows(name: str, t: torch.Tensor, rows: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2 or t.shape[0] != rows:
        raise ValueError(f"{name}: expected shape [{what}={rows}, hidden], got {tuple(t.shape)}")


def gather_rows(x: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """Dispatch: x `[num_tokens, hidden]` -> `[num_rows, hidden]`, padding rows exactly zero."""
    _check_rows("x", x, sched.num_tokens, "num_tokens")
    if x.device != sched.row_to_token.device:
        raise ValueError(f"x: expected device {sched.row_to_token.device}, got {x.device}")
    real = sched.row_to_token >= 0  # [num_rows]
    rows = x[sched.row_to_token.clamp(min=0)]  # [num_rows, hidden]
    # torch.where, not a multiply: a NaN/Inf token must not leak into the padding rows.
    return torch.where(real[:, None], rows, torch.zeros((), dtype=x.dtype, device=x.device))


def gather_routes(v: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """Per-route rows v `[num_tokens * num_topk, hidden]` (route id t·K + k) -> `[num_rows, hidden]`,
    padding rows exactly zero (the backward's dy, already scaled by the route's weight)."""
    _check_rows("v", v, sched.num_routes, "num_routes")
    real = sched.row_to_route >= 0  # [num_rows]
    rows = v[sched.row_to_route.clamp(min=0)]  # [num_rows, hidden]
    return torch.where(real[:, None], rows, torch.zeros((), dtype=v.dtype, device=v.device))


def scatter_routes(y_rows: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """Per-route output slots: y_rows `[num_rows, hidden]` -> `[num_tokens, num_topk, hidden]`."""
    _check_rows("y_rows", y_rows, sched.num_rows, "num_rows")
    if y_rows.device != sched.route_to_row.device:
        raise ValueError(f"y_rows: expected device {sched.route_to_row.device}, got {y_rows.device}")
    return y_rows[sched.route_to_row]  # [num_tokens, num_topk, hidden]


def segment(sched: Schedule, expert: int) -> slice:
    """Rows of `expert`'s segment (real rows first, then padding) as a slice of the row buffer."""
    check_int("expert", expert, 0, sched.num_experts - 1)
    start, stop = sched.expert_offsets[expert : expert + 2].tolist()
    return slice(start, stop)
