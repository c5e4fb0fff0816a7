"""Expert parallelism with each rank's pass one launch of the chain kernels (docs/megakernel.md, "The chain over
ranks"): the routed GEMM1 gathers its rows' x from the tokens' ranks, GEMM2's tiles count each row on its token's
home rank, and the tile that completes a token's slice sums it there (out = the routes' rows in increasing k, then
the shared expert's row) from the owners' rows; the backward's gate/up dgrad does the same for d_x. No task waits on
another rank, so the launches need no co-residency: R ranks in one process run them one after another on one GPU.

Around each launch: the inputs written and the counters zeroed on every rank (a barrier), every rank's routing read
and this rank's rows planned (mok.ep_build's tables), then the launch, then a barrier before out is read. The
backward: the shared expert's backward of this rank's tokens before the launch (its dx rows, for d_x's combine), its
share of the weight gradients after it (mok.ep_shared); in MXFP8 the launch's operands as the fused level's mxfp8
backward of the rank's rows makes them (mok.megakernel.mx_operands). R ranks in one process (forward_ranks) or one
per process (the generators with mok.ep_peer.run_rank). The bits: the fused level's at EP = 1
(tests/test_ep_peer.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mok import ep_peer, ep_shared, fused, megakernel, ops
from mok.checks import fail
from mok.ep_peer import PeerSaved, check_rank_inputs
from mok.ep_plan import expert_ranges
from mok.schedule import make_schedule


def route_rows(sched, row_starts: torch.Tensor) -> torch.Tensor:
    """int32 [T_all, K]: every route's row id (owner rank, row there) from the schedule of every rank's tokens,
    whose rows rank s owns from row_starts[s] on (ops.row_ids; -1 for a route without a row)."""
    g = sched.route_to_row.to(row_starts.device)  # [T_all, K] global rows
    owner = torch.searchsorted(row_starts, g.clamp(min=0), right=True) - 1  # [T_all, K]
    return ops.row_ids(torch.where(g >= 0, owner, -1), g - row_starts[owner.clamp(min=0)])


def forward_rank(P: dict, rank: int, x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None,
                 w_shared_up=None, w_shared_down=None, *, num_experts: int, precision="bf16", swiglu_limit=None,
                 num_sms=None, trace=None):
    """Rank `rank`'s forward over the peers' buffers P (mok.ep_peer.peers): a generator yielding at each barrier,
    returning (out [T_r, H], PeerSaved) as mok.ep_peer.forward_rank does, with the experts in one chain launch
    (trace: its per-task times, ops.grouped_gemm_bf16_chain's)."""
    check_rank_inputs(P, rank, x, w_gate, num_experts, w_shared_gate)
    R, T = P["x"].num_ranks, x.shape[0]
    own = {name: p.keep[rank] for name, p in P.items()}
    own["x"][:T], own["w"][:T], own["idx"][:T], own["count"][0, 0] = x, topk_weights, topk_idx, T
    if precision == "mxfp8":  # the routed GEMM1 reads x's round trip (row-wise: each token's alone)
        own["xq"][:T] = fused._mx(x, -1, precision)
    own["done"].zero_()
    own["out"].fill_(float("nan"))  # a token whose routes all lack a row is written by no tile (bad ids)
    yield  # every rank's inputs are in place and its counters zero

    split, sched_all, t, real, expert_of_row = ep_peer.plan_rank(P, rank, num_experts, x, w_gate, w_shared_gate)
    E_r = w_gate.shape[0]
    routed = (w_gate, w_up, w_down)  # E_r = 0 (E < R): a stand-in expert without rows, for the shared expert's launch
    launched = routed if E_r else tuple(w.new_zeros(1, *w.shape[1:]) for w in routed)
    schedule = ops.make_schedule_cuda if len(expert_of_row) else make_schedule  # (no rows: not the kernel's case)
    sched = schedule(expert_of_row, max(E_r, 1), block_m=fused.BLOCK_M)  # the rank's rows: t's layout
    if sched.num_rows != real.shape[0]:
        fail("tables", f"{sched.num_rows} rows (the schedule of the rank's real rows)", real.shape[0])
    firsts = [g.start for g in expert_ranges(num_experts, R)]  # each rank's first expert
    row_starts = sched_all.expert_offsets.to(x.device)[firsts].contiguous()  # [R]: each rank's first global row
    offsets = [sum(split[:s]) for s in range(R)]
    shared = w_shared_gate is not None
    ranks = ops.ChainRanks(rank, ops.row_ids(t["pull_rank"], t["pull_token"]), route_rows(sched_all, row_starts),
                           offsets, x=list(P["xq" if precision == "mxfp8" else "x"].keep), y=list(P["y"].keep),
                           topk_weights=list(P["w"].keep), out=list(P["out"].keep), token_done=list(P["done"].keep),
                           shared=list(P["sy"].keep) if shared else ())
    weights = (*launched, w_shared_gate, w_shared_up, w_shared_down)
    num_sms = fused.resolve_options(x, w_gate, precision, num_sms, megakernel.DEFAULT_MX_WEIGHTS)[0]
    _, rows = megakernel.run_chain(own["x"][:T], own["x"][:T], own["w"][:T], weights, sched, precision=precision,
                                   swiglu_limit=swiglu_limit, num_sms=num_sms, ranks=ranks, trace=trace)
    x_rows = ops.pull_rows(P["x"], t["pull_rank"][real], t["pull_token"][real])  # [n, H]: the backward's
    ones = torch.ones(x_rows.shape[0], 1, device=x.device)  # [n, 1]: each row its own token, weight 1
    if x_rows.shape[0] == 0 and precision != "bf16":  # no rows: the fused level's saved state of none (ep_peer's)
        experts = fused.forward(x_rows, expert_of_row, ones, *routed, precision=precision,
                                swiglu_limit=swiglu_limit)[1]
    else:
        experts = megakernel.saved_state(x_rows, expert_of_row, ones, (*launched, None, None, None), sched,
                                         (*rows[:3], None), precision=precision, swiglu_limit=swiglu_limit,
                                         num_sms=num_sms, mx_weights=megakernel.DEFAULT_MX_WEIGHTS)
        if precision == "mxfp8":  # the saved y rows, out of the buffer the next forward writes
            experts.y_rows = experts.y_rows.clone()
    shared_saved = ep_shared.forward(P, rank, split, x, weights[3:], swiglu_limit, rows[3][2:])[1] if shared else None
    saved = ChainSaved(rank, t, real, experts, split, shared_saved, swiglu_limit, sched, ranks)
    yield  # every rank's launch has ended: its tokens' out is whole

    return own["out"][:T].clone(), saved


def backward_rank(P: dict, saved, d_out, trace=None):
    """The rank's gradients, as mok.ep_peer.backward_rank's (a generator yielding at each barrier): the routed
    experts' backward one chain launch (ops.grouped_gemm_bf16_chain_backward over ranks: d_x's combine by the tile
    completing a token, on any rank; trace: its per-task times), after the shared expert's backward of this rank's
    tokens has written their dx rows (mok.ep_shared)."""
    s, t, real, T = saved, saved.tables, saved.real, d_out.shape[0]
    own = {name: p.keep[s.rank] for name, p in P.items()}
    own["d_out"][:T] = d_out
    own["done"].zero_()
    own["out"].fill_(float("nan"))
    yield  # every rank's d_out is in place and its counters zero

    d_shared = [None, None, None]
    if s.shared is not None:  # its tokens' shared dx rows (mok.ep_shared), for the combine of d_x
        own["sy"][:T] = ep_shared.backward_local(own, s.shared, d_out, s.swiglu_limit)
    rank, token, k = (t[name][real].long() for name in ("pull_rank", "pull_token", "pull_k"))
    w_rows = torch.stack(P["w"].keep)[rank, token, k][:, None]  # [n, 1]: each row's route weight
    ranks = replace(s.ranks, x=[], y=list(P["dx"].keep), topk_weights=[], out=list(P["out"].keep),
                    token_done=list(P["done"].keep), shared=list(P["sy"].keep) if s.shared is not None else [])
    yield  # every rank's shared dx rows are in place

    d_tw, d_w = _routed_backward(P, s, w_rows, ranks, trace)
    d_w = [d[: t["tokens_per_expert"].shape[0]] for d in d_w]  # a rank without experts: no stand-in's gradient
    own["dtw"][: real.shape[0]][real] = d_tw
    if s.shared is not None:  # its share of the shared expert's weight gradients (every rank's rows are in place)
        ep_shared.backward_share(P, s.rank, s.split, s.shared)
    yield  # every rank's launch has ended: its tokens' d_x is whole, every route's d_topk_weights row written

    d_x = own["out"][:T].clone()
    d_topk_weights = torch.stack(P["dtw"].keep)[t["combine_rank"].long(), t["combine_row"].long(), 0]  # [T_r, K]
    if s.shared is not None:
        d_shared = ep_shared.backward_gather(P, d_out.shape[1])
    return (d_x, d_topk_weights, *d_w, *d_shared)


def _routed_backward(P: dict, s, w_rows, ranks, trace) -> tuple:
    """The rank's chain launch of the routed experts' backward over ranks: (d_topk_weights [n, 1] of its rows, its
    [d_w_gate, d_w_up, d_w_down]). In MXFP8 its operands are those of the fused level's backward over the rank's rows
    (each row a token of weight w_rows: megakernel.mx_operands)."""
    t, real, e = s.tables, s.real, s.experts
    if e.precision == "bf16":
        dy_rows = ops.pull_rows(P["d_out"], t["pull_rank"], t["pull_token"])  # [rows, H], zeros in padding
        _, d_tw, d_w, _ = ops.grouped_gemm_bf16_chain_backward(
            dy_rows, fused.gather_x_rows(e.x, s.sched), *e.weights[:3], e.gate, e.up, w_rows, s.sched,
            swiglu_limit=s.swiglu_limit, num_sms=e.num_sms, ranks=ranks, trace=trace)
        return d_tw, d_w
    if real.shape[0] == 0:  # no rows here (the forward saved L0's state of none): nothing to launch
        return w_rows.new_zeros(0, 1), [torch.zeros_like(w) for w in e.weights[:3]]
    d_rows = ops.pull_rows(P["d_out"], t["pull_rank"][real], t["pull_token"][real])  # [n, H] unweighted
    dy_rows, dy_cols, x_rows, routed, d_tw = megakernel.mx_operands(replace(e, topk_weights=w_rows), d_rows)
    del d_rows
    _, _, d_w, _ = ops.grouped_gemm_bf16_chain_backward(
        dy_rows, x_rows, *routed, e.gate_mx, e.up_mx, None, s.sched, swiglu_limit=s.swiglu_limit, num_sms=e.num_sms,
        ranks=ranks, trace=trace, dy_cols=dy_cols)
    return d_tw, d_w


@dataclass
class ChainSaved(PeerSaved):
    """PeerSaved and what the backward chain adds: the rank's row schedule and its forward's ChainRanks."""
    sched: object = None
    ranks: object = None


def forward_ranks(*args, **kwargs) -> tuple[list, list]:
    """R ranks in one process: mok.ep_peer.forward_ranks with this module's forward (option num_sms too)."""
    return ep_peer.forward_ranks(*args, rank_forward=forward_rank, **kwargs)


def backward_ranks(saved: list, d_outs: list) -> list[tuple]:
    """backward_rank of every rank in one process, from forward_ranks' saved states."""
    return ep_peer.backward_ranks(saved, d_outs, rank_backward=backward_rank)
