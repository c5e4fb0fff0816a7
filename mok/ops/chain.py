"""The chain kernels (csrc/include/mok/gemm/chain.cuh, chain_backward.cuh): the megakernel level's passes at EP = 1,
each one persistent launch of several of mok.ops.gemm's kinds whose tasks wait on device counters, with the bits of
those kinds launched one by one (docs/gemm.md, docs/megakernel.md).

    grouped_gemm_bf16_chain            GEMM1 and GEMM2, the shared expert's and the combine optional
    grouped_gemm_bf16_chain_backward   the layer's backward (BF16, or MXFP8 for the routed experts): down dgrad,
                                       SwiGLU backward, MXFP8's round trips, gate/up dgrad with the combine of d_x,
                                       the three weight gradients, the shared expert's too
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from mok.checks import check_cuda, check_layout, fail
from mok.ops.core import load_extension
from mok.ops.gemm import (
    GEMM_BLOCK_M,
    GEMM_DOWN_TILE_N,
    GEMM_K_ALIGN,
    _check_devices,
    _check_gemm_dim,
    _check_limit,
    _check_num_sms,
    _check_rowwise_mx,
    _gemm1_args,
    _limit_kwargs,
    _rowwise_mx_buffer,
    gemm_schedule_kwargs,
    gemm_schedule_tensors,
    weight_grad_schedule_tensors,
)
from mok.ops.quant import BLOCK_SIZE
from mok.schedule import make_schedule

RANK_SHIFT = 24  # a row id over ranks: rank << RANK_SHIFT | local id (csrc/include/mok/gemm/chain.cuh)
MAX_RANKS = 8  # mok::kMaxRanks
TRACE_FIELDS = ("where", "wait_begin", "wait_end", "begin", "end")  # a traced task's row (csrc/.../gemm/trace.cuh)
FORWARD_KINDS = ("gate_up", "down")  # a forward task's kind: index · 2 + group (0: the shared expert, 1: routed)
BACKWARD_KINDS = ("down_dgrad", "swiglu_rows", "round_trips", "gate_up_dgrad", "wgrad_down", "wgrad_gate",
                  "wgrad_up")
FORWARD_LISTS = ("x", "y", "topk_weights", "out", "token_done", "shared")  # the ChainRanks lists each pass reads
BACKWARD_LISTS = ("y", "out", "token_done", "shared")


def row_ids(rank: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """int32 row ids over ranks (rank << RANK_SHIFT | local), -1 where rank < 0."""
    return torch.where(rank >= 0, (rank.long() << RANK_SHIFT) | local.long(), -1).to(torch.int32)


@dataclass(frozen=True)
class ChainRanks:
    """grouped_gemm_bf16_chain over ranks (EP > 1, docs/megakernel.md): this rank's place among R, and entry s of
    each list rank s's tensor as this process reaches it (its own, a CUDA IPC handle's, or symmetric memory's peer
    tensor). Row ids are row_ids(rank, local id). The combine of a token runs on the rank whose tile completes it,
    so a rank's out is whole once every rank's launch has ended; token_done must be zero on every rank first."""
    rank: int
    row_ids: torch.Tensor  # int32 [sched.num_rows]: each routed row's token as a row id, -1: padding
    route_to_row: torch.Tensor  # int32 [every rank's tokens, K], rank-major: each route's row id (its owner's row)
    token_offsets: list  # rank s's first token in route_to_row
    x: list  # bf16 [capacity, hidden]: the routed GEMM1's input rows (x, or its MXFP8 round trip)
    y: list  # bf16 [row capacity, hidden]: the routed rows (entry rank: written here)
    topk_weights: list  # fp32 [capacity, K]
    out: list  # bf16 [capacity, hidden] (entry rank: returned)
    token_done: list  # int32 [capacity, ceil(hidden / 256)]
    shared: list = ()  # with a shared expert: bf16 [capacity rounded up to 128, hidden], its rows (written here)


def grouped_gemm_bf16_chain(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, sched,
                            swiglu_limit: float | None = None, num_sms: int | None = None,
                            topk_weights: torch.Tensor | None = None, shared: torch.Tensor | None = None,
                            shared_weights: tuple | None = None, shared_sched=None,
                            shared_x: torch.Tensor | None = None, mx_out: bool = False,
                            ranks: ChainRanks | None = None, trace: torch.Tensor | None = None):
    """GEMM1 and GEMM2 in one persistent launch (csrc/include/mok/gemm/chain.cuh): the bits of
    grouped_gemm_bf16_swiglu_gather then grouped_gemm_bf16_nt_contiguous(h, w_down), with GEMM2's tiles started as
    soon as GEMM1 has written their rows (a device counter per 128 rows). w_down [num_experts, hidden,
    intermediate].
    - shared_weights (w_shared_gate [I_sh, H], w_shared_up, w_shared_down [H, I_sh]): the shared expert's GEMM1 and
      GEMM2 in the same launch, over the tokens in order (rows padded to 128): what the fused level computes for it;
      shared_sched: that schedule (mok.fused.shared_schedule, cached), or None: built here (one host sync);
      shared_x: its input, or None: x (the MXFP8 forward's shared expert reads BF16 x, GEMM1 x's round trip).
    - topk_weights (fp32 [num_tokens, num_topk]): GEMM2's tiles also finish the combine, out = combine_rows(y_rows,
      sched.route_to_row, topk_weights, shared) bit for bit, each token's 256 columns summed by the tile that stores
      the last of its rows; shared: the shared expert's rows (bf16 [num_tokens, hidden]) or None, or with
      shared_weights its y computed here.
    - mx_out: GEMM1 as grouped_gemm_bf16_swiglu_gather_mxfp8_out (the MXFP8 forward: h its row-wise round trip,
      gate and up quantized row-wise, (data, scales) each); the shared expert stays BF16 (DESIGN §4).
    - ranks (ChainRanks, with topk_weights): the launch of one rank among several: the routed rows (sched's, this
      rank's experts) gather their tokens' x rows from any rank (ranks.row_ids), and the combine sums every rank's
      tokens whose last row is stored here, from the owners' rows, into their home rank's out. y_rows, out and the
      shared expert's y are views of this rank's entries.
    - trace: None, or int64 zeros [capacity, 5]: each task's row (tasks numbered shared GEMM1, routed GEMM1, shared
      GEMM2, routed GEMM2): SM << 32 | kind (GEMM − 1) · 2 + group (0 shared, 1 routed), its producer's wait on its
      counter (begin, end), its first consumer's begin and end, globaltimer ns (TRACE_FIELDS; tools/chain_timeline.py).
    Returns (y_rows [num_rows, hidden], h, gate, up [num_rows, intermediate], out [num_tokens, hidden] or None,
    the shared expert's (y, h, gate, up) [R_sh, ·] or None), bf16 but for mx_out's gate and up."""
    intermediate, kwargs = _gemm1_args(x, w_gate, w_up, sched, swiglu_limit, num_sms,
                                       intermediate_multiple=BLOCK_SIZE if mx_out else GEMM_K_ALIGN,
                                       num_tokens=None if ranks is None else x.shape[0])  # ranks: this rank's tokens
    T, hidden = x.shape
    if max(T, sched.num_rows) > 1 << RANK_SHIFT:
        fail("x, sched", f"at most 2^{RANK_SHIFT} tokens and rows (a row id's local part)", (T, sched.num_rows))
    check_layout("w_down", w_down, torch.bfloat16, (sched.num_experts, hidden, intermediate),
                 "[num_experts, hidden, intermediate]")
    _check_devices(x.device, w_down=w_down)
    if ranks is not None:
        if topk_weights is None:
            fail("topk_weights", "a tensor with ranks (the combine over ranks)", None)
        _check_ranks(ranks, x.device, hidden, sched.num_rows, T, FORWARD_LISTS,
                     None if shared_weights is None else -(-T // GEMM_BLOCK_M) * GEMM_BLOCK_M)
        kwargs["row_to_token"] = ranks.row_ids
    shared_expert, shared_rows = None, None
    if shared_weights is not None:
        if shared_x is not None:
            check_layout("shared_x", shared_x, torch.bfloat16, tuple(x.shape), "[num_tokens, hidden] (x's)")
            _check_devices(x.device, shared_x=shared_x)
        shared_expert, shared_rows = _chain_shared_expert(x if shared_x is None else shared_x, shared_weights,
                                                          shared_sched, ranks and ranks.shared[ranks.rank])
        if shared is not None:
            fail("shared", "None with shared_weights (the shared expert's rows are computed here)", "a tensor")
        shared = shared_expert[9] if topk_weights is not None else None  # its y as the binding takes it
    route_to_row, out, token_done = None, None, None  # the combine's, with topk_weights
    if topk_weights is not None:
        K = sched.num_topk if ranks is None else ranks.route_to_row.shape[1]  # ranks: sched's rows are routes'
        check_layout("topk_weights", topk_weights, torch.float32, (T, K), "[num_tokens, num_topk] (sched's)")
        check_cuda("topk_weights", topk_weights, x.device, "x's")
        if shared is not None and shared_weights is None:
            check_layout("shared", shared, torch.bfloat16, (T, hidden), "[num_tokens, hidden]")
            check_cuda("shared", shared, x.device, "x's", aligned=True)
        if ranks is not None:
            route_to_row = ranks.route_to_row
            out, token_done = ranks.out[ranks.rank], ranks.token_done[ranks.rank]  # whole (an empty view's
            # address is 0): the kernel writes its tokens' rows
        elif shared_weights is not None:  # every token's slices complete (its shared row counts): all written
            out = torch.empty(T, hidden, dtype=torch.bfloat16, device=x.device)  # [T, H]
        else:  # a token whose routes all lack a row (bad ids) is written by no tile: NaN, as combine_rows gives it
            out = torch.full((T, hidden), float("nan"), dtype=torch.bfloat16, device=x.device)  # [T, H]
        if ranks is None:
            route_to_row = sched.route_to_row.to(x.device, torch.int32)  # [T, K]
            token_done = torch.zeros(T, -(-hidden // GEMM_DOWN_TILE_N), dtype=torch.int32, device=x.device)
    elif shared is not None:
        fail("shared", "None without topk_weights (no combine)", "a tensor")
    h = torch.empty(sched.num_rows, intermediate, dtype=torch.bfloat16, device=x.device)  # [num_rows, I]
    if mx_out:  # one buffer each (data, then scales) and its views
        (gate_buffer, gate), (up_buffer, up) = (_rowwise_mx_buffer(sched.num_rows, intermediate, x.device)
                                                for _ in range(2))
    else:
        gate_buffer, up_buffer = (torch.empty_like(h) for _ in range(2))  # [num_rows, I] each
        gate, up = gate_buffer, up_buffer
    y_rows = torch.empty(sched.num_rows, hidden, dtype=torch.bfloat16, device=x.device) if ranks is None \
        else ranks.y[ranks.rank]  # [num_rows (ranks: its capacity), hidden]
    h_ready = torch.zeros(sched.num_rows // GEMM_BLOCK_M, dtype=torch.int32, device=x.device)  # per 128 rows
    if ranks is not None:  # this rank's whole entries (an empty view's address is 0: a rank without tokens)
        if ranks.route_to_row.shape[0] == 0:  # no token on any rank: no task anywhere
            return y_rows[:0], h, gate, up, out[:0], shared_rows
        x, topk_weights = ranks.x[ranks.rank], ranks.topk_weights[ranks.rank]
    load_extension().grouped_gemm_bf16_chain(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down, h=h, gate=gate_buffer,
                                             up=up_buffer, y=y_rows, h_ready=h_ready, shared_expert=shared_expert,
                                             route_to_row=route_to_row, topk_weights=topk_weights, shared=shared,
                                             out=out, token_done=token_done, mx_out=mx_out,
                                             ranks=None if ranks is None else _rank_lists(ranks),
                                             rank=0 if ranks is None else ranks.rank,
                                             token_offsets=[] if ranks is None else list(ranks.token_offsets),
                                             trace=_checked_trace(trace, x.device), **kwargs)
    if ranks is not None:  # this rank's views of its entries
        y_rows, out = y_rows[: sched.num_rows], out[:T]
    return y_rows, h, gate, up, out, shared_rows


def _check_ranks(ranks: ChainRanks, device, hidden: int, num_rows: int, num_tokens: int, lists: tuple,
                 shared_rows: int | None) -> None:
    """ChainRanks against one launch: one entry per rank in each of `lists` (the others empty), each rank's buffers
    alike and large enough (num_rows routed rows, num_tokens tokens, shared_rows shared rows or None: no shared
    list), ids that fit their bits."""
    if not isinstance(ranks, ChainRanks):
        fail("ranks", "a mok.ops.ChainRanks", type(ranks).__name__)
    check_layout("ranks.route_to_row", ranks.route_to_row, torch.int32, (None, None), "[every rank's tokens, K]")
    R, K = len(ranks.y), ranks.route_to_row.shape[1]
    if not 1 <= R <= MAX_RANKS:
        fail("ranks.y", f"1 to {MAX_RANKS} tensors (one per rank)", R)
    if not isinstance(ranks.rank, int) or not 0 <= ranks.rank < R:
        fail("ranks.rank", f"an int in [0, {R})", ranks.rank)
    offsets = ranks.token_offsets
    if offsets is None or len(offsets) != R or list(offsets) != sorted(offsets) or offsets[0] != 0:
        fail("ranks.token_offsets", f"{R} non-decreasing ints from 0 (each rank's first token)", offsets)
    ends = [*offsets[1:], ranks.route_to_row.shape[0]]
    if ends[-1] < offsets[-1] or offsets[ranks.rank] + num_tokens > ends[ranks.rank]:
        fail("ranks.route_to_row", f"every rank's tokens (this one's {num_tokens} from {offsets[ranks.rank]})",
             f"{ranks.route_to_row.shape[0]} tokens")
    num_tokens = max(e - o for o, e in zip(offsets, ends))  # a home rank's tokens: what its buffers must hold
    want = {"x": (torch.bfloat16, hidden, num_tokens), "y": (torch.bfloat16, hidden, num_rows),
            "topk_weights": (torch.float32, K, num_tokens), "out": (torch.bfloat16, hidden, num_tokens),
            "token_done": (torch.int32, -(-hidden // GEMM_DOWN_TILE_N), num_tokens),
            "shared": (torch.bfloat16, hidden, shared_rows)}
    for name, (dtype, width, rows) in want.items():
        entries = getattr(ranks, name)
        if name not in lists or (name == "shared" and shared_rows is None):
            if len(entries):
                fail(f"ranks.{name}", "empty (this launch does not read it)", f"{len(entries)} tensors")
            continue
        if len(entries) != R:
            fail(f"ranks.{name}", f"{R} tensors (one per rank, as ranks.y)", len(entries))
        first = entries[0]
        for s, t in enumerate(entries):
            check_layout(f"ranks.{name}[{s}]", t, dtype, (first.shape[0], width), f"[capacity, {width}], alike")
        if not rows <= first.shape[0] < 1 << RANK_SHIFT:
            fail(f"ranks.{name}", f"a capacity in [{rows}, 2^{RANK_SHIFT})", first.shape[0])
    check_layout("ranks.row_ids", ranks.row_ids, torch.int32, (num_rows,), "[num_rows]")
    for name in lists:  # the device checks last: the layouts' are CPU-testable
        for s, t in enumerate(getattr(ranks, name)):
            check_cuda(f"ranks.{name}[{s}]", t, device, "the launch's", aligned=True)
    for name in ("row_ids", "route_to_row"):
        check_cuda(f"ranks.{name}", getattr(ranks, name), device, "the launch's")


def _checked_trace(trace, device):
    """trace as the bindings take it: None, or int64 [capacity, len(TRACE_FIELDS)] on the launch's device."""
    if trace is not None:
        check_layout("trace", trace, torch.int64, (None, len(TRACE_FIELDS)), "[capacity, fields]")
        check_cuda("trace", trace, device, "the launch's")
    return trace


def _rank_lists(ranks: ChainRanks) -> list:
    """The binding's lists (x, y, topk_weights, shared, out, token_done)."""
    return [list(ranks.x), list(ranks.y), list(ranks.topk_weights), list(ranks.shared), list(ranks.out),
            list(ranks.token_done)]


def _chain_shared_expert(x: torch.Tensor, weights: tuple, sched, y_buffer=None) -> tuple[list, tuple]:
    """The shared expert's tensors as the chain binding takes them (its input x, its weights as one expert, its
    schedule of the tokens in order, its outputs and counters) and its outputs (y, h, gate, up) [R_sh, ·]. y_buffer:
    None, or a buffer whose first R_sh rows are y (ChainRanks.shared's entry)."""
    if not isinstance(weights, (tuple, list)) or len(weights) != 3:
        fail("shared_weights", "(w_shared_gate, w_shared_up, w_shared_down)", type(weights).__name__)
    ws_gate, ws_up, ws_down = weights
    T, hidden = x.shape
    check_layout("w_shared_gate", ws_gate, torch.bfloat16, (None, hidden), "[shared_intermediate, hidden]")
    I_sh = ws_gate.shape[0]
    _check_gemm_dim("w_shared_gate", I_sh, "shared_intermediate (dim 0)")
    check_layout("w_shared_up", ws_up, torch.bfloat16, (I_sh, hidden), "[shared_intermediate, hidden]")
    check_layout("w_shared_down", ws_down, torch.bfloat16, (hidden, I_sh), "[hidden, shared_intermediate]")
    _check_devices(x.device, w_shared_gate=ws_gate, w_shared_up=ws_up, w_shared_down=ws_down)
    sh = make_schedule(torch.zeros(T, 1, dtype=torch.int64, device=x.device), 1) if sched is None else sched
    if sh.num_experts != 1 or sh.num_tokens != T or sh.num_topk != 1:
        fail("shared_sched", f"the one-expert schedule of the {T} tokens in order", f"{sh.num_experts} experts, "
             f"{sh.num_tokens} tokens, {sh.num_topk} routes each")
    row_to_token, tile_to_expert = gemm_schedule_tensors(sh, x.device)
    rows = [torch.empty(sh.num_rows, width, dtype=torch.bfloat16, device=x.device)
            for width in (hidden, I_sh, I_sh, I_sh)]  # y, h, gate, up
    if y_buffer is not None:
        rows[0] = y_buffer[: sh.num_rows]  # its capacity checked by _check_ranks
    h_ready = torch.zeros(sh.num_rows // GEMM_BLOCK_M, dtype=torch.int32, device=x.device)
    y = rows[0] if y_buffer is None else y_buffer  # the binding's: whole (an empty view's address is 0)
    tensors = [x, ws_gate[None], ws_up[None], ws_down[None], row_to_token, tile_to_expert, *rows[1:], y, h_ready]
    return tensors, tuple(rows)


def _backward_group(dy_rows, x_rows, w_gate, w_up, w_down, gate, up, sched, name: str,
                    ranks: ChainRanks | None = None, dy_cols=None) -> tuple[list, dict, list | None]:
    """One expert group's tensors as the backward chain's binding takes them (checked; outputs allocated), its
    outputs by name: d_gate, d_up, h [num_rows, I]; dx_rows [num_rows, H]; d_w_gate, d_w_up [E, I, H], d_w_down
    [E, H, I], and its MXFP8 tensors (None in BF16: gate is a tensor). name: how errors call the group ("" for the
    routed experts, "shared " for the shared expert). ranks: the routed group's over ranks (its row ids, its dx rows
    a view of its y entry). dy_cols: with gate, up row-wise MXFP8 pairs, the dy rows' column-wise round trip."""
    check_layout(f"{name}dy_rows", dy_rows, torch.bfloat16, (sched.num_rows, None), "[num_rows, hidden]")
    hidden = dy_rows.shape[1]
    _check_gemm_dim(f"{name}dy_rows", hidden, "hidden (dim 1)")
    check_layout(f"{name}x_rows", x_rows, torch.bfloat16, (sched.num_rows, hidden), "[num_rows, hidden]")
    check_layout(f"{name}w_gate", w_gate, torch.bfloat16, (sched.num_experts, None, hidden),
                 "[num_experts, intermediate, hidden]")
    intermediate = w_gate.shape[1]
    _check_gemm_dim(f"{name}w_gate", intermediate, "intermediate (dim 1)")
    check_layout(f"{name}w_up", w_up, torch.bfloat16, tuple(w_gate.shape), "[num_experts, intermediate, hidden]")
    check_layout(f"{name}w_down", w_down, torch.bfloat16, (sched.num_experts, hidden, intermediate),
                 "[num_experts, hidden, intermediate]")
    mx = isinstance(gate, tuple)
    if mx:  # the forward's row-wise MXFP8 (data, scales), and dy's other round trip
        for what, t in (("gate", gate), ("up", up)):
            _check_rowwise_mx(f"{name}{what}", t, sched.num_rows, intermediate)
        check_layout(f"{name}dy_cols", dy_cols, torch.bfloat16, tuple(dy_rows.shape), "[num_rows, hidden]")
    else:
        for what, t in (("gate", gate), ("up", up)):
            check_layout(f"{name}{what}", t, torch.bfloat16, (sched.num_rows, intermediate),
                         "[num_rows, intermediate]")
        if dy_cols is not None:
            fail(f"{name}dy_cols", "None with bf16 gate and up (the MXFP8 backward's operand)", "a tensor")
    gate_t, up_t = (gate[0], up[0]) if mx else (gate, up)
    _check_devices(dy_rows.device, **{f"{name}{n}": t for n, t in (("dy_rows", dy_rows), ("x_rows", x_rows),
                   ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down), ("gate", gate_t), ("up", up_t),
                   *((("gate scales", gate[1]), ("up scales", up[1]), ("dy_cols", dy_cols)) if mx else ()))})
    if sched.block_m % GEMM_BLOCK_M:
        fail(f"{name}sched", f"block_m a multiple of {GEMM_BLOCK_M}", f"block_m={sched.block_m}")
    device, E, R = dy_rows.device, sched.num_experts, sched.num_rows
    rows = partial(torch.empty, R, intermediate, dtype=torch.bfloat16, device=device)  # [R, I]
    out = {"d_gate": rows(), "d_up": rows(), "h": rows(),
           "dx_rows": torch.empty_like(dy_rows) if ranks is None else ranks.y[ranks.rank],  # ranks: whole
           "d_w_gate": torch.empty_like(w_gate), "d_w_up": torch.empty_like(w_gate),
           "d_w_down": torch.empty_like(w_down)}
    row_to_token, tile_to_expert = gemm_schedule_tensors(sched, device)
    row_to_token = row_to_token if ranks is None else ranks.row_ids
    offsets, expert_rows = weight_grad_schedule_tensors(sched, device)  # [E + 1], [E]
    counters = torch.zeros(3 * (R // GEMM_BLOCK_M) + E, dtype=torch.int32, device=device)
    tensors = [dy_rows, x_rows, w_gate, w_up, w_down, gate_t, up_t, *out.values(), row_to_token, tile_to_expert,
               offsets, expert_rows, counters]
    mx_tensors = [gate[1], up[1], dy_cols, rows(), rows()] if mx else None  # the last two: d_gate's, d_up's columns
    return tensors, out, mx_tensors


def grouped_gemm_bf16_chain_backward(dy_rows: torch.Tensor, x_rows: torch.Tensor, w_gate: torch.Tensor,
                                     w_up: torch.Tensor, w_down: torch.Tensor, gate, up, topk_weights, sched,
                                     swiglu_limit: float | None = None, num_sms: int | None = None, shared=None,
                                     ranks: ChainRanks | None = None, trace: torch.Tensor | None = None,
                                     dy_cols: torch.Tensor | None = None) -> tuple:
    """The layer's expert backward in one persistent launch: the fused level's backward kernels over the
    routed schedule and, with `shared`, the shared expert's, and the combine of d_x, with their bits:
        (d_gate, d_up, h, d_topk_weights) = grouped_gemm_bf16_dgrad_swiglu_route_grads(dy_rows, w_down, gate, up,
                                                                                        topk_weights, sched)
        d_w_down = weight_grad(dy_rows, h); d_w_gate = weight_grad(d_gate, x_rows); d_w_up = weight_grad(d_up, x_rows)
        dx_rows = grouped_gemm_bf16_dgrad_gate_up(d_gate, d_up, w_gate, w_up, sched)
        d_x = combine_rows(dx_rows, sched.route_to_row, None, the shared expert's dx rows [: num_tokens])
    the shared expert's steps the same (grouped_gemm_bf16_dgrad_swiglu: no route weights) over its one-expert schedule.
    dy_rows: the unweighted d_out rows (gather_rows_cuda(d_out, sched)), x_rows: x's rows (gather_rows_cuda(x,
    sched)), [num_rows, hidden]; gate, up: the forward's [num_rows, intermediate]; topk_weights fp32 [num_tokens,
    num_topk]. shared: None, or (dy_rows, x_rows, w_gate, w_up, w_down, gate, up, sched) of the shared expert, its
    weights as one expert ([1, ...]) and its schedule of the tokens in order (fused.shared_schedule).
    ranks (ChainRanks, without `shared`): one rank's launch among several, as the forward chain's: its rows' tokens
    by row id, d_x's combine of every rank's tokens that it completes, from the owners' dx rows (ranks.y: dx_rows is
    a view of its entry) and, in ranks.shared, each home rank's shared-expert dx rows written before any launch;
    d_x is then its out entry, whole, and d_topk_weights is per row of sched (its routes). trace: as the forward
    chain's, the kinds BACKWARD_KINDS · 2 + group.
    MXFP8 (the fused level's mxfp8 backward of the routed experts, its bits; the shared expert stays BF16): gate, up
    the forward's row-wise MXFP8 (data, scales) pairs; dy_rows the row-wise round trip of dy = bf16(w·d_out) and
    dy_cols its column-wise one (mxfp8_fake_quantize_dual of route_grads_prep's rows); x_rows the column-wise round
    trip of x's rows (mxfp8_fake_quantize_gathered); the weights their round trips along their K (dim -2); and
    topk_weights None: the route gradients come from route_grads_prep. The SwiGLU backward reads the MXFP8 gate/up,
    and the launch round-trips d_gate and d_up both ways and h column-wise (grouped_gemm_bf16_dgrad_swiglu_mxfp8,
    then mxfp8_fake_quantize_dual and mxfp8_fake_quantize in the fused level).
    Returns (d_x [num_tokens, hidden], d_topk_weights [num_tokens, num_topk] (NaN for a route without a row; None in
    MXFP8), [d_w_gate, d_w_up, d_w_down], and the shared expert's [d_w_gate, d_w_up, d_w_down] ([1, ...] each) or
    None)."""
    _check_limit(swiglu_limit)
    sms = _check_num_sms(num_sms)
    T, K = sched.num_tokens, sched.num_topk
    if max(T, sched.num_rows) > 1 << RANK_SHIFT:
        fail("sched", f"at most 2^{RANK_SHIFT} tokens and rows (a row id's local part)", (T, sched.num_rows))
    mx = isinstance(gate, tuple)
    if mx:
        if topk_weights is not None:
            fail("topk_weights", "None with MXFP8 gate and up (route_grads_prep gives their route gradients)",
                 type(topk_weights).__name__)
    else:
        check_layout("topk_weights", topk_weights, torch.float32, (T, K), "[num_tokens, num_topk] (sched's)")
    if ranks is not None:
        if shared is not None:
            fail("shared", "None with ranks (the shared expert's dx rows come in ranks.shared)", "a tuple")
        _check_ranks(ranks, dy_rows.device, dy_rows.shape[-1], sched.num_rows, 0, BACKWARD_LISTS,
                     0 if len(ranks.shared) else None)
    tensors, out, mx_tensors = _backward_group(dy_rows, x_rows, w_gate, w_up, w_down, gate, up, sched, "", ranks,
                                               dy_cols)
    if not mx:
        check_cuda("topk_weights", topk_weights, dy_rows.device, "dy_rows'")
    shared_tensors, shared_out = None, None
    if shared is not None:
        if not isinstance(shared, (tuple, list)) or len(shared) != 8:
            fail("shared", "(dy_rows, x_rows, w_gate, w_up, w_down, gate, up, sched) of the shared expert",
                 type(shared).__name__)
        sh = shared[7]
        if sh.num_experts != 1 or sh.num_tokens != T or sh.num_topk != 1:
            fail("shared", f"a one-expert schedule of the {T} tokens in order", f"{sh.num_experts} experts, "
                 f"{sh.num_tokens} tokens, {sh.num_topk} routes each")
        if isinstance(shared[5], tuple):
            fail("shared gate", "bf16 (the shared expert is BF16 in every precision)", "an MXFP8 pair")
        shared_tensors, shared_out, _ = _backward_group(*shared, "shared ")
        if shared_out["dx_rows"].shape[1] != dy_rows.shape[1]:
            fail("shared dy_rows", f"hidden {dy_rows.shape[1]} (dy_rows')", shared_out["dx_rows"].shape[1])
    hidden = dy_rows.shape[1]
    d_topk_weights = None if mx else torch.full_like(topk_weights, float("nan"))  # [T, K]: each route with a row
    if ranks is not None:
        d_x, token_done, route_to_row = ranks.out[ranks.rank], ranks.token_done[ranks.rank], ranks.route_to_row
    else:
        d_x = torch.empty(T, hidden, dtype=torch.bfloat16, device=dy_rows.device)  # [T, H]
        if shared is None:  # a token whose routes all lack a row (bad ids) is written by no tile: NaN (combine_rows)
            d_x.fill_(float("nan"))
        token_done = torch.zeros(T, -(-hidden // GEMM_DOWN_TILE_N), dtype=torch.int32, device=dy_rows.device)
        route_to_row = sched.route_to_row.to(dy_rows.device, torch.int32)
    if ranks is not None and sched.num_rows == 0:  # no rows here: nothing to count or combine, zero gradients
        return d_x, d_topk_weights, [torch.zeros_like(out[n]) for n in ("d_w_gate", "d_w_up", "d_w_down")], None
    counts = gemm_schedule_kwargs(sched, dy_rows.device)["counts"]
    load_extension().grouped_gemm_bf16_chain_backward(
        routed=tensors, counts=counts, topk_weights=topk_weights,
        row_to_route=None if mx else sched.row_to_route.to(dy_rows.device).contiguous(), d_topk_weights=d_topk_weights,
        shared=shared_tensors, route_to_row=route_to_row, d_x=d_x, token_done=token_done,
        **_limit_kwargs(swiglu_limit), num_sms=sms, ranks=None if ranks is None else _rank_lists(ranks),
        rank=0 if ranks is None else ranks.rank, token_offsets=[] if ranks is None else list(ranks.token_offsets),
        trace=_checked_trace(trace, dy_rows.device), mx=mx_tensors)
    d_w = [out["d_w_gate"], out["d_w_up"], out["d_w_down"]]
    d_w_shared = None if shared_out is None else [shared_out["d_w_gate"], shared_out["d_w_up"], shared_out["d_w_down"]]
    return d_x, d_topk_weights, d_w, d_w_shared
