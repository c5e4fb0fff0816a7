"""round_to_tiles (mok.rounding): the fewest, weakest routes moved; its twins (the prep, the rounds, the end game) and
the kernels against them; the pool's bound; the routers' tile= path on a GPU with no host read."""

from __future__ import annotations

import itertools

import pytest
import torch

from mok import ops, rounding, routing, twins
from mok.rounding import fill_rounds, round_to_tiles
from mok.routing import balanced_routing, random_routing, sigmoid_bias_topk, softmax_topk

cuda = pytest.mark.gpu  # skipped centrally (tests/conftest.py) without a GPU


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- rounding to tiles ---------------------------------------------------------------------------


def least_moves(counts: torch.Tensor, tile: int) -> int:
    """Routes that must move for every count but one (holding T·K mod tile) to be a multiple of tile: the largest
    remainders round up."""
    rem = sorted((counts % tile).tolist(), reverse=True)
    up, extra = divmod(sum(rem), tile)
    return sum(tile - r for r in rem[:up]) + max(0, extra - rem[up]) if up < len(rem) else sum(tile - r for r in rem)


# T, E, K as the standard shapes' (tile 128) and smaller ones at tile 16, T·K a multiple of the tile or not
@pytest.mark.parametrize("T, E, K, tile", [(2048, 48, 6, 128), (4096, 48, 8, 128), (8192, 128, 8, 128),
                                           (1000, 12, 4, 16), (333, 9, 2, 8), (5000, 8, 2, 128)])
def test_round_to_tiles_moves_the_fewest_weakest_routes(T, E, K, tile):
    seed = T + E
    before, _ = random_routing(T, E, K, skew=0.3, generator=gen(seed))
    scores = torch.randn(T, E, generator=gen(seed + 1))
    after = round_to_tiles(before, scores, tile)
    counts = torch.bincount(after.reshape(-1), minlength=E)
    assert int((counts % tile != 0).sum()) == (1 if T * K % tile else 0), counts
    assert bool((after.sort(-1).values.diff(dim=-1) > 0).all())  # distinct experts per token
    key = scores.gather(1, after)  # [T, K]: each token's experts by descending score
    assert bool((key.diff(dim=-1) <= 0).all())
    # the moves: each token keeps its experts but its moved routes', the fewest moves for these counts
    left = [set(b) - set(a) for a, b in zip(after.tolist(), before.tolist())]
    before_counts = torch.bincount(before.reshape(-1), minlength=E)
    assert sum(map(len, left)) == least_moves(before_counts, tile)
    # a losing expert gave up its weakest routes that could move (tokens lacking a gaining expert): none of them
    # scores it above a route it kept and could have given
    gaining = set(torch.nonzero(torch.bincount(after.reshape(-1), minlength=E) > before_counts).view(-1).tolist())
    movable = [bool(gaining - set(b)) for b in before.tolist()]
    for e in range(E):
        gone = [scores[t, e] for t in range(T) if e in left[t]]
        kept = [scores[t, e] for t in range(T) if e in after[t].tolist() and e in before[t].tolist() and movable[t]]
        if gone and kept:
            assert max(gone) <= min(kept), e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_ascending_key_sorts_as_torch_sort_does_and_ties_equal_values(dtype):
    """round_to_tiles sorts its scores inside int64 keys: the key must order them as torch.sort does, with -0.0 and
    +0.0 equal and every NaN equal and last."""
    special = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-30, -1e-30, 3.0, -3.0]
    values = torch.cat([torch.tensor(special), (torch.randn(300, generator=gen(dtype.itemsize)) * 4).round() / 4])
    values = values.to(dtype)[torch.randperm(310, generator=gen(1))]  # [310], ties everywhere
    key = rounding._ascending_key(values)  # [310]
    assert key.dtype == torch.int64 and int(key.min()) >= 0 and int(key.max()) < 2**32
    assert torch.equal(torch.sort(key, stable=True).indices, torch.sort(values, stable=True).indices)
    nan = values.isnan()
    equal = (values[:, None] == values[None, :]) | (nan[:, None] & nan[None, :])  # [310, 310]
    assert torch.equal(key[:, None] == key[None, :], equal)


