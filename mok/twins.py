"""L0 twins of the L2 kernels: each function has the name, arguments and contract of a `mok.ops` kernel
and computes it in plain PyTorch from L0's pieces (mok.reference), expert by expert, on any device.

Two uses: the GPU tests compare each kernel with its twin (tests/test_ops_gemm.py), and the CPU suite runs
the whole `fused` level with every kernel replaced by its twin (tests/test_fused.py), which must give L0's
bits exactly: that checks the level's wiring (schedules, saved state, gradient order) where CI has no GPU.
The twins round where the kernels round (DESIGN §3); only the fp32 summation order differs from the kernels.
The kernels never write a schedule's spare rows (mok.schedule; make_schedule_cuda(..., sync=False)): the
twins fill them with NaN, so that a level reading them anywhere shows it in the CPU suite.
The MXFP8 quantizer twins are the L0 spec itself (mok.mxfp8), which the kernels match bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mok import mxfp8, rounding
from mok.ops.chain import RANK_SHIFT
from mok.reference import BF16, combine, mm, swiglu, swiglu_backward
from mok.schedule import gather_rows, make_schedule, max_num_rows, scatter_routes, segment
from mok.torch_native import route_grads

LOCAL_MASK = (1 << RANK_SHIFT) - 1  # a row id's local part

# the mok.ops kernels that have a twin here (the names tests patch)
KERNELS = ("grouped_gemm_bf16_swiglu_gather", "grouped_gemm_bf16_swiglu_gather_mxfp8_out",
           "grouped_gemm_bf16_nt_contiguous", "grouped_gemm_bf16_chain", "grouped_gemm_bf16_chain_backward",
           "grouped_gemm_bf16_dgrad_swiglu",
           "grouped_gemm_bf16_dgrad_swiglu_mxfp8",
           "grouped_gemm_bf16_dgrad_swiglu_route_grads", "grouped_gemm_bf16_dgrad_gate_up",
           "grouped_gemm_bf16_weight_grad", "grouped_gemm_mxfp8_swiglu_gather", "grouped_gemm_mxfp8_nt_contiguous",
           "combine_rows", "gather_rows_cuda", "make_schedule_cuda", "route_grads_prep", "mxfp8_quantize_rowwise",
           "mxfp8_quantize_colwise", "mxfp8_quantize_dual", "mxfp8_dequantize", "mxfp8_fake_quantize",
           "mxfp8_fake_quantize_dual", "mxfp8_fake_quantize_gathered", "route_round_to_tiles",
           "route_round_prep", "route_fill_rounds", "route_swap_leftovers", "pull_rows", "combine_peers")


def _rows_of(sched, e: int) -> torch.Tensor:
    """The real (non-padding) rows of expert e's segment: padding rows come last in a segment."""
    start = segment(sched, e).start
    return torch.arange(start, start + int(sched.tokens_per_expert[e]), device=sched.row_to_token.device)  # [n]


def _poison_spare(rows: torch.Tensor, sched) -> torch.Tensor:
    """rows [num_rows, *] with its spare rows (from expert_offsets[-1] on) set to NaN, in place."""
    rows[int(sched.expert_offsets[-1]):] = float("nan")  # what the kernels leave there is unspecified
    return rows


def _zeros(sched, width: int, like: torch.Tensor) -> torch.Tensor:
    """[num_rows, width] bf16: zeros in the schedule's rows (padding included), NaN in its spare rows."""
    return _poison_spare(torch.zeros(sched.num_rows, width, dtype=BF16, device=like.device), sched)


