"""Expert parallelism over peer memory, phase by phase: every rank's pass from its mok.ep_build tables, with
dispatch and combine as pulls through tables of the ranks' buffers (mok.ops.Peers: the megakernel's pull and
combine bodies) and the local experts by the fused level. The megakernel (docs/megakernel.md) runs the same data
movement inside one launch per rank on dependency counters; here a kernel boundary stands for each counter, so
that the tables, the pulls and the determinism claim are proven on a GPU before the kernel exists.

R ranks in one process on one GPU (their buffers tensors of this process): `forward_ranks`, `backward_ranks`, with
each rank's inputs as a list indexed by rank. BF16. The bits equal the fused level's at EP = 1, in the output and
every gradient, for any split of the tokens over any number of ranks (tests/test_ep_peer.py):
- rank r's rows are the single-GPU schedule's rows cut at its experts (the pull), each expert's rows in ascending
  global route id, and a fused GEMM row's bits depend only on that row;
- each token's sum runs over its routes in increasing k on its home rank (combine_peers), then the shared expert;
- the backward gives each row its route's real weight (the level's d_h = w·g and w·h), as the fused level does.

Not yet over several processes: the peers' tables would come from symmetric memory, and the two scalar lookups
done here by torch indexing across ranks (each row's route weight, each route's d_topk_weights) would be pulls
too; the shared expert runs over every token at once, as mok.comm's exact_shared (the megakernel deals its weight
gradients' tiles over the ranks instead)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mok import fused, ops
from mok.checks import fail
from mok.ep_build import build_tables
from mok.ep_plan import expert_ranges

BF16 = torch.bfloat16


@dataclass
class PeerSaved:
    """What forward_ranks keeps for backward_ranks."""
    tables: list  # per rank: its forward tables (mok.ep_build)
    real: list  # per rank: bool [rows_r], the rows holding a route (pull_rank >= 0)
    experts: list  # per rank: the fused level's saved state of its rows
    weights: list  # per rank: fp32 [T_r, K]
    token_offsets: list  # [R + 1] first global token of each rank
    shared: tuple | None  # (x_all [T, H], gate, up rows, weights) of the shared expert over every token
    num_rows: int  # rows of every rank's peer buffers (the largest rank's)
    swiglu_limit: float | None


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [n, ...] as the first rows of a zeroed buffer of `rows` rows: one rank's peer buffer."""
    out = t.new_zeros(rows, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


def _scatter_rows(rows: torch.Tensor, real: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The level's rows [n_real, H] at their places among the rank's rows (zeros in padding), in a buffer of
    num_rows rows."""
    out = rows.new_zeros(num_rows, rows.shape[1])
    out[: real.shape[0]][real] = rows
    return out


def forward_ranks(xs, topk_idxs, topk_weights, w_gates, w_ups, w_downs, w_shared_gate=None, w_shared_up=None,
                  w_shared_down=None, *, swiglu_limit=None) -> tuple[list, PeerSaved]:
    """Each rank's out [T_r, H] and the saved state. xs, topk_idxs (global expert ids), topk_weights: rank r's
    tokens; w_gates, w_ups, w_downs: rank r's experts [E_r, ...], contiguous blocks (mok.ep_plan.expert_ranges);
    the shared expert's weights replicated."""
    R = len(xs)
    if not all(len(v) == R for v in (topk_idxs, topk_weights, w_gates, w_ups, w_downs)):
        fail("xs, topk_idxs, topk_weights, w_gates, w_ups, w_downs", f"{R} entries each (one per rank)",
             [len(v) for v in (xs, topk_idxs, topk_weights, w_gates, w_ups, w_downs)])
    E, H, I = sum(w.shape[0] for w in w_gates), xs[0].shape[1], w_gates[0].shape[1]
    if [len(g) for g in expert_ranges(E, R)] != [w.shape[0] for w in w_gates]:
        fail("w_gates", f"the blocks of mok.ep_plan.expert_ranges({E}, {R})", [w.shape[0] for w in w_gates])
    split = [x.shape[0] for x in xs]
    idx = torch.cat(topk_idxs)  # [T, K]: the all-gathered routing, rank-major
    sched = ops.make_schedule_cuda(idx, E, block_m=fused.BLOCK_M)
    I_sh = 0 if w_shared_gate is None else w_shared_gate.shape[0]
    tables = [build_tables(idx, split, E, r, "forward", hidden=H, intermediate=I, shared_intermediate=I_sh,
                           block_m=fused.BLOCK_M, sched=sched) for r in range(R)]
    real = [t["pull_rank"] >= 0 for t in tables]  # [rows_r]
    x_peers = ops.Peers.of([_pad(x.to(BF16), max(split + [1])) for x in xs])
    num_rows = max(t["pull_rank"].numel() for t in tables) or 1

    y_bufs, experts = [], []
    for r, (t, ok) in enumerate(zip(tables, real)):  # phases 0-2: pull, gate/up, down
        x_rows = ops.pull_rows(x_peers, t["pull_rank"][ok], t["pull_token"][ok])  # [n_r, H]
        expert_of_row = torch.repeat_interleave(torch.arange(w_gates[r].shape[0], device=x_rows.device),
                                                t["tokens_per_expert"].long())[:, None]  # [n_r, 1]
        ones = torch.ones(x_rows.shape[0], 1, device=x_rows.device)  # [n_r, 1]: the level's out is y itself
        y, saved = fused.forward(x_rows, expert_of_row, ones, w_gates[r], w_ups[r], w_downs[r],
                                 swiglu_limit=swiglu_limit)
        y_bufs.append(_scatter_rows(y, ok, num_rows))
        experts.append(saved)

    shared_out, shared = [None] * R, None
    if w_shared_gate is not None:  # every token at once: row t's bits are those of any split
        x_all = torch.cat(xs).to(BF16)
        sh = fused.shared_schedule(x_all.shape[0], x_all.device)
        out_sh, gate, up = fused.experts_forward(x_all, w_shared_gate[None], w_shared_up[None], w_shared_down[None],
                                                 sh, swiglu_limit, fused.DEFAULT_NUM_SMS)
        shared_out = list(out_sh[: x_all.shape[0]].split(split))
        shared = (x_all, gate, up, (w_shared_gate[None], w_shared_up[None], w_shared_down[None]))
    y_peers = ops.Peers.of(y_bufs)
    outs = [ops.combine_peers(y_peers, t["combine_rank"], t["combine_row"], w, s)  # phase 3
            for t, w, s in zip(tables, topk_weights, shared_out)]
    offsets = [0] + torch.tensor(split).cumsum(0).tolist()
    return outs, PeerSaved(tables, real, experts, list(topk_weights), offsets, shared, num_rows, swiglu_limit)


def backward_ranks(saved: PeerSaved, d_outs: list) -> list[tuple]:
    """Each rank's gradients (d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down of its experts, and the shared
    expert's three, the same on every rank), reference.moe_backward's order."""
    s, R = saved, len(saved.tables)
    if len(d_outs) != R:
        fail("d_outs", f"{R} tensors (one per rank)", len(d_outs))
    d_out_peers = ops.Peers.of([_pad(d.to(BF16), max([d.shape[0] for d in d_outs] + [1])) for d in d_outs])
    w_all = torch.cat(s.weights)  # [T, K] NOTE: a pull per row across processes
    offsets = torch.tensor(s.token_offsets, device=w_all.device)
    dx_bufs, dtw_bufs, d_w = [], [], []
    for t, ok, experts in zip(s.tables, s.real, s.experts):
        rank, token, k = (t[name][ok].long() for name in ("pull_rank", "pull_token", "pull_k"))
        d_rows = ops.pull_rows(d_out_peers, t["pull_rank"][ok], t["pull_token"][ok])  # [n_r, H] unweighted
        w_rows = w_all[offsets[rank] + token, k][:, None]  # [n_r, 1] each row's route weight
        dx_rows, d_tw, *grads = fused.backward(replace(experts, topk_weights=w_rows), d_rows)[:5]
        dx_bufs.append(_scatter_rows(dx_rows, ok, s.num_rows))
        dtw = d_tw.new_zeros(s.num_rows)  # [num_rows] fp32 per row
        dtw[: ok.shape[0]][ok] = d_tw[:, 0]
        dtw_bufs.append(dtw)
        d_w.append(grads)

    dx_shared, d_shared = [None] * R, [None, None, None]
    if s.shared is not None:  # the fused level's shared-expert backward over every token
        x_all, gate, up, ws = s.shared
        T, sh = x_all.shape[0], fused.shared_schedule(x_all.shape[0], x_all.device)
        d_out_all = torch.cat(d_outs).to(BF16)
        dx_all, d_ws, _ = fused._experts_backward(
            lambda: (fused.pad_rows(d_out_all, sh.num_rows), None), gate, up,
            lambda: fused.pad_rows(x_all, sh.num_rows), *ws, sh, s.swiglu_limit, fused.DEFAULT_NUM_SMS,
            lambda rows: rows[:T])
        dx_shared, d_shared = list(dx_all.split([d.shape[0] for d in d_outs])), [w[0] for w in d_ws]
    dx_peers, dtw_all = ops.Peers.of(dx_bufs), torch.stack(dtw_bufs)  # NOTE: dtw_all a pull per route across processes
    out = []
    for r, t in enumerate(s.tables):
        d_x = ops.combine_peers(dx_peers, t["combine_rank"], t["combine_row"], None, dx_shared[r])
        d_tw = dtw_all[t["combine_rank"].long(), t["combine_row"].long()]  # [T_r, K]
        out.append((d_x, d_tw, *d_w[r], *d_shared))
    return out
