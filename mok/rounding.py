"""Rounding every expert's routes to the fused level's tile (docs/routing.md): `round_to_tiles`, which the routers'
`tile=` option runs, and the PyTorch twins of its kernels (csrc/include/mok/moe/round_steps.cuh, round_to_tiles.cuh):
the prep `_prep`, the rounds `fill_rounds` and the end game `swap_leftovers`. On a GPU the kernels run
(mok.ops.route_round_to_tiles); the CPU runs the twins, and the GPU tests compare the two bit for bit.
"""

from __future__ import annotations

import functools

import torch

from mok.checks import check_int, check_topk_idx, fail
from mok.ops import moe

__all__ = ["fill_rounds", "pool_bound", "round_to_tiles", "swap_leftovers"]


def round_to_tiles(topk_idx: torch.Tensor, scores: torch.Tensor, tile: int, device_rounds: bool = True) -> torch.Tensor:
    """Move the fewest routes so that every expert's route count is a multiple of `tile` (all but one expert's when
    T·K is not a multiple of it): the fused level's segments then need no padding rows (SonicMoE's token rounding,
    kept to mok's fixed K: a route moves to another expert, never away).

    Each expert's count goes to a multiple of `tile` on the side its remainder favours: the experts with the largest
    remainders (ties: lower id) round up, the others down, so that the counts still sum to T·K; the one expert after
    the rounded-up ones keeps T·K mod tile extra routes. A rounding-down expert gives up its routes of lowest
    `scores` (ties: lower route id t·K + k first) among those whose tokens some rounding-up expert may take. The
    rounding-up experts take from those, in rounds, the ones scoring them highest (ties: lower route id), one per
    token and never a token already routed to them; where two want the same route, the one with the fewest spare
    routes it may take wins; scores of -inf (experts a router may not choose, e.g. outside a token's groups) never
    take a route. Routes left over at the end swap places with routes already moved where that lets them move. If
    a receiver still finds too few, the rest stay with their experts and some padding remains: exact on the
    standard shapes (seeds 0-2 tried) and on softmax top-k at 57 realistic (T, E, K), not where a token holds a
    large share of the experts (K/E = 3/7, 1/2).

    topk_idx: int64 `[num_tokens, num_topk]`, distinct experts per token; scores: float `[num_tokens, num_experts]`,
    the selection scores (higher = preferred); tile: at most T·K/E (rounding to the nearest multiple of a larger
    tile would empty most experts). Returns a new topk_idx, each token's experts still distinct and ordered by
    descending score, then ascending id. Runs on topk_idx's device: on a GPU in mok's kernels with ~30 aten calls
    around them (mok.ops.route_round_to_tiles); on the CPU or with device_rounds=False in PyTorch twins: the prep
    (_prep, ~60 ops), the rounds (fill_rounds, ~20 ops and a host read a round), the swaps (swap_leftovers, on the
    host) and the moves and final order (~30 ops); float64 scores take the twins' but for the rounds and swaps. On a
    GPU it reads the host once, to check topk_idx's range; the routers' tile= skips that (their topk_idx is theirs).
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or not scores.is_floating_point():
        fail("scores", "a float tensor [num_tokens, num_experts]",
             tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__)
    check_topk_idx(topk_idx, scores.shape[1])  # its ids' range: the one host read
    if topk_idx.shape[0] != scores.shape[0] or topk_idx.device != scores.device:
        fail("scores", f"{topk_idx.shape[0]} rows on {topk_idx.device} (those of topk_idx)",
             f"{scores.shape[0]} on {scores.device}")
    return _round_to_tiles(topk_idx, scores, tile, device_rounds)


def _round_to_tiles(topk_idx: torch.Tensor, scores: torch.Tensor, tile: int,
                    device_rounds: bool = True) -> torch.Tensor:
    """round_to_tiles on inputs already checked but for `tile`: the routers' own topk_idx, whose range check would
    read the host. On a GPU nothing here does (tests/test_rounding.py runs it under sync debug mode "error")."""
    num_experts = scores.shape[1]
    check_int("tile", tile, 1)
    if topk_idx.numel() < tile * num_experts:  # rounding to the nearest multiple would empty most experts
        fail("tile", f"at most the mean routes per expert, T·K/E = {topk_idx.numel() / num_experts:g}", tile)
    idx = topk_idx.contiguous()  # [T, K], never written
    num_tokens, num_topk = idx.shape
    num_routes = idx.numel()
    scores = scores.detach()
    # On a GPU: mok's kernels throughout (mok.ops.route_round_to_tiles), reading nothing on the host. Else the PyTorch
    # twins below: on the CPU, with device_rounds=False, or where the rounds' shared memory cannot hold the receivers;
    # float64 scores (whose keys are ranks) take the twins' prep, moves and order around the rounds' and swaps' kernels.
    kernels = idx.is_cuda and device_rounds
    if kernels:
        kernels = num_experts <= moe.FILL_MAX_RECEIVERS
        if kernels and scores.dtype != torch.float64:
            return moe.route_round_to_tiles(idx, scores, tile, min(num_routes, pool_bound(num_experts, tile)))
    allowed = scores > float("-inf")  # [T, E]
    # assign [P]: an expert or -1; need [E]: what each still lacks; the pool's entries from num_real on are padding
    pool, order, may, inv, need, num_real = _prep(idx, scores, tile, allowed)
    assign, need = (moe.route_fill_rounds if kernels else fill_rounds)(order, may, inv, need, num_real)
    real = pool < num_routes  # [P]
    flat = idx.view(-1)
    moves = torch.cat([flat, flat.new_zeros(1)])  # [T·K + 1]: the last slot takes the padding's (unchanging) writes
    moves[pool] = torch.where(assign >= 0, assign, moves[pool])
    idx = moves[:num_routes].view(num_tokens, num_topk)
    left = torch.where(real & (assign < 0), pool, -1)  # [P]: the routes no receiver took
    idx, _ = (moe.route_swap_leftovers if kernels else swap_leftovers)(idx, topk_idx, allowed, left, need)
    # each token's experts by descending score, then ascending id (the routers' order): one sort of both as a key
    key = ((2**31 - 1 - _ascending_key(scores.gather(1, idx))) << 32) | idx  # [T, K]: the high half signed
    return torch.sort(key, dim=1).values & 0xFFFFFFFF


def _prep(idx: torch.Tensor, scores: torch.Tensor, tile: int, allowed: torch.Tensor,
          num_pool: int | None = None) -> tuple:
    """round_to_tiles' prep in PyTorch (the twin of mok.ops.route_round_prep, which must give the same bits,
    receiver-major): which experts give and which lack routes, the pool of the routes that move, and what the rounds
    read. idx int64 [T, K] contiguous; scores float [T, E]; allowed: scores > -inf; num_pool: the pool's size (None:
    _pool_size). Returns (pool int64 [P]: route ids ascending, then padding T·K; order int64 [P, E]; may bool [P, E]
    (row inv[p] is p's token's); inv int64 [P]; need int64 [E]: what each expert lacks; num_real int64 scalar: the
    pool's real entries), the operands of fill_rounds with every expert a receiver and U = P."""
    num_tokens, num_experts = scores.shape
    num_topk = idx.shape[1]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=idx.device).scatter_add_(
        0, idx.reshape(-1), torch.ones_like(idx.reshape(-1)))  # [E] (bincount would read its size on the host)
    rem = counts % tile  # [E]
    by_rem = torch.sort(-rem, stable=True).indices  # [E]: largest remainder first, ties lower id
    rank_e = torch.empty_like(by_rem).scatter_(0, by_rem, torch.arange(num_experts, device=rem.device))  # [E]
    total = rem.sum()  # on the device: no host read
    num_up, extra = total // tile, total % tile
    delta_t = tile * (rank_e < num_up) + extra * (rank_e == num_up) - rem  # [E]: > 0 needs routes, < 0 gives routes
    # Every rounding-down expert's weakest routes that could move: routes sorted by (expert, whether the token may
    # go to no receiver, score ascending, route id).
    flat = idx.reshape(-1)  # [T·K]
    route_scores = scores.gather(1, idx).reshape(-1)  # [T·K]
    held = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)  # [T, E]
    stuck = ~(allowed & (delta_t > 0) & ~held).any(dim=1)  # [T]: no receiver may take this token
    group = 2 * flat + stuck.unsqueeze(1).expand(-1, num_topk).reshape(-1)  # [T·K], < 2^31: one sort takes all four
    by_expert = torch.sort((group << 32) | _ascending_key(route_scores), stable=True).indices  # [T·K]
    starts = torch.cumsum(counts, 0) - counts  # [E]
    giver = flat[by_expert]  # [T·K]
    rank = torch.arange(flat.numel(), device=flat.device) - starts[giver]  # [T·K], rank in its expert
    give = (-delta_t).clamp(min=0)  # [E]
    # The pool: those routes in ascending id (_pool_size: on a GPU padded to pool_bound); padding entries (id T·K) come
    # last, score -inf and are never candidates. Gathered by a running count (a sort of T·K int64 keys is ~10
    # kernels); the slot past the pool takes the rest (none: pool_bound holds them all).
    num_routes = flat.numel()
    chosen = torch.zeros_like(flat, dtype=torch.bool).scatter_(0, by_expert, rank < give[giver])  # [T·K]
    num_pool = _pool_size(chosen, num_experts, tile) if num_pool is None else num_pool
    slot = torch.where(chosen, (torch.cumsum(chosen, 0) - 1).clamp(max=num_pool), num_pool)  # [T·K]
    pool = flat.new_full((num_pool + 1,), num_routes).scatter_(
        0, slot, torch.arange(num_routes, device=flat.device))[:num_pool]  # [P] route ids, then padding
    real = pool < num_routes  # [P]
    # The receivers fill in rounds. Every expert is a receiver there, lacking max(delta, 0), and a token is keyed by
    # its first pool entry (the padding: one more).
    tokens = torch.where(real, pool // num_topk, num_tokens)  # [P], nondecreasing
    ids = torch.arange(pool.numel(), device=pool.device)  # [P]
    starts_token = torch.ones_like(tokens, dtype=torch.bool)
    starts_token[1:] = tokens[1:] != tokens[:-1]
    inv = torch.where(starts_token, ids, 0).cummax(0).values  # [P]: the index of the token's first entry
    rows = tokens.clamp(max=num_tokens - 1)  # [P], a token's row of scores (the padding's: any, masked)
    pool_scores = scores[rows].masked_fill(~real.unsqueeze(1), float("-inf"))  # [P, E]
    may = (pool_scores > float("-inf")) & ~held[rows]  # [P, E]: row inv[p] is p's token's
    order = torch.sort(pool_scores, dim=0, descending=True, stable=True).indices  # [P, E]
    return pool, order, may, inv, delta_t.clamp(min=0), real.sum()


def _ascending_key(values: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2^32) in the order torch.sort gives the float tensor `values`, equal values equal keys
    (-0.0 = +0.0; every NaN last, as torch.sort has them), so that a sort can carry more keys in the higher bits.
    Floats of up to 32 bits map by their bits; float64 by its rank among `values` (a sort)."""
    if values.dtype == torch.float64:
        sorted_values, by = torch.sort(values.reshape(-1))  # [n] each
        nan = sorted_values.isnan()
        differs = (sorted_values[1:] != sorted_values[:-1]) & ~(nan[1:] & nan[:-1])  # [n - 1]
        rank = torch.cat([differs.new_zeros(1), differs]).cumsum(0)  # [n]
        return torch.empty_like(by).scatter_(0, by, rank).view(values.shape)
    v = values.float()
    bits = torch.where(v == 0, 0.0, v).view(torch.int32).to(torch.int64)  # -0.0 as +0.0
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2**31  # a float's order is its bits', negatives' flipped
    return key.masked_fill(v.isnan(), 2**32 - 1)


def _pool_size(chosen: torch.Tensor, num_experts: int, tile: int) -> int:
    """round_to_tiles' pool as allocated: on a GPU its bound (pool_bound), so that nothing waits for the device to
    count it; elsewhere its size. chosen: bool [T·K]."""
    if chosen.is_cuda:
        return min(chosen.numel(), pool_bound(num_experts, tile))
    return int(chosen.sum())


@functools.cache
def pool_bound(num_experts: int, tile: int) -> int:
    """The most routes round_to_tiles' rounding-down experts can give, over every count of routes: ~E·tile/4, where
    the plain bound E·(tile − 1) (each gives its remainder) is about 4× more. With n experts rounding up, m the least
    of their remainders: the others' remainders are at most m each, and all remainders sum to less than (n + 1)·tile,
    so the given routes are at most min((E − n)·m, (n + 1)·tile − 1 − n·m); with none rounding up, less than a
    tile. For each n the maximum over m lies where the two meet (tests/test_rounding.py checks it against every
    remainder vector of small E and tile)."""
    best = tile - 1
    for n in range(1, num_experts + 1):
        meet = ((n + 1) * tile - 1) // num_experts
        for m in (min(meet, tile - 1), min(meet + 1, tile - 1)):
            best = max(best, min((num_experts - n) * m, (n + 1) * tile - 1 - n * m))
    return best


def fill_rounds(order: torch.Tensor, may: torch.Tensor, inv: torch.Tensor, need: torch.Tensor,
                num_real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """round_to_tiles' rounds, in PyTorch (the twin of the kernel mok.ops.route_fill_rounds, which must give the
    same result). The movable routes form a pool of P entries, in ascending route id, so each token's entries sit
    together; R receivers each still need need[r] routes. In each round every receiver with need[r] > 0 proposes
    its best candidates, at most need[r] of them: the entries still unassigned that are their token's first such
    (the others score it alike) and that it may take, best first in `order`. An entry proposed by several goes to
    the receiver with the least slack (its candidates minus need; ties lower index), which takes all it proposes;
    the others try again with what is left. A token takes each receiver once; otherwise which receivers it may go to
    never changes (a move takes a giving expert from it, never a receiver). Rounds go on while some receiver has a
    candidate; each round fills the least-slack receiver's proposals, so they end.

    order: int64 [P, R], column r the entries by descending score for receiver r, ties ascending (a stable sort);
    inv: int64 [P], each entry's token as a key in [0, U), nondecreasing (round_to_tiles: the index of the token's
    first entry, so U = P); may: bool [U, R], row u whether token u may go to the receiver; need: int [R] (a receiver
    needing nothing takes nothing); num_real: None, or an int64 scalar tensor: the entries from it on are padding,
    never candidates (their tokens may take no receiver: the twin needs nothing more; the kernel stops its walks
    there, so in `order` they must come after every entry whose token may take that receiver). Returns (assign int64
    [P]: the receiver an entry goes to, or -1; need int64 [R]: what each receiver still lacks). The inputs are not
    changed.
    """
    num_pool, num_receivers = order.shape
    may = may.clone()
    need = need.to(torch.int64).clone()
    assign = torch.full((num_pool,), -1, dtype=torch.int64, device=order.device)  # [P]
    ids = torch.arange(num_pool, device=order.device)  # [P]
    for _ in range(num_pool + 1):  # each round assigns an entry, or ends them
        free = assign < 0  # [P]
        first = torch.full((may.shape[0],), num_pool, dtype=torch.int64, device=order.device).scatter_reduce_(
            0, inv, torch.where(free, ids, num_pool), "amin")  # [U]: each token's first free entry
        cand = (free & (first[inv] == ids)).unsqueeze(1) & may[inv] & (need > 0)  # [P, R]
        if not bool(cand.any()):
            break
        rank = torch.empty_like(order).scatter_(0, order, cand.gather(0, order).cumsum(0) - 1)  # [P, R], among cands
        proposed = cand & (rank < need)  # [P, R]
        slack = torch.where(need > 0, cand.sum(dim=0) - need, torch.iinfo(torch.int64).max)  # [R]
        first_pick = torch.empty_like(slack).scatter_(0, torch.sort(slack, stable=True).indices,
                                                      torch.arange(num_receivers, device=order.device))  # [R]
        pick, j = torch.where(proposed, first_pick, num_receivers).min(dim=1)  # [P]: the winner (none: R)
        chosen = pick < num_receivers  # [P]
        assign[chosen] = j[chosen]
        need -= torch.bincount(j[chosen], minlength=num_receivers)
        may[inv[chosen], j[chosen]] = False  # a token holds each expert once
    return assign, need


def swap_leftovers(idx: torch.Tensor, before: torch.Tensor, allowed: torch.Tensor, left: torch.Tensor,
                   need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """round_to_tiles' end game, in PyTorch (the twin of the kernel mok.ops.route_swap_leftovers, which must give the
    same result): the last receivers may find only routes of tokens already routed to them. Route p (token t)
    cannot go to receiver e, but a route q moved earlier (token t', now at e2) can take e's place if t' lacks e and t
    lacks e2: q moves on to e and p takes q's place at e2. Receivers in ascending id, each taking leftovers in
    ascending id while it lacks routes; q is the first such in `moved`: the routes that differ from `before`,
    ascending, then the ones moved here, in turn. A token lacks an expert it is allowed and not routed to.

    idx, before: int64 [T, K], the routing so far and the one before rounding; allowed: bool [T, E]; left: int64 [P],
    the leftover route ids in ascending order where >= 0 (-1: none); need: int [E], what each expert lacks.
    Returns (idx, need) after the swaps; the inputs are not changed.
    """
    idx, need = idx.clone(), need.to(torch.int64).clone()
    if not bool((need > 0).any()):
        return idx, need
    num_topk = idx.shape[1]
    rows = idx.cpu()  # [T, K], changed as the routes move
    flat = rows.view(-1)
    moved = torch.nonzero(flat != before.cpu().reshape(-1)).view(-1).tolist()
    allowed = allowed.cpu()
    pool = [p for p in left.tolist() if p >= 0]
    lacking = need.tolist()

    def lacks(token: int, expert: int) -> bool:
        return bool(allowed[token, expert]) and expert not in rows[token].tolist()

    for expert in range(len(lacking)):
        for p in list(pool):
            if lacking[expert] <= 0:
                break
            t = p // num_topk
            if lacks(t, expert):
                flat[p] = expert
            else:
                q = next((q for q in moved if int(flat[q]) != expert and lacks(q // num_topk, expert)
                          and lacks(t, int(flat[q]))), None)
                if q is None:
                    continue
                flat[p], flat[q] = int(flat[q]), expert
            pool.remove(p)
            moved.append(p)
            lacking[expert] -= 1
    return rows.to(idx.device), torch.tensor(lacking, dtype=torch.int64, device=need.device)
