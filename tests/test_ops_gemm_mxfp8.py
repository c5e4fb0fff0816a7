"""GEMM1 and GEMM2 with MXFP8 weights dequantized in the mainloop (mok.ops.gemm_mx) against the BF16 kernels
on the dequantized weights: the same bits, everywhere, edge values included (the weight tiles the producer
dequantizes in shared memory are exactly mxfp8_dequantize's bf16, so any difference is a kernel bug: a wrong
swizzle, scale, k-block or landing slot). The BF16 kernels themselves are checked against L0 in
test_ops_gemm.py, and the level's mxfp8 path against L0 in test_fused.py.
"""

from __future__ import annotations

import pytest
import torch

from mok import ops
from mok.config import TINY_SHAPES, MoEConfig
from mok.reference import BF16
from mok.schedule import make_schedule
from mok.testing import bitwise_equal, fresh_seed, make_inputs, poison_allocator, routing_of

# Every K a multiple of 32 (whole MXFP8 blocks); K-tails of 32 (hidden 96, 544; intermediate 96, 224: an odd
# number of scale blocks), N-tails, more k-blocks than stages and landing slots, empty experts, a hot expert.
CASES = {
    **{name: (cfg, "random") for name, cfg in TINY_SHAPES.items()},
    "hot-expert": (MoEConfig("hot-expert", 200, 256, 192, 5, 2), "hot"),
    "two-experts-of-8": (MoEConfig("two-experts-of-8", 70, 128, 64, 8, 1), "two"),
    "deep-k": (MoEConfig("deep-k", 300, 544, 224, 6, 4), "random"),  # 9 k-blocks, n tail 96
}


def _problem(case: str, seed: int):
    cfg, kind = CASES[case]
    inputs = make_inputs(cfg, seed=seed, routing_fn=routing_of(kind))  # CPU tensors
    return inputs, make_schedule(inputs["topk_idx"], cfg.num_experts)


def _with_edge_values(w: torch.Tensor, seed: int) -> torch.Tensor:
    """w [E, n, k] with blocks the scale rule treats specially: huge and tiny rows (scale bytes far from 127),
    an all-zero block, and a NaN and an Inf block in the last expert (their scale is 0xFF: NaN columns)."""
    w = w.clone()
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, w.shape[1], (4,), generator=g)
    w[0, rows[0]] *= 2.0**100
    w[0, rows[1]] *= 2.0**-100
    w[0, rows[2], :32] = 0
    w[-1, rows[3], 0] = float("nan")
    w[-1, rows[3], -1] = float("inf")
    return w


def _mx(w: torch.Tensor):
    """(data, scales) of w along k, and the bf16 the BF16 kernels get instead: its dequantization."""
    q = ops.mxfp8_quantize_rowwise(w.cuda())
    return q, ops.mxfp8_dequantize(*q, -1)


