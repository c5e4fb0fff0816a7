"""L0 `reference`: the executable spec of DESIGN §3–§5, in plain PyTorch (CPU or GPU).

Naive on purpose: a Python loop over experts, every GEMM written as an fp32 matmul of BF16 values
(products of BF16 are exact in fp32, so `a.float() @ b.float().T` *is* "bf16 inputs, fp32
accumulation"), one rounding to BF16 wherever a kernel writes BF16 to memory. In `mxfp8` mode every
operand the recipe quantizes (DESIGN §4) goes through `fake_quantize`, which is bit-exact MXFP8
emulation: an E4M3 value times 2^e is exactly representable, so the GEMMs stay exact-product GEMMs.

Every deeper level (L1 torch, L2 fused, L3 megakernel, L4 EP) is tested against this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok import mxfp8
from mok.config import PRECISIONS

BF16 = torch.bfloat16


# --- building blocks ------------------------------------------------------------------------------

def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·bᵀ with fp32 accumulation: a [m, k], b [n, k] (nn.Linear layout) -> fp32 [m, n]."""
    return a.float() @ b.float().T


def quant(x: torch.Tensor, dim: int, precision: str) -> torch.Tensor:
    """The operand a GEMM sees: x itself in bf16, MXFP8 quantize→dequantize along its K dim in mxfp8.

    Blocks of 32 are aligned to the start of `dim`; a length that is not a multiple of 32 (an
    expert segment of tokens, for weight gradients) is padded with zero rows, as the kernels do."""
    if precision == "bf16":
        return x
    return mxfp8.fake_quantize(x, dim=dim, pad=True)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(g)·u in fp32; with a limit L: g = min(g, L), u = clamp(u, -L, L). Returns fp32."""
    g, u = gate.float(), up.float()
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g * torch.sigmoid(g) * u


def swiglu_backward(gate, up, d_h, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_gate, d_up) in fp32; zero where the limit clamped (g > L, |u| > L), as torch.clamp does."""
    g, u, d_h = gate.float(), up.float(), d_h.float()
    if limit is not None:
        g_pass, u_pass = g <= limit, (u >= -limit) & (u <= limit)
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    s = torch.sigmoid(g)
    d_gate = d_h * u * s * (1 + g * (1 - s))  # d silu(g)/dg = s·(1 + g·(1 − s))
    d_up = d_h * g * s
    if limit is not None:
        d_gate, d_up = d_gate * g_pass, d_up * u_pass
    return d_gate, d_up


def combine(y: torch.Tensor, topk_weights: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """out[t] = bf16(Σ_k w[t,k]·y[t,k] + shared[t]), summed in fp32 in increasing k (DESIGN §3)."""
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)  # [T, H]
    for k in range(y.shape[1]):
        acc += topk_weights[:, k, None] * y[:, k].float()  # [T, H]
    if shared is not None:
        acc += shared.float()
    return acc.to(BF16)


def routes_of_expert(topk_idx: torch.Tensor, e: int) -> torch.Tensor:
    """Route ids r = t·K + k sent to expert e, ascending (token, k): the schedule order of §5."""
    return (topk_idx.flatten() == e).nonzero().squeeze(1)  # [n]


# --- one expert (also the unit of the EP reference, mok.comm) --------------------------------------

def expert_forward(x_e, w_gate_e, w_up_e, w_down_e, *, precision="bf16", swiglu_limit=None):
    """One SwiGLU expert on its rows, in order. x_e [n, H]; w_gate_e, w_up_e [I, H]; w_down_e [H, I].

    Returns (y_e [n, H], gate_e [n, I], up_e [n, I]); gate/up are what the forward saves (bf16, or
    their MXFP8 round trip in mxfp8 mode)."""
    xq = quant(x_e, -1, precision)  # [n, H] row-wise: K of GEMM1 is hidden
    gate = mm(xq, quant(w_gate_e, -1, precision)).to(BF16)  # [n, I]
    up = mm(xq, quant(w_up_e, -1, precision)).to(BF16)  # [n, I]
    h = swiglu(gate, up, swiglu_limit).to(BF16)  # [n, I]
    y = mm(quant(h, -1, precision), quant(w_down_e, -1, precision)).to(BF16)  # [n, H]
    return y, quant(gate, -1, precision), quant(up, -1, precision)


