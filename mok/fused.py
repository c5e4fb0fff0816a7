"""L2 `fused`: the MoE layer on mok's Hopper kernels (sm_90a), a few launches per pass.

Same function and interface as L0/L1 (`forward(...) -> (out, saved)`, `backward(saved, d_out)`, see
mok.layer), in BF16 and MXFP8. What runs where (mxfp8 adds the `mx:` steps; `q` = an MXFP8 quantize kernel
along the GEMM's K, `q+dq` = a quantize kernel then a dequantize kernel back to bf16; every GEMM is the BF16
kernel, except the forward's with mx_weights="mainloop": MXFP8 weights dequantized in the mainloop):

forward:
    shared expert                              the same two kernels, one expert, a schedule of all tokens in
                                               token order (row t = token t), weights viewed as [1, ...];
                                               BF16 in every precision (DESIGN §4); first: its schedule is
                                               cached, so its GEMMs run while the host prepares the routed ones
    make_schedule_cuda(topk_idx, block_m=128,  kernels: counts, offsets, placement; no host sync: row buffers
                       sync=False)             have max_num_rows rows, the kernels read the real count on the
                                               device (sched.counts) and never touch the spare rows; bad ids
                                               raise later, through mok.bad_ids
    grouped_gemm_bf16_swiglu_gather            kernel: dispatch (gather of x rows) + gate/up GEMM + SwiGLU
                                               mx: q+dq x [T, H] row-wise (once, before the gather); q+dq
                                               w_gate, w_up along hidden; the kernel is
                                               grouped_gemm_bf16_swiglu_gather_mxfp8_out, whose epilogue
                                               writes h's row-wise q+dq and gate/up quantized row-wise (the
                                               saved MXFP8 data + scales) instead of bf16 gate, up, h
                                               (mx_weights="mainloop": weights q only,
                                               grouped_gemm_mxfp8_swiglu_gather dequantizes in the mainloop;
                                               h, gate, up by the kernels named above)
    grouped_gemm_bf16_nt_contiguous            kernel: down GEMM, y_rows [num_rows, hidden]
                                               mx: q+dq w_down along intermediate (mainloop: q,
                                               grouped_gemm_mxfp8_nt_contiguous)
    combine_rows                               kernel: out = bf16(Σ_k w·y + shared), fp32, increasing k
backward (in this order: at most one [rows, hidden] buffer alive beside the [rows, I] ones; _experts_backward):
    shared expert                              all its steps below on its one-expert schedule (BF16), first: its
                                               d_x part is ready for the routed combine
    gather_rows_cuda(d_out)                    kernel: the unweighted d_out rows (bf16; y is not saved)
    grouped_gemm_bf16_dgrad_swiglu_route_grads kernels: g = d_out_rows·W_down (read transposed), then the SwiGLU
                                               backward in place on d_h = w·g (swiglu_backward_rows: d_gate,
                                               d_up, h recomputed from gate/up and written as w·h for d_w_down,
                                               and d_topk_weights = Σ_i g·h per route, fixed order: DESIGN §3's
                                               router gradient without y)
                                               mx: route_grads_prep first (dy_rows = bf16(w·d_out), the recipe's
                                               operand, and d_topk_weights from the saved y_rows), then
                                               grouped_gemm_bf16_dgrad_swiglu on dy_rows;
                                               dual-quantize dy_rows (row-wise here, column-wise for
                                               d_w_down), dq both; q+dq w_down along hidden (dim -2); the
                                               op is grouped_gemm_bf16_dgrad_swiglu_mxfp8, whose SwiGLU
                                               kernel reads the saved MXFP8 gate/up (dequantized in registers)
    grouped_gemm_bf16_weight_grad              kernel: d_w_down, k-grouped over each expert's rows (then the
                                               d_out rows and h go); mx: q+dq h_rows column-wise
    grouped_gemm_bf16_dgrad_gate_up            kernel: dx_rows = d_gate·W_gate + d_up·W_up, one fp32 sum
                                               mx: dual-quantize d_gate, d_up, dq both; q+dq w_gate, w_up
                                               along intermediate (dim -2)
    combine_rows(dx_rows, weights None, dx_shared)   kernel: the fixed-order d_x sum (then dx_rows goes)
    grouped_gemm_bf16_weight_grad              kernel, 2 launches: d_w_gate, d_w_up over the x rows, gathered
                                               now (gather_rows_cuda, a copy kernel); mx: every operand
                                               column-wise (blocks along the rows): x_rows gathered and q+dq'd in
                                               one kernel (mxfp8_fake_quantize_gathered); d_gate, d_up from the
                                               duals

Numerics: the forward has exactly L0's rounding points (DESIGN §3); the GEMMs' fp32 sums run in another
order than L0's, so results agree within DESIGN §9's tolerance (most elements bit for bit). In mxfp8 the
GEMMs see exactly L0's operands (mok.reference.quant): E4M3·2^e is exact in bf16, so a BF16 GEMM of
dequantized operands is the MXFP8 GEMM. Bits are identical run to run and for any persistent grid size:
set it with `num_sms=` (default: MOK_NUM_SMS, read once at import; unset or 0: every SM).

No host sync in either pass (tests/test_fused.py runs both under torch.cuda.set_sync_debug_mode("error")). In
mxfp8 the round trips over row buffers (`_mx` with a schedule, `_mx_dual`, the gathered x rows) stop at the
real row count on the device (sched.counts), as the GEMMs do: spare rows are neither read nor written.

MXFP8 cost: a round trip (`_mx`: ops.mxfp8_fake_quantize, one kernel) moves 4 bytes per element (reads 2,
writes 2), twice the GEMM's own read of the bf16 operand, and the weights dominate; `_mx_dual` moves 6 for
both directions. With mx_weights="mainloop" the forward quantizes its weights only (3 bytes per element)
and its GEMMs read 1 + 1/32 bytes per weight element, but dequantizing in shared memory costs the GEMMs
1.45-1.9x their BF16 time on the H200 (docs/fused.md); the backward round-trips every operand either way.
Inside `mok.mxfp8_weight_cache()` (mok.mx_cache) the routed weights' round trips (`_mx_weight`: both directions
from one dual kernel; with mx_weights="mainloop" the forward's quantized weights, `_q_weight`) are computed once
per weight version and reused across calls, as gradient accumulation allows; outside it, every call computes them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from mok import bad_ids, mx_cache, ops, reference
from mok.checks import check_optional_int, fail
from mok.reference import BF16, Saved
from mok.schedule import Schedule, make_schedule, max_num_rows, schedule_like

__all__ = ["BLOCK_M", "CHECKS_IDS_ON_DEVICE", "MX_WEIGHTS", "MX_WEIGHTS_ENV", "NO_HOST_SYNC", "NUM_SMS_ENV", "OPTIONS",
           "PRECISIONS", "FusedSaved", "backward", "dgrad_gate_up", "dgrad_swiglu", "dgrad_swiglu_route_grads",
           "experts_forward", "forward", "gather_x_rows", "gemm1", "gemm2", "mx_weights_from_env", "num_sms_from_env",
           "pad_rows", "resolve_options", "saved_like", "shared_backward", "shared_forward", "shared_schedule"]

BLOCK_M = 128  # schedule tile: a multiple of the GEMM kernels' tile (ops.GEMM_BLOCK_M = 128)
NUM_SMS_ENV = "MOK_NUM_SMS"  # persistent grid size of the GEMM kernels; unset or 0 = all SMs
# How the mxfp8 forward feeds its weights to GEMM1/GEMM2 (the same bits either way):
#   "dequantize": quantize, dequantize to bf16 in HBM, the BF16 kernels (the default: faster on 3 of the 4
#                 standard shapes on the H200, docs/lab/log.md "MXFP8 weights in the mainloop")
#   "mainloop":   quantize only; the kernels read E4M3 and dequantize in shared memory (no bf16 weight copy:
#                 about half the forward's peak memory on dsv4pro-rank)
MX_WEIGHTS_ENV = "MOK_MX_WEIGHTS"
MX_WEIGHTS = ("dequantize", "mainloop")
PRECISIONS = ("bf16", "mxfp8")  # what this level runs (mok.levels.resolve_backend reads it)
CHECKS_IDS_ON_DEVICE = True  # mok.moe skips its host check of topk_idx's range (mok.bad_ids) unless check=True
NO_HOST_SYNC = True  # neither pass reads the device on the host: mok.moe runs it inside a CUDA graph capture
OPTIONS = ("num_sms", "mx_weights")  # the keyword options this level takes beyond precision and swiglu_limit


@dataclass(eq=False)
class FusedSaved(Saved):
    """L0's Saved in the schedule's row layout (`y` stays None), the shared expert's gate/up in shared_rows
    (`shared_gate`/`shared_up` stay None: views of them, which a custom op could not return beside them,
    mok.library). In bf16 nothing of size [rows, hidden] is kept: the router gradient comes from the expert
    backward. In mxfp8 the routed outputs are kept in y_rows (the recipe's dy = bf16(w·d_out) is what its dgrad
    quantizes, so d_topk_weights is ⟨d_out, y⟩), and the routed gate/up as MXFP8 in gate_mx/up_mx (`gate`/`up`
    None)."""

    y_rows: torch.Tensor | None = None  # [num_rows, H], mxfp8 only
    shared_rows: tuple | None = None  # (gate, up) [R_sh, I_sh] of the shared expert, padding rows included
    num_sms: int | None = None  # the forward's grid size, reused by the backward kernels
    mx_weights: str = "dequantize"  # the forward's weight path (MX_WEIGHTS), which the backward's cache lookups follow
    gate_mx: tuple | None = None  # mxfp8: (data e4m3 [num_rows, I], scales uint8 [num_rows, I / 32]), row-wise
    up_mx: tuple | None = None  # mxfp8: as gate_mx


def num_sms_from_env(environ=os.environ) -> int | None:
    """The grid size MOK_NUM_SMS asks for: None (all SMs) when unset, empty or 0."""
    raw = environ.get(NUM_SMS_ENV, "").strip()
    if raw in ("", "0"):
        return None
    if not raw.isdigit():
        fail(NUM_SMS_ENV, "unset, 0 (all SMs) or an int >= 1", repr(raw))
    return int(raw)


def mx_weights_from_env(environ=os.environ) -> str:
    """The mxfp8 forward's weight path MOK_MX_WEIGHTS asks for: "dequantize" (unset or empty) or "mainloop"."""
    raw = environ.get(MX_WEIGHTS_ENV, "").strip() or MX_WEIGHTS[0]
    if raw not in MX_WEIGHTS:
        fail(MX_WEIGHTS_ENV, f"unset or one of {MX_WEIGHTS}", repr(raw))
    return raw


