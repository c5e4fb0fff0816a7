"""The MoE plumbing around the GEMMs (csrc/include/mok/moe/; L2): the fixed-order combine, the row gather, the
route schedule built on the device, and the routed-gradient prep of the backward."""

from __future__ import annotations

import torch

from mok.checks import check_cuda, check_int, check_layout, check_topk_idx, fail
from mok.ops.core import load_extension
from mok.ops.gemm import GEMM_BLOCK_M, GEMM_K_ALIGN, GemmSchedule, gemm_schedule_tensors, real_num_rows
from mok.schedule import Schedule, make_schedule, max_num_rows

# ---- fixed-order combine (L2; csrc/include/mok/moe/combine.cuh) ----------------------------------------
# out[t] = bf16(Σ_k w[t,k]·y_rows[route_to_row[t,k]] + shared[t]): fp32, increasing k, then shared; each
# product and sum rounded on its own, so the bits equal mok.reference.combine's (and, without weights, the
# d_x sum of mok.reference.moe_backward). One thread per output element: no atomics, no grid dependence.


def combine_rows(y_rows: torch.Tensor, route_to_row: torch.Tensor, topk_weights: torch.Tensor | None = None,
                 shared: torch.Tensor | None = None, check_rows: bool = True) -> torch.Tensor:
    """Fixed-order combine of per-route rows into tokens: out [num_tokens, hidden] bf16 with
    out[t] = bf16(Σ_k topk_weights[t,k]·y_rows[route_to_row[t,k]] + shared[t]) in fp32, increasing k.

    y_rows bf16 [num_rows, hidden] (hidden % 8 == 0); route_to_row int64 or int32 [num_tokens, num_topk]
    (a schedule's `route_to_row`); topk_weights fp32 [num_tokens, num_topk] or None (weights 1: the d_x sum
    of the backward); shared bf16 [num_tokens, hidden] or None. check_rows: verify every row id is in
    [0, num_rows) (one host sync); without the check, a bad id gives NaN for its token, never a stray read."""
    check_layout("y_rows", y_rows, torch.bfloat16, (None, None), "[num_rows, hidden]")
    num_rows, hidden = y_rows.shape
    if hidden % GEMM_K_ALIGN:
        fail("y_rows", f"hidden (dim 1) a multiple of {GEMM_K_ALIGN} (16-byte rows)", hidden)
    check_layout("route_to_row", route_to_row, (torch.int64, torch.int32), (None, None),
                           "[num_tokens, num_topk]")
    num_tokens, num_topk = route_to_row.shape
    if topk_weights is not None:
        check_layout("topk_weights", topk_weights, torch.float32, (num_tokens, num_topk),
                               "[num_tokens, num_topk] (route_to_row's)")
    if shared is not None:
        check_layout("shared", shared, torch.bfloat16, (num_tokens, hidden), "[num_tokens, hidden]")
    operands = {"y_rows": (y_rows, True), "route_to_row": (route_to_row, False),
                "topk_weights": (topk_weights, False), "shared": (shared, True)}
    for name, (t, vector_rows) in operands.items():
        if t is not None:
            check_cuda(name, t, y_rows.device, "y_rows'", aligned=vector_rows)
    if check_rows and route_to_row.numel():
        low, high = int(route_to_row.min()), int(route_to_row.max())  # host sync
        if low < 0 or high >= num_rows:
            fail("route_to_row", f"row ids in [0, {num_rows}) (y_rows has {num_rows} rows)", f"ids in [{low}, {high}]")
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=y_rows.device)  # [num_tokens, hidden]
    load_extension().combine_rows(y_rows=y_rows, route_to_row=route_to_row, topk_weights=topk_weights, shared=shared,
                                  out=out)
    return out


# ---- row gather (L2; csrc/include/mok/moe/gather_rows.cuh) ----------------------------------------------


