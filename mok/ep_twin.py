"""The megakernel's CPU twin (docs/megakernel.md): runs an EPPlan's tasks with L0's pieces
(mok.reference: mm, quant, swiglu, swiglu_backward, combine), rounding where L0 rounds, in any order its counters
allow. The GPU kernel is meant to be a translation of these task bodies.

Buffers: one dict per rank (`rank_buffers`), what that rank's symmetric memory holds: its inputs, its row buffers
(`*_rows`, [num_rows, ...] in the plan's row order) and its token buffers ([T_r, ...]). A task writes its own rank's
buffers only, and reads a peer's only where the plan says: the pull list (x, d_out, topk_weights), the combine plan
(y_rows, dx_rows), and every token's shared-expert operands for the shared weight-gradient tiles.

- `run_pass`: all ranks in one process, in `task_order`'s order (grid=1: each rank in ticket order; grid=None and
  a generator: any ready task at random). Buffers a pass writes start as NaN; tiles write zeros in padding rows.
- `mok.ep_twin_ranks.run_rank_pass`: one rank inside a process group (gloo), the same task bodies.
- `mok.ep_twin_tables.run_tables_pass`: every rank from its int32 tables alone (mok.ep_tables), the same bodies.

Bits: a tile's GEMM is `reference.mm` on the tile's real rows and its BLOCK_N slice of the weights, looked up at
call time. Tiles hold the same rows at every EP degree (the plan cuts the single-GPU schedule), so the routed bits do
not depend on R. CPU BLAS gives a row other bits when its GEMM has other rows (docs/ep.md), so with torch's mm the
shared expert's tiles (each rank's own tokens) and any tiling but one tile per GEMM may differ from L0 in last bits;
a GEMM whose row bits do not depend on the other rows (as the GPU kernel's tiles; tests patch one into
`reference.mm`) makes the twin equal to L0 bit for bit at every EP degree and tiling. Elementwise steps run on
contiguous tiles: with widths that are multiples of 32, torch's vectorized sigmoid gives every element L0's bits.
"""

from __future__ import annotations

import torch

from mok import reference
from mok.checks import fail
from mok.config import PRECISIONS
from mok.ep_plan import PHASES, EPPlan, task_order

BF16 = torch.bfloat16
TOKEN_INPUTS = ("x", "topk_weights", "d_out")  # [T, ...]: cut by tokens
ROUTED_WEIGHTS = ("w_gate", "w_up", "w_down")  # [E, ...]: cut by experts
SHARED_WEIGHTS = ("w_shared_gate", "w_shared_up", "w_shared_down")  # replicated
SHARED_GRADS = ("d_w_shared_gate", "d_w_shared_up", "d_w_shared_down")
PLAN_DIMS = ("ep_size", "num_topk", "hidden", "intermediate", "shared_intermediate", "block_m", "block_n")


def rank_buffers(plan: EPPlan, rank: int, inputs: dict) -> dict:
    """Rank `rank`'s inputs cut from global ones (make_inputs' names: x, topk_weights, d_out [T, ...] in rank-major
    token order; w_gate, w_up, w_down [E, ...]; the shared weights, replicated), as its buffers' dict."""
    rp = plan.ranks[rank]
    tokens = slice(rp.token_offset, rp.token_offset + rp.num_tokens)
    experts = slice(rp.experts.start, rp.experts.stop)
    buf = {name: inputs[name][tokens] for name in TOKEN_INPUTS if inputs.get(name) is not None}
    buf.update({name: inputs[name][experts] for name in ROUTED_WEIGHTS})
    buf.update({name: inputs[name] for name in SHARED_WEIGHTS if inputs.get(name) is not None})
    return buf