# The options' defaults: the environment, read once, here (README's table); arguments override them per call.
DEFAULT_NUM_SMS = num_sms_from_env()
DEFAULT_MX_WEIGHTS = mx_weights_from_env()


def _check_options(num_sms, mx_weights) -> None:
    check_optional_int("num_sms", num_sms, 1)
    if mx_weights not in MX_WEIGHTS:
        fail("mx_weights", f"one of {MX_WEIGHTS}", repr(mx_weights))


def resolve_options(x, w_gate, precision: str, num_sms, mx_weights) -> tuple:
    """A forward's (num_sms, mx_weights), None for the defaults (DEFAULT_*), checked with the inputs it runs on."""
    num_sms = DEFAULT_NUM_SMS if num_sms is None else num_sms
    mx_weights = DEFAULT_MX_WEIGHTS if mx_weights is None else mx_weights
    _check_options(num_sms, mx_weights)
    if precision == "mxfp8":
        _check_mxfp8_dims(x, w_gate)
    _check_runs_here(x, precision)
    return num_sms, mx_weights


def _check_runs_here(x: torch.Tensor, precision: str) -> None:
    if precision not in PRECISIONS:
        fail("precision", f"one of {PRECISIONS} for backend 'fused'", repr(precision))
    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        fail("x", "a CUDA tensor on a Hopper GPU for backend 'fused' (use 'torch' or 'reference' elsewhere)",
             f"device {getattr(x, 'device', type(x).__name__)}")
    ops.require_hopper()


