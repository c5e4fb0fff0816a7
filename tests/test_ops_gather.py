"""The row gather (mok.ops.gather_rows_cuda) against mok.schedule.gather_rows, bit for bit, and the MXFP8
backward's gathered column-wise round trip (mok.ops.mxfp8_fake_quantize_gathered) against L0's round trip of it.

The kernel is a copy: every bit of a real row is x's (NaN payloads, -0 and Inf included), padding rows are
+0; the spare rows of a schedule built without a sync are compared nowhere here: both kernels leave them
unwritten (tests/test_nosync.py checks that they do). Shapes: hidden
from one 16-byte vector to rows with a partial block of vectors, K = 1 and 8, empty experts, one hot expert,
token counts off every multiple. The allocator is poisoned first, so a row the kernel forgets cannot pass.
Inputs are drawn fresh every run (the seed is in each failure message).
"""

from __future__ import annotations

import pytest
import torch

from mok import mxfp8, ops
from mok.reference import BF16
from mok.routing import hot_expert_routing, random_routing
from mok.schedule import gather_rows, make_schedule
from mok.testing import bitwise_equal, fresh_seed, poison_allocator

# (num_tokens, hidden, num_experts, num_topk, hot): hidden 8 (one vector), 72 (9 vectors), 7168 (896: a
# block of 1024 vectors spans rows); K = 1 and 8.
SHAPES = [(1, 8, 1, 1, False), (37, 72, 16, 8, False), (29, 64, 3, 1, False), (300, 7168, 48, 6, False),
          (1000, 2048, 128, 8, True), (130, 520, 300, 4, False)]


def _problem(num_tokens, hidden, num_experts, num_topk, hot, seed):
    """(x bf16 [T, H] on the CPU, topk_idx int64 [T, K] on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    if hot:
        topk_idx = hot_expert_routing(num_tokens, num_experts, num_topk, hot_expert=3, hot_fraction=0.95,
                                      generator=g)[0]
    else:
        topk_idx = random_routing(num_tokens, num_experts, num_topk, skew=1.2, generator=g)[0]
    x = (torch.randn(num_tokens, hidden, generator=g) * 3).to(BF16)  # [T, H]
    return x, topk_idx


# ---- CPU: argument checks (all before the extension is built) ---------------------------------------------


@pytest.mark.parametrize("op", [ops.gather_rows_cuda, ops.mxfp8_fake_quantize_gathered], ids=lambda f: f.__name__)
def test_bad_inputs_name_the_argument(op):
    x, topk_idx = _problem(37, 72, 16, 8, False, seed=1)
    sched = make_schedule(topk_idx, 16)
    bad = [
        (lambda: op(x, topk_idx), "sched: expected a mok.schedule.Schedule"),
        (lambda: op(x.float(), sched), "x: expected dtype torch.bfloat16"),
        (lambda: op(x[1:], sched), r"x: expected shape \[num_tokens, hidden\] = \[37, \*\]"),
        (lambda: op(x[:, :68], sched), "x: expected hidden"),
        (lambda: op(x, sched), "x: expected a CUDA tensor"),  # valid, but on the CPU
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()


# ---- GPU ---------------------------------------------------------------------------------------------------


def _token_past_the_end_at_row_3() -> tuple:
    """(x on the GPU, a schedule whose row 3 names token num_tokens): one past x."""
    x, topk_idx = _problem(37, 72, 16, 8, False, seed=fresh_seed())
    x = x.cuda()
    sched = make_schedule(topk_idx.cuda(), 16)
    row_to_token, tile_to_expert = ops.gemm_schedule_tensors(sched, x.device)
    bad = row_to_token.clone()
    bad[3] = x.shape[0]
    sched.gemm_tensors = (bad, tile_to_expert)
    return x, sched



@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "spare-rows"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-E{}-K{}{}".format(*s[:4], "-hot" if s[4] else ""))
def test_gather_rows_bitwise_equals_l0(shape, sync):
    seed = fresh_seed()
    x, topk_idx = _problem(*shape, seed)
    x[::7, 0] = float("nan")  # copied with its payload: a copy, not arithmetic
    x[::5, -1] = -0.0
    x[::3, x.shape[1] // 2] = float("-inf")
    x = x.cuda()
    sched = ops.make_schedule_cuda(topk_idx.cuda(), shape[2], sync=sync)
    n = int(sched.expert_offsets[-1])  # the real rows (padding included); the rest are spare
    expected = gather_rows(x, sched)[:n]  # [n, H]
    poison_allocator(4 * sched.num_rows * shape[1] * 2)
    out = ops.gather_rows_cuda(x, sched)
    assert out.shape == (sched.num_rows, shape[1]) and out.dtype == BF16
    assert bitwise_equal(out[:n], expected), f"{shape} sync={sync}: bits differ from L0 (seed {seed})"
    assert bitwise_equal(out[:n].cpu(), gather_rows(x.cpu(), sched.to("cpu"))[:n]), f"{shape}: CPU L0 (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
def test_gather_rows_token_past_the_end_is_a_nan_row():
    """A schedule is trusted (no host sync), but a token id past num_tokens must not read past x."""
    x, sched = _token_past_the_end_at_row_3()
    out = ops.gather_rows_cuda(x, sched)
    assert out[3].isnan().all()
    others = torch.arange(out.shape[0], device=out.device) != 3
    assert bitwise_equal(out[others], gather_rows(x, sched)[others])


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("corrupt", ["route_to_row", "row_to_token"])
def test_gather_rows_disagreeing_views_are_nan_rows(corrupt):
    """The kernel copies token-major (each token's row into its routes' rows) and fills the rows no route owns;
    a row whose route_to_row and row_to_token/row_to_k disagree must come out NaN, written once, never a
    neighbour's copy or poison."""
    x, topk_idx = _problem(37, 72, 16, 8, False, seed=fresh_seed())
    x = x.cuda()
    sched = make_schedule(topk_idx.cuda(), 16)
    row = int(sched.route_to_row[5, 2])  # the row of token 5's third route
    if corrupt == "route_to_row":  # the route points elsewhere: its row is nobody's
        sched.route_to_row = sched.route_to_row.clone()
        sched.route_to_row[5, 2] = int(sched.route_to_row[6, 0])
    else:  # the row names another real token
        row_to_token, tile_to_expert = ops.gemm_schedule_tensors(sched, x.device)
        bad = row_to_token.clone()
        bad[row] = 6
        sched.gemm_tensors = (bad, tile_to_expert)
    poison_allocator(4 * sched.num_rows * x.shape[1] * 2)
    out = ops.gather_rows_cuda(x, sched)
    assert out[row].isnan().all()
    others = torch.arange(out.shape[0], device=out.device) != row
    assert bitwise_equal(out[others], gather_rows(x, sched)[others])