def grouped_gemm_bf16_swiglu_gather(x, w_gate, w_up, sched, swiglu_limit=None, num_sms=None):
    """(h, gate, up) [num_rows, I]: gate/up = bf16(x[t]·W[e]ᵀ), h = bf16(swiglu(gate, up)); zero padding rows."""
    h, gate, up = (_zeros(sched, w_gate.shape[1], x) for _ in range(3))  # [num_rows, I] each
    for e in range(sched.num_experts):
        rows = _rows_of(sched, e)  # [n]
        x_e = x[sched.row_to_token[rows]]  # [n, H]
        gate[rows] = mm(x_e, w_gate[e]).to(BF16)  # [n, I]
        up[rows] = mm(x_e, w_up[e]).to(BF16)  # [n, I]
        h[rows] = swiglu(gate[rows], up[rows], swiglu_limit).to(BF16)  # [n, I]
    return h, gate, up


def grouped_gemm_bf16_swiglu_gather_mxfp8_out(x, w_gate, w_up, sched, swiglu_limit=None, num_sms=None):
    """(round trip of h along dim -1, quantize_rowwise(gate), quantize_rowwise(up)) of the BF16 GEMM1's outputs."""
    h, gate, up = grouped_gemm_bf16_swiglu_gather(x, w_gate, w_up, sched, swiglu_limit)  # [num_rows, I] each
    return mxfp8_fake_quantize(h, -1), mxfp8_quantize_rowwise(gate), mxfp8_quantize_rowwise(up)


def grouped_gemm_bf16_nt_contiguous(a_rows, w, sched, num_sms=None):
    """out [num_rows, n] = bf16(a_rows[r]·W[e]ᵀ); zero padding rows."""
    out = _zeros(sched, w.shape[1], a_rows)  # [num_rows, n]
    for e in range(sched.num_experts):
        rows = _rows_of(sched, e)  # [n_e]
        out[rows] = mm(a_rows[rows], w[e]).to(BF16)  # [n_e, n]
    return out


def grouped_gemm_bf16_chain(x, w_gate, w_up, w_down, sched, swiglu_limit=None, num_sms=None, topk_weights=None,
                            shared=None, shared_weights=None, shared_sched=None, shared_x=None, mx_out=False,
                            ranks=None, trace=None):
    """GEMM1 then GEMM2 (one launch on the GPU), with shared_weights the shared expert's too (over the tokens in
    order), and with topk_weights the combine: (y_rows [num_rows, hidden], h, gate, up, out [num_tokens, hidden] or
    None, the shared expert's (y, h, gate, up) or None). ranks: _chain_over_ranks. trace: left as it is (no times
    on the CPU)."""
    if ranks is not None:
        return _chain_over_ranks(x, w_gate, w_up, w_down, sched, swiglu_limit, topk_weights, shared_weights,
                                 shared_sched, shared_x, mx_out, ranks)
    gemm1 = grouped_gemm_bf16_swiglu_gather_mxfp8_out if mx_out else grouped_gemm_bf16_swiglu_gather
    h, gate, up = gemm1(x, w_gate, w_up, sched, swiglu_limit)  # [num_rows, I] each (mx_out: gate, up MXFP8)
    y_rows = grouped_gemm_bf16_nt_contiguous(h, w_down, sched)
    shared_rows = None
    if shared_weights is not None:
        ws_gate, ws_up, ws_down = shared_weights
        sh = make_schedule(torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device), 1) \
            if shared_sched is None else shared_sched  # the tokens in order
        x_sh = x if shared_x is None else shared_x
        h_sh, gate_sh, up_sh = grouped_gemm_bf16_swiglu_gather(x_sh, ws_gate[None], ws_up[None], sh, swiglu_limit)
        shared_rows = (grouped_gemm_bf16_nt_contiguous(h_sh, ws_down[None], sh), h_sh, gate_sh, up_sh)
        shared = shared_rows[0][: x.shape[0]] if topk_weights is not None else None
    out = None if topk_weights is None else combine_rows(y_rows, sched.route_to_row, topk_weights, shared)
    return y_rows, h, gate, up, out, shared_rows


