"""mok in torchtitan's MoE: `swap_experts(model)` runs the routed experts of every `MoE` block through `mok.moe`.

torchtitan (>= 0.3: `torchtitan.models.common.moe`) splits a block into its router (`TokenChoiceTopKRouter`), its
routed experts (`RoutedExperts`: a token dispatcher around `GroupedExperts`) and optional shared experts (a
`FeedForward`). The swap replaces `RoutedExperts.forward` on each instance, so the router still decides (its top-k ids
and scores, after its own normalization and `route_scale`, reach mok as they are) and the shared experts still run
as torchtitan's FeedForward, added by `MoE.forward`. The weights are GroupedExperts' own Parameters, in mok's layout:
    w1_EFD [E, I, H] = w_gate,   w3_EFD [E, I, H] = w_up,   w2_EDF [E, H, I] = w_down
torchtitan computes silu(x·w1ᵀ)·(x·w3ᵀ)·w2ᵀ per route, scales it by the score and scatter-adds over k: DESIGN §3's
function. Like GroupedExperts, the swap casts fp32 weights and activations to bf16 at the call (through autograd)
and returns the output in x's dtype. Undo a swap with `del module.forward`.

Not handled (raises): expert parallelism (a dispatcher with an EP mesh), DTensor (TP/FSDP-sharded) expert weights,
GroupedExperts subclasses (gpt-oss's biased experts, a low-precision `_grouped_mm` converter). NOTE: torchtitan 0.3.0
imports triton at import time (its EP kernels), so it needs the `triton` package even on a CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from mok.integrations.common import swap_forwards
from mok.layer import moe

BF16 = torch.bfloat16


def _classes():
    try:
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalTokenDispatcher
    except ImportError as e:
        raise ImportError(f"mok.integrations.torchtitan needs torchtitan >= 0.3 (torchtitan.models.common.moe) "
                          f"and triton, which it imports: {e}") from e
    return GroupedExperts, RoutedExperts, (LocalTokenDispatcher, AllToAllTokenDispatcher)


def unsupported(module: nn.Module) -> str | None:
    """Why mok cannot compute this RoutedExperts exactly, or None when it can."""
    from torch.distributed.tensor import DTensor

    grouped_experts, _, local_dispatchers = _classes()
    experts, dispatcher = module.inner_experts, module.token_dispatcher
    if type(experts) is not grouped_experts:
        return f"inner_experts of class {type(experts).__name__} (a GroupedExperts subclass: biases or its own GEMMs)"
    if type(dispatcher) not in local_dispatchers or getattr(dispatcher, "ep_mesh", None) is not None:
        return f"token dispatcher {type(dispatcher).__name__} with expert parallelism"
    if any(isinstance(p, DTensor) for p in experts.parameters()):
        return "DTensor (sharded) expert weights"
    return None


def routed_experts_forward(self: nn.Module, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor,
                           topk_expert_ids_BLK: torch.Tensor, num_local_tokens_per_expert_E=None) -> torch.Tensor:
    """RoutedExperts.forward through mok.moe: x [B, L, H], scores and ids [B, L, K] (the router's) -> [B, L, H] in
    x's dtype. The per-expert counts torchtitan passes are not needed: mok makes its own schedule."""
    if getattr(self.token_dispatcher, "ep_mesh", None) is not None:  # wired by parallelize() after the swap
        raise NotImplementedError(f"{type(self.token_dispatcher).__name__}: mok does not run torchtitan's EP")
    hidden, num_topk = x_BLD.shape[-1], topk_expert_ids_BLK.shape[-1]
    ex = self.inner_experts
    out = moe(x_BLD.reshape(-1, hidden).to(BF16).contiguous(),  # [T, H]
              topk_expert_ids_BLK.reshape(-1, num_topk).to(torch.int64).contiguous(),  # [T, K]
              topk_scores_BLK.reshape(-1, num_topk).float().contiguous(),  # [T, K]
              ex.w1_EFD.to(BF16), ex.w3_EFD.to(BF16), ex.w2_EDF.to(BF16),  # gate, up [E, I, H]; down [E, H, I]
              precision=self.mok_precision, backend=self.mok_backend)  # [T, H] bf16
    return out.to(x_BLD.dtype).view(x_BLD.shape)


def swap_experts(model: nn.Module, *, backend: str = "auto", precision: str = "bf16") -> list[str]:
    """Run the routed experts of every torchtitan MoE block in `model` (a model or one block) through mok.moe at
    `backend` and `precision`; returns the names of the swapped RoutedExperts. Raises ValueError naming what it found
    when there is none or one that mok cannot compute exactly (then nothing is swapped)."""
    _, routed_experts, _ = _classes()
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, routed_experts)]
    return swap_forwards(model, found, routed_experts_forward, backend=backend, precision=precision,
                         wanted="a torchtitan model or MoE block holding RoutedExperts (torchtitan.models.common.moe)",
                         exact="routed experts mok computes exactly (GroupedExperts, no EP)", unsupported=unsupported,
                         dims=lambda m: (f"w1_EFD {list(m.inner_experts.w1_EFD.shape)}",
                                         *m.inner_experts.w1_EFD.shape[1:]))