def _check_x_and_schedule(x: torch.Tensor, sched: Schedule) -> int:
    """The checks of a kernel that reads x's rows through a schedule; x's hidden."""
    if not isinstance(sched, Schedule):
        fail("sched", "a mok.schedule.Schedule", type(sched).__name__)
    check_layout("x", x, torch.bfloat16, (sched.num_tokens, None), "[num_tokens, hidden]")
    hidden = x.shape[1]
    if hidden % GEMM_K_ALIGN:
        fail("x", f"hidden (dim 1) a multiple of {GEMM_K_ALIGN} (16-byte rows)", hidden)
    check_cuda("x", x, aligned=True)
    return hidden


def gather_rows_cuda(x: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """mok.schedule.gather_rows on the GPU, bit for bit (a copy): x bf16 [num_tokens, hidden] (hidden % 8 == 0)
    -> [sched.num_rows, hidden], row r = x[row_to_token[r]], zeros in padding rows. The schedule's spare rows
    (from sched.counts[0] on, read on the device) are not written, as in every kernel over row buffers.
    Token-major: each token's row is read once and stored into its routes' rows. No host sync; the schedule is
    trusted, never followed blindly: a token id past num_tokens, or a row whose route_to_row and
    row_to_token/row_to_k disagree, gives a NaN row."""
    hidden = _check_x_and_schedule(x, sched)
    row_to_token, _ = gemm_schedule_tensors(sched, x.device)  # int32 [num_rows]
    row_to_k = sched.row_to_k.to(x.device).contiguous()  # int64 [num_rows]
    route_to_row = sched.route_to_row.to(x.device).contiguous()  # int64 [num_tokens, num_topk]
    out = torch.empty(sched.num_rows, hidden, dtype=torch.bfloat16, device=x.device)  # [num_rows, hidden]
    load_extension().gather_rows(x=x, row_to_token=row_to_token, row_to_k=row_to_k, route_to_row=route_to_row, out=out,
                                 counts=real_num_rows(sched, x.device))
    return out


def mxfp8_fake_quantize_gathered(x: torch.Tensor, sched: Schedule) -> torch.Tensor:
    """mxfp8_fake_quantize(gather_rows_cuda(x, sched), -2) bit for bit in one kernel (the MXFP8 backward's x rows
    for the weight gradients): x bf16 [num_tokens, hidden] (hidden % 8 == 0) -> bf16 [sched.num_rows, hidden].
    Each 32-row block reads its rows straight from x (a token's row once per route), so the gathered copy is
    never written and read back: 4 bytes moved per row element against 6 + the gather's read of x. Zero rows
    where row_to_token is -1; a token id past num_tokens makes its column blocks NaN (never read past x). The
    schedule's spare rows (from sched.counts[0] on, read on the device) are neither read nor written."""
    hidden = _check_x_and_schedule(x, sched)
    row_to_token, _ = gemm_schedule_tensors(sched, x.device)  # int32 [num_rows], num_rows % 128 == 0
    out = torch.empty(sched.num_rows, hidden, dtype=torch.bfloat16, device=x.device)  # [num_rows, hidden]
    load_extension().mxfp8_fake_quantize_gathered(x=x, row_to_token=row_to_token, out=out,
                                                  counts=real_num_rows(sched, x.device))
    return out


# ---- route schedule on the device (csrc/include/mok/moe/schedule.cuh) -----------------------------------
# make_schedule_cuda = mok.schedule.make_schedule in three integer-only launches (counts per chunk of 1024
# routes, a scan per expert, placement + row fill). The row arrays are allocated for max_num_rows (no routing
# needs more) and the real padded row count and the bad-id count land in device memory (`counts`). With
# sync=True one host read of them cuts the row arrays to make_schedule's, bit for bit, and raises on bad
# ids; with sync=False nothing is read: the Schedule keeps max_num_rows rows (spare rows past the real ones,
# which the kernels never touch) and the bad-id check is the caller's (mok.fused defers it).

SCHEDULE_MAX_EXPERTS = 4096  # kScheduleMaxExperts (mok/api.h): per-warp expert cursors in shared memory
# The arrays the binding returns, by name (struct ScheduleOutputs, mok/api.h; csrc/bindings.cpp, make_schedule):
# int64 ones, then the int32 counts and the GEMM kernels' row_to_token and per-128-row tile_to_expert.
_SCHEDULE_ARRAYS = ("tokens_per_expert", "padded_per_expert", "expert_offsets", "tile_offsets", "route_to_row",
                    "row_to_token", "row_to_k", "row_to_route", "row_to_expert", "tile_to_expert", "tile_num_rows",
                    "counts", "row_to_token_i32", "gemm_tile_to_expert")


def _check_topk_idx_layout(topk_idx, num_experts: int) -> None:
    """check_topk_idx's type, shape and dtype errors (same text) without its min/max host sync: an empty
    slice passes through its range check; the kernels count ids outside [0, num_experts)."""
    ok_shape = isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2
    check_topk_idx(topk_idx[:0] if ok_shape else topk_idx, num_experts)


def make_schedule_cuda(topk_idx: torch.Tensor, num_experts: int, block_m: int = 128, sync: bool = True) -> Schedule:
    """mok.schedule.make_schedule on the GPU, from the same topk_idx the same bits (Schedule.equal).

    topk_idx: int64 CUDA `[num_tokens, num_topk]`, ids in [0, num_experts); duplicates allowed.
    sync=True: one host sync (reading num_rows and the number of bad ids together); make_schedule's Schedule
    and errors. sync=False: no host sync at all; the Schedule has num_rows = max_num_rows(...) rows, the
    spare ones past expert_offsets[-1] = counts[0] marked -1 (`Schedule.trimmed()` gives make_schedule's),
    and ids outside [0, num_experts) are not raised here: those routes get no row (route_to_row -1: their
    token's combine_rows output is NaN) and counts[1] counts them, for the caller to check.
    The row arrays are views of buffers sized for `max_num_rows` (a few MB at most; no copy). With block_m a
    multiple of 128 the result also carries `gemm_tensors`, what `gemm_schedule_tensors(sched, device)`
    returns (int32 row_to_token [num_rows], tile_to_expert per 128-row tile), written by the same launches;
    it is not a dataclass field, so equality and `Schedule.to` ignore it. Beyond the kernels' limits
    (num_experts > SCHEDULE_MAX_EXPERTS, or max_num_rows >= 2^31) it returns make_schedule's result (syncs).
    """
    _check_topk_idx_layout(topk_idx, num_experts)
    check_int("block_m", block_m, 1)
    if topk_idx.device.type != "cuda":
        fail("topk_idx", "a CUDA tensor (mok.schedule.make_schedule runs on any device)", f"device {topk_idx.device}")
    num_tokens, num_topk = topk_idx.shape
    rows = max_num_rows(num_tokens, num_topk, num_experts, block_m)
    if num_experts > SCHEDULE_MAX_EXPERTS or rows >= 2**31:  # beyond the kernels' int32 rows / smem cursors
        return make_schedule(topk_idx, num_experts, block_m)  # the same bits from torch ops
    gemm = block_m % GEMM_BLOCK_M == 0
    v = load_extension().make_schedule(topk_idx=topk_idx.contiguous(), num_experts=num_experts, block_m=block_m,
                                       max_num_rows=rows, gemm=gemm)  # name -> view sized for `rows`
    num_rows = rows  # row arrays of max_num_rows entries, spare rows included
    if sync:
        num_rows, num_bad = v["counts"].tolist()  # the one host sync
        if num_bad:
            check_topk_idx(topk_idx, num_experts)  # raises its error, with the ids' min and max
            raise AssertionError(f"make_schedule_cuda: {num_bad} ids outside [0, {num_experts}) not seen by the check")
    if num_rows < rows:  # sync=True: cut the views to the real rows (without a sync they have `rows` already)
        tiles = num_rows // block_m
        for name, n in (("row_to_token", num_rows), ("row_to_k", num_rows), ("row_to_route", num_rows),
                        ("row_to_expert", num_rows), ("tile_to_expert", tiles), ("tile_num_rows", tiles)):
            v[name] = v[name][:n]
        v["row_to_token_i32"] = v["row_to_token_i32"][:num_rows]
        v["gemm_tile_to_expert"] = v["gemm_tile_to_expert"][:num_rows // GEMM_BLOCK_M]
    sched = Schedule(
        num_tokens=num_tokens, num_topk=num_topk, num_experts=num_experts, block_m=block_m, num_rows=num_rows,
        tokens_per_expert=v["tokens_per_expert"], padded_per_expert=v["padded_per_expert"],
        expert_offsets=v["expert_offsets"], row_to_token=v["row_to_token"], row_to_k=v["row_to_k"],
        row_to_route=v["row_to_route"], row_to_expert=v["row_to_expert"],
        route_to_row=v["route_to_row"], tile_offsets=v["tile_offsets"], tile_to_expert=v["tile_to_expert"],
        tile_num_rows=v["tile_num_rows"], counts=v["counts"])
    if gemm:
        sched.gemm_tensors = GemmSchedule(row_to_token=v["row_to_token_i32"], tile_to_expert=v["gemm_tile_to_expert"])
    return sched


# ---- routed-gradient prep (csrc/include/mok/moe/route_grads.cuh) -----------------------------------------

ROUTE_GRADS_MAX_TOPK = 1024  # kRouteGradsMaxTopk (mok/api.h): the per-warp partial sums in shared memory


def route_grads_prep(d_out: torch.Tensor, topk_weights: torch.Tensor, y_rows: torch.Tensor,
                     sched: Schedule) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's first step on the schedule's rows, one pass over d_out and y_rows:
    dy_rows [num_rows, hidden] bf16, dy_rows[r] = bf16(fp32(d_out[t]) · w[t, k]) for r's route (t, k), zeros
    in padding rows (bit for bit L0's dy gathered into rows); d_topk_weights [num_tokens, num_topk] fp32,
    Σ_h fp32(d_out[t, h]) · fp32(y_rows[route_to_row[t, k], h]) in a fixed order (not torch's: agrees with
    L0 to a few fp32 roundings, identical bits run to run). d_out bf16 [num_tokens, hidden] (hidden % 8 == 0);
    topk_weights fp32 [num_tokens, num_topk]; y_rows bf16 [num_rows, hidden]; sched from make_schedule(_cuda)
    on their device (its route_to_row is trusted: no host sync; a row id out of range gives NaN). Tiles past
    the schedule's real rows (sched.counts[0]: spare rows) are neither read nor written."""
    if not isinstance(sched, Schedule):
        fail("sched", "a mok.schedule.Schedule", type(sched).__name__)
    num_tokens, num_topk = sched.num_tokens, sched.num_topk
    check_layout("y_rows", y_rows, torch.bfloat16, (sched.num_rows, None), "[num_rows, hidden]")
    hidden = y_rows.shape[1]
    if hidden % GEMM_K_ALIGN:
        fail("y_rows", f"hidden (dim 1) a multiple of {GEMM_K_ALIGN} (16-byte rows)", hidden)
    check_layout("d_out", d_out, torch.bfloat16, (num_tokens, hidden), "[num_tokens, hidden]")
    check_layout("topk_weights", topk_weights, torch.float32, (num_tokens, num_topk),
                           "[num_tokens, num_topk]")
    if num_topk > ROUTE_GRADS_MAX_TOPK:
        fail("sched", f"num_topk <= {ROUTE_GRADS_MAX_TOPK}", num_topk)
    operands = {"y_rows": (y_rows, True), "d_out": (d_out, True), "topk_weights": (topk_weights, False),
                "sched.route_to_row": (sched.route_to_row, False), "sched.tile_num_rows": (sched.tile_num_rows, False)}
    for name, (t, vector_rows) in operands.items():
        check_cuda(name, t, y_rows.device, "y_rows'", aligned=vector_rows)
    dy_rows = torch.empty(sched.num_rows, hidden, dtype=torch.bfloat16, device=y_rows.device)  # [num_rows, hidden]
    d_topk_weights = torch.empty(num_tokens, num_topk, dtype=torch.float32, device=y_rows.device)  # [T, K]
    load_extension().route_grads_prep(d_out=d_out, topk_weights=topk_weights, y_rows=y_rows,
                                      route_to_row=sched.route_to_row, tile_num_rows=sched.tile_num_rows,
                                      counts=real_num_rows(sched, y_rows.device), dy_rows=dy_rows,
                                      d_topk_weights=d_topk_weights, block_m=sched.block_m)
    return dy_rows, d_topk_weights


# ---- round_to_tiles on a GPU (csrc/include/mok/moe/round_steps.cuh, round_to_tiles.cuh) -------------------

FILL_MAX_RECEIVERS = 1024  # kFillMaxReceivers (mok/api.h): 20 bytes per receiver in shared memory
_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)  # what a `need` may be, as in the twins


def _check_on_one_gpu(tensors: dict, like: str) -> None:
    """Every tensor of `tensors` (name -> tensor or None) a CUDA tensor on the device of tensors[like]."""
    device = tensors[like].device
    for name, t in tensors.items():
        if t is not None:
            check_cuda(name, t, device, f"{like}'s", contiguous=False)


def route_fill_rounds(order: torch.Tensor, may: torch.Tensor, inv: torch.Tensor, need: torch.Tensor,
                      num_real: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounds of routing.round_to_tiles in one launch (one block), with the contract and the bits of its twin
    rounding.fill_rounds: order int64 [P, R], may bool [U, R], inv int64 [P] (nondecreasing), need int [R], num_real
    None or an int64 scalar (read on the device: the padding entries from it on are never walked), all on one GPU;
    returns (assign int64 [P], need int64 [R]). The inputs are not changed."""
    check_layout("order", order, torch.int64, (None, None), "[num_pool, num_receivers]")
    num_pool, num_receivers = order.shape
    check_layout("may", may, torch.bool, (None, num_receivers), "[num_tokens, num_receivers]")
    check_layout("inv", inv, torch.int64, (num_pool,), "[num_pool]")
    check_layout("need", need, _INTEGERS, (num_receivers,), "[num_receivers]")
    if num_receivers > FILL_MAX_RECEIVERS:
        fail("order", f"at most {FILL_MAX_RECEIVERS} receivers (dim 1)", num_receivers)
    if num_pool > 2**31 - 1 - 1024:
        fail("order", "fewer than 2^31 - 1024 entries (dim 0)", num_pool)
    if num_real is not None:
        check_layout("num_real", num_real, torch.int64, (), "a scalar")
    _check_on_one_gpu({"order": order, "may": may, "inv": inv, "need": need, "num_real": num_real}, "order")
    # receiver-major copies: a warp walks a receiver's row of order; the kernel clears what the tokens take in may
    may_rows = torch.empty(num_receivers, may.shape[0], dtype=torch.uint8, device=order.device).copy_(may.t())
    return _fill_rounds_receiver_major(order.t().contiguous(), may_rows, inv.contiguous(), need, num_real)


def _fill_rounds_receiver_major(order: torch.Tensor, may: torch.Tensor, inv: torch.Tensor, need: torch.Tensor,
                               num_real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """route_fill_rounds on operands already checked and laid out as the kernel reads them: order int64 [R, P]
    and may uint8 [R, U] contiguous (may is changed: the kernel clears what the tokens take), inv int64 [P]
    contiguous, need int [R], num_real None or int64 with one element (route_round_prep's outputs are so)."""
    num_receivers, num_pool = order.shape
    need = need.to(torch.int64, copy=True)  # [R] in, then out
    assign = torch.full((num_pool,), -1, dtype=torch.int64, device=order.device)  # [P]
    if num_pool and num_receivers:
        first = torch.empty(may.shape[1], dtype=torch.int32, device=order.device)  # [U] scratch
        pick = torch.empty(num_pool, dtype=torch.int32, device=order.device)  # [P] scratch
        load_extension().route_fill_rounds(order=order, may=may, inv=inv, need=need, assign=assign, first=first,
                                           pick=pick, num_real=None if num_real is None else num_real.reshape(1))
    return assign, need


def route_swap_leftovers(idx: torch.Tensor, before: torch.Tensor, allowed: torch.Tensor, left: torch.Tensor,
                         need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The end game of routing.round_to_tiles in one launch (one block), with the contract and the bits of its twin
    rounding.swap_leftovers: idx, before int64 [T, K], allowed bool [T, E], left int64 [P], need int [E], all on one
    GPU; returns (idx, need) after the swaps, reading nothing on the host (the kernel returns at once when no expert
    lacks routes). The inputs are not changed."""
    check_layout("idx", idx, torch.int64, (None, None), "[num_tokens, num_topk]")
    num_tokens, num_topk = idx.shape
    check_layout("before", before, torch.int64, (num_tokens, num_topk), "[num_tokens, num_topk]")
    check_layout("allowed", allowed, torch.bool, (num_tokens, None), "[num_tokens, num_experts]")
    num_experts = allowed.shape[1]
    check_layout("left", left, torch.int64, (None,), "[num_left]")
    check_layout("need", need, _INTEGERS, (num_experts,), "[num_experts]")
    if idx.numel() + left.numel() > 2**31 - 1 - 1024:
        fail("idx", "fewer than 2^31 - 1024 routes and leftovers in all", idx.numel() + left.numel())
    _check_on_one_gpu({"idx": idx, "before": before, "allowed": allowed, "left": left, "need": need}, "idx")
    device = idx.device
    idx = idx.clone(memory_format=torch.contiguous_format)  # [T, K], changed by the kernel
    need = need.to(torch.int64, copy=True)  # [E] in, then out
    waiting = torch.empty(left.numel(), dtype=torch.int32, device=device)  # [P] scratch
    moved = torch.empty(idx.numel() + left.numel(), dtype=torch.int32, device=device)  # [T·K + P] scratch
    load_extension().route_swap_leftovers(idx=idx, before=before.contiguous(),
                                          allowed=allowed.to(torch.uint8).contiguous(), left=left.contiguous(),
                                          need=need, waiting=waiting, moved=moved)
    return idx, need


# RouteRoundStep (mok/api.h), in the order they run
ROUND_STEPS = ("count", "plan", "keys", "choose", "pool", "cells", "apply", "order")
# the buffers, by the names of struct RouteRound's pointer fields (mok/api.h) and of the binding's arguments
ROUND_BUFFERS = ("idx", "scores", "counts", "plan", "keys", "by_expert", "chosen", "slots", "pool", "num_real",
                 "inv", "may", "pool_scores", "assign", "routes", "left", "out")


def route_round_to_tiles(topk_idx: torch.Tensor, scores: torch.Tensor, tile: int, num_pool: int, run_step=None,
                         fill=None, swap=None) -> torch.Tensor:
    """routing.round_to_tiles on a GPU, with the bits of its twin and nothing read on the host: the prep
    (route_round_prep), the rounds (_fill_rounds_receiver_major), the moves and leftovers (a map step), the swaps
    (route_swap_leftovers), each token's experts in the routers' order (a map step). ~30 aten calls and 8 launches
    of mok's around the rounds and swaps, where the twins' path makes ~140 calls.

    topk_idx, scores, tile, num_pool: route_round_prep's. Returns the rounded topk_idx, int64 [T, K]. run_step,
    fill, swap: the map steps' runner (route_round_prep's), the rounds and the swaps (default: the kernels;
    tests/test_round_steps.py passes the map steps' bodies compiled for the host and the twins of the others)."""
    b, run_step = _round_buffers(topk_idx, scores, tile, num_pool, run_step)
    order = _prep_steps(b, tile, run_step)
    num_tokens, num_topk = topk_idx.shape
    b["assign"], need = (fill or _fill_rounds_receiver_major)(order, b["may"], b["inv"], b["plan"][2], b["num_real"])
    b["routes"], b["left"] = b["idx"].reshape(-1).clone(), torch.empty_like(b["pool"])
    run_step("apply", b, tile)
    allowed = b["scores"] > float("-inf")  # [T, E]
    routes, _ = (swap or route_swap_leftovers)(b["routes"].view(num_tokens, num_topk), b["idx"], allowed, b["left"],
                                               need)
    b["routes"], b["out"] = routes.reshape(-1), torch.empty_like(routes)
    run_step("order", b, tile)
    return b["out"]


def route_round_prep(topk_idx: torch.Tensor, scores: torch.Tensor, tile: int, num_pool: int,
                     run_step=None) -> tuple:
    """The prep of routing.round_to_tiles in six map steps, two sorts and a running count, with the bits of its twin
    rounding._prep, laid out receiver-major as the rounds' kernel reads them (_fill_rounds_receiver_major).

    topk_idx int64 [T, K] (distinct experts per token, in range: unchecked here, as in the routers' path); scores
    float32, bf16 or fp16 [T, E] (float64 keys are ranks: the twin's); tile; num_pool the pool's size (P >= the
    routes that move: rounding.pool_bound). Returns (pool int64 [P]: the moving routes' ids ascending, then T·K;
    order int64 [E, P]: each receiver's entries by descending score, ties ascending; may uint8 [E, P]: whether the
    entry's token may take the receiver; inv int64 [P]: the index of each entry's token's first entry; need int64
    [E]: what each expert lacks; num_real int64 [1]: the pool's real entries). Reads nothing on the host.
    run_step(step, buffers, tile): runs one of ROUND_STEPS over the dict of buffers (default: its kernel on the
    current stream; tests/test_round_steps.py passes the same bodies compiled for the host)."""
    b, run_step = _round_buffers(topk_idx, scores, tile, num_pool, run_step)
    order = _prep_steps(b, tile, run_step)
    return b["pool"], order, b["may"], b["inv"], b["plan"][2], b["num_real"]


def _round_buffers(topk_idx: torch.Tensor, scores: torch.Tensor, tile: int, num_pool: int, run_step) -> tuple:
    """The map steps' buffers (ROUND_BUFFERS; the rounds' and later ones empty until then) and their runner."""
    check_layout("topk_idx", topk_idx, torch.int64, (None, None), "[num_tokens, num_topk]")
    check_layout("scores", scores, (torch.float32, torch.bfloat16, torch.float16),
                           (topk_idx.shape[0], None), "[num_tokens, num_experts]")
    check_int("tile", tile, 1)
    check_int("num_pool", num_pool, 0)
    num_experts, num_routes = scores.shape[1], topk_idx.numel()
    if num_routes > 2**31 - 1:
        fail("topk_idx", "fewer than 2^31 routes", num_routes)
    if run_step is None:
        _check_on_one_gpu({"topk_idx": topk_idx, "scores": scores}, "topk_idx")
        run_step = _round_step_on_gpu
    device = topk_idx.device

    def empty(*shape, dtype=torch.int64):
        return torch.empty(shape, dtype=dtype, device=device)

    b = {"idx": topk_idx.contiguous(), "scores": scores.detach().float().contiguous(),
         "counts": torch.zeros(num_experts, dtype=torch.int32, device=device), "plan": empty(3, num_experts),
         "keys": empty(num_routes), "by_expert": empty(num_routes),
         "chosen": empty(num_routes, dtype=torch.int32), "slots": empty(num_routes, dtype=torch.int32),
         "pool": torch.full((num_pool,), num_routes, dtype=torch.int64, device=device), "num_real": empty(1),
         "inv": empty(num_pool), "may": empty(num_experts, num_pool, dtype=torch.uint8),
         "pool_scores": empty(num_experts, num_pool, dtype=torch.float32)}
    b.update((name, empty(0)) for name in ("assign", "routes", "left", "out"))
    return b, run_step


def _prep_steps(b: dict, tile: int, run_step) -> torch.Tensor:
    """route_round_prep's steps over the buffers; returns `order` [E, P]."""
    run_step("count", b, tile)
    run_step("plan", b, tile)
    run_step("keys", b, tile)
    torch.sort(b["keys"], stable=True, out=(torch.empty_like(b["keys"]), b["by_expert"]))
    run_step("choose", b, tile)
    torch.cumsum(b["chosen"], 0, dtype=torch.int32, out=b["slots"])
    run_step("pool", b, tile)
    run_step("cells", b, tile)
    return torch.sort(b["pool_scores"], dim=1, descending=True, stable=True).indices  # [E, P]


def _round_step_on_gpu(step: str, b: dict, tile: int) -> None:
    buffers = {name: b[name] for name in ROUND_BUFFERS}
    load_extension().route_round_step(step=ROUND_STEPS.index(step), tile=tile, **buffers)
