"""L2 `fused`: the MoE layer on mok's Hopper kernels (sm_90a), a few launches per pass.

Same function and interface as L0/L1 (`forward(...) -> (out, saved)`, `backward(saved, d_out)`, see
mok.layer), BF16 only. What runs where today:

forward, all in Hopper kernels except the schedule:
    make_schedule_cuda(topk_idx, block_m=128)  kernels: counts, offsets, placement (one host sync: num_rows)
    grouped_gemm_bf16_swiglu_gather            kernel: dispatch (gather of x rows) + gate/up GEMM + SwiGLU
    grouped_gemm_bf16_nt_contiguous            kernel: down GEMM, y_rows [num_rows, hidden]
    shared expert                              the same two kernels, one expert, a schedule of all tokens in
                                               token order (row t = token t), weights viewed as [1, ...]
    combine_rows                               kernel: out = bf16(Σ_k w·y + shared), fp32, increasing k
backward:
    route_grads_prep                           kernel: d_topk_weights (fixed order) and dy_rows, one pass
    grouped_gemm_bf16_dgrad_swiglu             kernel: d_h = dy·W_down (read transposed) + SwiGLU backward,
                                               and h recomputed from gate/up for d_w_down
    grouped_gemm_bf16_dgrad_gate_up            kernel: dx_rows = d_gate·W_gate + d_up·W_up, one fp32 sum
    shared expert dgrad                        the same two kernels on its one-expert schedule
    grouped_gemm_bf16_weight_grad              kernel, 3 launches: k-grouped d_w_down, d_w_gate, d_w_up over
                                               each expert's rows (x rows gathered by torch first)
    shared expert weight gradients             the same kernel on its one-expert schedule
    combine_rows(dx_rows, weights None, dx_shared)   kernel: the fixed-order d_x sum

Numerics: the forward has exactly L0's rounding points (DESIGN §3); the GEMMs' fp32 sums run in another
order than L0's, so results agree within DESIGN §9's tolerance (most elements bit for bit). Bits
are identical run to run and for any persistent grid size: set it with `num_sms=` or the environment
variable MOK_NUM_SMS (unset or 0: every SM), which tests use to run two grid sizes.

precision="mxfp8" raises NotImplementedError (no fused MXFP8 path yet); backend="auto" then picks L1.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from mok import ops
from mok.checks import fail
from mok.reference import BF16, Saved
from mok.schedule import Schedule, gather_rows, make_schedule

__all__ = ["BLOCK_M", "NUM_SMS_ENV", "PRECISIONS", "FusedSaved", "backward", "experts_forward", "forward",
           "num_sms_from_env", "pad_rows", "shared_schedule"]

BLOCK_M = 128  # schedule tile: a multiple of the GEMM kernels' tile (ops.GEMM_BLOCK_M = 128)
NUM_SMS_ENV = "MOK_NUM_SMS"  # persistent grid size of the GEMM kernels; unset or 0 = all SMs
PRECISIONS = ("bf16",)  # what this level runs (mok.layer.resolve_backend reads it)


@dataclass(eq=False)
class FusedSaved(Saved):
    """L0's Saved, with the routed outputs kept in the schedule's row layout (`y` stays None)."""

    y_rows: torch.Tensor | None = None  # [num_rows, H]
    shared_rows: tuple | None = None  # (gate, up) [R_sh, I_sh] of the shared expert, padding rows included
    num_sms: int | None = None  # the forward's grid size, reused by the backward kernels


def num_sms_from_env() -> int | None:
    """The grid size MOK_NUM_SMS asks for: None (all SMs) when unset, empty or 0."""
    raw = os.environ.get(NUM_SMS_ENV, "").strip()
    if raw in ("", "0"):
        return None
    if not raw.isdigit():
        fail(NUM_SMS_ENV, "unset, 0 (all SMs) or an int >= 1", repr(raw))
    return int(raw)


def _check_runs_here(x: torch.Tensor, precision: str) -> None:
    if precision == "mxfp8":
        raise NotImplementedError("precision: backend 'fused' (L2) has no MXFP8 path yet; use backend='torch' "
                                  "(L1, an MXFP8 emulation) or backend='auto', which picks it for mxfp8")
    if precision not in PRECISIONS:
        fail("precision", f"one of {PRECISIONS} for backend 'fused'", repr(precision))
    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        fail("x", "a CUDA tensor on a Hopper GPU for backend 'fused' (use 'torch' or 'reference' elsewhere)",
             f"device {getattr(x, 'device', type(x).__name__)}")
    ops.require_hopper()


def experts_forward(x, w_gate, w_up, w_down, sched, swiglu_limit, num_sms):
    """GEMM1 (gather + SwiGLU) then GEMM2 over `sched`: (y_rows [R, H], gate [R, I], up [R, I])."""
    h, gate, up = ops.grouped_gemm_bf16_swiglu_gather(x, w_gate, w_up, sched, swiglu_limit=swiglu_limit,
                                                      num_sms=num_sms)  # [R, I] each
    y_rows = ops.grouped_gemm_bf16_nt_contiguous(h, w_down, sched, num_sms=num_sms)  # [R, H]
    return y_rows, gate, up


@functools.lru_cache(maxsize=8)
def shared_schedule(num_tokens: int, device) -> Schedule:
    """The shared expert as one routed expert that every token visits once: rows 0..T-1 are tokens
    0..T-1 in order (routes in ascending token order), then padding up to BLOCK_M. It depends on
    num_tokens alone, so it is built once per (num_tokens, device): no host sync per forward."""
    topk_idx = torch.zeros(num_tokens, 1, dtype=torch.int64, device=device)  # [T, 1]
    return make_schedule(topk_idx, 1, block_m=BLOCK_M)


def forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None, w_shared_up=None,
            w_shared_down=None, *, precision="bf16", swiglu_limit=None, num_sms=None):
    """out [T, H] bf16 and a FusedSaved. num_sms: the GEMMs' grid size (None: MOK_NUM_SMS, else all SMs)."""
    _check_runs_here(x, precision)
    num_sms = num_sms_from_env() if num_sms is None else num_sms
    T = x.shape[0]
    sched = ops.make_schedule_cuda(topk_idx, w_gate.shape[0], block_m=BLOCK_M)  # bitwise make_schedule
    y_rows, gate, up = experts_forward(x, w_gate, w_up, w_down, sched, swiglu_limit, num_sms)  # [R, *]

    shared, shared_gate, shared_up, shared_rows = None, None, None, None
    if w_shared_gate is not None:  # BF16 in every precision (DESIGN §4)
        sh = shared_schedule(T, x.device)  # cached; read-only
        rows = experts_forward(x, w_shared_gate[None], w_shared_up[None], w_shared_down[None], sh,
                                swiglu_limit, num_sms)  # [R_sh, H], [R_sh, I_sh] x2
        shared, shared_gate, shared_up = (t[:T] for t in rows)  # row t = token t: contiguous prefixes
        shared_rows = rows[1:]

    out = ops.combine_rows(y_rows, sched.route_to_row, topk_weights, shared, check_rows=False)  # [T, H]
    saved = FusedSaved(x, topk_idx, topk_weights, (w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                       w_shared_down), gate, up, None, shared_gate, shared_up, precision, swiglu_limit,
                       sched=sched, y_rows=y_rows, shared_rows=shared_rows, num_sms=num_sms)
    return out, saved