def _chain_over_ranks(x, w_gate, w_up, w_down, sched, swiglu_limit, topk_weights, shared_weights, shared_sched,
                      shared_x, mx_out, ranks):
    """One rank's chain launch among several (mok.ops.ChainRanks): its rows gathered from every rank's x by row id,
    its y rows and shared rows written into its entries, each real row counted in its token's token_done on the
    home rank, and every token whose count this launch completes combined there: out = combine of its routes'
    rows at their owners, in increasing k, then its shared row (the kernel's completion counters, in order)."""
    r, cap = ranks.rank, ranks.x[0].shape[0]
    ids = ranks.row_ids.long()  # [num_rows]
    flat = torch.where(ids >= 0, (ids >> RANK_SHIFT) * cap + (ids & LOCAL_MASK), -1)  # rows of every rank's x
    y_rows, h, gate, up, _, _ = grouped_gemm_bf16_chain(torch.cat(list(ranks.x)), w_gate, w_up, w_down,
                                                        replace(sched, row_to_token=flat), swiglu_limit,
                                                        mx_out=mx_out)
    ranks.y[r][: sched.num_rows] = y_rows
    T, shared_rows = x.shape[0], None
    before = [d[:, 0].clone() for d in ranks.token_done]  # the counts before this launch's rows
    if shared_weights is not None:  # the shared expert over this rank's tokens, its rows counted with the routes'
        sh = shared_sched or make_schedule(torch.zeros(T, 1, dtype=torch.int64, device=x.device), 1)
        shared_rows = grouped_gemm_bf16_chain(x if shared_x is None else shared_x,
                                              *(w[None] for w in shared_weights), sh, swiglu_limit)[:4]
        ranks.shared[r][: shared_rows[0].shape[0]] = shared_rows[0]
        ranks.token_done[r][:T] += 1
    _count_and_combine(ranks, ids, before, int(shared_weights is not None))
    return y_rows, h, gate, up, ranks.out[r][:T], shared_rows


def _count_and_combine(ranks, ids, before: list, shared_counts: int) -> None:
    """The completion counters of a chain launch over ranks: each real row (ids: its token's row id) counts on its
    token's home rank, and each token whose count reaches its target (its routes with a row, plus shared_counts)
    in this launch (before: every rank's counts at its start) is combined there, from the owners' rows (ranks.y),
    its weights (ranks.topk_weights, or 1 where empty) and its shared row (ranks.shared, where given)."""
    R, real = len(ranks.y), ids >= 0
    home, token = ids[real] >> RANK_SHIFT, ids[real] & LOCAL_MASK  # [real rows]
    for s in range(R):
        ranks.token_done[s].index_add_(0, token[home == s], torch.ones_like(ranks.token_done[s][token[home == s]]))
    y_all = torch.stack(list(ranks.y))  # [R, rows, H]
    for s in range(R):  # home rank s: its tokens whose count reached the target in this launch
        n = min(ranks.token_done[s].shape[0], ranks.route_to_row.shape[0] - ranks.token_offsets[s])
        routes = ranks.route_to_row[ranks.token_offsets[s]: ranks.token_offsets[s] + n].long()  # [n, K]
        target = (routes >= 0).sum(1) + shared_counts  # [n]
        t = ((ranks.token_done[s][:n, 0] == target) & (before[s][:n] < target) & (target > 0)).nonzero()[:, 0]
        if t.numel() == 0:
            continue
        rid = routes[t]  # [d, K]
        rows = y_all[(rid >> RANK_SHIFT).clamp(min=0), rid.clamp(min=0) & LOCAL_MASK]  # [d, K, H]
        rows[rid < 0] = float("nan")
        w = ranks.topk_weights[s][t] if len(ranks.topk_weights) else torch.ones(rid.shape, device=rid.device)
        ranks.out[s][t] = combine(rows, w, ranks.shared[s][t] if len(ranks.shared) else None)


