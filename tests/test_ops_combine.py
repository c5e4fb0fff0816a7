"""The fixed-order combine kernel (mok.ops.combine_rows) against L0's combine, bit for bit.

L0 (mok.reference.combine) sums acc = 0; acc += w·y per k (a separately rounded fp32 product and sum);
acc += shared; rounds to bf16. The kernel rounds at exactly those points, so it must match every bit,
on the GPU's L0 and on the CPU's. Without weights it is the d_x sum of mok.reference.moe_backward
(d_x += dx[:, k].float() per k, then += dx_shared.float()), which equals L0 combine with weights 1
(1·y = y exactly). The rows a schedule leaves as padding are filled with NaN: the kernel must never read
them. Inputs are drawn fresh every run (the seed is in each failure message).
"""

from __future__ import annotations

import pytest
import torch

from mok import ops, routing
from mok.reference import BF16, combine
from mok.schedule import make_schedule
from mok.testing import bitwise_equal, fresh_seed, poison_allocator

# (num_tokens, hidden, num_experts, num_topk): K = 1 and 8 and one K that is not a multiple of the kernel's
# batch of 4; hidden from one 16-byte vector to several warp tiles with a tail (7168 = 14 tiles of 512).
SHAPES = [(1, 8, 1, 1), (37, 64, 4, 2), (29, 72, 3, 1), (50, 520, 6, 3), (23, 96, 9, 8), (300, 7168, 48, 6),
          (64, 2048, 128, 8)]


def _problem(num_tokens, hidden, num_experts, num_topk, seed, weights=True, shared=True, device="cuda"):
    """y_rows in a schedule's row layout (NaN padding rows), route_to_row, weights, shared; on `device`."""
    g = torch.Generator().manual_seed(seed)
    topk_idx, topk_weights = routing.random_routing(num_tokens, num_experts, num_topk, skew=1.0, generator=g)
    sched = make_schedule(topk_idx, num_experts, block_m=128)
    y_rows = (torch.randn(sched.num_rows, hidden, generator=g) * 3).to(BF16)  # [num_rows, hidden]
    y_rows[sched.row_to_token < 0] = float("nan")  # never read
    shared_t = torch.randn(num_tokens, hidden, generator=g).to(BF16) if shared else None  # [T, hidden]
    return dict(y_rows=y_rows.to(device), route_to_row=sched.route_to_row.to(device),
                topk_weights=topk_weights.to(device) if weights else None,
                shared=shared_t.to(device) if shared else None)


def _l0(p: dict) -> torch.Tensor:
    """L0's combine on the per-route slots (weights None: weights 1, the d_x sum of moe_backward)."""
    y = p["y_rows"][p["route_to_row"]]  # [T, K, hidden]
    w = p["topk_weights"]
    if w is None:
        w = torch.ones(y.shape[:2], dtype=torch.float32, device=y.device)  # [T, K]
    return combine(y, w, p["shared"])


# ---- CPU: argument checks (all before the extension is built) ---------------------------------------------