def _check_mxfp8_dims(x: torch.Tensor, w_gate: torch.Tensor) -> None:
    """The MXFP8 kernels block whole rows/columns only: hidden and intermediate (every routed GEMM's K) must
    be multiples of 32 (mok.moe checks the same for every level; L0/L1 called directly zero-pad instead)."""
    for name, dim, size in (("x", "hidden (dim 1)", x.shape[-1]), ("w_gate", "intermediate (dim 1)", w_gate.shape[1])):
        if size % ops.BLOCK_SIZE:
            fail(name, f"{dim} a multiple of {ops.BLOCK_SIZE} for precision 'mxfp8' on backend 'fused' (MXFP8 "
                       "blocks along each GEMM's K; L1, mok.torch_native, zero-pads blocks and runs this size)",
                 size)


# ---- MXFP8 operands: the round trip (quantize + dequantize) -> the BF16 kernels (DESIGN §4) ---------------
# An E4M3 value times 2^e is exact in bf16, so a BF16 GEMM of dequantized operands is L0's MXFP8 GEMM
# (mok.reference.quant), bit for bit in its operands. These two functions are the level's MXFP8 operand path,
# but for the forward's weights with mx_weights="mainloop" (their GEMMs dequantize to the same bf16).
#
# Column-wise (dim -2) on a schedule row array [num_rows, *] blocks 32 rows at a time over all experts at
# once. That is exactly L0's per-expert blocks: segments start at multiples of BLOCK_M = 128 (so at a block
# boundary) and their padding rows are zero (the GEMM and route_grads_prep kernels write zeros there, h
# recomputed by the dgrad kernel included, and gather_x_rows too), just as L0 pads each expert's rows to 32
# with zero rows; zeros never change a block's amax, and padding rows of a zero-padded block stay zero.

