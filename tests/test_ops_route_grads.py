"""The routed-gradient prep kernel (mok.ops.route_grads_prep) against L0's first backward step.

L0 (mok.torch_native.routed_backward, as mok.reference): dy = bf16(d_out.float()[:, None, :] * w[:, :, None])
gathered into the schedule's rows (padding rows zero), and d_topk_weights = (d_out.float()[:, None, :] *
y.float()).sum(-1). dy has one rounding point, so the kernel must match it bit for bit. The dot product is
summed in the kernel's own fixed order, not torch's: it is held to DOT_TOL (below) against L0 and against an
fp64 evaluation, and must be bitwise identical run to run. y_rows' padding rows hold NaN (never read); the
allocator is poisoned with NaN before each call, so a dy row the kernel forgets is caught. Inputs are drawn
fresh every run (the seed is in each failure message).
"""

from __future__ import annotations

import pytest
import torch

from mok import ops
from mok.reference import BF16
from mok.routing import hot_expert_routing, random_routing
from mok.schedule import gather_routes, make_schedule, scatter_routes
from mok.testing import bitwise_equal, fresh_seed, poison_allocator

# |kernel − L0| and |kernel − fp64| per (t, k), as a fraction of Σ_h |d_out[t,h]·y[t,k,h]| (the sum's
# condition: a bound that holds under cancellation). The kernel sums ≤ H/128 + 8 terms in a row, so its
# rounding error is below (H/128 + 8)·2^-24 of that scale: 3.8e-6 at H = 7168; torch's `.sum(-1)` does as well.
DOT_TOL = 1e-5

# (num_tokens, hidden, num_experts, num_topk, block_m, routing): hidden from one 16-byte vector to 7168 (7
# vectors per thread), tails of the 128-thread row loop; K = 1, 3, 8 and 9 (> the kernel's batch of 8);
# tokens no multiple of anything; block_m 128 and 256; a hot expert (one long segment, many padding-free tiles).
SHAPES = [(1, 8, 1, 1, 128, "random"), (37, 64, 4, 2, 128, "random"), (29, 72, 3, 1, 256, "random"),
          (50, 1032, 6, 3, 128, "random"), (23, 96, 16, 9, 128, "random"), (300, 7168, 48, 6, 128, "random"),
          (513, 2048, 128, 8, 256, "random"), (700, 256, 16, 8, 128, "hot")]


