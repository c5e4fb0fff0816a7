"""L1 `torch`: the path MoE users have today — permute, `torch._grouped_mm`, un-permute.

Same function as L0 (mok.reference), written the way training code does it: routes sorted into
expert-major segments (mok.schedule), one grouped GEMM per projection over all experts, a
k-grouped GEMM per weight gradient, and an un-permute before the fixed-order combine. Where
`torch._grouped_mm` cannot run (no kernel for this device/dtype, strides it does not take), a per-expert loop
stands in for that call.

Differences from L0 that stay inside the DESIGN §9 tolerance: `_grouped_mm` writes BF16 only, so the
gate/up dgrad is two GEMMs each rounded to BF16, then summed (L0 rounds once).
In mxfp8 mode segments are padded to 32 rows so column-wise MX blocks align with segment starts.
"""

from __future__ import annotations

import torch

from mok import schedule as sch
from mok.reference import BF16, Saved, combine, quant, swiglu, swiglu_backward

# Where L1 uses torch._grouped_mm. On the CPU torch's version is a slow reference (tens of ms on a tiny problem,
# about 40x the per-expert loop), so L1 loops there.
GROUPED_MM_DEVICES = ("cuda",)


def _try_grouped_mm(*args, **kwargs) -> torch.Tensor | None:
    """torch._grouped_mm(*args) where it runs; None where it cannot for this call (not a GROUPED_MM_DEVICES device;
    no kernel for this dtype or torch version; strides it does not take). Decided per call: an odd shape never turns
    it off for later calls. Running out of memory is an error, not a reason to fall back."""
    if args[0].device.type not in GROUPED_MM_DEVICES:
        return None
    try:
        return torch._grouped_mm(*args, **kwargs)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped a·b per expert segment: a [R, K] (segments end at offs [E]), b [E, K, N] -> [R, N]."""
    out = _try_grouped_mm(a, b, offs=offs)
    if out is not None:
        return out
    out = a.new_zeros(a.shape[0], b.shape[2])  # [R, N]
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[e]
        start = end
    return out


def gmm_k(a_t: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """k-grouped a_tᵀ·b per segment of the shared R dim (weight gradients): a_t [R, M], b [R, N]
    -> [E, M, N]; an expert with an empty segment gets zeros."""
    out = _try_grouped_mm(a_t.T, b, offs=offs)
    if out is not None:
        return out
    out = a_t.new_zeros(offs.numel(), a_t.shape[1], b.shape[1])  # [E, M, N]
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[e] = a_t[start:end].T @ b[start:end]
        start = end
    return out


def _linear(x, w):
    """x·wᵀ in BF16 with fp32 accumulation (cuBLAS / CPU BLAS)."""
    return torch.nn.functional.linear(x, w)


def _shared_forward(x, ws_gate, ws_up, ws_down, limit):
    gate, up = _linear(x, ws_gate), _linear(x, ws_up)  # [T, I_sh] each
    h = swiglu(gate, up, limit).to(BF16)  # [T, I_sh]
    return _linear(h, ws_down), gate, up  # [T, H]


def forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None, w_shared_up=None,
            w_shared_down=None, *, precision="bf16", swiglu_limit=None):
    p = precision
    sched = sch.make_schedule(topk_idx, w_gate.shape[0], block_m=32 if p == "mxfp8" else 1)
    offs = sched.expert_offsets[1:].to(torch.int32)  # [E] segment ends
    x_rows = sch.gather_rows(quant(x, -1, p), sched)  # [R, H] permuted copy (zero padding rows)
    gate = gmm(x_rows, quant(w_gate, -1, p).transpose(1, 2), offs)  # [R, I]
    up = gmm(x_rows, quant(w_up, -1, p).transpose(1, 2), offs)  # [R, I]
    h = swiglu(gate, up, swiglu_limit).to(BF16)  # [R, I]
    y_rows = gmm(quant(h, -1, p), quant(w_down, -1, p).transpose(1, 2), offs)  # [R, H]
    y = sch.scatter_routes(y_rows, sched)  # [T, K, H] un-permute
    shared, sg, su = (None, None, None)
    if w_shared_gate is not None:
        shared, sg, su = _shared_forward(x, w_shared_gate, w_shared_up, w_shared_down, swiglu_limit)
    out = combine(y, topk_weights, shared)  # [T, H]
    saved = Saved(x, topk_idx, topk_weights, (w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                  w_shared_down), quant(gate, -1, p), quant(up, -1, p), y, sg, su, p, swiglu_limit,
                  sched=sched)  # gate/up stay in the permuted row layout
    return out, saved


def saved_like(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None, w_shared_up=None,
               w_shared_down=None, *, precision="bf16", swiglu_limit=None, dynamic_size=None) -> Saved:
    """forward's Saved with empty tensors of its shapes and dtypes (mok.levels). Its schedule has T·K rows in bf16
    (block_m 1: no padding); in mxfp8 (block_m 32) a count that depends on the ids, taken from dynamic_size()."""
    T, H = x.shape
    K, E, I = topk_idx.shape[1], w_gate.shape[0], w_gate.shape[1]
    block_m = 32 if precision == "mxfp8" else 1
    num_rows = T * K if block_m == 1 else dynamic_size()
    sched = sch.schedule_like(T, K, E, block_m, num_rows, x.device)
    shared_gate, shared_up = None, None
    if w_shared_gate is not None:
        shared_gate, shared_up = (x.new_empty(T, w_shared_gate.shape[0]) for _ in range(2))  # [T, I_sh] each
    return Saved(x, topk_idx, topk_weights, (w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down),
                 x.new_empty(num_rows, I), x.new_empty(num_rows, I), x.new_empty(T, K, H), shared_gate, shared_up,
                 precision, swiglu_limit, sched=sched)  # gate/up [R, I] in the schedule's rows, y [T, K, H]


def weight_grads(x_rows, h, dy_rows, d_gate, d_up, offs, p):
    """Routed weight gradients as k-grouped GEMMs over each expert's rows (K = its tokens):
    (d_w_gate [E, I, H], d_w_up [E, I, H], d_w_down [E, H, I])."""
    d_w_down = gmm_k(quant(dy_rows, -2, p), quant(h, -2, p), offs)  # [E, H, I]
    d_w_gate = gmm_k(quant(d_gate, -2, p), quant(x_rows, -2, p), offs)  # [E, I, H]
    d_w_up = gmm_k(quant(d_up, -2, p), quant(x_rows, -2, p), offs)  # [E, I, H]
    return [d_w_gate, d_w_up, d_w_down]


def route_grads(d_out: torch.Tensor, topk_weights: torch.Tensor, y: torch.Tensor, sched) -> tuple:
    """d_topk_weights [T, K] fp32 = Σ_h d_out·y (y [T, K, H] per route), and dy_rows [R, H] = bf16(d_out·w)
    in `sched`'s rows (zeros in padding rows), as L0 computes them. Shared by L1, L2 and mok.twins."""
    T, K, H = y.shape
    d_topk_weights = (d_out.float()[:, None, :] * y.float()).sum(-1)  # [T, K]
    dy = (d_out.float()[:, None, :] * topk_weights[:, :, None]).to(BF16)  # [T, K, H]
    return d_topk_weights, sch.gather_routes(dy.view(T * K, H), sched)  # [T, K], [R, H]