def _mx(t: torch.Tensor, dim: int, precision: str, sched: Schedule | None = None) -> torch.Tensor:
    """The operand a GEMM sees: t itself in bf16; in mxfp8 its MXFP8 round trip in blocks of 32 along
    dim (-1: row-wise, -2: column-wise), the GEMM's K. bf16, t's shape. With `sched` (t one of its row buffers,
    column-wise) the round trip stops at the schedule's real rows, read on the device: the spare rows' output
    is left unwritten, and no GEMM reads it."""
    if precision == "bf16":
        return t
    counts = None if sched is None else sched.counts
    return ops.mxfp8_fake_quantize(t, dim, counts=counts)  # t.shape: dequantize(quantize(t)) in one pass


def _mx_dual(t: torch.Tensor, precision: str, sched: Schedule) -> tuple[torch.Tensor, torch.Tensor]:
    """(_mx(t, -1), _mx(t, -2)) from one read of t, a row buffer of `sched` (its real rows only): a backward
    operand that is both a dgrad operand (K along its row) and a weight-gradient operand (K along the rows)."""
    if precision == "bf16":
        return t, t
    return ops.mxfp8_fake_quantize_dual(t, counts=sched.counts)


def _mx_weight(w: torch.Tensor, dim: int, precision: str, mx_weights: str = "dequantize") -> torch.Tensor:
    """_mx for a routed weight [E, *, *]; inside mok.mxfp8_weight_cache() computed once per weight version and
    reused across calls (mok.mx_cache). There, on the default weight path, both of its round trips (the
    forward's dim -1, the backward's dim -2) come from one dual kernel at the first call: 6 bytes moved per
    element instead of 4 + 4. Activations never take this path."""
    if precision == "bf16":
        return w
    if mx_cache.active() and mx_weights == "dequantize":  # the forward reads the row-wise one too
        row, col = mx_cache.lookup(w, ("fake_quantize_dual",), lambda: ops.mxfp8_fake_quantize_dual(w))
        return row if dim in (-1, w.dim() - 1) else col
    return mx_cache.lookup(w, ("fake_quantize", dim), lambda: _mx(w, dim, precision))  # computes outside a context