class PassRun:
    """One pass's state: the plan, every rank's buffers (peers' as mirrors in a process group), options. The
    bodies read the plan only through dims (PLAN_DIMS) and sizes ... routes (mok.ep_twin_tables: from tables)."""

    def __init__(self, plan, pass_, bufs, precision, swiglu_limit, dims=None):
        dims = dims or {name: getattr(plan, name) for name in PLAN_DIMS}
        if precision not in PRECISIONS:
            fail("precision", f"one of {PRECISIONS}", repr(precision))
        if precision == "mxfp8" and (dims["block_n"] % 32 or dims["hidden"] % 32 or dims["intermediate"] % 32):
            fail("block_n/hidden/intermediate", "multiples of 32 in mxfp8 mode (whole MXFP8 blocks per tile)",
                 (dims["block_n"], dims["hidden"], dims["intermediate"]))
        (self.ep_size, self.num_topk, self.hidden, self.intermediate, self.shared_intermediate, self.block_m,
         self.block_n) = (dims[name] for name in PLAN_DIMS)
        self.plan, self.pass_, self.bufs, self.p, self.limit = plan, pass_, bufs, precision, swiglu_limit
        self.shared = self.shared_intermediate > 0
        self._w = {}

    def sizes(self, rank: int) -> tuple[int, int, int]:  # (num_tokens, num_rows, owned experts)
        rp = self.plan.ranks[rank]
        return rp.num_tokens, rp.num_rows, len(rp.experts)

    def tile_num_rows(self, rank: int, m: int) -> int:
        return int(self.plan.ranks[rank].tile_num_rows[m])

    def expert(self, rank: int, t) -> int:  # the task's expert as an index into the rank's [E_r, ...] weights
        return t.expert - self.plan.ranks[rank].experts.start

    def expert_rows(self, rank: int, e: int) -> slice:  # owned expert e's (local index) real rows
        rp = self.plan.ranks[rank]
        return rp.expert_rows(rp.experts.start + e)

    def pulls(self, rank: int, rows: slice) -> tuple:  # per row: (rank of its token, the token's id there, k)
        rp = self.plan.ranks[rank]
        return rp.pull_rank[rows], rp.pull_token[rows], rp.row_to_route[rows] % self.num_topk

    def routes(self, rank: int, tok: slice) -> tuple:  # per route of the tokens: (owner rank, row there), [n, K]
        rp = self.plan.ranks[rank]
        return rp.combine_rank[tok], rp.combine_row[tok]

    def poison(self, rank: int) -> None:
        """Every buffer the pass writes on `rank`, as NaN."""
        H, I, I_sh, K = self.hidden, self.intermediate, self.shared_intermediate, self.num_topk
        T, N, E = self.sizes(rank)
        if self.pass_ == "forward":
            s = {"x_rows": (N, H), "gate_rows": (N, I), "up_rows": (N, I), "h_rows": (N, I), "y_rows": (N, H),
                 "y": (T, K, H), "out": (T, H)}
            shared = {"shared_gate": (T, I_sh), "shared_up": (T, I_sh), "shared_h": (T, I_sh), "shared_out": (T, H)}
        else:
            s = {"dy_rows": (N, H), "d_gate_rows": (N, I), "d_up_rows": (N, I), "h_rows": (N, I),
                 "dx_rows": (N, H), "d_x": (T, H), "d_topk_weights": (T, K), "d_w_gate": (E, I, H),
                 "d_w_up": (E, I, H), "d_w_down": (E, H, I)}
            shared = {"shared_d_gate": (T, I_sh), "shared_d_up": (T, I_sh), "shared_h": (T, I_sh),
                      "shared_dx": (T, H), "d_w_shared_gate": (I_sh, H), "d_w_shared_up": (I_sh, H),
                      "d_w_shared_down": (H, I_sh)}
        s.update(shared if I_sh else {})
        for name, shape in s.items():
            dtype = torch.float32 if name == "d_topk_weights" else BF16
            self.bufs[rank][name] = torch.full(shape, float("nan"), dtype=dtype)

    def w(self, rank: int, name: str) -> torch.Tensor:
        """A routed weight as the pass's GEMMs see it: quantized along its K (forward: dim -1; backward: -2)."""
        if (rank, name) not in self._w:
            dim = -1 if self.pass_ == "forward" else -2
            w = self.bufs[rank][name]  # [E_r, ...]
            self._w[rank, name] = [reference.quant(w[i], dim, self.p) for i in range(w.shape[0])]
        return self._w[rank, name]

    def tile(self, rank: int, m: int) -> tuple[slice, slice]:
        """Row tile m: (all its rows, its real rows: a prefix)."""
        bm, real = self.block_m, self.tile_num_rows(rank, m)
        return slice(m * bm, (m + 1) * bm), slice(m * bm, m * bm + real)

    def cols(self, n: int, size: int) -> slice:
        return slice(n * self.block_n, min(size, (n + 1) * self.block_n))

    def tokens(self, rank: int, c: int) -> slice:
        bm = self.block_m
        return slice(c * bm, min(self.sizes(rank)[0], (c + 1) * bm))

    def pull(self, name: str, ranks: torch.Tensor, index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Rows index[i] of buffer `name` on rank ranks[i] (peer loads): [len(index), *like.shape[1:]]."""
        out = like.new_empty(len(index), *like.shape[1:])
        for s in ranks.unique().tolist():
            sel = ranks == s
            out[sel] = self.bufs[s][name][index[sel]]
        return out

    def all_tokens(self, name: str) -> torch.Tensor:
        """[T, ...] buffer `name` of every rank in global token order (the shared weight gradients' operands)."""
        return torch.cat([self.bufs[s][name] for s in range(self.ep_size)])

    def gather_shared_wgrads(self, rank: int, tiles) -> None:
        """The all-gather after the backward: `rank` gets each tile (which, n, owner) of d_w_shared_* from its owner."""
        for which, n, owner in tiles:
            name = f"d_w_shared_{which}"
            rows = self.cols(n, self.bufs[owner][name].shape[0])
            self.bufs[rank][name][rows] = self.bufs[owner][name][rows]


def _write(buf: torch.Tensor, rows: slice, real: slice, cols, value: torch.Tensor) -> None:
    buf[rows, cols] = 0  # padding rows hold zeros, as the kernels write them
    buf[real, cols] = value


# ---- the task bodies: (run, rank, task) ------------------------------------------------------------------------


def _pull_x(run, r, t):
    b = run.bufs[r]
    rows, real = run.tile(r, t.m)
    src, tok, _ = run.pulls(r, real)
    b["x_rows"][rows] = 0
    b["x_rows"][real] = run.pull("x", src, tok, b["x"])  # [n, H]


def _gate_up(run, r, t):
    b, e, p = run.bufs[r], run.expert(r, t), run.p
    rows, real = run.tile(r, t.m)
    cols = run.cols(t.n, run.intermediate)
    xq = reference.quant(b["x_rows"][real], -1, p)  # [n, H] row-wise: K of GEMM1 is hidden
    gate = reference.mm(xq, run.w(r, "w_gate")[e][cols]).to(BF16)  # [n, BLOCK_N]
    up = reference.mm(xq, run.w(r, "w_up")[e][cols]).to(BF16)  # [n, BLOCK_N]
    _write(b["h_rows"], rows, real, cols, reference.swiglu(gate, up, run.limit).to(BF16))
    _write(b["gate_rows"], rows, real, cols, reference.quant(gate, -1, p))  # saved: MXFP8 blocks inside the tile
    _write(b["up_rows"], rows, real, cols, reference.quant(up, -1, p))


def _down(run, r, t):
    b, e = run.bufs[r], run.expert(r, t)
    rows, real = run.tile(r, t.m)
    cols = run.cols(t.n, run.hidden)
    hq = reference.quant(b["h_rows"][real], -1, run.p)  # [n, I]: the whole row, every gate_up tile of m
    _write(b["y_rows"], rows, real, cols, reference.mm(hq, run.w(r, "w_down")[e][cols]).to(BF16))


def _shared_gate_up(run, r, t):
    b, tok = run.bufs[r], run.tokens(r, t.m)
    cols = run.cols(t.n, run.shared_intermediate)
    gate = reference.mm(b["x"][tok], b["w_shared_gate"][cols]).to(BF16)  # [n, BLOCK_N], BF16 always (DESIGN §4)
    up = reference.mm(b["x"][tok], b["w_shared_up"][cols]).to(BF16)
    b["shared_gate"][tok, cols], b["shared_up"][tok, cols] = gate, up
    b["shared_h"][tok, cols] = reference.swiglu(gate, up, run.limit).to(BF16)


def _shared_down(run, r, t):
    b, tok = run.bufs[r], run.tokens(r, t.m)
    cols = run.cols(t.n, run.hidden)
    b["shared_out"][tok, cols] = reference.mm(b["shared_h"][tok], b["w_shared_down"][cols]).to(BF16)


def _routes(run, r, tok, name):
    """[n, K, H]: row `name` of each route of the tokens, pulled from its owner (the combine plan)."""
    owner, row = run.routes(r, tok)  # [n, K] each
    rows = run.pull(name, owner.flatten(), row.flatten(), run.bufs[r][name])
    return rows.view(tok.stop - tok.start, run.num_topk, -1)


def _combine(run, r, t):
    b, tok = run.bufs[r], run.tokens(r, t.m)
    b["y"][tok] = _routes(run, r, tok, "y_rows")  # saved for d_topk_weights
    shared = b["shared_out"][tok] if run.shared else None
    b["out"][tok] = reference.combine(b["y"][tok], b["topk_weights"][tok], shared)  # fp32, increasing k, shared


def _pull_dy(run, r, t):
    b = run.bufs[r]
    rows, real = run.tile(r, t.m)
    src, tok, k = run.pulls(r, real)  # [n] each
    d_out = run.pull("d_out", src, tok, b["d_out"])  # [n, H]
    w = run.pull("topk_weights", src, tok, b["topk_weights"])  # [n, K]
    b["dy_rows"][rows] = 0
    b["dy_rows"][real] = (d_out.float() * w.gather(1, k[:, None])).to(BF16)  # bf16(d_out·w), one rounding


def _dgrad_down(run, r, t):
    b, e, p = run.bufs[r], run.expert(r, t), run.p
    rows, real = run.tile(r, t.m)
    cols = run.cols(t.n, run.intermediate)
    d_h = reference.mm(reference.quant(b["dy_rows"][real], -1, p), run.w(r, "w_down")[e].T[cols]).to(BF16)
    gate, up = b["gate_rows"][real, cols].contiguous(), b["up_rows"][real, cols].contiguous()  # [n, BLOCK_N]
    d_gate, d_up = reference.swiglu_backward(gate, up, d_h, run.limit)
    _write(b["d_gate_rows"], rows, real, cols, d_gate.to(BF16))
    _write(b["d_up_rows"], rows, real, cols, d_up.to(BF16))
    _write(b["h_rows"], rows, real, cols, reference.swiglu(gate, up, run.limit).to(BF16))  # recomputed


def _dgrad_gate_up(run, r, t):
    b, e, p = run.bufs[r], run.expert(r, t), run.p
    rows, real = run.tile(r, t.m)
    cols = run.cols(t.n, run.hidden)
    dx = (reference.mm(reference.quant(b["d_gate_rows"][real], -1, p), run.w(r, "w_gate")[e].T[cols])
          + reference.mm(reference.quant(b["d_up_rows"][real], -1, p), run.w(r, "w_up")[e].T[cols]))  # fp32
    _write(b["dx_rows"], rows, real, cols, dx.to(BF16))  # one rounding of the K = 2·I sum


def _wgrad(run, r, t):
    b, p, e = run.bufs[r], run.p, run.expert(r, t)
    seg = run.expert_rows(r, e)  # the expert's rows, ascending route id
    out = b[f"d_w_{t.which}"][e]  # [I, H] or [H, I]
    rows_out = run.cols(t.n, out.shape[0])
    if seg.stop == seg.start:
        out[rows_out] = 0  # no routes: exactly zero, as L0
        return
    a, x = (b["dy_rows"], b["h_rows"]) if t.which == "down" else (b[f"d_{t.which}_rows"], b["x_rows"])
    # K = the expert's rows, in order; column-wise MXFP8 blocks from the segment's first row
    out[rows_out] = reference.mm(reference.quant(a[seg], -2, p).T[rows_out], reference.quant(x[seg], -2, p).T).to(BF16)


def _shared_dgrad_down(run, r, t):
    b, tok = run.bufs[r], run.tokens(r, t.m)
    cols = run.cols(t.n, run.shared_intermediate)
    d_h = reference.mm(b["d_out"][tok], b["w_shared_down"].T[cols]).to(BF16)  # dy = d_out for the shared expert
    gate, up = b["shared_gate"][tok, cols].contiguous(), b["shared_up"][tok, cols].contiguous()
    d_gate, d_up = reference.swiglu_backward(gate, up, d_h, run.limit)
    b["shared_d_gate"][tok, cols], b["shared_d_up"][tok, cols] = d_gate.to(BF16), d_up.to(BF16)
    b["shared_h"][tok, cols] = reference.swiglu(gate, up, run.limit).to(BF16)


def _shared_dgrad_gate_up(run, r, t):
    b, tok = run.bufs[r], run.tokens(r, t.m)
    cols = run.cols(t.n, run.hidden)
    dx = (reference.mm(b["shared_d_gate"][tok], b["w_shared_gate"].T[cols])
          + reference.mm(b["shared_d_up"][tok], b["w_shared_up"].T[cols]))
    b["shared_dx"][tok, cols] = dx.to(BF16)


def _shared_wgrad(run, r, t):
    out = run.bufs[r][f"d_w_shared_{t.which}"]
    rows_out = run.cols(t.n, out.shape[0])
    a, x = (("d_out", "shared_h") if t.which == "down" else (f"shared_d_{t.which}", "x"))
    a, x = run.all_tokens(a), run.all_tokens(x)  # [T, ...]: K = every token, in global order
    out[rows_out] = reference.mm(a.T[rows_out], x.T).to(BF16)


def _combine_dx(run, r, t):
    b, tok = run.bufs[r], run.tokens(r, t.m)
    dx = _routes(run, r, tok, "dx_rows")  # [n, K, H]
    ones = torch.ones(dx.shape[:2])  # 1·dx is exact: reference.combine is then L0's d_x sum
    b["d_x"][tok] = reference.combine(dx, ones, b["shared_dx"][tok] if run.shared else None)
    b["d_topk_weights"][tok] = (b["d_out"][tok].float()[:, None, :] * b["y"][tok].float()).sum(-1)  # [n, K]


def _notify(run, r, t):
    """Nothing to compute: the counter it waits on is complete, the ones it increments are its consumers'."""


BODIES = {"pull_x": _pull_x, "gate_up": _gate_up, "down": _down, "notify_y": _notify, "combine": _combine,
          "shared_gate_up": _shared_gate_up, "shared_down": _shared_down, "pull_dy": _pull_dy,
          "dgrad_down": _dgrad_down, "dgrad_gate_up": _dgrad_gate_up, "notify_dx": _notify, "wgrad": _wgrad,
          "shared_dgrad_down": _shared_dgrad_down, "shared_dgrad_gate_up": _shared_dgrad_gate_up,
          "shared_wgrad": _shared_wgrad, "combine_dx": _combine_dx}


def run_pass(plan: EPPlan, pass_: str, bufs: list, *, precision: str = "bf16", swiglu_limit=None, grid=1,
             generator=None) -> list:
    """Run pass_ ("forward", then "backward" with d_out in the buffers) for every rank in one process, in
    task_order(plan, pass_, grid=grid, generator=generator); then every rank gets the shared weight gradients'
    tiles of the others (the all-gather after the kernel). Returns bufs, filled."""
    if pass_ not in PHASES:
        fail("pass_", f"one of {tuple(PHASES)}", repr(pass_))
    if len(bufs) != plan.ep_size:
        fail("bufs", f"one dict per rank ({plan.ep_size})", len(bufs))
    run = PassRun(plan, pass_, bufs, precision, swiglu_limit)
    for r in range(plan.ep_size):
        run.poison(r)
    for r, i in task_order(plan, pass_, grid=grid, generator=generator):
        t = plan.ranks[r].tasks[pass_][i]
        BODIES[t.kind](run, r, t)
    if pass_ == "backward" and run.shared:
        for r in range(plan.ep_size):
            run.gather_shared_wgrads(r, plan.shared_wgrad_tiles)
    return bufs
