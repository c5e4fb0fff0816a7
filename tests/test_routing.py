"""Routers: deterministic ties, normalization, DeepSeek-V3 bias/group semantics, synthetic routings."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mok.routing import (
    balanced_routing,
    hot_expert_routing,
    load_stats,
    moved_routes,
    random_routing,
    round_to_tiles,
    sigmoid_bias_topk,
    softmax_topk,
)

cuda = pytest.mark.gpu  # skipped centrally (tests/conftest.py) without a GPU


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def naive_topk(scores: list[float], k: int, allowed=None) -> list[int]:
    """The documented rule: descending score, then ascending expert id."""
    ids = [e for e in range(len(scores)) if allowed is None or allowed[e]]
    return sorted(ids, key=lambda e: (-scores[e], e))[:k]


def naive_sigmoid_bias(logits, bias, k, num_groups=None, topk_groups=None, scaling=1.0):
    scores = logits.float().sigmoid()  # [T, E]
    choice = scores + bias  # [T, E]
    E = logits.shape[1]
    idx, weights = [], []
    for s, c in zip(scores.tolist(), choice.tolist()):
        allowed = None
        if num_groups is not None:
            size = E // num_groups
            top2 = [sorted(c[g * size : (g + 1) * size], reverse=True)[:2] for g in range(num_groups)]
            gs = [float(torch.tensor(t, dtype=torch.float32).sum()) for t in top2]  # fp32, as the router
            keep = naive_topk(gs, topk_groups)
            allowed = [e // size in keep for e in range(E)]
        chosen = naive_topk(c, k, allowed)
        idx.append(chosen)
        w = torch.tensor([s[e] for e in chosen])
        weights.append((w / (w.sum() + 1e-20) * scaling).tolist())
    return torch.tensor(idx), torch.tensor(weights)


# ---- softmax_topk ------------------------------------------------------------------------------


# Integer logits in a small range produce many exact ties; the naive rule is the oracle.
@pytest.mark.parametrize("num_experts, num_topk", [(8, 1), (8, 3), (16, 8), (5, 5)])
def test_softmax_topk_matches_rule_with_ties(num_experts, num_topk):
    logits = torch.randint(-2, 3, (64, num_experts), generator=gen(num_experts + num_topk)).float()
    topk_idx, topk_weights = softmax_topk(logits, num_topk)
    probs = logits.softmax(-1)  # [T, E]
    assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
    assert topk_idx.tolist() == [naive_topk(p, num_topk) for p in probs.tolist()]
    raw = probs.gather(1, topk_idx)  # [T, K]
    torch.testing.assert_close(topk_weights, raw / raw.sum(-1, keepdim=True), rtol=0, atol=0)


def test_softmax_topk_explicit_ties_lower_id_wins():
    logits = torch.zeros(3, 10, dtype=torch.bfloat16)  # [T, E]
    logits[1, [7, 2, 5]] = 4.0  # three-way tie at the top
    logits[2, 9] = -0.0  # -0.0 ties with +0.0
    idx, w = softmax_topk(logits, 2)
    assert idx.tolist() == [[0, 1], [2, 5], [0, 1]]
    torch.testing.assert_close(w, torch.full((3, 2), 0.5))


def test_softmax_topk_weights_normalized_or_raw():
    logits = torch.randn(100, 32, generator=gen(1), dtype=torch.bfloat16)
    idx, w = softmax_topk(logits, 6)
    assert bool((w > 0).all())
    torch.testing.assert_close(w.sum(-1), torch.ones(100))
    assert bool((w[:, :-1] >= w[:, 1:]).all())  # descending
    idx_raw, w_raw = softmax_topk(logits, 6, normalize=False)
    assert torch.equal(idx_raw, idx)
    assert torch.equal(w_raw, logits.float().softmax(-1).gather(1, idx))
    assert bool((w_raw.sum(-1) < 1).all())


# ---- sigmoid_bias_topk -------------------------------------------------------------------------


def test_sigmoid_bias_selection_uses_bias_weights_do_not():
    logits = torch.tensor([[3.0, 2.0, 1.0, -2.0]])  # unbiased top-2 would be experts 0, 1
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # pushes expert 3 to the top
    idx, w = sigmoid_bias_topk(logits, bias, 2)
    assert idx.tolist() == [[3, 0]]
    s = logits.sigmoid()[0]
    torch.testing.assert_close(w, torch.stack([s[3], s[0]])[None] / (s[3] + s[0]))
    _, w_zero_bias = sigmoid_bias_topk(logits, torch.zeros(4), 2)
    assert not torch.allclose(w, w_zero_bias)


@pytest.mark.parametrize(
    "num_experts, num_topk, num_groups, topk_groups, scaling",
    [(8, 2, None, None, 1.0), (16, 4, 4, 2, 2.5), (12, 3, 3, 1, 1.0), (6, 2, 6, 3, 1.0), (9, 9, 3, 3, 1.0)],
)
def test_sigmoid_bias_matches_naive(num_experts, num_topk, num_groups, topk_groups, scaling):
    g = gen(num_experts * 100 + num_topk)
    # logits 0 and bias on a coarse grid: exact ties in experts and in groups
    logits = torch.randint(-1, 2, (48, num_experts), generator=g).float() * 0.5
    bias = torch.randint(-1, 2, (num_experts,), generator=g).float() * 0.25
    idx, w = sigmoid_bias_topk(logits, bias, num_topk, num_groups, topk_groups, routed_scaling=scaling)
    ref_idx, ref_w = naive_sigmoid_bias(logits, bias, num_topk, num_groups, topk_groups, scaling)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w)
    torch.testing.assert_close(w.sum(-1), torch.full((48,), scaling))


def test_sigmoid_bias_group_limit_excludes_other_groups():
    logits = torch.randn(200, 32, generator=gen(5))
    idx, _ = sigmoid_bias_topk(logits, torch.zeros(32), 4, num_groups=8, topk_groups=2)
    groups_used = (idx // 4).sort(-1).values  # [T, K]
    n_distinct = (groups_used.diff(dim=-1) != 0).sum(-1) + 1  # [T]
    assert bool((n_distinct <= 2).all())
    assert torch.equal(idx.sort(-1).values.diff(dim=-1) > 0, torch.ones(200, 3, dtype=torch.bool))


# ---- synthetic routings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "T, E, K, skew", [(257, 8, 2, 0.0), (100, 16, 8, 3.0), (33, 6, 6, 1.0), (0, 4, 2, 0.0)]
)
def test_random_routing_distinct_and_normalized(T, E, K, skew):
    idx, w = random_routing(T, E, K, skew=skew, generator=gen(T + E))
    assert idx.shape == w.shape == (T, K) and idx.dtype == torch.int64 and w.dtype == torch.float32
    assert bool(((idx >= 0) & (idx < E)).all())
    assert bool((idx.sort(-1).values.diff(dim=-1) > 0).all())  # distinct experts per token
    assert bool((w > 0).all())
    torch.testing.assert_close(w.sum(-1), torch.ones(T))


def test_random_routing_seeded_reproducible():
    a = random_routing(64, 16, 4, skew=1.0, generator=gen(7))
    b = random_routing(64, 16, 4, skew=1.0, generator=gen(7))
    c = random_routing(64, 16, 4, skew=1.0, generator=gen(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_random_routing_zipf_frequencies():
    # K = 1: the expert frequencies are the Zipf probabilities; 5-sigma binomial bounds.
    T, E, skew = 20000, 8, 1.2
    idx, _ = random_routing(T, E, 1, skew=skew, generator=gen(11))
    p = torch.arange(1, E + 1, dtype=torch.float64) ** -skew
    p /= p.sum()
    counts = load_stats(idx, E)["tokens_per_expert"].double()
    sigma = (T * p * (1 - p)).sqrt()
    assert bool(((counts - T * p).abs() < 5 * sigma).all()), (counts, T * p)


def test_zipf_skew_increases_imbalance():
    T, E, K = 4096, 64, 4
    stats = [load_stats(random_routing(T, E, K, skew=s, generator=gen(0))[0], E) for s in (0, 0.5, 1, 1.5, 2)]
    imbalance = [s["imbalance"] for s in stats]
    cv = [s["cv"] for s in stats]
    assert imbalance[0] < 1.3  # uniform: 256 ± 16 routes per expert
    assert all(a < b for a, b in itertools.pairwise(imbalance)), imbalance
    assert all(a < b for a, b in itertools.pairwise(cv)), cv


def test_hot_expert_routing():
    idx, w = hot_expert_routing(100, 8, 1, hot_expert=5)
    assert bool((idx == 5).all()) and torch.equal(w, torch.ones(100, 1))
    idx, _ = hot_expert_routing(100, 8, 3, hot_expert=2, generator=gen(0))
    assert bool((idx[:, 0] == 2).all()) and bool((idx.sort(-1).values.diff(dim=-1) > 0).all())
    assert load_stats(idx, 8)["tokens_per_expert"][2] == 100
    idx, _ = hot_expert_routing(100, 8, 3, hot_expert=2, hot_fraction=0.0, generator=gen(0))
    assert load_stats(idx, 8)["tokens_per_expert"][2] == 0
    idx, _ = hot_expert_routing(2000, 8, 2, hot_expert=0, hot_fraction=0.5, generator=gen(0))
    assert 900 < int((idx == 0).sum()) < 1100


@pytest.mark.parametrize("T, E, K", [(8192, 128, 8), (2048, 6, 6), (37, 5, 2), (10, 3, 1), (0, 4, 2)])
def test_balanced_routing_gives_every_expert_the_same_routes(T, E, K):
    idx, w = balanced_routing(T, E, K, generator=gen(T))
    assert idx.shape == w.shape == (T, K) and idx.dtype == torch.int64 and w.dtype == torch.float32
    assert bool((idx.sort(-1).values.diff(dim=-1) > 0).all())  # distinct experts per token
    counts = load_stats(idx, E)["tokens_per_expert"]
    assert counts.tolist() == [T * K // E + (e < T * K % E) for e in range(E)]  # the first T·K mod E get one more
    assert bool((w > 0).all())
    torch.testing.assert_close(w.sum(-1), torch.ones(T))


def test_moved_routes_marks_the_experts_new_to_their_token():
    before = torch.tensor([[0, 1], [2, 3], [1, 2]])
    after = torch.tensor([[1, 0], [2, 0], [3, 0]])  # token 0 reordered only; token 1 one new; token 2 two new
    assert moved_routes(before, after).tolist() == [[False, False], [False, True], [True, True]]
    with pytest.raises(ValueError, match=r"after: expected the shape of before, \(3, 2\)"):
        moved_routes(before, after[:, :1])


def test_load_stats_values():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1]])  # counts [3, 2, 1, 0], mean 1.5
    s = load_stats(idx, 4)
    assert s["tokens_per_expert"].tolist() == [3, 2, 1, 0] and s["num_empty"] == 1
    assert s["imbalance"] == 2.0
    assert math.isclose(s["cv"], math.sqrt(1.25) / 1.5)
    empty = load_stats(torch.zeros(0, 2, dtype=torch.int64), 4)
    assert math.isnan(empty["imbalance"]) and empty["num_empty"] == 4


# ---- the routers on a GPU --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
def test_gpu_ties_follow_the_same_rule():
    logits = torch.randint(-2, 3, (512, 64), generator=gen(2)).float()
    for dev in ("cpu", "cuda"):
        idx, _ = softmax_topk(logits.to(dev), 8)
        assert idx.cpu().tolist() == [naive_topk(p, 8) for p in logits.softmax(-1).tolist()]
        idx, _ = sigmoid_bias_topk(logits.to(dev), torch.zeros(64, device=dev), 8, 8, 4)
        ref, _ = naive_sigmoid_bias(logits, torch.zeros(64), 8, 8, 4)
        assert torch.equal(idx.cpu(), ref)
    cpu = random_routing(300, 32, 4, skew=1.0, generator=gen(4))
    gpu = random_routing(300, 32, 4, skew=1.0, generator=gen(4), device="cuda")
    assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())
    idx, _ = random_routing(8192, 128, 8, generator=gen(5))
    scores = torch.randn(8192, 128, generator=gen(6))
    assert torch.equal(round_to_tiles(idx.cuda(), scores.cuda(), 128).cpu(), round_to_tiles(idx, scores, 128))


# ---- bad input ---------------------------------------------------------------------------------

L = torch.randn(4, 8)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: softmax_topk(L, 9), ValueError, r"num_topk: expected an int in \[1, 8\], got 9"),
        (lambda: softmax_topk(L, 0), ValueError, "num_topk"),
        (lambda: softmax_topk(L[0], 2), ValueError, r"logits: expected shape \[num_tokens, num_experts\]"),
        (lambda: softmax_topk(L.long(), 2), TypeError, "logits: expected a floating dtype"),
        (lambda: softmax_topk(L.clone().fill_(float("nan")), 2), ValueError, "logits: expected finite"),
        (lambda: softmax_topk(L.numpy(), 2), TypeError, "logits: expected a torch.Tensor"),
        (
            lambda: sigmoid_bias_topk(L, torch.zeros(7), 2),
            ValueError,
            r"bias: expected a float tensor of shape \(8,\)",
        ),
        (lambda: sigmoid_bias_topk(L, torch.zeros(8), 2, 3, 1), ValueError, "num_groups: expected a divisor"),
        (lambda: sigmoid_bias_topk(L, torch.zeros(8), 2, 4), ValueError, "num_groups, topk_groups"),
        (
            lambda: sigmoid_bias_topk(L, torch.zeros(8), 5, 4, 2),
            ValueError,
            "topk_groups: expected topk_groups",
        ),
        (lambda: sigmoid_bias_topk(L, torch.zeros(8), 2, routed_scaling=0.0), ValueError, "routed_scaling"),
        (lambda: random_routing(4, 8, 9), ValueError, "num_topk"),
        (lambda: random_routing(-1, 8, 2), ValueError, "num_tokens"),
        (lambda: balanced_routing(4, 2, 3), ValueError, "num_topk"),
        (lambda: random_routing(4, 8, 2, skew=-1.0), ValueError, "skew"),
        (lambda: hot_expert_routing(4, 8, 2, hot_expert=8), ValueError, "hot_expert"),
        (lambda: hot_expert_routing(4, 8, 2, hot_fraction=1.5), ValueError, "hot_fraction"),
        (lambda: load_stats(torch.tensor([[0, 8]]), 8), ValueError, "topk_idx: expected expert ids"),
        (lambda: round_to_tiles(torch.zeros(64, 2, dtype=torch.int64), L, 16), ValueError,
         r"tile: expected at most the mean routes per expert, T·K/E = 16, got 16|scores: expected 64 rows"),
        (lambda: round_to_tiles(torch.zeros(4, 2, dtype=torch.int64), L, 2), ValueError,
         r"tile: expected at most the mean routes per expert, T·K/E = 1, got 2"),
        (lambda: round_to_tiles(torch.tensor([[0, 1]] * 4), L, 0), ValueError, r"tile: expected an int in"),
        (lambda: round_to_tiles(torch.tensor([[0, 1]] * 4), L[0], 1), ValueError, "scores: expected a float"),
        (lambda: softmax_topk(L, 2, tile=2), ValueError, "tile: expected at most the mean"),
        (
            lambda: load_stats(torch.tensor([[0, 1]], dtype=torch.int32), 8),
            TypeError,
            "topk_idx: expected dtype",
        ),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()