def _q_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.mxfp8_quantize_rowwise(w) for a routed weight (mx_weights="mainloop"), cached like _mx_weight."""
    return mx_cache.lookup(w, ("quantize_rowwise",), lambda: ops.mxfp8_quantize_rowwise(w))


# ---- forward --------------------------------------------------------------------------------------------

def gemm1(x, w_gate, w_up, sched, swiglu_limit, num_sms, precision="bf16"):
    """Step `gemm1`, one kernel: dispatch (x rows gathered on load) + gate/up GEMM + SwiGLU over `sched`:
    (h, gate, up) [R, I]. In mxfp8 x and the weights are MXFP8 along hidden (x quantized once per token, before the
    gather: a row's blocks are the same wherever it lands), and the epilogue writes h's round trip (GEMM2's operand)
    and gate/up quantized row-wise, (data, scales) each, as the backward saves them."""
    p = precision
    gemm = ops.grouped_gemm_bf16_swiglu_gather_mxfp8_out if p == "mxfp8" else ops.grouped_gemm_bf16_swiglu_gather
    return gemm(_mx(x, -1, p), _mx_weight(w_gate, -1, p), _mx_weight(w_up, -1, p), sched, swiglu_limit=swiglu_limit,
                num_sms=num_sms)


def gemm2(h, w_down, sched, num_sms, precision="bf16"):
    """Step `gemm2`, one kernel: the down GEMM, y_rows [R, H] (w_down MXFP8 along intermediate in mxfp8)."""
    return ops.grouped_gemm_bf16_nt_contiguous(h, _mx_weight(w_down, -1, precision), sched, num_sms=num_sms)


def experts_forward(x, w_gate, w_up, w_down, sched, swiglu_limit, num_sms, precision="bf16", mx_weights="dequantize"):
    """gemm1 then gemm2 over `sched`: (y_rows [R, H], gate, up), gate/up as the backward saves them: bf16 [R, I] in
    bf16; in mxfp8 quantized row-wise, (data, scales) each (L0 saves quant(gate, -1): the same values in 1 + 1/32
    bytes per element, not 2). The weights go by the path `mx_weights` picks (MX_WEIGHTS)."""
    if precision == "mxfp8" and mx_weights == "mainloop":
        return _experts_forward_mx_weights(x, w_gate, w_up, w_down, sched, swiglu_limit, num_sms)
    h, gate, up = gemm1(x, w_gate, w_up, sched, swiglu_limit, num_sms, precision)  # [R, I] each
    return gemm2(h, w_down, sched, num_sms, precision), gate, up


def _experts_forward_mx_weights(x, w_gate, w_up, w_down, sched, swiglu_limit, num_sms):
    """experts_forward in mxfp8 with the weights quantized only, dequantized in the GEMM mainloops."""
    q = _q_weight
    h, gate, up = ops.grouped_gemm_mxfp8_swiglu_gather(_mx(x, -1, "mxfp8"), q(w_gate), q(w_up), sched,
                                                       swiglu_limit=swiglu_limit, num_sms=num_sms)  # [R, I] each
    y_rows = ops.grouped_gemm_mxfp8_nt_contiguous(_mx(h, -1, "mxfp8"), q(w_down), sched, num_sms=num_sms)  # [R, H]
    return y_rows, ops.mxfp8_quantize_rowwise(gate), ops.mxfp8_quantize_rowwise(up)


@functools.lru_cache(maxsize=8)
def shared_schedule(num_tokens: int, device) -> Schedule:
    """The shared expert as one routed expert that every token visits once: rows 0..T-1 are tokens
    0..T-1 in order (routes in ascending token order), then padding up to BLOCK_M. It depends on
    num_tokens alone, so it is built once per (num_tokens, device), with the GEMM kernels' int32 copies of
    it: no host sync and no conversion per pass."""
    topk_idx = torch.zeros(num_tokens, 1, dtype=torch.int64, device=device)  # [T, 1]
    sched = make_schedule(topk_idx, 1, block_m=BLOCK_M)
    sched.gemm_tensors = ops.gemm_schedule_tensors(sched, device)  # the kernels' int32 views, made once
    return sched


def forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None, w_shared_up=None,
            w_shared_down=None, *, precision="bf16", swiglu_limit=None, num_sms=None, mx_weights=None):
    """out [T, H] bf16 and a FusedSaved. num_sms: the GEMMs' grid size (None: DEFAULT_NUM_SMS, MOK_NUM_SMS's, else
    every SM); mx_weights: the mxfp8 forward's weight path, one of MX_WEIGHTS (None: DEFAULT_MX_WEIGHTS)."""
    num_sms, mx_weights = resolve_options(x, w_gate, precision, num_sms, mx_weights)
    T = x.shape[0]
    if T == 0:  # an empty batch (a rank without tokens): no kernel has work; L0 gives the empty output and zero grads
        return reference.forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                                 w_shared_down, precision=precision, swiglu_limit=swiglu_limit)
    # The shared expert first: its schedule is cached, so its GEMMs start at once and run while the host
    # prepares the routed schedule and GEMM launches (from an idle GPU, that host time would show as idle).
    shared, shared_rows = None, None
    if w_shared_gate is not None:  # BF16 in every precision (DESIGN §4)
        shared, shared_rows = shared_forward(x, (w_shared_gate, w_shared_up, w_shared_down), swiglu_limit, num_sms)

    # rows [0, num_rows) of make_schedule, then spare rows up to max_num_rows; no host sync
    sched = ops.make_schedule_cuda(topk_idx, w_gate.shape[0], block_m=BLOCK_M, sync=False)
    y_rows, gate, up = experts_forward(x, w_gate, w_up, w_down, sched, swiglu_limit, num_sms, precision,
                                       mx_weights)  # [R, *]
    gate_mx, up_mx = None, None
    if precision == "mxfp8":  # quantized row-wise (experts_forward)
        gate_mx, up_mx, gate, up = gate, up, None, None

    out = ops.combine_rows(y_rows, sched.route_to_row, topk_weights, shared, check_rows=False)  # [T, H]
    # The bad-id bookkeeping after every launch (from an idle GPU its ~50 us of host time came before GEMM1).
    # Earlier calls' counts first: this call's own may land at once on a small problem, and a forward must
    # not raise on its own ids some of the time (the same step's backward does, every time).
    bad_ids.raise_landed()  # earlier calls' counts that have reached the host
    bad_ids.defer(sched)  # this call's count of ids outside [0, E), checked once it has landed
    saved = FusedSaved(x, topk_idx, topk_weights, (w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                       w_shared_down), gate, up, None, None, None, precision, swiglu_limit,
                       sched=sched, y_rows=y_rows if precision == "mxfp8" else None, shared_rows=shared_rows,
                       num_sms=num_sms, mx_weights=mx_weights, gate_mx=gate_mx, up_mx=up_mx)
    return out, saved