def _experts_dgrad(dy_rows, gate, up, w_gate, w_up, w_down, sched, limit, num_sms):
    """The dgrad kernels over `sched`: (d_gate, d_up, h [R, I], dx_rows [R, H]); h is recomputed by the first."""
    d_gate, d_up, h = ops.grouped_gemm_bf16_dgrad_swiglu(dy_rows, w_down, gate, up, sched, swiglu_limit=limit,
                                                         num_sms=num_sms)  # [R, I] each
    dx_rows = ops.grouped_gemm_bf16_dgrad_gate_up(d_gate, d_up, w_gate, w_up, sched, num_sms=num_sms)  # [R, H]
    return d_gate, d_up, h, dx_rows


def _shared_backward(s: FusedSaved, d_out: torch.Tensor) -> tuple:
    """(dx_shared [T, H] or None, [d_w_shared_gate, _up, _down] or Nones): the routed experts' kernels over
    the cached one-expert schedule, whose rows are the tokens in order and then zero padding."""
    ws_gate, ws_up, ws_down = s.weights[3:]
    if ws_gate is None:
        return None, [None, None, None]
    T = d_out.shape[0]
    sh = shared_schedule(T, d_out.device)
    dy_rows, x_rows = pad_rows(d_out, sh.num_rows), pad_rows(s.x, sh.num_rows)  # [R_sh, H] each
    gate_rows, up_rows = s.shared_rows  # [R_sh, I_sh] each
    d_gate, d_up, h_rows, dx_rows = _experts_dgrad(dy_rows, gate_rows, up_rows, ws_gate[None], ws_up[None],
                                                   ws_down[None], sh, s.swiglu_limit, s.num_sms)
    d_w = _weight_grads(x_rows, h_rows, dy_rows, d_gate, d_up, sh, s.num_sms)
    return dx_rows[:T], [w[0] for w in d_w]


def pad_rows(t: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[T, H] -> bf16 [num_rows, H]: row t = t's row t, then zero rows (the shared schedule's row layout)."""
    rows = t.new_zeros(num_rows, t.shape[1], dtype=BF16)  # [num_rows, H]
    rows[: t.shape[0]] = t
    return rows


def _weight_grads(x_rows, h_rows, dy_rows, d_gate, d_up, sched, num_sms) -> list:
    """[d_w_gate [E, I, H], d_w_up [E, I, H], d_w_down [E, H, I]]: the weight-gradient kernel, K = each
    expert's rows."""
    return [ops.grouped_gemm_bf16_weight_grad(d_gate, x_rows, sched, num_sms=num_sms),
            ops.grouped_gemm_bf16_weight_grad(d_up, x_rows, sched, num_sms=num_sms),
            ops.grouped_gemm_bf16_weight_grad(dy_rows, h_rows, sched, num_sms=num_sms)]


def backward(saved: FusedSaved, d_out: torch.Tensor) -> tuple:
    """Gradients in mok.reference.moe_backward's order (see the module docstring for what runs where)."""
    s, sched, limit = saved, saved.sched, saved.swiglu_limit
    w_gate, w_up, w_down = s.weights[:3]
    dy_rows, d_topk_weights = ops.route_grads_prep(d_out, s.topk_weights, s.y_rows, sched)  # [R, H], [T, K]
    d_gate, d_up, h_rows, dx_rows = _experts_dgrad(dy_rows, s.gate, s.up, w_gate, w_up, w_down, sched, limit,
                                                   s.num_sms)
    d_w = _weight_grads(gather_rows(s.x, sched), h_rows, dy_rows, d_gate, d_up, sched, s.num_sms)
    del h_rows, d_gate, d_up
    dx_shared, d_shared = _shared_backward(s, d_out)  # [T, H] bf16 or None
    # d_x[t] = bf16(Σ_k dx_rows[route_to_row[t, k]] + dx_shared[t]) in fp32, increasing k (DESIGN §3)
    d_x = ops.combine_rows(dx_rows, sched.route_to_row, None, dx_shared, check_rows=False)  # [T, H]
    return (d_x, d_topk_weights, *d_w, *d_shared)