def grouped_gemm_bf16_chain_backward(dy_rows, x_rows, w_gate, w_up, w_down, gate, up, topk_weights, sched,
                                     swiglu_limit=None, num_sms=None, shared=None, ranks=None, trace=None,
                                     dy_cols=None):
    """The expert backward (one launch on the GPU): the route-gradient dgrad and SwiGLU backward, the gate/up dgrad,
    the weight gradients and the combine of d_x, the shared expert's steps too: (d_x, d_topk_weights, [d_w_gate,
    d_w_up, d_w_down], the shared expert's [...] or None). ranks: one rank's launch among several (as
    _chain_over_ranks: its dx rows into its y entry, d_x's combine of the tokens it completes into their out).
    MXFP8 (gate, up (data, scales) pairs): the SwiGLU backward on their dequantization, no route gradients (None),
    d_gate and d_up round-tripped both ways, h column-wise, dy_cols for d_w_down."""
    if isinstance(gate, tuple):
        d_gate, d_up, h = grouped_gemm_bf16_dgrad_swiglu_mxfp8(dy_rows, w_down, gate, up, sched, swiglu_limit)
        (d_gate, d_gate_w), (d_up, d_up_w) = (mxfp8_fake_quantize_dual(t, sched.counts) for t in (d_gate, d_up))
        h, d_topk_weights, dy_w = mxfp8_fake_quantize(h, -2, sched.counts), None, dy_cols
    else:
        d_gate, d_up, h, d_topk_weights = grouped_gemm_bf16_dgrad_swiglu_route_grads(dy_rows, w_down, gate, up,
                                                                                      topk_weights, sched, swiglu_limit)
        d_gate_w, d_up_w, dy_w = d_gate, d_up, dy_rows
    d_w = [grouped_gemm_bf16_weight_grad(d_gate_w, x_rows, sched), grouped_gemm_bf16_weight_grad(d_up_w, x_rows, sched),
           grouped_gemm_bf16_weight_grad(dy_w, h, sched)]
    dx_rows = grouped_gemm_bf16_dgrad_gate_up(d_gate, d_up, w_gate, w_up, sched)
    if ranks is not None:
        ranks.y[ranks.rank][: sched.num_rows] = dx_rows
        before = [d[:, 0].clone() for d in ranks.token_done]
        _count_and_combine(ranks, ranks.row_ids.long(), before, 0)
        return ranks.out[ranks.rank], d_topk_weights, d_w, None
    dx_shared, d_w_shared = None, None
    if shared is not None:
        dy_sh, x_sh, wg_sh, wu_sh, wd_sh, gate_sh, up_sh, sh = shared
        dg_sh, du_sh, h_sh = grouped_gemm_bf16_dgrad_swiglu(dy_sh, wd_sh, gate_sh, up_sh, sh, swiglu_limit)
        d_w_shared = [grouped_gemm_bf16_weight_grad(dg_sh, x_sh, sh), grouped_gemm_bf16_weight_grad(du_sh, x_sh, sh),
                      grouped_gemm_bf16_weight_grad(dy_sh, h_sh, sh)]
        dx_shared = grouped_gemm_bf16_dgrad_gate_up(dg_sh, du_sh, wg_sh, wu_sh, sh)[: sched.num_tokens]
    d_x = combine_rows(dx_rows, sched.route_to_row, None, dx_shared)
    return d_x, d_topk_weights, d_w, d_w_shared


def grouped_gemm_mxfp8_swiglu_gather(x, w_gate, w_up, sched, swiglu_limit=None, num_sms=None):
    """grouped_gemm_bf16_swiglu_gather on the dequantized MXFP8 weights ((data, scales) along hidden)."""
    return grouped_gemm_bf16_swiglu_gather(x, mxfp8_dequantize(*w_gate), mxfp8_dequantize(*w_up), sched, swiglu_limit)


