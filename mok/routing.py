"""Routers and routing statistics (DESIGN §3: mok never routes; these serve notebooks, benchmarks and
the nn.Module wrapper).

Every router returns `topk_idx` int64 `[num_tokens, num_topk]` and `topk_weights` fp32
`[num_tokens, num_topk]`, the two routing arguments of the mok op.

Tie-breaking (identical on CPU and GPU): among equal scores the **lower expert id wins**, and inside a
token `topk_idx` is ordered by descending score, then ascending expert id. `torch.topk` does not
promise this, so the selection is a *stable* descending sort (`_topk_lowest_id`): a stable sort keeps
equal scores in input order, i.e. ascending expert id. -0.0 and +0.0 compare equal and tie.
NOTE: the scores themselves (softmax, sigmoid) may differ in the last bit between CPU and GPU; the
rule only makes the choice among *equal* scores deterministic.
"""

from __future__ import annotations

import functools
import math

import torch

from mok.checks import check_int, fail

__all__ = [
    "check_topk_idx",
    "hot_expert_routing",
    "load_stats",
    "moved_routes",
    "random_routing",
    "round_to_tiles",
    "sigmoid_bias_topk",
    "softmax_topk",
]


# ---- input checks ------------------------------------------------------------------------------


def _check_logits(logits) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits: expected shape [num_tokens, num_experts], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits: expected a floating dtype, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("logits: expected num_experts >= 1, got shape with 0 columns")
    finite = torch.isfinite(logits).all()
    if logits.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph: no host read, a device assert
        torch._assert_async(finite, "logits: expected finite values, found NaN or Inf")
    elif not bool(finite):
        raise ValueError("logits: expected finite values, found NaN or Inf")
    return logits


def check_topk_idx(topk_idx, num_experts: int) -> torch.Tensor:
    """Raise a clear error unless topk_idx is int64 `[num_tokens, num_topk]` with ids in [0, num_experts)."""
    check_int("num_experts", num_experts, 1)
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx: expected a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected shape [num_tokens, num_topk], got {tuple(topk_idx.shape)}")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx: expected dtype torch.int64, got {topk_idx.dtype}")
    if topk_idx.shape[1] == 0:
        raise ValueError("topk_idx: expected num_topk >= 1, got shape with 0 columns")
    if topk_idx.numel() > 0:
        low, high = int(topk_idx.min()), int(topk_idx.max())
        if low < 0 or high >= num_experts:
            raise ValueError(
                f"topk_idx: expected expert ids in [0, {num_experts}), got values in [{low}, {high}]"
            )
    return topk_idx


# ---- deterministic top-k -----------------------------------------------------------------------