# ---- CPU ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks", [1, 2, 7, 8])
def test_mx_scales_by_k_block_is_a_tile_major_transpose(num_blocks):
    g = torch.Generator().manual_seed(num_blocks)
    scales = torch.randint(0, 256, (3, 40, num_blocks), generator=g, dtype=torch.uint8)  # [E, n, k / 32]
    out = ops.mx_scales_by_k_block(scales)
    assert out.shape == (3, (num_blocks + 1) // 2, 40, 2) and out.is_contiguous()
    for e, kb, r, j in [(0, 0, 0, 0), (2, (num_blocks - 1) // 2, 39, 1), (1, 0, 17, 1)]:
        block = 2 * kb + j
        expected = scales[e, r, block] if block < num_blocks else 127  # the pad: 2^0, scaling zeros
        assert out[e, kb, r, j] == expected, (e, kb, r, j)
    assert torch.equal(out.permute(0, 2, 1, 3).reshape(3, 40, -1)[..., :num_blocks], scales)


def test_mx_gemm_bad_inputs_name_the_argument():
    inputs, sched = _problem("tiny-noshared", seed=1)
    x, wg = inputs["x"], inputs["w_gate"]  # [T, 128], [6, 64, 128]
    data = torch.zeros(wg.shape, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(*wg.shape[:2], wg.shape[2] // 32, dtype=torch.uint8)
    a_rows = torch.zeros(sched.num_rows, 64, dtype=BF16)  # [R, I]
    w_down = (torch.zeros(6, 128, 64, dtype=torch.float8_e4m3fn), torch.zeros(6, 128, 2, dtype=torch.uint8))
    gemm1, gemm2 = ops.grouped_gemm_mxfp8_swiglu_gather, ops.grouped_gemm_mxfp8_nt_contiguous
    bad = [
        (lambda: gemm1(x, data, (data, scales), sched), r"w_gate: expected \(data, scales\)"),
        (lambda: gemm1(x, (wg, scales), (data, scales), sched), r"w_gate\[0\]: expected data of dtype"),
        (lambda: gemm1(x, (data[:-1], scales), (data, scales), sched), r"w_gate\[0\]: expected shape"),
        (lambda: gemm1(x, (data, scales[..., :-1]), (data, scales), sched), r"w_gate\[1\]: expected shape"),
        (lambda: gemm1(x, (data, scales.float()), (data, scales), sched), r"w_gate\[1\]: expected scales"),
        (lambda: gemm1(x, (data, scales), (data[:, :-8], scales[:, :-8]), sched), r"w_up\[0\]: expected shape"),
        (lambda: gemm1(x[:, :-8], (data[..., :-8], scales), (data, scales), sched), r"w_gate\[0\]: expected k"),
        (lambda: gemm1(x, (data, scales), (data, scales), sched), "x: expected a CUDA tensor"),  # valid, on the CPU
        (lambda: gemm2(a_rows, w_down[0], sched), r"w: expected \(data, scales\)"),
        (lambda: gemm2(a_rows[:, :-32], w_down, sched), r"w\[0\]: expected shape"),
        (lambda: gemm2(a_rows, w_down, sched), "a_rows: expected a CUDA tensor"),
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()


# ---- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("num_sms", [None, 3])  # 3: many tasks per CTA, the landing ring crosses tasks
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("case", list(CASES))
def test_gemm1_mx_weights_equal_bf16_kernel_on_dequantized(case, limit, num_sms):
    seed = fresh_seed()
    inputs, sched = _problem(case, seed)
    sched = sched.to("cuda")
    x = inputs["x"].cuda()
    (qg, wg), (qu, wu) = _mx(_with_edge_values(inputs["w_gate"], seed)), _mx(inputs["w_up"])
    expected = ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched, swiglu_limit=limit, num_sms=num_sms)
    poison_allocator(2 * 3 * sched.num_rows * wg.shape[1] * 2)
    got = ops.grouped_gemm_mxfp8_swiglu_gather(x, qg, qu, sched, swiglu_limit=limit, num_sms=num_sms)
    for name, a, e in zip(("h", "gate", "up"), got, expected):
        assert bitwise_equal(a, e), f"{case} limit={limit} num_sms={num_sms} {name}: bits differ (seed {seed})"
    if (inputs["topk_idx"] == inputs["w_gate"].shape[0] - 1).any():  # the NaN block's expert has routes
        assert got[1].isnan().any(), f"{case}: the NaN block reached no output (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("num_sms", [None, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_gemm2_mx_weights_equal_bf16_kernel_on_dequantized(case, num_sms):
    seed = fresh_seed()
    inputs, sched = _problem(case, seed)
    sched = sched.to("cuda")
    q, wd = _mx(_with_edge_values(inputs["w_down"], seed))  # [E, H, I]
    a_rows = torch.randn(sched.num_rows, wd.shape[2], generator=torch.Generator().manual_seed(seed)).to(BF16)
    a_rows[sched.row_to_token.cpu() < 0] = 0
    a_rows = a_rows.cuda()
    expected = ops.grouped_gemm_bf16_nt_contiguous(a_rows, wd, sched, num_sms=num_sms)
    poison_allocator(2 * sched.num_rows * wd.shape[1] * 2)
    got = ops.grouped_gemm_mxfp8_nt_contiguous(a_rows, q, sched, num_sms=num_sms)
    assert bitwise_equal(got, expected), f"{case} num_sms={num_sms}: bits differ (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
def test_gemm1_mx_dequantizes_every_byte_and_scale_exactly():
    """One-hot tokens make gate[t, n] = bf16(1 · w[n, t]): the dequantized weight itself. Every E4M3 byte but
    the NaNs meets scale bytes 0..240 (none overflows).
    Compared with mxfp8_dequantize where that is a normal number or zero (the tensor cores' handling of
    subnormal inputs is not this test's business); a zero's sign is not compared (1 · -0 + 0 · ... = +0)."""
    hidden, intermediate = 64, 256
    n, k = torch.meshgrid(torch.arange(intermediate), torch.arange(hidden), indexing="ij")  # [256, 64] each
    data = ((7 * n + 13 * k) % 256).to(torch.uint8)  # [I, H]
    data[(data & 0x7F) == 0x7F] = 0x7E  # E4M3 NaN bytes: the NaN-block test above has them
    scales = ((3 * torch.arange(intermediate)[:, None] + 101 * torch.arange(2)) % 241).to(torch.uint8)  # [I, 2]
    w = (data.view(torch.float8_e4m3fn)[None].cuda(), scales[None].cuda())  # [1, I, H], [1, I, H / 32]
    x = torch.eye(hidden, dtype=BF16, device="cuda")  # [T = 64, H]: token t is e_t
    sched = make_schedule(torch.zeros(hidden, 1, dtype=torch.int64, device="cuda"), 1)  # row t = token t
    expected = ops.mxfp8_dequantize(*w, -1)[0].T.contiguous()  # [T, I]: gate[t, n] = w[n, t]
    poison_allocator(3 * sched.num_rows * intermediate * 2)
    gate = ops.grouped_gemm_mxfp8_swiglu_gather(x, w, w, sched)[1][:hidden]  # [T, I]
    zero = expected == 0
    checked = zero | (expected.float().abs() >= 2.0**-126)
    assert checked.float().mean() > 0.9, "most values must be normal, or the test checks little"
    same = (gate.view(torch.int16) == expected.view(torch.int16)) | (zero & (gate == 0))
    bad = checked & ~same
    assert not bad.any(), f"{int(bad.sum())} elements differ, first at {bad.nonzero()[:4].tolist()}"