@pytest.mark.gpu
@pytest.mark.sm90
def test_gather_rows_no_tokens():
    sched = make_schedule(torch.zeros(0, 2, dtype=torch.int64, device="cuda"), 4)
    out = ops.gather_rows_cuda(torch.zeros(0, 64, dtype=BF16, device="cuda"), sched)
    assert out.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "spare-rows"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-E{}-K{}{}".format(*s[:4], "-hot" if s[4] else ""))
def test_fake_quantize_gathered_bitwise_equals_l0(shape, sync):
    """The round trip of the gathered rows in one kernel: L0's fake_quantize(gather_rows(x), dim=-2) bit for bit
    (NaN, Inf and -0 inputs included), and the two kernels it replaces."""
    seed = fresh_seed()
    x, topk_idx = _problem(*shape, seed)
    x[::7, 0] = float("nan")
    x[::5, -1] = -0.0
    x[::3, x.shape[1] // 2] = float("-inf")
    x[::11] *= 2.0 ** 100  # blocks whose scales differ by far more than E4M3's range
    x = x.cuda()
    sched = ops.make_schedule_cuda(topk_idx.cuda(), shape[2], sync=sync)
    n = int(sched.expert_offsets[-1])  # the real rows (a multiple of 32); the rest are spare
    two_kernels = ops.mxfp8_fake_quantize(ops.gather_rows_cuda(x, sched)[:n], -2)  # [n, H]
    poison_allocator(4 * sched.num_rows * shape[1] * 2)
    out = ops.mxfp8_fake_quantize_gathered(x, sched)
    assert out.shape == (sched.num_rows, shape[1]) and out.dtype == BF16
    out = out[:n]
    assert bitwise_equal(out, two_kernels), f"{shape} sync={sync}: bits differ from the two kernels (seed {seed})"
    expected = mxfp8.fake_quantize(gather_rows(x.cpu(), sched.to("cpu"))[:n], dim=-2)
    nan = expected.isnan()  # NaN payloads differ between CPU and GPU casts: any NaN equals any NaN
    assert torch.equal(out.cpu().isnan(), nan), f"{shape} sync={sync}: NaN positions differ from L0 (seed {seed})"
    assert bitwise_equal(out.cpu()[~nan], expected[~nan]), f"{shape} sync={sync}: bits differ from L0 (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
def test_fake_quantize_gathered_token_past_the_end_is_nan():
    """A token id past num_tokens is never read: its row's column blocks (32 rows each) come out NaN, the rest
    is L0's."""
    x, sched = _token_past_the_end_at_row_3()
    out = ops.mxfp8_fake_quantize_gathered(x, sched)
    assert out[:32].isnan().all()  # row 3's block: every column's scale is NaN
    assert bitwise_equal(out[32:], mxfp8.fake_quantize(gather_rows(x, sched), dim=-2)[32:])