def grouped_gemm_mxfp8_nt_contiguous(a_rows, w, sched, num_sms=None):
    """grouped_gemm_bf16_nt_contiguous on the dequantized MXFP8 weight ((data, scales) along k)."""
    return grouped_gemm_bf16_nt_contiguous(a_rows, mxfp8_dequantize(*w), sched)


def grouped_gemm_bf16_dgrad_swiglu(dy_rows, w_down, gate, up, sched, swiglu_limit=None, num_sms=None):
    """(d_gate, d_up, h) [num_rows, I]: d_h = bf16(dy·Wd[e]), then bf16(swiglu_backward(gate, up, d_h)), and
    h = bf16(swiglu(gate, up))."""
    d_gate, d_up, h = (_zeros(sched, gate.shape[1], gate) for _ in range(3))  # [num_rows, I] each
    for e in range(sched.num_experts):
        rows = _rows_of(sched, e)  # [n]
        d_h = mm(dy_rows[rows], w_down[e].T).to(BF16)  # [n, I]: K = hidden
        dg, du = swiglu_backward(gate[rows], up[rows], d_h, swiglu_limit)  # [n, I] fp32 each
        d_gate[rows], d_up[rows] = dg.to(BF16), du.to(BF16)
        h[rows] = swiglu(gate[rows], up[rows], swiglu_limit).to(BF16)
    return d_gate, d_up, h


def grouped_gemm_bf16_dgrad_swiglu_mxfp8(dy_rows, w_down, gate_mx, up_mx, sched, swiglu_limit=None, num_sms=None):
    """grouped_gemm_bf16_dgrad_swiglu on the dequantized row-wise MXFP8 gate/up ((data, scales) each)."""
    return grouped_gemm_bf16_dgrad_swiglu(dy_rows, w_down, mxfp8_dequantize(*gate_mx), mxfp8_dequantize(*up_mx),
                                          sched, swiglu_limit)


def grouped_gemm_bf16_dgrad_swiglu_route_grads(d_out_rows, w_down, gate, up, topk_weights, sched,
                                               swiglu_limit=None, num_sms=None):
    """(d_gate, d_up, h [num_rows, I], d_topk_weights [T, K]): g = bf16(d_out_rows·Wd[e]) unweighted, w the row's
    route weight; bf16(swiglu_backward(gate, up, w·g)), h = bf16(w·swiglu(gate, up)), d_topk_weights =
    Σ_i g·bf16(swiglu(gate, up)) (torch's sum order), NaN for a route without a row."""
    d_gate, d_up, h = (_zeros(sched, gate.shape[1], gate) for _ in range(3))  # [num_rows, I] each
    d_topk_weights = torch.full_like(topk_weights, float("nan"))  # [T, K]
    for e in range(sched.num_experts):
        rows = _rows_of(sched, e)  # [n]
        routes = sched.row_to_route[rows]  # [n]
        w = topk_weights.reshape(-1)[routes][:, None]  # [n, 1] fp32
        g = mm(d_out_rows[rows], w_down[e].T).to(BF16).float()  # [n, I]: K = hidden
        dg, du = swiglu_backward(gate[rows], up[rows], w * g, swiglu_limit)  # [n, I] fp32 each
        hs = swiglu(gate[rows], up[rows], swiglu_limit)  # [n, I] fp32
        d_gate[rows], d_up[rows], h[rows] = dg.to(BF16), du.to(BF16), (w * hs).to(BF16)
        d_topk_weights.view(-1)[routes] = (g * hs.to(BF16).float()).sum(-1)
    return d_gate, d_up, h, d_topk_weights


def grouped_gemm_bf16_dgrad_gate_up(d_gate, d_up, w_gate, w_up, sched, num_sms=None):
    """dx_rows [num_rows, H] = bf16(d_gate·Wg[e] + d_up·Wu[e]), one rounding; zero padding rows."""
    dx = _zeros(sched, w_gate.shape[2], d_gate)  # [num_rows, H]
    for e in range(sched.num_experts):
        rows = _rows_of(sched, e)  # [n]
        dx[rows] = (mm(d_gate[rows], w_gate[e].T) + mm(d_up[rows], w_up[e].T)).to(BF16)  # [n, H]
    return dx


