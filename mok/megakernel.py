"""L3 `megakernel` at EP = 1 (DESIGN §6, docs/megakernel.md): the layer's forward in one persistent launch of the
chain kernel (csrc/include/mok/gemm/chain.cuh) after the schedule's three small launches: the shared expert's and the
routed experts' GEMM1 and GEMM2, and the combine behind GEMM2's tiles on completion counters. Its out and saved state
are the fused level's bit for bit (tests/test_megakernel.py: on the CPU with every kernel an L0 twin; on a Hopper
GPU), so the backward is the fused level's launches: not yet one launch. EP > 1 runs phase by phase over peer
memory in mok.ep_peer, outside the level. "auto" picks the fused level (mok.levels); `backend="megakernel"` this one.

Same interface as mok.fused (forward, backward, saved_like), BF16 and MXFP8 (the "dequantize" weight path: the
chain's GEMMs read BF16 weights); its one option is num_sms."""

from __future__ import annotations

from mok import bad_ids, fused, ops, reference
from mok.checks import fail
from mok.fused import BLOCK_M, FusedSaved

PRECISIONS = fused.PRECISIONS
CHECKS_IDS_ON_DEVICE = True  # bad expert ids are counted on the device and raised later (mok.bad_ids), as in fused
NO_HOST_SYNC = True  # neither pass reads the device on the host
OPTIONS = ("num_sms",)


def forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None, w_shared_up=None,
            w_shared_down=None, *, precision="bf16", swiglu_limit=None, num_sms=None):
    """(out [T, H] bf16, a FusedSaved): mok.fused.forward's results from one launch of the experts' kernels. In
    mxfp8 the fused level's recipe with its weights dequantized ("dequantize", fused.MX_WEIGHTS): x's and the
    weights' round trips before the launch, GEMM1's epilogue writing h's and the saved MXFP8 gate/up."""
    if precision not in fused.PRECISIONS:
        fail("precision", f"one of {fused.PRECISIONS}", repr(precision))
    num_sms, mx_weights = fused.resolve_options(x, w_gate, precision, num_sms, "dequantize")
    T = x.shape[0]
    if T == 0:  # an empty batch: no kernel has work, as in the fused level
        return reference.forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                                 w_shared_down, precision=precision, swiglu_limit=swiglu_limit)
    shared = None if w_shared_gate is None else (w_shared_gate, w_shared_up, w_shared_down)
    sh = None if shared is None else fused.shared_schedule(T, x.device)  # cached: no host sync
    sched = ops.make_schedule_cuda(topk_idx, w_gate.shape[0], block_m=BLOCK_M, sync=False)
    p, mx = precision, fused._mx_weight
    y_rows, _, gate, up, out, shared_rows = ops.grouped_gemm_bf16_chain(
        fused._mx(x, -1, p), mx(w_gate, -1, p), mx(w_up, -1, p), mx(w_down, -1, p), sched, swiglu_limit=swiglu_limit,
        num_sms=num_sms, topk_weights=topk_weights, shared_weights=shared, shared_sched=sh, shared_x=x,
        mx_out=p == "mxfp8")
    gate_mx, up_mx = (gate, up) if p == "mxfp8" else (None, None)  # row-wise MXFP8 (data, scales): what is saved
    gate, up = (None, None) if p == "mxfp8" else (gate, up)
    bad_ids.raise_landed()  # as fused.forward: earlier calls' bad-id counts, then this call's deferred
    bad_ids.defer(sched)
    saved = FusedSaved(x, topk_idx, topk_weights, (w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down),
                       gate, up, None, None, None, precision, swiglu_limit,
                       sched=sched, y_rows=y_rows if p == "mxfp8" else None,
                       shared_rows=None if shared_rows is None else shared_rows[2:], num_sms=num_sms,
                       mx_weights=mx_weights, gate_mx=gate_mx, up_mx=up_mx)
    return out, saved


backward = fused.backward


def saved_like(*args, num_sms=None, **kwargs):
    """forward's saved state from the inputs' shapes (mok.levels): the fused level's, whose forward it equals."""
    return fused.saved_like(*args, num_sms=num_sms, mx_weights="dequantize", **kwargs)