def expert_backward(x_e, gate_e, up_e, dy_e, w_gate_e, w_up_e, w_down_e, *, precision="bf16",
                    swiglu_limit=None):
    """Backward of one expert. dy_e [n, H] is already bf16(d_out·w). Returns
    (dx_e [n, H], d_w_gate_e [I, H], d_w_up_e [I, H], d_w_down_e [H, I]), all bf16."""
    p = precision
    d_h = mm(quant(dy_e, -1, p), quant(w_down_e, -2, p).T).to(BF16)  # [n, I]: K = hidden
    d_gate, d_up = swiglu_backward(gate_e, up_e, d_h, swiglu_limit)  # [n, I] fp32 each
    d_gate, d_up = d_gate.to(BF16), d_up.to(BF16)
    h = swiglu(gate_e, up_e, swiglu_limit).to(BF16)  # [n, I], recomputed from the saved gate/up
    # dgrad of gate and up: one GEMM over K = 2·intermediate, one rounding.
    dx = (mm(quant(d_gate, -1, p), quant(w_gate_e, -2, p).T)
          + mm(quant(d_up, -1, p), quant(w_up_e, -2, p).T)).to(BF16)  # [n, H]
    # wgrad: K = this expert's tokens; column-wise quantization (blocks along tokens) from BF16.
    d_w_down = mm(quant(dy_e, -2, p).T, quant(h, -2, p).T).to(BF16)  # [H, I]
    d_w_gate = mm(quant(d_gate, -2, p).T, quant(x_e, -2, p).T).to(BF16)  # [I, H]
    d_w_up = mm(quant(d_up, -2, p).T, quant(x_e, -2, p).T).to(BF16)  # [I, H]
    return dx, d_w_gate, d_w_up, d_w_down


# --- the MoE layer --------------------------------------------------------------------------------

@dataclass
class Saved:
    """What the forward keeps for the backward."""
    x: torch.Tensor  # [T, H]
    topk_idx: torch.Tensor  # [T, K]
    topk_weights: torch.Tensor  # [T, K]
    weights: tuple  # (w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down)
    gate: torch.Tensor  # [T·K, I] per route (MXFP8 round trip in mxfp8 mode)
    up: torch.Tensor  # [T·K, I]
    y: torch.Tensor  # [T, K, H] per-route expert outputs, for d_topk_weights
    shared_gate: torch.Tensor | None  # [T, I_sh]
    shared_up: torch.Tensor | None  # [T, I_sh]
    precision: str
    swiglu_limit: float | None
    sched: object = None  # levels that keep gate/up in a schedule's row layout (L1) put it here


def moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down,
                w_shared_gate=None, w_shared_up=None, w_shared_down=None, *,
                precision="bf16", swiglu_limit=None) -> tuple[torch.Tensor, Saved]:
    """out [T, H] bf16 and the saved state. Shapes and dtypes: DESIGN §3 (checked in mok.checks)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    T, H = x.shape
    K, E, I = topk_idx.shape[1], w_gate.shape[0], w_gate.shape[1]
    y = x.new_zeros(T * K, H)  # [T·K, H] one output slot per route
    gate = x.new_zeros(T * K, I)  # [T·K, I]
    up = x.new_zeros(T * K, I)  # [T·K, I]
    for e in range(E):
        routes = routes_of_expert(topk_idx, e)  # [n]
        if routes.numel() == 0:
            continue
        x_e = x[routes // K]  # [n, H] dispatch: gather the routed tokens
        y[routes], gate[routes], up[routes] = expert_forward(
            x_e, w_gate[e], w_up[e], w_down[e], precision=precision, swiglu_limit=swiglu_limit)
    y = y.view(T, K, H)  # [T, K, H]

    shared, shared_gate, shared_up = None, None, None
    if w_shared_gate is not None:  # the shared expert always runs in BF16 (DESIGN §4)
        shared, shared_gate, shared_up = expert_forward(
            x, w_shared_gate, w_shared_up, w_shared_down, precision="bf16", swiglu_limit=swiglu_limit)
    out = combine(y, topk_weights, shared)  # [T, H]
    saved = Saved(x, topk_idx, topk_weights, (w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                  w_shared_down), gate, up, y, shared_gate, shared_up, precision, swiglu_limit)
    return out, saved


def moe_backward(saved: Saved, d_out: torch.Tensor) -> tuple:
    """Gradients (d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_w_shared_gate, d_w_shared_up,
    d_w_shared_down); the shared ones are None without a shared expert."""
    s = saved
    w_gate, w_up, w_down, ws_gate, ws_up, ws_down = s.weights
    T, K, H = s.y.shape
    # d_topk_weights[t,k] = Σ_h d_out[t,h]·y[t,k,h] in fp32
    d_topk_weights = (d_out.float()[:, None, :] * s.y.float()).sum(-1)  # [T, K]
    dy = (d_out.float()[:, None, :] * s.topk_weights[:, :, None]).to(BF16).view(T * K, H)  # [T·K, H]

    dx = torch.zeros(T * K, H, dtype=BF16, device=d_out.device)  # [T·K, H] per-route dx
    d_w = [torch.zeros_like(w) for w in (w_gate, w_up, w_down)]  # experts without tokens: zero
    for e in range(w_gate.shape[0]):
        routes = routes_of_expert(s.topk_idx, e)  # [n]
        if routes.numel() == 0:
            continue
        dx[routes], d_w[0][e], d_w[1][e], d_w[2][e] = expert_backward(
            s.x[routes // K], s.gate[routes], s.up[routes], dy[routes], w_gate[e], w_up[e], w_down[e],
            precision=s.precision, swiglu_limit=s.swiglu_limit)

    d_x = torch.zeros(T, H, dtype=torch.float32, device=d_out.device)  # [T, H] fp32
    for k in range(K):  # fixed order: increasing k, then the shared expert
        d_x += dx.view(T, K, H)[:, k].float()
    d_shared = (None, None, None)
    if ws_gate is not None:
        dx_shared, *d_shared = expert_backward(
            s.x, s.shared_gate, s.shared_up, d_out.to(BF16), ws_gate, ws_up, ws_down,
            precision="bf16", swiglu_limit=s.swiglu_limit)
        d_x += dx_shared.float()
    return (d_x.to(BF16), d_topk_weights, *d_w, *d_shared)


def saved_like(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None, w_shared_up=None,
               w_shared_down=None, *, precision="bf16", swiglu_limit=None, dynamic_size=None) -> Saved:
    """moe_forward's Saved with empty tensors of its shapes and dtypes, from the inputs' shapes (mok.levels); no size
    here depends on the ids, so dynamic_size (a source of data-dependent sizes) goes unused."""
    T, H = x.shape
    K, I = topk_idx.shape[1], w_gate.shape[1]
    gate, up = x.new_empty(T * K, I), x.new_empty(T * K, I)  # [T·K, I] bf16 each
    shared_gate, shared_up = None, None
    if w_shared_gate is not None:
        shared_gate, shared_up = (x.new_empty(T, w_shared_gate.shape[0]) for _ in range(2))  # [T, I_sh] each
    return Saved(x, topk_idx, topk_weights, (w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down),
                 gate, up, x.new_empty(T, K, H), shared_gate, shared_up, precision, swiglu_limit)


# The level interface of mok.levels (every level exposes forward/backward/saved_like with these signatures).
forward, backward = moe_forward, moe_backward
