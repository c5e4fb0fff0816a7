"""The shared expert over ranks (mok.ep_peer, mok.ep_chain): each rank runs it over its own tokens, and the weight
gradients, whose K spans every rank's tokens, are dealt over the ranks by columns of hidden instead of computed
whole on every rank.

- forward: every rank's tokens through the fused level's shared expert (a row's bits do not depend on the others);
- backward, local: the down dgrad, SwiGLU backward and gate/up dgrad of its tokens (its dx rows), with its d_gate,
  d_up and h rows written to its buffers (`sdg`, `sdu`, `sh`);
- backward, dealt: rank r's columns of hidden (`columns`) of the three weight gradients, over every token's rows in
  the fused level's row order (the all-token schedule: its sums), into its buffer `sdw`; then every rank puts the
  columns together. An output column's bits do not depend on the other columns, so the gradients are the fused
  level's bits on every rank, for 1/R of the work each."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mok import fused, ops

BF16 = torch.bfloat16
UNIT = 8  # columns per 16 bytes of bf16: the kernels' row alignment


def columns(hidden: int, num_ranks: int) -> list[slice]:
    """Each rank's columns of hidden: near-equal slices in whole 16-byte units, in rank order, covering hidden."""
    cuts = [hidden // UNIT * s // num_ranks * UNIT for s in range(num_ranks)] + [hidden]
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]


def buffer_shapes(num_ranks: int, tokens: int, hidden: int, shared_intermediate: int) -> dict:
    """The buffers the backward adds per rank (mok.ep_peer.buffer_shapes): its tokens' d_gate, d_up and h rows, and
    its columns of the three weight gradients (d_w_gate's and d_w_up's transposed, then d_w_down's: [3·width, I])."""
    if not shared_intermediate:
        return {}
    width = max(c.stop - c.start for c in columns(hidden, num_ranks))
    rows = (tokens, shared_intermediate, BF16)
    return {"sdg": rows, "sdu": rows, "sh": rows, "sdw": (3 * width, shared_intermediate, BF16)}


@dataclass
class Saved:
    """What a rank's forward keeps of the shared expert for its backward."""
    x_cols: torch.Tensor  # [R_all, c]: its columns of every token's x in the all-token rows (a later forward
    # overwrites the x buffers), zeros in padding
    rows: tuple | None  # (gate, up) rows of its tokens (fused.shared_forward's), None for a rank of no tokens
    weights: tuple  # (w_shared_gate, w_shared_up, w_shared_down)


def forward(P: dict, rank: int, split: list, x: torch.Tensor, weights: tuple, swiglu_limit,
            rows: tuple | None = None) -> tuple:
    """(out [T, H] or None, Saved) of this rank's tokens (every rank's x in place): fused.shared_forward, or with
    rows (gate, up) its rows computed elsewhere (the chain launch's; out None)."""
    out = None
    if rows is None and x.shape[0]:
        out, rows = fused.shared_forward(x, weights, swiglu_limit, fused.DEFAULT_NUM_SMS)
    elif rows is None:
        out = x.new_zeros(x.shape)
    cols = columns(x.shape[1], len(split))[rank]
    num_rows = fused.shared_schedule(sum(split), x.device).num_rows if sum(split) else 0  # the all-token rows
    x_cols = P["x"].tokens(split, cols, num_rows)
    return out, Saved(x_cols, rows, weights)


def backward_local(own: dict, saved: Saved, d_out: torch.Tensor, swiglu_limit) -> torch.Tensor:
    """dx [T, H] of this rank's tokens (fused.shared_backward's rows of them), their d_gate, d_up and h rows written
    to its buffers `own` for every rank's share of the weight gradients."""
    T = d_out.shape[0]
    if T == 0:
        return d_out.new_zeros(d_out.shape)
    ws_gate, ws_up, ws_down = (w[None] for w in saved.weights)
    sh, sms = fused.shared_schedule(T, d_out.device), fused.DEFAULT_NUM_SMS
    d_gate, d_up, h = fused.dgrad_swiglu(fused.pad_rows(d_out, sh.num_rows), ws_down, *saved.rows, sh, swiglu_limit,
                                         sms)
    own["sdg"][:T], own["sdu"][:T], own["sh"][:T] = d_gate[:T], d_up[:T], h[:T]
    return fused.dgrad_gate_up(d_gate, d_up, ws_gate, ws_up, sh, sms)[:T]


def backward_share(P: dict, rank: int, split: list, saved: Saved) -> None:
    """This rank's columns of d_w_gate, d_w_up, d_w_down over every token's rows (every rank's backward_local
    done), into its buffer `sdw`."""
    hidden = P["d_out"].keep[rank].shape[1]
    cols = columns(hidden, len(split))[rank]
    c, width = cols.stop - cols.start, P["sdw"].keep[rank].shape[0] // 3
    sdw, wgrad, sms = P["sdw"].keep[rank], ops.grouped_gemm_bf16_weight_grad, fused.DEFAULT_NUM_SMS
    if sum(split) == 0:  # no token anywhere: zero gradients (L0's), not an earlier pass's columns
        sdw.zero_()
        return
    if c == 0:
        return
    sh = fused.shared_schedule(sum(split), sdw.device)  # the fused level's rows: every token in order
    d_gate, d_up, h = (P[n].tokens(split, num_rows=sh.num_rows) for n in ("sdg", "sdu", "sh"))  # [R_all, I] each
    dy, x = P["d_out"].tokens(split, cols, sh.num_rows), saved.x_cols  # [R_all, c] each
    sdw[:c] = wgrad(d_gate, x, sh, num_sms=sms)[0].T  # d_w_gate's columns [I, c], transposed
    sdw[width: width + c] = wgrad(d_up, x, sh, num_sms=sms)[0].T
    sdw[2 * width: 2 * width + c] = wgrad(dy, h, sh, num_sms=sms)[0]  # d_w_down's rows [c, I]


def backward_gather(P: dict, hidden: int) -> list[torch.Tensor]:
    """[d_w_shared_gate [I, H], d_w_shared_up [I, H], d_w_shared_down [H, I]] from every rank's `sdw` (every rank's
    backward_share done): the same on every rank."""
    parts = list(zip(P["sdw"].keep, columns(hidden, P["sdw"].num_ranks)))
    width = parts[0][0].shape[0] // 3

    def stack(first: int) -> torch.Tensor:  # [H, I]: each rank's rows of its columns, in rank order
        return torch.cat([b[first: first + c.stop - c.start] for b, c in parts])

    return [stack(0).T.contiguous(), stack(width).T.contiguous(), stack(2 * width)]