@pytest.mark.parametrize("T, E, K", [(300, 4, 2), (1000, 7, 3), (300, 16, 8)])
def test_round_to_tiles_where_tokens_hold_many_experts_never_pads_more(T, E, K):
    """K/E of 1/2 or 3/7: a receiver may find too few tokens it can take, and some padding stays (best effort)."""
    before, _ = random_routing(T, E, K, generator=gen(T))
    after = round_to_tiles(before, torch.randn(T, E, generator=gen(E)), 128)
    assert bool((after.sort(-1).values.diff(dim=-1) > 0).all())  # distinct experts per token

    def tiles(idx):
        return int(((torch.bincount(idx.reshape(-1), minlength=E) + 127) // 128).sum())

    assert tiles(after) <= tiles(before)


def test_round_to_tiles_is_deterministic_and_leaves_multiples_alone():
    idx, _ = random_routing(2048, 48, 6, generator=gen(3))
    scores = torch.rand(2048, 48, generator=gen(4))
    assert torch.equal(round_to_tiles(idx, scores, 128), round_to_tiles(idx.clone(), scores.clone(), 128))
    balanced, _ = balanced_routing(2048, 48, 6)  # 256 routes each: nothing to move
    key = torch.zeros(2048, 48).scatter_(1, balanced, 1.0)  # the chosen experts first, in id order
    assert torch.equal(round_to_tiles(balanced, key, 128), balanced.sort(-1).values)


def test_routers_round_to_tiles():
    logits = torch.randn(2048, 48, generator=gen(6))
    idx, w = softmax_topk(logits, 6, tile=128)
    assert bool((torch.bincount(idx.reshape(-1), minlength=48) % 128 == 0).all())
    probs = logits.softmax(-1).gather(1, idx)
    torch.testing.assert_close(w, probs / probs.sum(-1, keepdim=True))  # the weights of the experts it kept
    assert not torch.equal(idx, softmax_topk(logits, 6)[0])
    bias = torch.randn(48, generator=gen(7)) * 0.1
    idx, w = sigmoid_bias_topk(logits, bias, 6, num_groups=8, topk_groups=4, routed_scaling=2.0, tile=128)
    assert bool((torch.bincount(idx.reshape(-1), minlength=48) % 128 == 0).all())
    torch.testing.assert_close(w.sum(-1), torch.full((2048,), 2.0))
    # still group-limited: the rounding never moves a route outside its token's 4 groups
    biased = (logits.sigmoid() + bias).view(2048, 8, 6)
    top_groups = biased.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True, stable=True).indices[:, :4]
    assert all(set(r) <= set(g) for r, g in zip((idx // 6).tolist(), top_groups.tolist()))
    idx, w = random_routing(8192, 128, 8, generator=gen(8), tile=128)
    plain, plain_w = random_routing(8192, 128, 8, generator=gen(8))
    assert bool((torch.bincount(idx.reshape(-1), minlength=128) % 128 == 0).all()) and torch.equal(w, plain_w)
    assert 0 < int((idx.sort(-1).values != plain.sort(-1).values).sum()) < 0.07 * 8192 * 8


# ---- round_to_tiles' rounds: the twin, and the kernel against it ----------------------------------------


def _order(pool_scores: torch.Tensor) -> torch.Tensor:
    return torch.sort(pool_scores, dim=0, descending=True, stable=True).indices  # [P, R]


def test_fill_rounds_gives_a_contested_route_to_the_receiver_with_least_slack():
    """Token 0 has two pool entries, token 1 one; token 1 may not go to receiver 1. Both receivers want entry 0
    most. Receiver 1 has one candidate for one need (slack 0), receiver 0 two (slack 1): receiver 1 wins entry 0,
    and in the next round receiver 0 takes token 0's next entry, which it scores above token 1's."""
    scores = torch.tensor([[0.9, 0.8], [0.7, 0.1], [0.5, 0.3]])  # [P, R]: entries 0, 1 (token 0), 2 (token 1)
    may = torch.tensor([[True, True], [True, False]])  # [U, R]
    inv = torch.tensor([0, 0, 1])
    need = torch.tensor([1, 1])
    assign, left = fill_rounds(_order(scores), may, inv, need)
    assert assign.tolist() == [1, 0, -1] and left.tolist() == [0, 0]
    assert may.tolist() == [[True, True], [True, False]] and need.tolist() == [1, 1], "inputs unchanged"
    # a receiver that needs more than it may take keeps its lack
    assign, left = fill_rounds(_order(scores), may, inv, torch.tensor([3, 0]))
    assert assign.tolist() == [0, -1, 0] and left.tolist() == [1, 0], "one route per token: entry 1 never comes up"


@pytest.mark.parametrize("T, E, K, tile", [(2048, 48, 6, 128), (1000, 16, 2, 16), (1024, 14, 7, 64), (300, 2, 1, 16)])
def test_round_to_tiles_with_the_gpus_padded_pool_gives_the_same_routing(monkeypatch, T, E, K, tile):
    """On a GPU the pool is allocated at its bound, rounding.pool_bound(E, tile) entries, so that no host read counts
    it; the padding scores -inf and is never a candidate. Forced here on the CPU, it must give the exact pool's
    routing (ties, and at K/E = 1/2 the swaps at the end, included)."""
    logits = (torch.randn(T, E, generator=gen(T + E)) * 2).round() / 2  # ties
    scores = logits.softmax(-1)
    idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :K]
    exact = round_to_tiles(idx, scores, tile)
    monkeypatch.setattr(rounding, "_pool_size",
                        lambda chosen, experts, t: min(chosen.numel(), rounding.pool_bound(experts, t)))
    assert torch.equal(round_to_tiles(idx, scores, tile), exact)


def test_pool_bound_holds_every_route_the_rounding_moves_at_about_a_quarter_of_the_plain_bound():
    """pool_bound(E, tile) against every remainder vector of small E and tile: with K = 1 a token may go to any
    expert, so every route a rounding-down expert gives moves, and their count is the pool's size."""
    for E, tile in [(1, 4), (2, 5), (3, 4), (4, 3), (3, 6)]:
        most = 0
        for rems in itertools.product(range(tile), repeat=E):
            counts = torch.tensor(rems) + tile  # every expert holds a full tile, so tile ≤ T·K/E
            idx = torch.repeat_interleave(torch.arange(E), counts).view(-1, 1)
            scores = torch.rand(idx.shape[0], E, generator=gen(sum(rems)))
            moved = int(routing.moved_routes(idx, round_to_tiles(idx, scores, tile)).sum())
            assert moved <= rounding.pool_bound(E, tile), (E, tile, rems)
            most = max(most, moved)
        assert rounding.pool_bound(E, tile) - most <= 3, "the bound is near the worst case"
    assert rounding.pool_bound(128, 128) == 4159  # qwen3-30b's pool: 0.26 of E·(tile − 1) = 16,256 entries


def _swap_problems(monkeypatch) -> list[tuple]:
    """The end games of round_to_tiles where tokens hold many experts (K/E of 1/2 and 3/7, so receivers run short of
    tokens they may take), as swap_leftovers receives them: a leftover each at least, swaps and unfillable lacks."""
    problems, twin = [], rounding.swap_leftovers
    monkeypatch.setattr(rounding, "swap_leftovers", lambda *args: problems.append(args) or twin(*args))
    for T, E, K, tile in [(1024, 14, 7, 64), (700, 7, 3, 16), (2048, 8, 4, 128), (512, 6, 3, 32)]:
        for seed in range(4):
            scores = torch.randn(T, E, generator=gen(seed)).softmax(-1)
            round_to_tiles(torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :K], scores, tile)
    monkeypatch.undo()
    return problems


def test_swap_leftovers_places_leftovers_where_tokens_hold_distinct_experts(monkeypatch):
    problems = _swap_problems(monkeypatch)
    assert sum(int(need.sum()) > 0 for *_, need in problems) >= 12, "the hard cases leave receivers short"
    placed = 0
    for idx, before, allowed, left, need in problems:
        args = [t.clone() for t in (idx, before, allowed, left, need)]
        after, lacking = rounding.swap_leftovers(idx, before, allowed, left, need)
        assert all(torch.equal(a, b) for a, b in zip(args, (idx, before, allowed, left, need))), "inputs unchanged"
        assert all(len(set(row)) == len(row) for row in after.tolist()), "a token holds an expert twice"
        assert bool(allowed.gather(1, after).all()), "a route went where its token may not go"
        gained = torch.bincount(after.view(-1), minlength=len(need)) - torch.bincount(idx.view(-1), minlength=len(need))
        assert torch.equal(gained.clamp(min=0), need - lacking) and bool((lacking >= 0).all())
        placed += int((need - lacking).sum())
    assert placed > 0, "no leftover placed by a swap"


def _fill_problem(seed: int, num_tokens: int = 400, num_receivers: int = 24) -> tuple:
    """A random fill: tokens of 1-3 pool entries, scores with ties and -inf (a receiver the token may not take),
    needs of 1-6 routes."""
    g = gen(seed)
    per_token = torch.randint(1, 4, (num_tokens,), generator=g)  # [U]
    inv = torch.repeat_interleave(torch.arange(num_tokens), per_token)  # [P]
    token_scores = (torch.randn(num_tokens, num_receivers, generator=g) * 4).round() / 4  # [U, R], ties
    token_scores[torch.rand(num_tokens, num_receivers, generator=g) < 0.2] = float("-inf")
    held = torch.rand(num_tokens, num_receivers, generator=g) < 0.1  # the token is already routed there
    may = (token_scores > float("-inf")) & ~held  # [U, R]
    need = torch.randint(1, 7, (num_receivers,), generator=g)  # [R]
    return _order(token_scores[inv]), may, inv, need


def test_fill_rounds_assigns_within_the_rules():
    """Every assigned entry's token may take its receiver, takes each receiver once, and gives entries in order;
    no receiver gets more than it needs, and the lack returned is what it did not get."""
    order, may, inv, need = _fill_problem(0)
    assign, left = fill_rounds(order, may, inv, need)
    got = torch.bincount(assign[assign >= 0], minlength=len(need))
    assert torch.equal(got + left, need) and bool((left >= 0).all())
    assert 0 < int((assign >= 0).sum()) < len(assign)
    for u in range(may.shape[0]):
        taken = assign[inv == u].tolist()
        assert all(may[u, r] for r in taken if r >= 0)
        assert len({r for r in taken if r >= 0}) == sum(r >= 0 for r in taken), f"token {u} takes a receiver twice"
        assert taken == sorted(taken, key=lambda r: r < 0), f"token {u}: an entry skipped before a taken one"


def test_route_fill_rounds_bad_inputs_name_the_argument():
    order, may, inv, need = _fill_problem(1, num_tokens=8, num_receivers=3)
    for call, match in [
        (lambda: ops.route_fill_rounds(order.int(), may, inv, need), "order: expected dtype torch.int64"),
        (lambda: ops.route_fill_rounds(order, may[:, :2], inv, need), r"may: expected shape .* = \[\*, 3\]"),
        (lambda: ops.route_fill_rounds(order, may, inv[:-1], need), "inv: expected shape"),
        (lambda: ops.route_fill_rounds(order, may, inv, need.float()), "need: expected dtype torch.uint8 or"),
        (lambda: ops.route_fill_rounds(torch.zeros(2, 1025, dtype=torch.int64), torch.zeros(2, 1025, dtype=torch.bool),
                                       torch.zeros(2, dtype=torch.int64), torch.ones(1025, dtype=torch.int64)),
         "order: expected at most 1024 receivers"),
        (lambda: ops.route_fill_rounds(order, may, inv, need), "order: expected a CUDA tensor"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    idx = torch.tensor([[0, 1], [2, 3]])
    allowed, left, lacking = torch.ones(2, 4, dtype=torch.bool), torch.tensor([1, -1]), torch.tensor([0, 0, 1, 0])
    for call, match in [
        (lambda: ops.route_swap_leftovers(idx.int(), idx, allowed, left, lacking), "idx: expected dtype torch.int64"),
        (lambda: ops.route_swap_leftovers(idx, idx[:1], allowed, left, lacking), "before: expected shape"),
        (lambda: ops.route_swap_leftovers(idx, idx, allowed.int(), left, lacking), "allowed: expected dtype"),
        (lambda: ops.route_swap_leftovers(idx, idx, allowed, left, lacking[:3]), r"need: expected shape .*\[4\]"),
        (lambda: ops.route_swap_leftovers(idx, idx, allowed, left, lacking), "idx: expected a CUDA tensor"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.gpu
def test_route_fill_rounds_kernel_gives_its_twins_bits():
    """The kernel against rounding.fill_rounds on random fills (ties, -inf, tokens of several entries), and
    round_to_tiles on the GPU with its rounds in the kernel, in PyTorch ops, and on the CPU."""
    for seed in range(12):
        problem = _fill_problem(seed, num_tokens=50 + 90 * seed, num_receivers=4 + 7 * seed)
        expected = twins.route_fill_rounds(*problem)
        got = ops.route_fill_rounds(*(t.cuda() for t in problem))
        assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1]), f"seed {seed}"
    # padded as round_to_tiles pads on a GPU: 50 entries of one more token that may take nothing, last in `order`;
    # the kernel stops its walks at num_real
    order, may, inv, need = _fill_problem(3)
    (num_pool, num_receivers), pad = order.shape, 50
    padded = (torch.cat([order, torch.arange(num_pool, num_pool + pad).unsqueeze(1).expand(pad, num_receivers)]),
              torch.cat([may, torch.zeros(1, num_receivers, dtype=torch.bool)]),
              torch.cat([inv, torch.full((pad,), may.shape[0])]), need)
    expected = twins.route_fill_rounds(order, may, inv, need)
    got = ops.route_fill_rounds(*(t.cuda() for t in padded), torch.tensor(num_pool).cuda())
    assert torch.equal(got[0][:num_pool].cpu(), expected[0]) and bool((got[0][num_pool:] == -1).all())
    assert torch.equal(got[1].cpu(), expected[1])


def _random_swap_problem(seed: int, T: int, E: int, K: int, changed: float, num_left: int) -> tuple:
    """An end game beyond round_to_tiles' own: a random routing and a `before` that differs for a share of the tokens
    (long moved lists), a random allowed mask, leftovers at random route ids, needs of 0-2: direct moves and swaps."""
    g = gen(seed)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]  # [T, K], distinct experts per token
    before = torch.where(torch.rand(T, 1, generator=g) < changed, torch.rand(T, E, generator=g).argsort(dim=1)[:, :K],
                         idx)
    allowed = torch.rand(T, E, generator=g) < 0.9
    allowed.scatter_(1, idx, True)  # a token may go where it is
    left = torch.sort(torch.randperm(T * K, generator=g)[:num_left]).values
    left = torch.where(torch.rand(num_left, generator=g) < 0.1, -1, left)  # some entries none
    return idx, before, allowed, left, torch.randint(0, 3, (E,), generator=g)


@pytest.mark.gpu
def test_round_to_tiles_on_a_gpu_reads_nothing_on_the_host():
    """The routers' path (_round_to_tiles: topk_idx their own) under sync debug mode "error": any host read raises.
    Where nothing is left short, and where receivers are (the end game's kernel at work)."""
    for T, E, K, tile in [(8192, 128, 8, 128), (1024, 14, 7, 64)]:
        scores = torch.randn(T, E, generator=gen(E), device="cpu").softmax(-1).cuda()
        idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :K]
        expected = rounding._round_to_tiles(idx, scores, tile)  # the first call: builds and loads the kernels
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = rounding._round_to_tiles(idx, scores, tile)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        assert torch.equal(got, expected)


@pytest.mark.gpu
def test_the_routers_tile_replays_from_a_cuda_graph():
    """With no host read, the routers' rounding can live in a CUDA graph (a training step captured whole, or
    `bench route`'s round_graph_ms; the logits' finiteness check becomes a device assert under capture): captured
    once, replayed on new logits copied into the captured input, it gives the eager call's routing on those logits,
    ties and a hot expert included."""
    T, E, K, tile = 4096, 64, 6, 128
    static = torch.randn(T, E, generator=gen(0)).cuda()  # [T, E]
    routing.softmax_topk(static, K, tile=tile)  # builds and loads the kernels outside the capture
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        idx, weights = routing.softmax_topk(static, K, tile=tile)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(1, 4):
        logits = (torch.randn(T, E, generator=gen(seed)) * 2).round() / 2  # ties
        logits[:, 3] += seed - 1  # expert 3 ever hotter
        static.copy_(logits.cuda())
        graph.replay()
        expected = routing.softmax_topk(logits.cuda(), K, tile=tile)
        assert torch.equal(idx, expected[0]) and torch.equal(weights, expected[1]), f"seed {seed}"
        assert int((torch.bincount(idx.view(-1), minlength=E) % tile != 0).sum()) <= 1, "every count but one rounded"


@pytest.mark.gpu
def test_route_swap_leftovers_kernel_gives_its_twins_bits(monkeypatch):
    """The end-game kernel against rounding.swap_leftovers on the hard cases' end games (swaps, unfillable lacks) and
    with nothing lacking; then round_to_tiles on the GPU, both ways, against the CPU there."""
    problems = _swap_problems(monkeypatch)
    idx, before, allowed, left, need = problems[0]
    problems.append((idx, before, allowed, left, torch.zeros_like(need)))  # nothing lacks: the kernel returns at once
    problems += [_random_swap_problem(seed, 40 + 30 * seed, 6 + seed, 1 + seed % 4, 0.3, 5 + 7 * seed)
                 for seed in range(12)]  # direct moves among the swaps
    problems.append(_random_swap_problem(12, 3000, 16, 4, 0.3, 1500))  # > 1024 moved and leftovers: several chunks
    for i, problem in enumerate(problems):
        expected = twins.route_swap_leftovers(*problem)
        got = ops.route_swap_leftovers(*(t.cuda() for t in problem))
        assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1]), f"problem {i}"
    for T, E, K, tile in [(1024, 14, 7, 64), (2048, 8, 4, 128)]:
        for seed in range(4):
            scores = torch.randn(T, E, generator=gen(seed)).softmax(-1)
            idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :K]
            cpu = round_to_tiles(idx, scores, tile)
            for device_rounds in (True, False):
                gpu = round_to_tiles(idx.cuda(), scores.cuda(), tile, device_rounds)
                assert torch.equal(gpu.cpu(), cpu), f"T={T} E={E} K={K} seed {seed} device_rounds={device_rounds}"
    for T, E, K in [(2048, 48, 6), (8192, 128, 8), (1000, 16, 2)]:
        scores = torch.randn(T, E, generator=gen(T + E)).softmax(-1)
        idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :K]
        cpu = round_to_tiles(idx, scores, 128 if T * K >= 128 * E else 16)
        for device_rounds in (True, False):
            gpu = round_to_tiles(idx.cuda(), scores.cuda(), 128 if T * K >= 128 * E else 16, device_rounds)
            assert torch.equal(gpu.cpu(), cpu), f"T={T} E={E} K={K} device_rounds={device_rounds}"