def install(setattr) -> None:
    """Every kernel of KERNELS in mok.ops replaced by its twin, and the fused level's device check off, so that the
    level runs on the CPU. setattr: a test's monkeypatch.setattr (undone after the test), or the builtin setattr in a
    process of its own."""
    from mok import fused, ops

    for name in KERNELS:
        setattr(ops, name, globals()[name])
    setattr(fused, "_check_runs_here", lambda x, precision: None)


def combine_rows(y_rows, route_to_row, topk_weights=None, shared=None, check_rows=True):
    """out [T, H] = bf16(Σ_k w[t,k]·y_rows[route_to_row[t,k]] + shared[t]), L0's combine (weights 1 if None)."""
    T, K = route_to_row.shape
    y = y_rows[route_to_row.reshape(-1).long()].view(T, K, -1)  # [T, K, H]
    w = torch.ones(T, K, device=y_rows.device) if topk_weights is None else topk_weights  # [T, K]
    return combine(y, w, shared)


def pull_rows(src, pull_rank, pull_token, *, weights=None, pull_k=None, num_topk=1):
    """[num_rows, width]: row r = rank pull_rank[r]'s row pull_token[r] of src (src.keep: the ranks' tensors), times
    its route's weight and rounded to bf16 with weights; zeros where pull_rank[r] < 0."""
    rank, token, ok = pull_rank.long(), pull_token.long(), pull_rank >= 0
    rows = torch.zeros(rank.numel(), src.width, dtype=BF16, device=pull_rank.device)  # [num_rows, width]
    rows[ok] = torch.stack(src.keep)[rank[ok], token[ok]]
    if weights is not None:
        w = torch.stack(weights.keep)[rank[ok], token[ok], pull_k.long()[ok]]  # [real rows]
        rows[ok] = (rows[ok].float() * w[:, None]).to(BF16)
    return rows


def combine_peers(rows, combine_rank, combine_row, topk_weights=None, shared=None):
    """L0's combine of route (t, k)'s row at rank combine_rank[t, k], row combine_row[t, k] (rows.keep)."""
    T, K = combine_rank.shape
    y = torch.stack(rows.keep)[combine_rank.long().flatten(), combine_row.long().flatten()].view(T, K, rows.width)
    w = torch.ones(T, K, device=y.device) if topk_weights is None else topk_weights  # [T, K]
    return combine(y, w, shared)


def gather_rows_cuda(x, sched):
    """[num_rows, H]: L0's dispatch (mok.schedule.gather_rows), NaN in the schedule's spare rows."""
    return _poison_spare(gather_rows(x, sched), sched)


def grouped_gemm_bf16_weight_grad(a_rows, b_rows, sched, num_sms=None):
    """d_w [E, m, n]: d_w[e] = bf16(Σ_r a_rows[r]ᵀ·b_rows[r]) over expert e's rows; zeros for an empty expert."""
    d_w = torch.zeros(sched.num_experts, a_rows.shape[1], b_rows.shape[1], dtype=BF16, device=a_rows.device)
    for e in range(sched.num_experts):
        rows = _rows_of(sched, e)  # [n_e]
        if rows.numel():
            d_w[e] = mm(a_rows[rows].T, b_rows[rows].T).to(BF16)  # [m, n]: K = the expert's rows
    return d_w


def make_schedule_cuda(topk_idx, num_experts, block_m=128, sync=True):
    """The schedule: make_schedule itself (the kernel is bitwise equal to it); sync=False: with spare rows up
    to max_num_rows, as the kernel leaves it (bad ids raise here, at once: make_schedule's check)."""
    sched = make_schedule(topk_idx, num_experts, block_m=block_m)
    return sched if sync else sched.extended(max_num_rows(*topk_idx.shape, num_experts, block_m))


