"""The layer's forward at EP = 1 in one persistent launch (csrc/include/mok/gemm/chain.cuh): the shared expert's and
the routed experts' GEMM1 and GEMM2, and the combine behind GEMM2's tiles on completion counters, after the
schedule's three small launches. The megakernel level's first pass (docs/megakernel.md); not a level yet: its
backward is the fused level's, and it has not run on a GPU.

`forward` has mok.fused.forward's arguments (BF16 or MXFP8) and returns the fused level's out and saved state bit
for bit, so `mok.fused.backward` takes it (tests/test_chain.py: on the CPU with every kernel an L0 twin; on a Hopper
GPU). `tools/chain_combine_probe.py` times it against the fused level."""

from __future__ import annotations

from mok import bad_ids, fused, ops, reference
from mok.checks import fail
from mok.fused import BLOCK_M, FusedSaved


def forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None, w_shared_up=None,
            w_shared_down=None, *, precision="bf16", swiglu_limit=None, num_sms=None):
    """(out [T, H] bf16, a FusedSaved): mok.fused.forward's results from one launch of the experts' kernels. In
    mxfp8 the fused level's recipe with its weights dequantized ("dequantize", fused.MX_WEIGHTS): x's and the
    weights' round trips before the launch, GEMM1's epilogue writing h's and the saved MXFP8 gate/up."""
    if precision not in fused.PRECISIONS:
        fail("precision", f"one of {fused.PRECISIONS}", repr(precision))
    num_sms, mx_weights = fused.resolve_options(x, w_gate, precision, num_sms, None)
    if precision == "mxfp8" and mx_weights != "dequantize":
        fail("MOK_MX_WEIGHTS", "'dequantize' (the chain's GEMMs read BF16 weights)", repr(mx_weights))
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
