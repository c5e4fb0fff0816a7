"""The differentiable functional op `mok.moe` and the `nn.Module` `mok.MoE` (DESIGN §3).

Every level is a module with the same two functions, so the ladder is one dictionary:
    forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_*, *, precision, swiglu_limit)
        -> (out [T, H] bf16, saved)
    backward(saved, d_out [T, H] bf16) -> (d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_w_shared_*)
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math

import torch
from torch import nn

from mok import routing
from mok.checks import check_expert_ids, check_int, check_moe_inputs, fail
from mok.config import PRECISIONS
from mok.layouts import GATE_UP_LAYOUTS, split_gate_up

# level name -> module implementing forward/backward (DESIGN §6)
LEVELS = {
    "reference": "mok.reference",  # L0
    "torch": "mok.torch_native",  # L1
    "fused": "mok.fused",  # L2 (Hopper kernels; bf16)
    "megakernel": "mok.megakernel",  # L3/L4 (not built yet)
}
HOPPER_LEVELS = ("megakernel", "fused")  # run only on sm_90 (Hopper); "auto" tries them deepest first


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _lists(name: str, attr: str, value, default=()) -> bool:
    """Whether level `name` is built and its `attr` (PRECISIONS, OPTIONS; `default` where it has none) holds `value`."""
    return importlib.util.find_spec(LEVELS[name]) is not None and value in getattr(get_level(name), attr, default)


def resolve_backend(backend: str, device: torch.device, precision: str = "bf16") -> str:
    """"auto" picks the deepest level that exists and runs `precision` on `device`: the Hopper levels
    on an sm_90 GPU only; L1 ("torch") everywhere else."""
    if backend == "auto":
        if _is_hopper(device):
            for name in HOPPER_LEVELS:
                if _lists(name, "PRECISIONS", precision, PRECISIONS):
                    return name
        return "torch"
    if backend not in LEVELS:
        raise ValueError(f"backend: expected 'auto' or one of {list(LEVELS)}, got {backend!r}")
    if importlib.util.find_spec(LEVELS[backend]) is None:
        raise NotImplementedError(f"backend: level {backend!r} is not built yet; use 'reference' or 'torch'")
    return backend


def get_level(backend: str):
    return importlib.import_module(LEVELS[backend])


def _level_options(backend: str, **options) -> dict:
    """The options given (not None), checked against what level `backend` takes (its OPTIONS)."""
    given = {name: value for name, value in options.items() if value is not None}
    takes = getattr(get_level(backend), "OPTIONS", ())
    for name, value in given.items():
        if name not in takes:
            fail(name, f"None for backend {backend!r} (levels that take it: "
                       f"{[n for n in LEVELS if n != backend and _lists(n, 'OPTIONS', name)]})", repr(value))
    return given


class _Slot(int):
    """A tensor's position in ctx.saved_tensors, standing in for it in the level's Saved on ctx."""


def _to_slots(value, tensors: list, slots: dict):
    """value with every tensor (also inside tuples) replaced by its _Slot, appending new tensors to `tensors`."""
    if isinstance(value, torch.Tensor):
        if id(value) not in slots:
            slots[id(value)] = _Slot(len(tensors))
            tensors.append(value)
        return slots[id(value)]
    if isinstance(value, tuple):
        return tuple(_to_slots(v, tensors, slots) for v in value)
    return value


def _from_slots(value, tensors: tuple):
    if isinstance(value, _Slot):
        return tensors[value]
    if isinstance(value, tuple):
        return tuple(_from_slots(v, tensors) for v in value)
    return value


class _MoEFunction(torch.autograd.Function):
    """Every tensor of the level's Saved (the inputs x, topk_idx, topk_weights and weights first, then its own
    activations) goes through save_for_backward: autograd checks their versions (an input modified in place
    raises), keeps them for retain_graph and frees them after the last backward. Other fields (a schedule,
    options) stay on ctx as they are."""

    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down,
                precision, swiglu_limit, backend, options):
        level = get_level(backend)
        inputs = (x, topk_idx, topk_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down)
        out, saved = level.forward(*inputs, precision=precision, swiglu_limit=swiglu_limit, **options)
        tensors, slots = [], {}
        _to_slots(inputs, tensors, slots)  # the inputs first, whether or not the level's Saved holds them
        ctx.saved = dataclasses.replace(saved, **{f.name: _to_slots(getattr(saved, f.name), tensors, slots)
                                                  for f in dataclasses.fields(saved)})
        ctx.save_for_backward(*tensors)
        ctx.level = level
        ctx.mark_non_differentiable(topk_idx)
        return out

    @staticmethod
    def backward(ctx, d_out):
        tensors = ctx.saved_tensors  # raises if an input was modified in place since the forward
        saved = dataclasses.replace(ctx.saved, **{f.name: _from_slots(getattr(ctx.saved, f.name), tensors)
                                                  for f in dataclasses.fields(ctx.saved)})
        with torch.no_grad():
            d_x, d_tw, *d_w = ctx.level.backward(saved, d_out.contiguous())
        grads = (d_x, d_tw, *d_w)
        # torch's once_differentiable, but for the saved inputs too: under create_graph=True the gradients
        # depend on x and the weights even when d_out needs no grad (a loss's ones), and would otherwise come
        # back as constants, a silently missing second-order term.
        if torch.is_grad_enabled():
            grads = _NoDoubleBackward.apply(len(grads), *grads, d_out, *tensors)
        d_x, d_tw, *d_w = grads
        return (d_x, None, d_tw, *d_w, None, None, None, None)


class _NoDoubleBackward(torch.autograd.Function):
    """The identity on a create_graph=True backward's gradients, linked to what they depend on (d_out and the
    saved inputs); differentiating them raises."""

    @staticmethod
    def forward(ctx, num_grads, *grads_then_inputs):  # the inputs only link the gradients to the graph
        return tuple(g if g is None else g.view_as(g) for g in grads_then_inputs[:num_grads])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("mok.moe: double backward is not supported (its backward is once-differentiable): "
                           "the gradients of a create_graph=True backward through it cannot be differentiated")


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
    backend = resolve_backend(backend, x.device, precision)
    options = _level_options(backend, num_sms=num_sms, mx_weights=mx_weights)
    if check or not getattr(get_level(backend), "CHECKS_IDS_ON_DEVICE", False):
        check_expert_ids(topk_idx, w_gate.shape[0])
    return _MoEFunction.apply(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate,
                              w_shared_up, w_shared_down, precision, swiglu_limit, backend, options)


class MoE(nn.Module):
    """A routed SwiGLU MoE block (plus an optional shared expert) with a softmax top-k router.

    x [..., hidden] -> [..., hidden] in x's dtype. The router runs in fp32 in plain PyTorch and receives
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
        logits = x2.float() @ self.w_router.float().T  # [num_tokens, num_experts] fp32
        tile = self.route_tile
        if tile is not None and x2.shape[0] * self.num_topk < tile * self.num_experts:
            tile = None  # too few routes to round: plain top-k (class docstring)
        routes = routing.softmax_topk(logits, self.num_topk, tile=tile)
        topk_idx, topk_weights = (t.contiguous() for t in routes)
        gate_up = ((self.w_gate, self.w_up) if self.gate_up_layout is None
                   else split_gate_up(self.w_gate_up, self.gate_up_layout))  # [E, I, H] each
        weights = (*gate_up, self.w_down, self.w_shared_gate, self.w_shared_up, self.w_shared_down)
        weights = [None if w is None else w.to(torch.bfloat16) for w in weights]  # no copy when already bf16
        out = moe(x2.to(torch.bfloat16).contiguous(), topk_idx, topk_weights, *weights,
                  precision=self.precision, swiglu_limit=self.swiglu_limit, backend=self.backend,
                  num_sms=self.num_sms, mx_weights=self.mx_weights)
        return out.to(x.dtype).view(shape)