def routed_backward(saved: Saved, d_out: torch.Tensor, y: torch.Tensor) -> tuple:
    """The routed experts' backward on the schedule's rows (saved.sched; gate/up saved in its row
    layout), y [T, K, H] the per-route outputs. Returns (d_topk_weights [T, K] fp32, dx_rows [R, H] bf16,
    [d_w_gate, d_w_up, d_w_down])."""
    s, sched, p, limit = saved, saved.sched, saved.precision, saved.swiglu_limit
    w_gate, w_up, w_down = s.weights[:3]
    offs = sched.expert_offsets[1:].to(torch.int32)  # [E]
    d_topk_weights, dy_rows = route_grads(d_out, s.topk_weights, y, sched)  # [T, K], [R, H]
    d_h = gmm(quant(dy_rows, -1, p), quant(w_down, -2, p), offs)  # [R, I]: K = hidden
    d_gate, d_up = (g.to(BF16) for g in swiglu_backward(s.gate, s.up, d_h, limit))  # [R, I] each
    dx_rows = (gmm(quant(d_gate, -1, p), quant(w_gate, -2, p), offs).float()
               + gmm(quant(d_up, -1, p), quant(w_up, -2, p), offs).float()).to(BF16)  # [R, H]
    h = swiglu(s.gate, s.up, limit).to(BF16)  # [R, I] recomputed
    x_rows = sch.gather_rows(s.x, sched)  # [R, H]
    return d_topk_weights, dx_rows, weight_grads(x_rows, h, dy_rows, d_gate, d_up, offs, p)


def shared_backward(saved: Saved, d_out: torch.Tensor) -> tuple:
    """The shared expert's backward (BF16, DESIGN §4) from its saved gate/up [T, I_sh]. Returns
    (dx_shared [T, H] bf16 — rounded once, as L0's — or None, [d_w_shared_gate, _up, _down] or Nones)."""
    s = saved
    ws_gate, ws_up, ws_down = s.weights[3:]
    if ws_gate is None:
        return None, [None, None, None]
    d_h = _linear(d_out.to(BF16), ws_down.T)  # [T, I_sh]
    d_gate, d_up = (g.to(BF16) for g in swiglu_backward(s.shared_gate, s.shared_up, d_h, s.swiglu_limit))
    h = swiglu(s.shared_gate, s.shared_up, s.swiglu_limit).to(BF16)  # [T, I_sh]
    dx_shared = (_linear(d_gate, ws_gate.T).float() + _linear(d_up, ws_up.T).float()).to(BF16)  # [T, H]
    d_w = [_linear(d_gate.T, s.x.T), _linear(d_up.T, s.x.T), _linear(d_out.to(BF16).T, h.T)]  # cuBLAS, BF16
    return dx_shared, d_w


def backward(saved: Saved, d_out: torch.Tensor) -> tuple:
    s, sched = saved, saved.sched
    T, K, H = s.y.shape
    d_topk_weights, dx_rows, d_w = routed_backward(s, d_out, s.y)
    dx = sch.scatter_routes(dx_rows, sched)  # [T, K, H]
    dx_shared, d_shared = shared_backward(s, d_out)
    d_x = torch.zeros(T, H, dtype=torch.float32, device=d_out.device)  # [T, H]
    for k in range(K):  # fixed order: increasing k, then the shared expert
        d_x += dx[:, k].float()
    if dx_shared is not None:
        d_x += dx_shared.float()
    return (d_x.to(BF16), d_topk_weights, *d_w, *d_shared)