def saved_like(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None, w_shared_up=None,
               w_shared_down=None, *, precision="bf16", swiglu_limit=None, num_sms=None, mx_weights=None,
               dynamic_size=None) -> Saved:
    """forward's saved state with empty tensors of its shapes and dtypes, from the inputs' shapes (mok.levels): row
    buffers of max_num_rows rows (make_schedule_cuda without a sync), or of an id-dependent count from dynamic_size()
    where make_schedule_cuda falls back to make_schedule; an empty batch's is L0's."""
    num_sms = DEFAULT_NUM_SMS if num_sms is None else num_sms
    mx_weights = DEFAULT_MX_WEIGHTS if mx_weights is None else mx_weights
    (T, H), (E, I, _) = x.shape, w_gate.shape
    if T == 0:
        return reference.saved_like(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                                    w_shared_down, precision=precision, swiglu_limit=swiglu_limit)
    K = topk_idx.shape[1]
    num_rows = max_num_rows(T, K, E, BLOCK_M)
    if E > ops.SCHEDULE_MAX_EXPERTS or num_rows >= 2**31:  # make_schedule_cuda's fallback: make_schedule (syncs)
        num_rows = dynamic_size()
    shared_rows = None
    if w_shared_gate is not None:  # shared_schedule(T): the tokens in order, padded to BLOCK_M
        shared_rows = tuple(x.new_empty((T + BLOCK_M - 1) // BLOCK_M * BLOCK_M, w_shared_gate.shape[0])
                            for _ in range(2))  # [R_sh, I_sh] each
    gate, up, gate_mx, up_mx = None, None, None, None
    if precision == "mxfp8":  # row-wise MXFP8: (data e4m3 [R, I], scales uint8 [R, I / 32]) each
        gate_mx, up_mx = ((x.new_empty(num_rows, I, dtype=torch.float8_e4m3fn),
                           x.new_empty(num_rows, I // ops.BLOCK_SIZE, dtype=torch.uint8)) for _ in range(2))
    else:
        gate, up = x.new_empty(num_rows, I), x.new_empty(num_rows, I)  # [R, I] bf16 each
    return FusedSaved(x, topk_idx, topk_weights, (w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down),
                      gate, up, None, None, None, precision, swiglu_limit,
                      sched=schedule_like(T, K, E, BLOCK_M, num_rows, x.device),
                      y_rows=x.new_empty(num_rows, H) if precision == "mxfp8" else None,
                      shared_rows=shared_rows, num_sms=num_sms, mx_weights=mx_weights, gate_mx=gate_mx, up_mx=up_mx)


# ---- backward -------------------------------------------------------------------------------------------

def _saved_gate_up(s: FusedSaved) -> tuple:
    """The routed gate/up as saved: bf16 [R, I] each, or in mxfp8 row-wise (data, scales) each."""
    return (s.gate, s.up) if s.gate_mx is None else (s.gate_mx, s.up_mx)


def dgrad_swiglu(dy_rows, w_down, gate, up, sched, swiglu_limit, num_sms, precision="bf16", mx_weights="dequantize"):
    """Step `dgrad_swiglu`, two kernels: d_h = dy·W_down (W_down read transposed, MXFP8 along hidden in mxfp8),
    then the SwiGLU backward: (d_gate, d_up, h) [R, I], h recomputed from the saved gate/up for d_w_down. dy_rows as
    the GEMM reads it (its row-wise round trip in mxfp8); gate/up as saved (_saved_gate_up): in mxfp8 the SwiGLU
    kernel dequantizes the saved MXFP8 itself, with no bf16 copy in memory."""
    p = precision
    dgrad = ops.grouped_gemm_bf16_dgrad_swiglu_mxfp8 if p == "mxfp8" else ops.grouped_gemm_bf16_dgrad_swiglu
    return dgrad(dy_rows, _mx_weight(w_down, -2, p, mx_weights), gate, up, sched, swiglu_limit=swiglu_limit,
                 num_sms=num_sms)


def dgrad_swiglu_route_grads(d_out_rows, w_down, gate, up, topk_weights, sched, swiglu_limit, num_sms):
    """Step `dgrad_swiglu` in bf16, two kernels: g = d_out_rows·W_down from the unweighted rows, then the SwiGLU
    backward on w·g, with the router gradient: (d_gate, d_up, w·h) [R, I] and d_topk_weights [T, K]."""
    return ops.grouped_gemm_bf16_dgrad_swiglu_route_grads(d_out_rows, w_down, gate, up, topk_weights, sched,
                                                          swiglu_limit=swiglu_limit, num_sms=num_sms)


def dgrad_gate_up(d_gate, d_up, w_gate, w_up, sched, num_sms, precision="bf16", mx_weights="dequantize"):
    """Step `dgrad_gate_up`, one kernel: dx_rows [R, H] = bf16(d_gate·W_gate + d_up·W_up), one fp32 sum over
    2·intermediate; the weights MXFP8 along intermediate in mxfp8, d_gate/d_up as the GEMM reads them."""
    p = precision
    return ops.grouped_gemm_bf16_dgrad_gate_up(d_gate, d_up, _mx_weight(w_gate, -2, p, mx_weights),
                                               _mx_weight(w_up, -2, p, mx_weights), sched, num_sms=num_sms)


def _experts_backward(make_dy, gate, up, make_x_rows, w_gate, w_up, w_down, sched, limit, num_sms, finish_dx,
                      precision="bf16", mx_weights="dequantize", topk_weights=None) -> tuple:
    """One expert group's backward over `sched`, gate/up as saved: (finish_dx(dx_rows), [d_w_gate, d_w_up, d_w_down],
    d_topk_weights). make_dy() -> (dy rows [R, H], d_topk_weights or None); with topk_weights (bf16) they are the
    unweighted d_out rows, weighted in the SwiGLU backward (dgrad_swiglu_route_grads), which gives d_topk_weights.
    The steps run in the order that keeps the fewest row buffers alive (each step's bits do not depend on it): the
    down dgrad, d_w_down (then dy and h go), the gate/up dgrad and finish_dx (the routed combine: then dx_rows
    goes), and only then make_x_rows() and d_w_gate, d_w_up, d_gate's rows freed between them: at most one [R, H]
    buffer beside the [R, I] ones (two in mxfp8: dy's two round trips)."""
    p = precision
    dy_rows, d_topk_weights = make_dy()
    dy_k, dy_w = _mx_dual(dy_rows, p, sched)  # [R, H] each: blocks along hidden (K here), along rows (K of d_w_down)
    del dy_rows
    if topk_weights is None:
        d_gate, d_up, h = dgrad_swiglu(dy_k, w_down, gate, up, sched, limit, num_sms, p, mx_weights)  # [R, I] each
    else:
        d_gate, d_up, h, d_topk_weights = dgrad_swiglu_route_grads(dy_k, w_down, gate, up, topk_weights, sched,
                                                                   limit, num_sms)  # [R, I] x3, [T, K]
    del dy_k
    # h recomputed from the saved gate/up (w·h beside unweighted rows), column-wise in mxfp8
    d_w_down = ops.grouped_gemm_bf16_weight_grad(dy_w, _mx(h, -2, p, sched), sched, num_sms=num_sms)  # [E, H, I]
    del dy_w, h
    (d_gate_k, d_gate_w), (d_up_k, d_up_w) = _mx_dual(d_gate, p, sched), _mx_dual(d_up, p, sched)  # [R, I] each
    del d_gate, d_up
    dx = finish_dx(dgrad_gate_up(d_gate_k, d_up_k, w_gate, w_up, sched, num_sms, p, mx_weights))  # from [R, H]
    del d_gate_k, d_up_k
    x_rows = make_x_rows()  # [R, H]
    d_w_gate = ops.grouped_gemm_bf16_weight_grad(d_gate_w, x_rows, sched, num_sms=num_sms)  # [E, I, H]
    del d_gate_w  # before d_w_up exists: the pass's peak is here, beside three weight gradients
    d_w_up = ops.grouped_gemm_bf16_weight_grad(d_up_w, x_rows, sched, num_sms=num_sms)  # [E, I, H]
    return dx, [d_w_gate, d_w_up, d_w_down], d_topk_weights


def shared_forward(x: torch.Tensor, weights: tuple, swiglu_limit, num_sms) -> tuple:
    """The shared expert (w_shared_gate, _up, _down), BF16, over the tokens of x [T, H]: the routed experts' kernels
    over the cached one-expert schedule, whose rows are the tokens in order, then zero padding. Returns (its out
    [T, H], its (gate, up) rows [R_sh, I_sh] as shared_backward takes them)."""
    ws_gate, ws_up, ws_down = weights
    sh = shared_schedule(x.shape[0], x.device)  # cached; read-only
    y, gate, up = experts_forward(x, ws_gate[None], ws_up[None], ws_down[None], sh, swiglu_limit, num_sms)
    return y[: x.shape[0]], (gate, up)  # row t = token t: a contiguous prefix


def shared_backward(x: torch.Tensor, rows: tuple, d_out: torch.Tensor, weights: tuple, swiglu_limit,
                    num_sms) -> tuple:
    """shared_forward's backward: (dx [T, H], [d_w_shared_gate, _up, _down]), summed over the T tokens of x."""
    ws_gate, ws_up, ws_down = weights
    T = d_out.shape[0]
    sh = shared_schedule(T, d_out.device)
    dx, d_w, _ = _experts_backward(lambda: (pad_rows(d_out, sh.num_rows), None), *rows,
                                   lambda: pad_rows(x, sh.num_rows), ws_gate[None], ws_up[None], ws_down[None], sh,
                                   swiglu_limit, num_sms, lambda dx_rows: dx_rows[:T])
    return dx, [w[0] for w in d_w]


def _shared_backward(s: FusedSaved, d_out: torch.Tensor) -> tuple:
    """(dx_shared [T, H] or None, [d_w_shared_gate, _up, _down] or Nones) of the level's saved state."""
    if s.weights[3] is None:
        return None, [None, None, None]
    return shared_backward(s.x, s.shared_rows, d_out, s.weights[3:], s.swiglu_limit, s.num_sms)


def gather_x_rows(x: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """x [T, H] -> bf16 [num_rows, H] in the schedule's rows, zeros in padding rows, spare rows unwritten:
    mok.schedule.gather_rows as one copy kernel."""
    return ops.gather_rows_cuda(x.to(BF16), sched)  # [num_rows, H]


def _x_rows(x: torch.Tensor, sched: Schedule, precision: str) -> torch.Tensor:
    """_mx(gather_x_rows(x, sched), -2, precision): in mxfp8 one kernel reads the rows straight from x and writes
    their round trip, without the gathered copy in memory."""
    if precision == "bf16":
        return gather_x_rows(x, sched)
    return ops.mxfp8_fake_quantize_gathered(x.to(BF16), sched)  # [num_rows, H]


def pad_rows(t: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[T, H] -> bf16 [num_rows, H]: row t = t's row t, then zero rows (the shared schedule's row layout).
    A contiguous bf16 t with no padding to add (T a multiple of BLOCK_M) is returned as it is, not copied."""
    if t.shape[0] == num_rows and t.dtype == BF16 and t.is_contiguous():
        return t  # the kernels only read it
    rows = t.new_zeros(num_rows, t.shape[1], dtype=BF16)  # [num_rows, H]
    rows[: t.shape[0]] = t
    return rows


def backward(saved: FusedSaved, d_out: torch.Tensor) -> tuple:
    """Gradients in mok.reference.moe_backward's order (see the module docstring for what runs where)."""
    if not isinstance(saved, FusedSaved):  # the forward of an empty batch was L0's
        return reference.backward(saved, d_out)
    s, sched, p = saved, saved.sched, saved.precision
    dx_shared, d_shared = _shared_backward(s, d_out)  # [T, H] bf16 or None: first, for the combine of d_x
    if p == "bf16":  # the router gradient comes from the expert backward (no y saved): the rows unweighted
        make_dy, route_weights = lambda: (ops.gather_rows_cuda(d_out, sched), None), s.topk_weights  # [R, H]
    else:  # the recipe's dy = bf16(w·d_out) is the dgrad's quantized operand, so ⟨d_out, y⟩ from the saved y
        make_dy, route_weights = lambda: ops.route_grads_prep(d_out, s.topk_weights, s.y_rows, sched), None

    def combine_dx(dx_rows):  # d_x[t] = bf16(Σ_k dx_rows[route_to_row[t, k]] + dx_shared[t]), fp32, increasing k
        return ops.combine_rows(dx_rows, sched.route_to_row, None, dx_shared, check_rows=False)  # [T, H]

    d_x, d_w, d_topk_weights = _experts_backward(
        make_dy, *_saved_gate_up(s), lambda: _x_rows(s.x, sched, p),  # x rows column-wise from BF16 x in mxfp8
        *s.weights[:3], sched, s.swiglu_limit, s.num_sms, combine_dx, p, s.mx_weights, route_weights)
    bad_ids.raise_landed()  # this forward's bad expert ids, if their count has landed (it never waits)
    return (d_x, d_topk_weights, *d_w, *d_shared)