def _topk_lowest_id(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; ties go to the lower index. Returns (values, indices), descending."""
    values, idx = torch.sort(scores, dim=-1, descending=True, stable=True)  # [..., n] each
    return values[..., :k], idx[..., :k]  # [..., k] each


# ---- rounding to the kernels' tiles ------------------------------------------------------------


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
    read the host. On a GPU nothing here does (tests/test_routing.py runs it under sync debug mode "error")."""
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
        from mok.ops import moe

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
    tile. For each n the maximum over m lies where the two meet (tests/test_routing.py checks it against every
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


# ---- routers -----------------------------------------------------------------------------------


def softmax_topk(
    logits: torch.Tensor, num_topk: int, normalize: bool = True, tile: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (in fp32), then top-k. With `normalize`, the k weights sum to 1.

    logits: float `[num_tokens, num_experts]`. Returns topk_idx int64 and topk_weights fp32,
    both `[num_tokens, num_topk]`, ordered by descending probability then ascending expert id.
    With `tile`, the choice is rounded to it (`round_to_tiles` on the probabilities) before the
    weights are taken.
    """
    logits = _check_logits(logits)
    check_int("num_topk", num_topk, 1, logits.shape[1])
    probs = logits.float().softmax(dim=-1)  # [num_tokens, num_experts]
    topk_weights, topk_idx = _topk_lowest_id(probs, num_topk)  # [num_tokens, num_topk] each
    if tile is not None:
        topk_idx = _round_to_tiles(topk_idx, probs, tile)
        topk_weights = probs.gather(1, topk_idx)  # [num_tokens, num_topk]
    if normalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)  # [num_tokens, num_topk]
    return topk_idx, topk_weights


def sigmoid_bias_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    num_topk: int,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    routed_scaling: float = 1.0,
    normalize: bool = True,
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 router: selection by `sigmoid(logits) + bias`, weights from the unbiased scores.

    logits: float `[num_tokens, num_experts]`; bias: float `[num_experts]` (the load-balancing bias).
    Group-limited routing (both `num_groups` and `topk_groups` given): experts are split into
    `num_groups` contiguous groups; a group scores the sum of its best two biased scores (its best
    one if the group has one expert); only experts of the `topk_groups` best groups (ties: lower group
    id) can be chosen. Weights = scores of the chosen experts, divided by their sum (with
    `normalize`), times `routed_scaling`. topk_idx is ordered by descending biased score, then
    ascending expert id. With `tile`, the choice is rounded to it (`round_to_tiles` on the biased
    scores: a route never moves outside its token's groups).
    """
    logits = _check_logits(logits)
    num_tokens, num_experts = logits.shape
    check_int("num_topk", num_topk, 1, num_experts)
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected a torch.Tensor, got {type(bias).__name__}")
    if tuple(bias.shape) != (num_experts,) or not bias.is_floating_point():
        raise ValueError(
            f"bias: expected a float tensor of shape ({num_experts},), got {bias.dtype} {tuple(bias.shape)}"
        )
    if bias.device != logits.device:
        raise ValueError(f"bias: expected device {logits.device}, got {bias.device}")
    if not bool(torch.isfinite(bias).all()):
        raise ValueError("bias: expected finite values, found NaN or Inf")
    if (
        not isinstance(routed_scaling, (int, float))
        or not math.isfinite(routed_scaling)
        or routed_scaling <= 0
    ):
        raise ValueError(f"routed_scaling: expected a finite float > 0, got {routed_scaling!r}")

    scores = logits.float().sigmoid()  # [num_tokens, num_experts]
    choice = scores + bias.float()  # [num_tokens, num_experts], used for selection only
    if (num_groups is None) != (topk_groups is None):
        raise ValueError(
            f"num_groups, topk_groups: expected both or neither, got {num_groups!r}, {topk_groups!r}"
        )
    if num_groups is not None:
        check_int("num_groups", num_groups, 1, num_experts)
        if num_experts % num_groups != 0:
            raise ValueError(f"num_groups: expected a divisor of num_experts={num_experts}, got {num_groups}")
        check_int("topk_groups", topk_groups, 1, num_groups)
        group_size = num_experts // num_groups
        if topk_groups * group_size < num_topk:
            raise ValueError(
                f"topk_groups: expected topk_groups * group_size >= num_topk={num_topk}, "
                f"got {topk_groups} * {group_size}"
            )
        grouped = choice.view(num_tokens, num_groups, group_size)  # [T, G, E/G]
        best, _ = _topk_lowest_id(grouped, min(2, group_size))  # [T, G, <=2]
        group_scores = best.sum(dim=-1)  # [T, G]
        _, top_groups = _topk_lowest_id(group_scores, topk_groups)  # [T, topk_groups]
        group_mask = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=logits.device)  # [T, G]
        group_mask.scatter_(1, top_groups, True)
        expert_mask = group_mask.repeat_interleave(group_size, dim=1)  # [T, E]
        choice = choice.masked_fill(~expert_mask, float("-inf"))  # [T, E]

    _, topk_idx = _topk_lowest_id(choice, num_topk)  # [num_tokens, num_topk]
    if tile is not None:
        topk_idx = _round_to_tiles(topk_idx, choice, tile)
    topk_weights = scores.gather(1, topk_idx)  # [num_tokens, num_topk], unbiased
    if normalize:
        # DeepSeek-V3's guard: sigmoid can underflow to 0 for every chosen expert.
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_idx, topk_weights * routed_scaling


# ---- synthetic routings ------------------------------------------------------------------------


def _check_synthetic(num_tokens, num_experts, num_topk) -> None:
    check_int("num_tokens", num_tokens, 0)
    check_int("num_experts", num_experts, 1)
    check_int("num_topk", num_topk, 1, num_experts)


def _random_weights(num_tokens: int, num_topk: int, generator, device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else "cpu"
    w = torch.rand(num_tokens, num_topk, generator=generator, device=gen_device) + 0.05  # [T, K] > 0
    return (w / w.sum(dim=-1, keepdim=True)).to(device)  # [T, K], rows sum to 1


def random_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    skew: float = 0.0,
    generator: torch.Generator | None = None,
    device="cpu",
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing with Zipf popularity: expert e is drawn with probability ∝ (e + 1) ** -skew.

    skew 0 is uniform; larger skew piles tokens onto the low expert ids (expert 0 hottest). Each token
    gets `num_topk` distinct experts, drawn without replacement (Gumbel top-k, exact and free of
    underflow at any skew). Weights are random, positive, fp32, summing to 1 per token. Samples are
    drawn on the generator's device (CPU without one) and moved to `device`, so a seeded CPU
    generator gives the same routing for every `device`. With `tile`, the draw is rounded to it
    (`round_to_tiles` on the draw's keys; the weights stay with their slots).
    """
    _check_synthetic(num_tokens, num_experts, num_topk)
    if not isinstance(skew, (int, float)) or not math.isfinite(skew) or skew < 0:
        raise ValueError(f"skew: expected a finite float >= 0, got {skew!r}")
    gen_device = generator.device if generator is not None else "cpu"
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64, device=gen_device)  # [E]
    log_p = -skew * ranks.log()  # [E], unnormalized log-probabilities
    u = torch.rand(num_tokens, num_experts, generator=generator, dtype=torch.float64, device=gen_device)
    gumbel = -(-u.clamp(1e-300, 1.0 - 1e-16).log()).log()  # [T, E]
    keys = log_p + gumbel  # [T, E]
    _, topk_idx = _topk_lowest_id(keys, num_topk)  # [T, K], distinct per token
    if tile is not None:
        topk_idx = _round_to_tiles(topk_idx, keys, tile)
    return topk_idx.to(device), _random_weights(num_tokens, num_topk, generator, device)


def hot_expert_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    hot_expert: int = 0,
    hot_fraction: float = 1.0,
    generator: torch.Generator | None = None,
    device="cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Edge case: `hot_expert` is routed from (about) `hot_fraction` of the tokens, in slot k = 0.

    The remaining slots (and slot 0 of the other tokens) take distinct other experts uniformly at
    random. With num_topk = 1 and hot_fraction = 1 every route goes to the hot expert.
    """
    _check_synthetic(num_tokens, num_experts, num_topk)
    check_int("hot_expert", hot_expert, 0, num_experts - 1)
    if not isinstance(hot_fraction, (int, float)) or not 0.0 <= hot_fraction <= 1.0:
        raise ValueError(f"hot_fraction: expected a float in [0, 1], got {hot_fraction!r}")
    if num_topk == num_experts and hot_fraction < 1.0:
        raise ValueError("hot_fraction: expected 1.0 when num_topk == num_experts (every token is hot)")
    gen_device = generator.device if generator is not None else "cpu"
    u = torch.rand(num_tokens, num_experts, generator=generator, device=gen_device)  # [T, E]
    is_hot = torch.rand(num_tokens, generator=generator, device=gen_device) < hot_fraction  # [T]
    if hot_fraction == 1.0:
        is_hot = torch.ones_like(is_hot)  # [T]
    # Random keys in [0, 1) for the others; the hot expert gets 2 (always first) or -1 (never chosen).
    u[:, hot_expert] = torch.where(is_hot, 2.0, -1.0)  # [T]
    _, topk_idx = _topk_lowest_id(u, num_topk)  # [T, K]
    return topk_idx.to(device), _random_weights(num_tokens, num_topk, generator, device)


def balanced_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    generator: torch.Generator | None = None,
    device="cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert gets the same number of routes (one more for the first T·K mod E): route (t, k) goes to expert
    (t·K + k) mod E, so a token's experts are distinct and consecutive. Where E divides T·K into multiples of the
    schedule's tile, no segment needs padding: the routing that prices the experts apart from their padding.
    Weights are random, positive, fp32, summing to 1 per token (drawn from `generator`)."""
    _check_synthetic(num_tokens, num_experts, num_topk)
    routes = torch.arange(num_tokens * num_topk, dtype=torch.int64).view(num_tokens, num_topk)  # [T, K]: t·K + k
    return (routes % num_experts).to(device), _random_weights(num_tokens, num_topk, generator, device)


# ---- statistics --------------------------------------------------------------------------------


def load_stats(topk_idx: torch.Tensor, num_experts: int) -> dict:
    """Per-expert load of a routing.

    Returns `tokens_per_expert` (int64 `[num_experts]`, routes per expert), `imbalance` (max / mean),
    `cv` (population std / mean), `num_empty` (experts with no route); imbalance and cv are NaN for
    an empty routing.
    """
    check_topk_idx(topk_idx, num_experts)
    counts = torch.bincount(topk_idx.reshape(-1), minlength=num_experts)  # [num_experts]
    mean = topk_idx.numel() / num_experts
    c = counts.double()  # [num_experts]
    nan = float("nan")
    return {
        "tokens_per_expert": counts,
        "imbalance": float(c.max()) / mean if mean > 0 else nan,
        "cv": float(c.std(unbiased=False)) / mean if mean > 0 else nan,
        "num_empty": int((counts == 0).sum()),
    }


def moved_routes(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """bool `[num_tokens, num_topk]`: the routes of `after` whose expert is not among the token's experts in `before`
    (both `topk_idx` of the same tokens; e.g. a routing and its round_to_tiles)."""
    if before.shape != after.shape:
        fail("after", f"the shape of before, {tuple(before.shape)}", tuple(after.shape))
    return ~(after.unsqueeze(2) == before.unsqueeze(1)).any(dim=2)
