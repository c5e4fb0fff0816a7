"""The differentiable functional op `mok.moe` and the `nn.Module` `mok.MoE` (DESIGN §3).

Both run mok's custom ops (mok.library), in eager and under torch.compile(fullgraph=True) alike: `mok.moe` is
mok::moe_forward with its autograd formula, `mok.MoE` adds its router, mok::softmax_topk_router. The levels they run
are mok.levels' ladder (its names are importable from here too).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mok import library  # noqa: F401  registers the mok:: ops
from mok.checks import check_int, check_moe_inputs, check_optional_int, fail
from mok.config import PRECISIONS
from mok.layouts import GATE_UP_LAYOUTS, split_gate_up
from mok.levels import HOPPER_LEVELS, LEVELS, get_level, level_options, resolve_backend  # noqa: F401  (API)

__all__ = ["HOPPER_LEVELS", "LEVELS", "MoE", "get_level", "level_options", "moe", "resolve_backend"]


def moe(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None, w_shared_up=None,
        w_shared_down=None, *, precision: str = "bf16", swiglu_limit: float | None = None,
        backend: str = "auto", check: bool = False, num_sms: int | None = None,
        mx_weights: str | None = None) -> torch.Tensor:
    """The MoE layer: out [num_tokens, hidden] bf16. mok does not route: topk_idx/topk_weights come
    from the caller, weights already normalized. Differentiable in x, topk_weights and all weights.

    Expert ids outside [0, num_experts) raise ValueError. On a level that checks them on the device (`fused`:
    no host sync per call) the error comes from a later call, the same step's backward in practice, and the
    routes are skipped meanwhile (their tokens' outputs NaN: mok.bad_ids); check=True reads the ids' range on
    the host first (one sync) and raises in this call, on every level.

    Options of the `fused` level (None: the default, from the environment read once at import, README's table):
    num_sms, the persistent grid size of its kernels (bits are the same for any); mx_weights, how its mxfp8 forward
    feeds the weights to the GEMMs, "dequantize" (a bf16 round trip) or "mainloop" (E4M3 read by the GEMMs: less
    memory, slower; the same bits). Giving one to a level that has no such option raises ValueError."""
    check_moe_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                     w_shared_down, precision=precision, swiglu_limit=swiglu_limit, check_ids=False)
    # The op's schema takes these types only (it would refuse others with a less clear error, or turn True into 1);
    # the values are the level's to check, inside the op, where the level is resolved.
    if not isinstance(backend, str):
        fail("backend", f"'auto' or one of {list(LEVELS)}", repr(backend))
    check_optional_int("num_sms", num_sms, 1)
    if mx_weights is not None and not isinstance(mx_weights, str):
        fail("mx_weights", "None or a str (the fused level's weight path)", repr(mx_weights))
    out, _ = torch.ops.mok.moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                                       w_shared_down, backend, precision, swiglu_limit, num_sms, mx_weights,
                                       bool(check))
    return out


class MoE(nn.Module):
    """A routed SwiGLU MoE block (plus an optional shared expert) with a softmax top-k router.

    x [..., hidden] -> [..., hidden] in x's dtype. The router runs in fp32 (an op of its own, mok.library) and receives
    gradients through topk_weights; the experts run at the chosen level and precision on bf16 x and bf16
    weights. The module follows `.to(dtype)`: parameters in fp32 (master weights) or fp16 are cast to bf16
    at the call, and their gradients come back in their own dtype.

    With `route_tile` (128: the fused level's tile), the router rounds every expert's routes to a multiple of it
    (routing.round_to_tiles): no padding rows in the fused level's GEMMs, for 1-3% of the routes moved to
    their tokens' next choices (a change to the model's routing; on a GPU in mok's kernels, which add no host read:
    docs/routing.md). A batch of fewer than route_tile·num_experts/num_topk tokens, too few to round (an eval
    batch, a last partial batch), takes the plain top-k.

    With `gate_up_layout` ("concat", as Hugging Face's gate_up_proj, or "interleaved", as SonicMoE's) the module
    holds one `w_gate_up` [E, 2I, H] in that layout instead of `w_gate` and `w_up`, split by a copy at every call
    (mok.layouts, which says what the copy costs)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, num_topk: int,
                 shared_intermediate: int = 0, *, precision: str = "bf16",
                 swiglu_limit: float | None = None, backend: str = "auto", route_tile: int | None = None,
                 num_sms: int | None = None, mx_weights: str | None = None, gate_up_layout: str | None = None,
                 device=None):
        super().__init__()
        for name, value in (("hidden", hidden), ("intermediate", intermediate), ("num_experts", num_experts)):
            check_int(name, value, 1)
        check_int("num_topk", num_topk, 1, num_experts)
        check_int("shared_intermediate", shared_intermediate, 0)
        if precision not in PRECISIONS:
            fail("precision", f"one of {PRECISIONS}", repr(precision))
        if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float)) and swiglu_limit > 0):
            fail("swiglu_limit", "None or a positive float", repr(swiglu_limit))
        if backend != "auto" and backend not in LEVELS:
            fail("backend", f"'auto' or one of {list(LEVELS)}", repr(backend))
        if route_tile is not None:
            check_int("route_tile", route_tile, 1)
        if gate_up_layout is not None and gate_up_layout not in GATE_UP_LAYOUTS:
            fail("gate_up_layout", f"None (separate w_gate, w_up) or one of {GATE_UP_LAYOUTS}", repr(gate_up_layout))
        self.gate_up_layout = gate_up_layout
        self.hidden, self.intermediate, self.num_experts = hidden, intermediate, num_experts
        self.num_topk, self.shared_intermediate = num_topk, shared_intermediate
        self.precision, self.swiglu_limit, self.backend = precision, swiglu_limit, backend
        self.route_tile, self.num_sms, self.mx_weights = route_tile, num_sms, mx_weights  # options: mok.moe's

        def param(*shape, fan_in):
            w = torch.randn(*shape, device=device) / math.sqrt(fan_in)
            return nn.Parameter(w.to(torch.bfloat16))

        self.w_router = nn.Parameter(torch.randn(num_experts, hidden, device=device) / math.sqrt(hidden))
        if gate_up_layout is None:
            self.w_gate = param(num_experts, intermediate, hidden, fan_in=hidden)
            self.w_up = param(num_experts, intermediate, hidden, fan_in=hidden)
        else:  # one [E, 2I, H] weight in that layout (mok.layouts), split by a copy at every call
            self.w_gate_up = param(num_experts, 2 * intermediate, hidden, fan_in=hidden)
        self.w_down = param(num_experts, hidden, intermediate, fan_in=intermediate)
        shared = shared_intermediate > 0
        self.w_shared_gate = param(shared_intermediate, hidden, fan_in=hidden) if shared else None
        self.w_shared_up = param(shared_intermediate, hidden, fan_in=hidden) if shared else None
        self.w_shared_down = param(hidden, shared_intermediate, fan_in=shared_intermediate) if shared else None

    def extra_repr(self) -> str:
        s = (f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
             f"num_topk={self.num_topk}, shared_intermediate={self.shared_intermediate}, "
             f"precision={self.precision!r}, backend={self.backend!r}")
        for name in ("swiglu_limit", "route_tile", "num_sms", "mx_weights", "gate_up_layout"):
            if getattr(self, name) is not None:
                s += f", {name}={getattr(self, name)!r}"
        return s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden:
            fail("x", f"a tensor [..., hidden={self.hidden}]", list(getattr(x, "shape", [type(x).__name__])))
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # [num_tokens, hidden]
        tile = self.route_tile
        if tile is not None and x2.shape[0] * self.num_topk < tile * self.num_experts:
            tile = None  # too few routes to round: plain top-k (class docstring)
        # routing.softmax_topk on fp32 logits, in an op: eager's bits under torch.compile too (mok.library)
        topk_idx, topk_weights, _ = torch.ops.mok.softmax_topk_router(x2, self.w_router, self.num_topk, tile)
        gate_up = ((self.w_gate, self.w_up) if self.gate_up_layout is None
                   else split_gate_up(self.w_gate_up, self.gate_up_layout))  # [E, I, H] each
        weights = (*gate_up, self.w_down, self.w_shared_gate, self.w_shared_up, self.w_shared_down)
        weights = [None if w is None else w.to(torch.bfloat16) for w in weights]  # no copy when already bf16
        out = moe(x2.to(torch.bfloat16).contiguous(), topk_idx, topk_weights, *weights,
                  precision=self.precision, swiglu_limit=self.swiglu_limit, backend=self.backend,
                  num_sms=self.num_sms, mx_weights=self.mx_weights)
        return out.to(x.dtype).view(shape)