def test_combine_bad_inputs_name_the_argument():
    p = _problem(37, 64, 4, 2, seed=1, device="cpu")
    y, r, w, s = p["y_rows"], p["route_to_row"], p["topk_weights"], p["shared"]
    bad = [
        (lambda: ops.combine_rows(y.float(), r, w, s), "y_rows: expected dtype torch.bfloat16"),
        (lambda: ops.combine_rows(y[None], r, w, s), r"y_rows: expected shape \[num_rows, hidden\]"),
        (lambda: ops.combine_rows(y[:, :60], r, w, s[:, :60]), "y_rows: expected hidden"),
        (lambda: ops.combine_rows(y, r.float(), w, s), "route_to_row: expected dtype torch.int64 or torch.int32"),
        (lambda: ops.combine_rows(y, r[:, 0], w, s), r"route_to_row: expected shape \[num_tokens, num_topk\]"),
        (lambda: ops.combine_rows(y, r, w.double(), s), "topk_weights: expected dtype torch.float32"),
        (lambda: ops.combine_rows(y, r, w[:, :1], s), "topk_weights: expected shape"),
        (lambda: ops.combine_rows(y, r, w, s[1:]), r"shared: expected shape \[num_tokens, hidden\]"),
        (lambda: ops.combine_rows(y, r, w, s.float()), "shared: expected dtype torch.bfloat16"),
        (lambda: ops.combine_rows(y, r, w, s), "y_rows: expected a CUDA tensor"),  # valid, but on the CPU
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()


# ---- GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("weights,shared", [(True, True), (True, False), (False, True), (False, False)],
                         ids=["w-shared", "w", "none-shared", "none"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-E{}-K{}".format(*s))
def test_combine_rows_bitwise_equals_l0(shape, weights, shared, index_dtype):
    seed = fresh_seed()
    p = _problem(*shape, seed, weights=weights, shared=shared)
    expected_gpu = _l0(p)  # [T, hidden]
    expected_cpu = _l0({k: None if v is None else v.cpu() for k, v in p.items()})
    poison_allocator(4 * expected_gpu.numel() * 2)
    out = ops.combine_rows(p["y_rows"], p["route_to_row"].to(index_dtype), p["topk_weights"], p["shared"])
    assert out.dtype == BF16 and out.shape == expected_gpu.shape
    assert bitwise_equal(out, expected_gpu), f"{shape}: bits differ from L0 on the GPU (seed {seed})"
    assert bitwise_equal(out.cpu(), expected_cpu), f"{shape}: bits differ from L0 on the CPU (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
def test_combine_rows_special_values_match_l0():
    """Inf and NaN in y, weights 0, negative and > 1, products that overflow: the same values as L0 (NaN
    positions compared as NaN: the payload of a NaN is not part of the spec)."""
    seed = fresh_seed()
    p = _problem(64, 256, 8, 4, seed)
    real = p["route_to_row"].flatten()  # rows the kernel reads
    y = p["y_rows"]
    y[real[::7], 3] = float("inf")
    y[real[::11], 5] = float("-inf")
    y[real[::13], 9] = float("nan")
    y[real[::5], 17] = 3.0e38  # near bf16's max
    p["topk_weights"][::3, 0] = 0.0  # 0·Inf = NaN
    p["topk_weights"][::4, 1] = -0.5
    p["topk_weights"][::2, 2] = 4.0  # 4 · 3e38 overflows fp32 to Inf
    expected = _l0(p)
    out = ops.combine_rows(p["y_rows"], p["route_to_row"], p["topk_weights"], p["shared"])
    assert torch.equal(out.isnan(), expected.isnan()), f"NaN positions differ (seed {seed})"
    finite = ~expected.isnan()
    assert bitwise_equal(out[finite], expected[finite]), f"bits differ from L0 (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
def test_combine_rows_bad_row_ids():
    p = _problem(37, 64, 4, 2, seed=fresh_seed())
    bad = p["route_to_row"].clone()
    bad[5, 1] = p["y_rows"].shape[0]  # one past the end
    with pytest.raises(ValueError, match=r"route_to_row: expected row ids in \[0, "):
        ops.combine_rows(p["y_rows"], bad, p["topk_weights"], p["shared"])
    # Unchecked (the fused level's trusted schedules): the token's row is NaN, the others are right.
    out = ops.combine_rows(p["y_rows"], bad, p["topk_weights"], p["shared"], check_rows=False)
    expected = _l0(p)
    assert out[5].isnan().all()
    others = torch.arange(out.shape[0], device=out.device) != 5
    assert bitwise_equal(out[others], expected[others])


@pytest.mark.gpu
@pytest.mark.sm90
def test_combine_rows_no_tokens():
    y_rows = torch.randn(128, 64, device="cuda").to(BF16)
    out = ops.combine_rows(y_rows, torch.zeros(0, 2, dtype=torch.int64, device="cuda"),
                           torch.zeros(0, 2, device="cuda"))
    assert out.shape == (0, 64)
