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

import math

import torch

from mok.checks import check_int, check_topk_idx, fail
from mok.rounding import _round_to_tiles, round_to_tiles

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
    if torch.compiler.is_compiling():  # a host read would break the graph (mok.MoE's router checks inside its op)
        return logits
    finite = torch.isfinite(logits).all()
    if logits.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph: no host read, a device assert
        torch._assert_async(finite, "logits: expected finite values, found NaN or Inf")
    elif not bool(finite):
        raise ValueError("logits: expected finite values, found NaN or Inf")
    return logits


# ---- deterministic top-k -----------------------------------------------------------------------


def _topk_lowest_id(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; ties go to the lower index. Returns (values, indices), descending."""
    values, idx = torch.sort(scores, dim=-1, descending=True, stable=True)  # [..., n] each
    return values[..., :k], idx[..., :k]  # [..., k] each

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
    return _softmax_topk(logits, num_topk, normalize, tile)[:2]


def _softmax_topk(logits, num_topk: int, normalize: bool = True, tile: int | None = None) -> tuple:
    """softmax_topk, and its softmax: (topk_idx, topk_weights, probs fp32 [num_tokens, num_experts])."""
    logits = _check_logits(logits)
    check_int("num_topk", num_topk, 1, logits.shape[1])
    probs = logits.float().softmax(dim=-1)  # [num_tokens, num_experts]
    topk_weights, topk_idx = _topk_lowest_id(probs, num_topk)  # [num_tokens, num_topk] each
    if tile is not None:
        topk_idx = _round_to_tiles(topk_idx, probs, tile)
        topk_weights = probs.gather(1, topk_idx)  # [num_tokens, num_topk]
    if normalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)  # [num_tokens, num_topk]
    return topk_idx, topk_weights, probs


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
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(bias).all()):  # a host read breaks a graph
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
