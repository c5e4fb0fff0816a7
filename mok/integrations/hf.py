"""mok in Hugging Face transformers' MoE models: `swap_experts(model)` runs every experts module through `mok.moe`.

transformers >= 5 holds a model's routed experts in one module per layer, built by `@use_experts_implementation`
(Qwen3-MoE, Mixtral, DeepSeek-V3, Qwen2-MoE, OLMoE, ...) with 3D weights and the forward
    experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]
called by the block after its router. The swap replaces that forward on each instance (its class and every other
module stay as they were), so the block's router still decides: mok receives its ids and weights as they are (mok
never renormalizes). The weights are the module's own Parameters, read at every call:
    gate_up_proj [E, 2I, H]   rows [gate; up] ("concat": what HF's `_default_apply_gate` chunks), split by one copy
                              per call through autograd (mok.layouts), its gradient joined back in that layout
    down_proj    [E, H, I]    nn.Linear's [out, in], mok's w_down as it is
HF computes silu(gate)·up, then down, then scales by the routing weight and sums over k: DESIGN §3's function. Weights
and activations of another dtype (an fp32 model) are cast to bf16 at the call through autograd, the output cast
back, as `mok.MoE` does. Undo a swap with `del module.forward`.
"""

from __future__ import annotations

import torch
from torch import nn

from mok.integrations.common import swap_forwards
from mok.layer import moe
from mok.layouts import split_gate_up

BF16 = torch.bfloat16


def _is_experts(module: nn.Module) -> bool:
    """An experts module of transformers >= 5 (`@use_experts_implementation` sets is_transposed, has_bias, ...)."""
    return hasattr(module, "is_transposed") and hasattr(module, "down_proj")


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def unsupported(module: nn.Module) -> str | None:
    """Why mok cannot compute this experts module's function exactly, or None when it can."""
    from transformers.integrations.moe import _default_apply_gate

    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):  # has_gate: transformers >= 5.x
        return "experts without a gate (up_proj only): mok's experts are SwiGLU"
    if getattr(module, "has_bias", False):
        return "expert biases (gate_up_proj_bias, down_proj_bias)"
    if module.is_transposed:
        return "transposed expert weights (gate_up_proj [E, H, 2I]); mok reads [E, 2I, H]"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert"
    if getattr(module, "limit", None) is not None or type(module)._apply_gate is not _default_apply_gate:
        return f"a gate of its own ({type(module).__name__}._apply_gate or a limit, e.g. gpt-oss's clamped SwiGLU)"
    if not _is_silu(getattr(module, "act_fn", None)):
        return f"activation {type(getattr(module, 'act_fn', None)).__name__}; mok's experts are SwiGLU (silu)"
    if getattr(module, "_is_expert_parallel", False):
        return "expert parallelism (routes to other ranks' experts)"
    return None


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts forward through mok.moe: hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K] (the
    block's router's, any float dtype) -> [T, H] in hidden_states' dtype."""
    if getattr(self, "_is_expert_parallel", False):  # set by HF's EP plan after the swap: mok sees local experts only
        raise NotImplementedError(f"{type(self).__name__}: mok does not run HF's expert parallelism")
    w_gate, w_up = split_gate_up(self.gate_up_proj.to(BF16), "concat")  # [E, I, H] each
    out = moe(hidden_states.to(BF16).contiguous(), top_k_index.to(torch.int64).contiguous(),
              top_k_weights.float().contiguous(), w_gate, w_up, self.down_proj.to(BF16).contiguous(),
              precision=self.mok_precision, backend=self.mok_backend)  # [T, H] bf16
    return out.to(hidden_states.dtype)


def swap_experts(model: nn.Module, *, backend: str = "auto", precision: str = "bf16") -> list[str]:
    """Run every experts module of `model` (a transformers model or any module holding some) through mok.moe at
    `backend` and `precision`; returns their names. Raises ValueError naming what it found when there is no experts
    module or one that mok cannot compute exactly (then nothing is swapped)."""
    found = [(name, m) for name, m in model.named_modules() if _is_experts(m)]
    return swap_forwards(model, found, experts_forward, backend=backend, precision=precision,
                         wanted="a transformers >= 5 model with experts modules (@use_experts_implementation: 3D "
                                "gate_up_proj and down_proj)",
                         exact="experts mok computes exactly (SwiGLU, no bias, [E, 2I, H])", unsupported=unsupported,
                         dims=lambda m: (f"gate_up_proj {list(m.gate_up_proj.shape)}", m.gate_up_proj.shape[-1],
                                         m.down_proj.shape[-1]))
