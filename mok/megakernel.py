"""L3 `megakernel` at EP = 1 (DESIGN §6, docs/megakernel.md): the layer's forward in one persistent launch of the
chain kernel (csrc/include/mok/gemm/chain.cuh) after the schedule's three small launches: the shared expert's and the
routed experts' GEMM1 and GEMM2, and the combine behind GEMM2's tiles on completion counters. Its out and saved state
are the fused level's bit for bit (tests/test_megakernel.py: on the CPU with every kernel an L0 twin; on a Hopper
GPU). The backward is one persistent launch of the backward chain (chain_backward.cuh) after the gathers of its rows,
again the fused level's bits; in MXFP8 the round trips of the launch's inputs (dy both ways, the x rows, the weights)
come before it, and those of d_gate, d_up and h are its tasks. At EP > 1 mok.ep_chain runs the same chain kernels
over ranks (run_chain with ops.ChainRanks, saved_state), outside the level's custom op.
"auto" picks the fused level (mok.levels); `backend="megakernel"` this one.

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
DEFAULT_MX_WEIGHTS = "dequantize"  # the mxfp8 forward's weight path (fused.MX_WEIGHTS): the chain reads BF16 weights


def forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None, w_shared_up=None,
            w_shared_down=None, *, precision="bf16", swiglu_limit=None, num_sms=None, trace=None):
    """(out [T, H] bf16, a FusedSaved): mok.fused.forward's results from one launch of the experts' kernels. In
    mxfp8 the fused level's recipe with its weights dequantized ("dequantize", fused.MX_WEIGHTS): x's and the
    weights' round trips before the launch, GEMM1's epilogue writing h's and the saved MXFP8 gate/up. trace: the
    launch's per-task times (ops.grouped_gemm_bf16_chain's; tools/chain_timeline.py)."""
    if precision not in fused.PRECISIONS:
        fail("precision", f"one of {fused.PRECISIONS}", repr(precision))
    num_sms, mx_weights = fused.resolve_options(x, w_gate, precision, num_sms, DEFAULT_MX_WEIGHTS)
    T = x.shape[0]
    if T == 0:  # an empty batch: no kernel has work, as in the fused level
        return reference.forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                                 w_shared_down, precision=precision, swiglu_limit=swiglu_limit)
    sched = ops.make_schedule_cuda(topk_idx, w_gate.shape[0], block_m=BLOCK_M, sync=False)
    weights = (w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down)
    out, rows = run_chain(fused._mx(x, -1, precision), x, topk_weights, weights, sched, precision=precision,
                          swiglu_limit=swiglu_limit, num_sms=num_sms, trace=trace)
    bad_ids.raise_landed()  # as fused.forward: earlier calls' bad-id counts, then this call's deferred
    bad_ids.defer(sched)
    return out, saved_state(x, topk_idx, topk_weights, weights, sched, rows, precision=precision,
                            swiglu_limit=swiglu_limit, num_sms=num_sms, mx_weights=mx_weights)


def run_chain(x_routed, x, topk_weights, weights, sched, *, precision, swiglu_limit, num_sms, ranks=None,
              trace=None):
    """The forward's chain launch: (out, its row outputs (y_rows, gate, up, shared_rows)) for saved_state. x_routed:
    the routed GEMM1's input (x's round trip in mxfp8); x: the shared expert's; weights: the six (routed
    dequantized here in mxfp8); ranks: None, or the launch's ops.ChainRanks (EP > 1); trace: the op's."""
    w_gate, w_up, w_down, *shared = weights
    shared = None if shared[0] is None else tuple(shared)
    sh = None if shared is None else fused.shared_schedule(x.shape[0], x.device)  # cached: no host sync
    p, mx = precision, fused._mx_weight
    y_rows, _, gate, up, out, shared_rows = ops.grouped_gemm_bf16_chain(
        x_routed, mx(w_gate, -1, p), mx(w_up, -1, p), mx(w_down, -1, p), sched, swiglu_limit=swiglu_limit,
        num_sms=num_sms, topk_weights=topk_weights, shared_weights=shared, shared_sched=sh, shared_x=x,
        mx_out=p == "mxfp8", ranks=ranks, trace=trace)
    return out, (y_rows, gate, up, shared_rows)


def saved_state(x, topk_idx, topk_weights, weights, sched, rows, *, precision, swiglu_limit, num_sms, mx_weights):
    """The FusedSaved of a forward whose chain launch gave rows (run_chain's): the fused level's."""
    y_rows, gate, up, shared_rows = rows
    mx = precision == "mxfp8"  # then gate, up are row-wise MXFP8 (data, scales): what is saved
    return FusedSaved(x, topk_idx, topk_weights, weights, None if mx else gate, None if mx else up, None, None, None,
                      precision, swiglu_limit, sched=sched, y_rows=y_rows if mx else None,
                      shared_rows=None if shared_rows is None else shared_rows[2:], num_sms=num_sms,
                      mx_weights=mx_weights, gate_mx=gate if mx else None, up_mx=up if mx else None)


def backward(saved: FusedSaved, d_out):
    """Gradients in mok.reference.moe_backward's order, the fused level's bits: the experts' backward is one launch
    of the chain kernel (ops.grouped_gemm_bf16_chain_backward) after the gathers of d_out's and x's rows (and the
    shared expert's padded copies); for an empty batch the fused level's."""
    if not isinstance(saved, FusedSaved):
        return fused.backward(saved, d_out)
    return run_backward(saved, d_out)


def run_backward(saved: FusedSaved, d_out, trace=None):
    """backward's chain launch (trace: the op's); in mxfp8 its routed inputs from mx_operands."""
    s, sched = saved, saved.sched
    ws_gate, ws_up, ws_down = s.weights[3:]
    shared = None
    if ws_gate is not None:  # its rows: the tokens in order, then zero padding (fused.shared_backward's operands)
        sh = fused.shared_schedule(d_out.shape[0], d_out.device)  # cached
        shared = (fused.pad_rows(d_out, sh.num_rows), fused.pad_rows(s.x, sh.num_rows), ws_gate[None], ws_up[None],
                  ws_down[None], *s.shared_rows, sh)
    if s.precision == "bf16":  # the unweighted d_out rows: the launch computes the route gradients
        dy_rows, dy_cols, x_rows, routed, d_topk_prep = (ops.gather_rows_cuda(d_out, sched), None,
                                                         fused.gather_x_rows(s.x, sched), s.weights[:3], None)
        gate, up, topk_weights = s.gate, s.up, s.topk_weights
    else:
        dy_rows, dy_cols, x_rows, routed, d_topk_prep = mx_operands(s, d_out)
        gate, up, topk_weights = s.gate_mx, s.up_mx, None
    d_x, d_topk_weights, d_w, d_w_shared = ops.grouped_gemm_bf16_chain_backward(  # d_topk_weights None in mxfp8
        dy_rows, x_rows, *routed, gate, up, topk_weights, sched, swiglu_limit=s.swiglu_limit, num_sms=s.num_sms,
        shared=shared, trace=trace, dy_cols=dy_cols)
    if d_topk_prep is not None:
        d_topk_weights = d_topk_prep
    bad_ids.raise_landed()  # this forward's bad expert ids, if their count has landed (it never waits)
    d_w_shared = [None] * 3 if d_w_shared is None else [w[0] for w in d_w_shared]
    return (d_x, d_topk_weights, *d_w, *d_w_shared)


def mx_operands(saved: FusedSaved, d_out) -> tuple:
    """The mxfp8 backward chain's routed inputs as the fused level's mxfp8 backward computes them, from its saved
    state and d_out [T, H]: (dy rows, dy_cols, x rows, the routed weights' round trips along their K, d_topk_weights
    [T, K]): dy = bf16(w·d_out) and the route gradients from the saved y rows (route_grads_prep), dy's round trips
    both ways (_mx_dual), the x rows' column-wise (_x_rows). The saved MXFP8 gate/up go to the launch as they are."""
    s, sched, p = saved, saved.sched, saved.precision
    dy, d_topk_weights = ops.route_grads_prep(d_out, s.topk_weights, s.y_rows, sched)  # [R, H], [T, K]
    dy_rows, dy_cols = fused._mx_dual(dy, p, sched)  # [R, H] each: K along hidden, along the rows
    del dy
    weights = tuple(fused._mx_weight(w, -2, p, s.mx_weights) for w in s.weights[:3])
    return dy_rows, dy_cols, fused._x_rows(s.x, sched, p), weights, d_topk_weights


def saved_like(*args, num_sms=None, **kwargs):
    """forward's saved state from the inputs' shapes (mok.levels): the fused level's, whose forward it equals."""
    return fused.saved_like(*args, num_sms=num_sms, mx_weights=DEFAULT_MX_WEIGHTS, **kwargs)