def route_grads_prep(d_out, topk_weights, y_rows, sched):
    """(dy_rows [num_rows, H] bf16, d_topk_weights [T, K] fp32) as L0 computes them (mok.reference.moe_backward)."""
    d_topk_weights, dy_rows = route_grads(d_out, topk_weights, scatter_routes(y_rows, sched), sched)
    return _poison_spare(dy_rows, sched), d_topk_weights


# ---- MXFP8 (mok.ops.quant): the kernels are bit-exact with mok.mxfp8 (tests/test_ops_quant.py) -------------------

def mxfp8_quantize_rowwise(x):
    """(data e4m3 x.shape, scales uint8 [..., cols / 32]): blocks of 32 along dim -1."""
    return mxfp8.quantize(x, dim=-1)


def mxfp8_quantize_colwise(x):
    """(data e4m3 x.shape, scales uint8 [..., rows / 32, cols]): blocks of 32 along dim -2."""
    return mxfp8.quantize(x, dim=-2)


def mxfp8_quantize_dual(x):
    """((data_row, scales_row), (data_col, scales_col)): both directions, each from x (BF16) independently."""
    return mxfp8.quantize(x, dim=-1), mxfp8.quantize(x, dim=-2)


def mxfp8_dequantize(data, scales, dim=-1):
    """q · 2^e rounded to bf16, data.shape; dim -1 (row-wise scales) or -2 (column-wise)."""
    return mxfp8.dequantize(data, scales, dim=dim, dtype=BF16)


def _poison_from(rows: torch.Tensor, counts) -> torch.Tensor:
    """rows [R, *] with the 32-row blocks from counts[0] on set to NaN, in place (what the kernels leave there
    is unspecified); counts None: rows as they are."""
    if counts is not None:
        rows[-(-int(counts[0]) // mxfp8.BLOCK_SIZE) * mxfp8.BLOCK_SIZE:] = float("nan")
    return rows


def mxfp8_fake_quantize(x, dim=-1, counts=None):
    """dequantize(quantize(x, dim), dim) in bf16: L0's round trip; NaN in the blocks from counts[0] on."""
    return _poison_from(mxfp8.fake_quantize(x, dim=dim), counts)


def mxfp8_fake_quantize_dual(x, counts=None):
    """(row-wise, column-wise) round trips, each from x independently; NaN in the blocks from counts[0] on."""
    return (_poison_from(mxfp8.fake_quantize(x, dim=-1), counts),
            _poison_from(mxfp8.fake_quantize(x, dim=-2), counts))


def mxfp8_fake_quantize_gathered(x, sched):
    """The column-wise round trip of L0's dispatch of x into the schedule's rows (NaN in its spare rows)."""
    return _poison_spare(mxfp8.fake_quantize(gather_rows(x, sched), dim=-2), sched)


def route_round_to_tiles(topk_idx, scores, tile, num_pool, run_step=None, fill=None, swap=None):
    return rounding._round_to_tiles(topk_idx, scores, tile, device_rounds=False)  # the twins' path: any pool size


def route_round_prep(topk_idx, scores, tile, num_pool, run_step=None):
    """The reference itself (rounding._prep), laid out receiver-major as the kernels give it."""
    pool, order, may, inv, need, num_real = rounding._prep(topk_idx.contiguous(), scores, tile,
                                                           scores > float("-inf"), num_pool)
    return pool, order.t().contiguous(), may.t().to(torch.uint8).contiguous(), inv, need, num_real.reshape(1)


def route_fill_rounds(order, may, inv, need, num_real=None):
    return rounding.fill_rounds(order, may, inv, need, num_real)  # the reference itself: the kernel gives its bits


def route_swap_leftovers(idx, before, allowed, left, need):
    return rounding.swap_leftovers(idx, before, allowed, left, need)  # the reference itself