def _problem(num_tokens, hidden, num_experts, num_topk, block_m, kind, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    if kind == "hot":
        topk_idx, w = hot_expert_routing(num_tokens, num_experts, num_topk, hot_expert=2, hot_fraction=0.9,
                                         generator=g)
    else:
        topk_idx, w = random_routing(num_tokens, num_experts, num_topk, skew=1.0, generator=g)
    w = w * torch.randn(num_tokens, num_topk, generator=g)  # signs and magnitudes beyond a softmax's
    sched = make_schedule(topk_idx, num_experts, block_m=block_m)
    y_rows = (torch.randn(sched.num_rows, hidden, generator=g) * 3).to(BF16)  # [num_rows, H]
    y_rows[sched.row_to_token < 0] = float("nan")  # never read
    d_out = torch.randn(num_tokens, hidden, generator=g).to(BF16)  # [T, H]
    return d_out.to(device), w.to(device), y_rows.to(device), sched.to(device)


def _torch_prep(d_out, w, y_rows, sched):
    """What routed_backward runs today (L1/L2): dy rows and d_topk_weights from torch ops."""
    T, H = d_out.shape
    dy = (d_out.float()[:, None, :] * w[:, :, None]).to(BF16)  # [T, K, H]
    y = scatter_routes(y_rows, sched)  # [T, K, H]
    return gather_routes(dy.view(-1, H), sched), (d_out.float()[:, None, :] * y.float()).sum(-1)


def _l0(d_out, w, y_rows, sched):
    """L0's dy rows and d_topk_weights, plus the fp64 value and the scale Σ|d·y| of each dot product."""
    dy_rows, d_w = _torch_prep(d_out, w, y_rows, sched)  # [num_rows, H], [T, K]
    y = scatter_routes(y_rows, sched)  # [T, K, H]
    products = d_out.double()[:, None, :] * y.double()  # [T, K, H]
    return dy_rows, d_w, products.sum(-1), products.abs().sum(-1)


# ---- CPU: argument checks (all before the extension is built) ---------------------------------------------------


def test_route_grads_bad_inputs_name_the_argument():
    d, w, y, s = _problem(37, 64, 4, 2, 128, "random", seed=1, device="cpu")
    bad = [
        (lambda: ops.route_grads_prep(d, w, y, "sched"), "sched: expected a mok.schedule.Schedule"),
        (lambda: ops.route_grads_prep(d, w, y.float(), s), "y_rows: expected dtype torch.bfloat16"),
        (lambda: ops.route_grads_prep(d, w, y[1:], s), r"y_rows: expected shape \[num_rows, hidden\]"),
        (lambda: ops.route_grads_prep(d[:, :60], w, y[:, :60], s), "y_rows: expected hidden"),
        (lambda: ops.route_grads_prep(d.float(), w, y, s), "d_out: expected dtype torch.bfloat16"),
        (lambda: ops.route_grads_prep(d[:, :32], w, y, s), r"d_out: expected shape \[num_tokens, hidden\]"),
        (lambda: ops.route_grads_prep(d, w.double(), y, s), "topk_weights: expected dtype torch.float32"),
        (lambda: ops.route_grads_prep(d, w[:, :1], y, s), r"topk_weights: expected shape"),
        (lambda: ops.route_grads_prep(d, w, y, s), "y_rows: expected a CUDA tensor"),  # valid, but on the CPU
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()


# ---- GPU -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-E{}-K{}-bm{}-{}".format(*s))
def test_route_grads_prep_matches_l0(shape):
    seed = fresh_seed()
    d_out, w, y_rows, sched = _problem(*shape, seed)
    dy_want, dw_l0, dw_exact, scale = _l0(d_out, w, y_rows, sched)
    poison_allocator(4 * dy_want.numel() * 2)  # 0xFF: NaN in bf16 and fp32
    dy_rows, d_w = ops.route_grads_prep(d_out, w, y_rows, sched)
    assert dy_rows.shape == dy_want.shape and d_w.shape == dw_l0.shape and d_w.dtype == torch.float32
    assert bitwise_equal(dy_rows, dy_want), f"{shape}: dy_rows bits differ from L0 (seed {seed})"
    err_l0 = ((d_w.double() - dw_l0.double()).abs() / scale.clamp_min(1e-30)).max().item()
    err_exact = ((d_w.double() - dw_exact).abs() / scale.clamp_min(1e-30)).max().item()
    assert err_l0 <= DOT_TOL, f"{shape}: d_topk_weights vs L0 {err_l0:.2e} of Σ|d·y| (seed {seed})"
    assert err_exact <= DOT_TOL, f"{shape}: d_topk_weights vs fp64 {err_exact:.2e} of Σ|d·y| (seed {seed})"
    again = ops.route_grads_prep(d_out, w, y_rows, sched)
    assert bitwise_equal(again[0], dy_rows) and bitwise_equal(again[1], d_w), f"{shape}: run to run (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
def test_route_grads_prep_on_the_device_schedule():
    """The same results with make_schedule_cuda's Schedule (views of larger buffers) as with make_schedule's."""
    seed = fresh_seed()
    d_out, w, y_rows, sched = _problem(513, 2048, 128, 8, 128, "random", seed)
    topk_idx = sched.row_to_expert[sched.route_to_row]  # [T, K]: the expert of each route
    device_sched = ops.make_schedule_cuda(topk_idx, 128)
    assert device_sched.equal(sched)
    want = ops.route_grads_prep(d_out, w, y_rows, sched)
    got = ops.route_grads_prep(d_out, w, y_rows, device_sched)
    assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1]), f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.sm90
def test_route_grads_prep_special_values():
    """Inf and NaN in d_out and y, weights 0 and huge: dy as L0 (NaN positions compared as NaN: a NaN's payload
    is not part of the spec); d_topk_weights NaN exactly where L0's is."""
    seed = fresh_seed()
    d_out, w, y_rows, sched = _problem(64, 256, 8, 4, 128, "random", seed)
    d_out[::7, 3] = float("inf")
    d_out[::11, 5] = float("nan")
    real = sched.route_to_row.flatten()
    y_rows[real[::13], 9] = float("-inf")
    w[::3, 0] = 0.0  # 0·Inf = NaN
    w[::4, 1] = 1e38  # overflows to Inf in fp32, then bf16
    dy_want, dw_l0, _, _ = _l0(d_out, w, y_rows, sched)
    dy_rows, d_w = ops.route_grads_prep(d_out, w, y_rows, sched)
    assert torch.equal(dy_rows.isnan(), dy_want.isnan()), f"dy NaN positions differ (seed {seed})"
    finite = ~dy_want.isnan()
    assert bitwise_equal(dy_rows[finite], dy_want[finite]), f"dy bits differ from L0 (seed {seed})"
    assert torch.equal(d_w.isnan(), dw_l0.isnan()), f"d_topk_weights NaN positions differ (seed {seed})"
    assert torch.equal(d_w.isinf(), dw_l0.isinf()), f"d_topk_weights Inf positions differ (seed {seed})"
