"""Grouped BF16 GEMMs (mok.ops, L2 building blocks) against their L0 twins (mok.twins: L0's mm / swiglu /
swiglu_backward per expert).

Expectations are computed on the CPU by the twins, expert by expert over the schedule's segments;
kernels run on the Hopper GPU. The GEMMs' fp32 sums run in another order than the CPU's, so results
are compared with DESIGN §9's tolerance *and* must agree bit for bit on nearly every element (a wrong
layout, swizzle or expert would fail both by far). Outputs come from a caching allocator poisoned with
NaN first, so an element the kernel never writes cannot pass. Inputs are drawn fresh every run (the
seed is in each failure message).
"""

from __future__ import annotations

import pytest
import torch

from mok import ops, routing, twins
from mok.config import TINY_SHAPES, MoEConfig
from mok.reference import BF16, moe_forward
from mok.schedule import make_schedule, scatter_routes
from mok.testing import TOLERANCES, bitwise_equal, fresh_seed, make_inputs, poison_allocator, rel_err, routing_of

# Irregular on purpose: K-tails (hidden not a multiple of 64), N-tails, more k-blocks than stages, empty
# experts, one hot expert, num_topk 1 and 8, token counts that are no tile multiple.
CASES = {
    **{name: (cfg, "random") for name, cfg in TINY_SHAPES.items()},  # K = 1..8, hidden 64/96/128
    "hot-expert": (MoEConfig("hot-expert", 200, 256, 192, 5, 2), "hot"),  # most routes on expert 3
    "two-experts-of-8": (MoEConfig("two-experts-of-8", 70, 128, 64, 8, 1), "two"),  # six empty experts
    "deep-k": (MoEConfig("deep-k", 300, 520, 200, 6, 4), "random"),  # 9 k-blocks > 4 stages, n tail
    # ~300 routes (3 m-tiles) per expert: m-tile pairs within an expert, across two, and a last one alone (the
    # three cases of the multicast build's pairing)
    "pairs": (MoEConfig("pairs", 450, 128, 96, 3, 2), "random"),
    # ~150 routes per expert: a full m-tile, then a short tail of mostly <= 32 routes
    "short-tails": (MoEConfig("short-tails", 300, 128, 96, 4, 2), "random"),
    # tails of exactly 1, 32, 8 and 33 routes after a full tile, with n- and k-tails: 3 n-tiles of GEMM2 and
    # the gate/up dgrad (the last 8 columns wide), 2 of GEMM1, the down dgrad's B1 half 72 columns wide
    "wide-tails": (MoEConfig("wide-tails", 293, 520, 200, 4, 2), "tails"),
}
NEAR_BITWISE = 0.98  # fraction of elements that must equal L0's bits (fp32 sum order flips a few roundings)


def _problem(case: str, seed: int, block_m: int = 128) -> tuple[dict, object]:
    cfg, kind = CASES[case]
    inputs = make_inputs(cfg, seed=seed, routing_fn=routing_of(kind))  # CPU tensors
    return inputs, make_schedule(inputs["topk_idx"], cfg.num_experts, block_m=block_m)


def _backward_operands(sched, cfg_i: int, cfg_h: int, seed: int) -> dict:
    """Random dy_rows [R, H], gate/up [R, I] (bf16, zeros in padding rows, as the forward leaves them)."""
    g = torch.Generator().manual_seed(seed + 1)
    padding = sched.row_to_token < 0  # [R]
    ops_in = {}
    for name, width in (("dy_rows", cfg_h), ("gate", cfg_i), ("up", cfg_i)):
        t = torch.randn(sched.num_rows, width, generator=g).to(BF16)  # [R, width]
        t[padding] = 0
        ops_in[name] = t
    return ops_in


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, seed: int) -> None:
    a = actual.cpu()
    assert a.shape == expected.shape, f"{what}: shape {tuple(a.shape)} vs L0 {tuple(expected.shape)}"
    assert not a.isnan().any(), f"{what}: {int(a.isnan().sum())} NaN (unwritten or wrong) elements (seed {seed})"
    err = rel_err(a, expected)
    assert err <= TOLERANCES["bf16_vs_l0"], f"{what}: rel_err {err:.3e} vs L0 (seed {seed})"
    same = (a.view(torch.int16) == expected.view(torch.int16)).float().mean().item() if a.numel() else 1.0
    assert same >= NEAR_BITWISE, f"{what}: only {same:.4f} of the elements equal L0's bits (seed {seed})"


# ---- CPU: the pure-Python pieces ------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [128, 256, 384])
def test_gemm_schedule_tensors_split_tiles_into_kernel_tiles(block_m):
    topk_idx = routing.random_routing(45, 5, 3, skew=1.0, generator=torch.Generator().manual_seed(block_m))[0]
    sched = make_schedule(topk_idx, 5, block_m=block_m)
    row_to_token, tile_to_expert = ops.gemm_schedule_tensors(sched, "cpu")
    assert row_to_token.dtype == tile_to_expert.dtype == torch.int32
    assert torch.equal(row_to_token.long(), sched.row_to_token)
    assert torch.equal(tile_to_expert.long(), sched.row_to_expert[:: ops.GEMM_BLOCK_M])  # [num_rows / 128]
    with pytest.raises(ValueError, match="sched: expected block_m a multiple of 128"):
        ops.gemm_schedule_tensors(make_schedule(topk_idx, 5, block_m=64), "cpu")


def test_weight_grad_schedule_tensors_are_the_offsets_and_real_rows_made_once():
    """int32 expert_offsets [E + 1] and tokens_per_expert [E] (the real rows the weight gradients' K stops at),
    empty experts included, made on the first call and then reused (three weight gradients per backward)."""
    topk_idx = routing.random_routing(300, 9, 2, skew=1.5, generator=torch.Generator().manual_seed(5))[0]
    topk_idx[topk_idx == 4] = 3  # expert 4 gets no rows
    sched = make_schedule(topk_idx, 9)
    offsets, rows = ops.gemm.weight_grad_schedule_tensors(sched, "cpu")
    assert offsets.dtype == rows.dtype == torch.int32 and rows[4] == 0
    assert torch.equal(offsets.long(), sched.expert_offsets) and torch.equal(rows.long(), sched.tokens_per_expert)
    assert ops.gemm.weight_grad_schedule_tensors(sched, "cpu")[0] is offsets  # kept on the schedule


def test_gemm_bad_inputs_name_the_argument():
    inputs, sched = _problem("tiny-noshared", seed=1)
    x, wg, wu, wd = inputs["x"], inputs["w_gate"], inputs["w_up"], inputs["w_down"]
    gemm1, gemm2 = ops.grouped_gemm_bf16_swiglu_gather, ops.grouped_gemm_bf16_nt_contiguous
    gemm1_mx, dgrad_mx = ops.grouped_gemm_bf16_swiglu_gather_mxfp8_out, ops.grouped_gemm_bf16_dgrad_swiglu_mxfp8
    dgrad_down, dgrad_gate_up = ops.grouped_gemm_bf16_dgrad_swiglu, ops.grouped_gemm_bf16_dgrad_gate_up
    chain_bwd, w = ops.grouped_gemm_bf16_chain_backward, inputs["topk_weights"]
    a_rows = torch.zeros(sched.num_rows, wg.shape[1], dtype=BF16)  # [num_rows, I]
    dy_rows = torch.zeros(sched.num_rows, x.shape[1], dtype=BF16)  # [num_rows, H]
    mx_rows = twins.mxfp8_quantize_rowwise(a_rows)  # (data, scales) of [num_rows, I]
    T, K, H = x.shape[0], w.shape[1], x.shape[1]

    def ranks(**changed):  # the backward chain's ranks: two, this one rank 0, valid but on the CPU
        lists = dict(rank=0, row_ids=torch.zeros(sched.num_rows, dtype=torch.int32),
                     route_to_row=torch.zeros(2 * T, K, dtype=torch.int32), token_offsets=[0, T], x=[], y=[dy_rows] * 2,
                     topk_weights=[], out=[dy_rows[:T]] * 2,
                     token_done=[torch.zeros(T, -(-H // 256), dtype=torch.int32)] * 2)
        return ops.ChainRanks(**{**lists, **changed})
    bad = [
        (lambda: gemm1(x.float(), wg, wu, sched), "x: expected dtype torch.bfloat16"),
        (lambda: gemm1(x[:-1], wg, wu, sched), r"x: expected shape \[num_tokens, hidden\]"),
        (lambda: gemm1(x[:, :-4], wg[..., :-4], wu[..., :-4], sched), "x: expected hidden"),
        (lambda: gemm1(x, wg[:-1], wu, sched), "w_gate: expected shape"),
        (lambda: gemm1(x, wg, wu[:, :-8], sched), "w_up: expected shape"),
        (lambda: gemm1(x, wg, wu, sched, swiglu_limit=float("nan")), "swiglu_limit: expected"),
        (lambda: gemm1(x, wg, wu, sched, num_sms=0), "num_sms: expected"),
        (lambda: gemm1(x, wg, wu, sched), "x: expected a CUDA tensor"),  # valid, but on the CPU
        (lambda: gemm1_mx(x, wg[:, :40], wu[:, :40], sched), "w_gate: expected intermediate .* multiple of 32"),
        (lambda: gemm1_mx(x, wg, wu, sched), "x: expected a CUDA tensor"),
        (lambda: gemm2(a_rows[1:], wd, sched), r"a_rows: expected shape \[num_rows, k\]"),
        (lambda: gemm2(a_rows, wd.transpose(1, 2), sched), "w: expected shape"),
        (lambda: gemm2(a_rows, wd[:, :-4], sched), "w: expected n"),
        (lambda: gemm2(a_rows, wd, sched), "a_rows: expected a CUDA tensor"),
        (lambda: dgrad_down(dy_rows, wd, a_rows, a_rows, sched), "dy_rows: expected a CUDA tensor"),
        (lambda: dgrad_mx(dy_rows, wd, a_rows, a_rows, sched), "gate_mx: expected a \\(data, scales\\) pair"),
        (lambda: dgrad_mx(dy_rows, wd, mx_rows, (mx_rows[0], mx_rows[1][:, :1]), sched), "up_mx: expected scales"),
        (lambda: dgrad_mx(dy_rows, wd, mx_rows, mx_rows, sched), "dy_rows: expected a CUDA tensor"),
        (lambda: dgrad_down(dy_rows, wd.transpose(1, 2), a_rows, a_rows, sched), "w_down: expected shape"),
        (lambda: dgrad_down(dy_rows, wd, a_rows[:, :-8], a_rows, sched), "gate: expected shape"),
        (lambda: dgrad_down(dy_rows, wd, a_rows, a_rows, sched, swiglu_limit="1"), "swiglu_limit: expected"),
        (lambda: dgrad_gate_up(a_rows, a_rows, wg, wu, sched), "d_gate: expected a CUDA tensor"),
        (lambda: dgrad_gate_up(a_rows, a_rows[:, :-8], wg, wu, sched), "d_up: expected shape"),
        (lambda: dgrad_gate_up(a_rows, a_rows, wg.transpose(1, 2), wu, sched), "w_gate: expected shape"),
        (lambda: ops.grouped_gemm_bf16_weight_grad(a_rows[1:], dy_rows, sched), "a_rows: expected shape"),
        (lambda: ops.grouped_gemm_bf16_weight_grad(a_rows, dy_rows[:, :-4], sched), "b_rows: expected n"),
        (lambda: ops.grouped_gemm_bf16_weight_grad(a_rows, dy_rows, sched), "a_rows: expected a CUDA tensor"),
        (lambda: chain_bwd(dy_rows, dy_rows[:, :-8], wg, wu, wd, a_rows, a_rows, w, sched), "x_rows: expected shape"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, a_rows, a_rows[1:], w, sched), "up: expected shape"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, a_rows, a_rows, w[:, :1], sched), "topk_weights: expected"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, a_rows, a_rows, w, sched, shared=(dy_rows,)),
         "dy_rows: expected a CUDA tensor"),  # the routed group's checks come first
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, a_rows, a_rows, w, sched), "dy_rows: expected a CUDA tensor"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, mx_rows, mx_rows, w, sched, dy_cols=dy_rows),
         "topk_weights: expected None with MXFP8"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, mx_rows, mx_rows, None, sched), "dy_cols: expected"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, mx_rows, (mx_rows[0], mx_rows[1][:, :1]), None, sched,
                           dy_cols=dy_rows), "up: expected scales"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, a_rows, a_rows, w, sched, dy_cols=dy_rows),
         "dy_cols: expected None with bf16"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, mx_rows, mx_rows, None, sched, dy_cols=dy_rows),
         "dy_rows: expected a CUDA tensor"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, a_rows, a_rows, w, sched,
                           ranks=ranks(y=[dy_rows, dy_rows[1:]])), r"ranks.y\[1\]: expected shape"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, a_rows, a_rows, w, sched, ranks=ranks(x=[x, x])),
         "ranks.x: expected empty"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, a_rows, a_rows, w, sched, ranks=ranks(rank=2)),
         "ranks.rank: expected an int in"),
        (lambda: chain_bwd(dy_rows, dy_rows, wg, wu, wd, a_rows, a_rows, w, sched, ranks=ranks()),
         r"ranks.y\[0\]: expected a CUDA tensor"),
    ]
    for call, message in bad:
        with pytest.raises(ValueError, match=message):
            call()


def test_wide_tails_give_each_expert_a_full_tile_and_a_short_tail():
    """routing_of("tails"): each expert a full tile and a tail of 1, 32, 8 or 33 routes, each token's experts
    distinct, so the GEMM tests meet tails of exactly those sizes."""
    seed = fresh_seed()
    inputs, sched = _problem("wide-tails", seed)
    assert torch.bincount(inputs["topk_idx"].view(-1), minlength=4).tolist() == [129, 160, 136, 161]
    assert all(len(set(experts)) == 2 for experts in inputs["topk_idx"].tolist()), f"seed {seed}"
    rows = (sched.row_to_token.view(-1, 128) >= 0).sum(dim=1)  # [m-tiles]: routes in each
    assert rows.tolist() == [128, 1, 128, 32, 128, 8, 128, 33]


# ---- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("case", list(CASES))
def test_gemm1_swiglu_gather_matches_l0(case, limit):
    seed = fresh_seed()
    inputs, sched = _problem(case, seed)
    x, wg, wu = inputs["x"], inputs["w_gate"], inputs["w_up"]
    expected = twins.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched, limit)
    poison_allocator(2 * 3 * sched.num_rows * wg.shape[1] * 2)
    got = ops.grouped_gemm_bf16_swiglu_gather(x.cuda(), wg.cuda(), wu.cuda(), sched.to("cuda"), swiglu_limit=limit)
    for name, a, e in zip(("h", "gate", "up"), got, expected):
        _assert_close(a, e, f"{case} limit={limit} {name}", seed)
        padding = sched.row_to_token < 0  # [num_rows]
        assert not a.cpu()[padding].view(torch.int16).any(), f"{case} {name}: padding rows not zero (seed {seed})"


MX_OUT_CASES = [c for c, (cfg, _) in CASES.items() if cfg.intermediate % ops.BLOCK_SIZE == 0]  # row-wise blocks


def _assert_same_bits_nan_aside(a: torch.Tensor, e: torch.Tensor, what: str) -> None:
    """Every bit equal, except that a NaN matches any NaN (the quantizers' NaN blocks dequantize to NaN)."""
    nan = e.isnan()
    assert torch.equal(a.isnan(), nan), f"{what}: NaN positions differ"
    assert bitwise_equal(a[~nan], e[~nan]), f"{what}: bits differ"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("extremes", [False, True], ids=["plain", "extremes"])
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("case", MX_OUT_CASES)
def test_gemm1_mxfp8_out_is_gemm1_then_its_quantizers(case, limit, extremes):
    """The MXFP8 forward's GEMM1 writes, from its epilogue, exactly what the BF16 GEMM1 followed by the
    quantizers gives: h's row-wise round trip and gate/up's row-wise (data, scales), padding rows included, for
    two grid sizes. `extremes`: tokens scaled to 1e38 (gate/up may overflow to ±Inf), one Inf in x (NaN blocks
    for sure, scale 0xFF) and tokens scaled to 1e-30 (amaxes under the floor): every branch of the recipe runs."""
    seed = fresh_seed()
    inputs, sched = _problem(case, seed)
    x, wg, wu = (inputs[n].cuda() for n in ("x", "w_gate", "w_up"))
    if extremes:
        x[::5] *= 1e38
        x[1::5] *= 1e-30
        x[0, 0] = float("inf")  # token 0's gate/up rows: Inf or NaN in every block
    sched = sched.to("cuda")
    h, gate, up = ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched, swiglu_limit=limit)
    expected = (ops.mxfp8_fake_quantize(h, -1), ops.mxfp8_quantize_rowwise(gate), ops.mxfp8_quantize_rowwise(up))
    for num_sms in (None, 3):
        what = f"{case} limit={limit} extremes={extremes} num_sms={num_sms} (seed {seed})"
        poison_allocator(4 * sched.num_rows * wg.shape[1] * 2)
        got_h, got_gate, got_up = ops.grouped_gemm_bf16_swiglu_gather_mxfp8_out(x, wg, wu, sched, swiglu_limit=limit,
                                                                                num_sms=num_sms)
        _assert_same_bits_nan_aside(got_h, expected[0], f"{what} h")
        for name, (data, scales), (want_data, want_scales) in (("gate", got_gate, expected[1]),
                                                              ("up", got_up, expected[2])):
            assert data.dtype == want_data.dtype and scales.dtype == want_scales.dtype, f"{what} {name}: dtypes"
            assert bitwise_equal(scales, want_scales), f"{what} {name}: scales differ"
            assert bitwise_equal(data, want_data), f"{what} {name}: data differ"
    if extremes:  # the case ran what it is for
        assert (expected[1][1] == 0xFF).any() and (expected[2][1] == 0xFF).any(), f"{case}: no NaN block (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", list(CASES))
def test_gemm2_nt_contiguous_matches_l0(case):
    seed = fresh_seed()
    inputs, sched = _problem(case, seed, block_m=256)  # two kernel tiles per schedule tile
    wd = inputs["w_down"]  # [E, H, I]
    a_rows = torch.randn(sched.num_rows, wd.shape[2], generator=torch.Generator().manual_seed(seed)).to(BF16)
    expected = twins.grouped_gemm_bf16_nt_contiguous(a_rows, wd, sched)
    poison_allocator(2 * sched.num_rows * wd.shape[1] * 2)
    got = ops.grouped_gemm_bf16_nt_contiguous(a_rows.cuda(), wd.cuda(), sched.to("cuda"))
    _assert_close(got, expected, f"{case} out_rows", seed)


CHAIN_CASES = {**{case: CASES[case][0] for case in CASES},
               # enough m-tiles (~260) for every SM to hold tasks of both GEMMs at the hand-over
               "chain-wide": MoEConfig("chain-wide", 4096, 1024, 512, 16, 8)}


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", list(CHAIN_CASES))
def test_chain_is_gemm1_then_gemm2_bit_for_bit(case):
    """GEMM1 and GEMM2 in one launch (GEMM2's tiles waiting on device counters) store the bits of the launches one by
    one; with the combine behind GEMM2, combine_rows' out (weights, a shared expert's rows given); with the shared
    expert's GEMMs in the launch too, the layer's forward: its rows and out. For any grid: 1 CTA (every task in
    turn), 3 and 7 (several tasks per CTA, GEMM2's first tiles beside GEMM1's last) and the full grid. Outputs
    poisoned first; a counter bug shows as a timeout fault, NaN rows or a token's slice left unwritten."""
    seed = fresh_seed()
    cfg = CHAIN_CASES[case]
    inputs = make_inputs(cfg, seed=seed, routing_fn=routing_of(CASES[case][1]) if case in CASES else None)
    sched = make_schedule(inputs["topk_idx"], cfg.num_experts).to("cuda")
    x, wg, wu, wd = (inputs[n].cuda() for n in ("x", "w_gate", "w_up", "w_down"))
    h, gate, up = ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched, swiglu_limit=0.75)
    y_rows = ops.grouped_gemm_bf16_nt_contiguous(h, wd, sched)
    w = inputs["topk_weights"].cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    I_sh = 192  # the shared expert: its own width, weights drawn here
    ws = tuple((torch.randn(*shape, generator=g, device="cuda") / shape[1] ** 0.5).bfloat16()
               for shape in ((I_sh, cfg.hidden), (I_sh, cfg.hidden), (cfg.hidden, I_sh)))
    sh = make_schedule(torch.zeros(cfg.num_tokens, 1, dtype=torch.int64), 1).to("cuda")  # the tokens in order
    h_sh, gate_sh, up_sh = ops.grouped_gemm_bf16_swiglu_gather(x, ws[0][None], ws[1][None], sh, swiglu_limit=0.75)
    shared_rows = (ops.grouped_gemm_bf16_nt_contiguous(h_sh, ws[2][None], sh), h_sh, gate_sh, up_sh)
    external = torch.randn(cfg.num_tokens, cfg.hidden, device="cuda").bfloat16()
    variants = {  # name: (the chain's keywords, the expected out, the expected shared rows)
        "gemms": ({}, None, None),
        "combine": (dict(topk_weights=w, shared=external),
                    ops.combine_rows(y_rows, sched.route_to_row, w, external), None),
        "layer": (dict(topk_weights=w, shared_weights=ws),
                  ops.combine_rows(y_rows, sched.route_to_row, w, shared_rows[0][: cfg.num_tokens]), shared_rows),
    }
    for num_sms, variant in ((1, "layer"), (3, "combine"), (7, "gemms"), (None, "layer"), (None, "combine")):
        kw, want_out, want_shared = variants[variant]
        poison_allocator(2 * sched.num_rows * (3 * cfg.intermediate + cfg.hidden) * 2)
        *got, out, got_shared = ops.grouped_gemm_bf16_chain(x, wg, wu, wd, sched, swiglu_limit=0.75,
                                                            num_sms=num_sms, **kw)
        where = f"{case} {variant} num_sms={num_sms} (seed {seed})"
        for name, a, b in zip(("y_rows", "h", "gate", "up"), got, (y_rows, h, gate, up)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name}: {where}"
        assert (out is None) == (want_out is None) and (got_shared is None) == (want_shared is None), where
        if want_out is not None:
            assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)), f"out: {where}"
        for name, a, b in zip(("y", "h", "gate", "up"), got_shared or (), want_shared or ()):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"shared {name}: {where}"


def _routed_backward_launches(x, wg, wu, wd, w, d_out, sched, precision: str) -> tuple:
    """The routed experts' backward by the launches one by one, as the fused level runs them in `precision`:
    (the chain's arguments dy_rows, x_rows, w_gate, w_up, w_down, gate, up, topk_weights, dy_cols; the launches'
    d_topk_weights or None, [d_w_gate, d_w_up, d_w_down], dx_rows)."""
    _, gate, up = ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched, swiglu_limit=0.75)
    wgrad = ops.grouped_gemm_bf16_weight_grad
    dy_rows = ops.gather_rows_cuda(d_out, sched)
    if precision == "bf16":
        x_rows = ops.gather_rows_cuda(x, sched)
        d_gate, d_up, h, d_tw = ops.grouped_gemm_bf16_dgrad_swiglu_route_grads(dy_rows, wd, gate, up, w, sched,
                                                                               swiglu_limit=0.75)
        want_w = [wgrad(d_gate, x_rows, sched), wgrad(d_up, x_rows, sched), wgrad(dy_rows, h, sched)]
        dx_rows = ops.grouped_gemm_bf16_dgrad_gate_up(d_gate, d_up, wg, wu, sched)
        return (dy_rows, x_rows, wg, wu, wd, gate, up, w, None), d_tw, want_w, dx_rows
    counts = sched.counts  # every operand as fused._experts_backward's mxfp8 path reads it
    gate_mx, up_mx = ops.mxfp8_quantize_rowwise(gate), ops.mxfp8_quantize_rowwise(up)
    dy_k, dy_w = ops.mxfp8_fake_quantize_dual(dy_rows, counts=counts)
    x_rows = ops.mxfp8_fake_quantize_gathered(x, sched)
    wg, wu, wd = (ops.mxfp8_fake_quantize(t, -2) for t in (wg, wu, wd))
    d_gate, d_up, h = ops.grouped_gemm_bf16_dgrad_swiglu_mxfp8(dy_k, wd, gate_mx, up_mx, sched, swiglu_limit=0.75)
    (dg_k, dg_w), (du_k, du_w) = (ops.mxfp8_fake_quantize_dual(t, counts=counts) for t in (d_gate, d_up))
    h_w = ops.mxfp8_fake_quantize(h, -2, counts=counts)
    want_w = [wgrad(dg_w, x_rows, sched), wgrad(du_w, x_rows, sched), wgrad(dy_w, h_w, sched)]
    dx_rows = ops.grouped_gemm_bf16_dgrad_gate_up(dg_k, du_k, wg, wu, sched)
    return (dy_k, x_rows, wg, wu, wd, gate_mx, up_mx, None, dy_w), None, want_w, dx_rows


MX_CHAIN_CASES = [case for case, cfg in CHAIN_CASES.items() if cfg.hidden % 32 == 0 and cfg.intermediate % 32 == 0]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case, precision", [(case, "bf16") for case in CHAIN_CASES]
                         + [(case, "mxfp8") for case in MX_CHAIN_CASES])
def test_chain_backward_is_the_launches_bit_for_bit(case, precision):
    """The expert backward in one launch (the dgrad and SwiGLU backward, in MXFP8 the round trips of d_gate, d_up and
    h, the gate/up dgrad with d_x's combine, the weight gradients, on device counters) stores the bits of the
    launches one by one: the routed experts alone and with a (BF16) shared expert, at grids of 1 CTA, 3, 7 and every
    SM. Outputs poisoned first: a counter bug shows as a timeout fault, a NaN or a tile left unwritten."""
    seed = fresh_seed()
    cfg = CHAIN_CASES[case]
    inputs = make_inputs(cfg, seed=seed, routing_fn=routing_of(CASES[case][1]) if case in CASES else None)
    sched = make_schedule(inputs["topk_idx"], cfg.num_experts).to("cuda")
    x, wg, wu, wd, w = (inputs[n].cuda() for n in ("x", "w_gate", "w_up", "w_down", "topk_weights"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    d_out = torch.randn(cfg.num_tokens, cfg.hidden, generator=g, device="cuda").bfloat16()
    args, d_tw, want_w, dx_rows = _routed_backward_launches(x, wg, wu, wd, w, d_out, sched, precision)
    wgrad = ops.grouped_gemm_bf16_weight_grad
    I_sh = 192  # the shared expert: its own width, weights drawn here
    ws = tuple((torch.randn(*shape, generator=g, device="cuda") / shape[1] ** 0.5).bfloat16()[None]
               for shape in ((I_sh, cfg.hidden), (I_sh, cfg.hidden), (cfg.hidden, I_sh)))
    sh = make_schedule(torch.zeros(cfg.num_tokens, 1, dtype=torch.int64), 1).to("cuda")  # the tokens in order
    _, gate_sh, up_sh = ops.grouped_gemm_bf16_swiglu_gather(x, ws[0], ws[1], sh, swiglu_limit=0.75)
    dy_sh, x_sh = (ops.gather_rows_cuda(t, sh) for t in (d_out, x))
    dg_sh, du_sh, h_sh = ops.grouped_gemm_bf16_dgrad_swiglu(dy_sh, ws[2], gate_sh, up_sh, sh, swiglu_limit=0.75)
    want_w_sh = [wgrad(dg_sh, x_sh, sh), wgrad(du_sh, x_sh, sh), wgrad(dy_sh, h_sh, sh)]
    dx_sh = ops.grouped_gemm_bf16_dgrad_gate_up(dg_sh, du_sh, ws[0], ws[1], sh)[: cfg.num_tokens]
    shared = (dy_sh, x_sh, *ws, gate_sh, up_sh, sh)
    want = {False: ops.combine_rows(dx_rows, sched.route_to_row, None, None),
            True: ops.combine_rows(dx_rows, sched.route_to_row, None, dx_sh)}
    same = lambda a, b: torch.equal(a.view(torch.int16), b.view(torch.int16))  # noqa: E731
    for num_sms, with_shared in ((1, True), (3, False), (7, True), (None, True), (None, False)):
        poison_allocator(2 * sched.num_rows * (5 * cfg.intermediate + 2 * cfg.hidden) * 2)
        d_x, d_topk, d_w, d_w_sh = ops.grouped_gemm_bf16_chain_backward(
            *args[:8], sched, swiglu_limit=0.75, num_sms=num_sms, shared=shared if with_shared else None,
            dy_cols=args[8])
        where = f"{case} {precision} shared={with_shared} num_sms={num_sms} (seed {seed})"
        assert same(d_x, want[with_shared]), f"d_x: {where}"
        assert (d_topk is None) == (d_tw is None), where
        assert d_tw is None or torch.equal(d_topk.view(torch.int32), d_tw.view(torch.int32)), f"d_topk: {where}"
        for name, a, b in zip(("d_w_gate", "d_w_up", "d_w_down"), d_w, want_w):
            assert same(a, b), f"{name}: {where}"
        assert (d_w_sh is None) != with_shared, where
        for name, a, b in zip(("d_w_gate", "d_w_up", "d_w_down"), d_w_sh or (), want_w_sh):
            assert same(a, b), f"shared {name}: {where}"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("case", list(CASES))
def test_dgrad_swiglu_matches_l0(case, limit):
    """Backward of the down projection (W_down read transposed) with SwiGLU's backward in the epilogue, and
    h recomputed there from the saved gate/up."""
    seed = fresh_seed()
    inputs, sched = _problem(case, seed)
    cfg = CASES[case][0]
    b = _backward_operands(sched, cfg.intermediate, cfg.hidden, seed)
    wd = inputs["w_down"]  # [E, H, I]
    expected = twins.grouped_gemm_bf16_dgrad_swiglu(b["dy_rows"], wd, b["gate"], b["up"], sched, limit)
    poison_allocator(2 * 3 * sched.num_rows * cfg.intermediate * 2)
    got = ops.grouped_gemm_bf16_dgrad_swiglu(b["dy_rows"].cuda(), wd.cuda(), b["gate"].cuda(), b["up"].cuda(),
                                             sched.to("cuda"), swiglu_limit=limit)
    for name, a, e in zip(("d_gate", "d_up", "h"), got, expected):
        _assert_close(a, e, f"{case} limit={limit} {name}", seed)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("case", list(CASES))
def test_dgrad_swiglu_route_grads_matches_l0(case, limit):
    """The same from unweighted rows, weighted by route in the SwiGLU backward, with the route gradients (no y):
    d_gate, d_up, w·h as the twin's, and d_topk_weights within the level's tolerance (another fp32 sum order)."""
    seed = fresh_seed()
    inputs, sched = _problem(case, seed)
    cfg = CASES[case][0]
    b = _backward_operands(sched, cfg.intermediate, cfg.hidden, seed)
    wd, weights = inputs["w_down"], inputs["topk_weights"]  # [E, H, I], [T, K]
    expected = twins.grouped_gemm_bf16_dgrad_swiglu_route_grads(b["dy_rows"], wd, b["gate"], b["up"], weights, sched,
                                                                limit)
    poison_allocator(2 * 3 * sched.num_rows * cfg.intermediate * 2)
    got = ops.grouped_gemm_bf16_dgrad_swiglu_route_grads(b["dy_rows"].cuda(), wd.cuda(), b["gate"].cuda(),
                                                         b["up"].cuda(), weights.cuda(), sched.to("cuda"),
                                                         swiglu_limit=limit)
    for name, a, e in zip(("d_gate", "d_up", "h"), got, expected):
        _assert_close(a, e, f"{case} limit={limit} {name}", seed)
    d_topk, d_topk0 = got[3].cpu(), expected[3]
    assert torch.isfinite(d_topk).all(), f"{case}: a route's d_topk_weights unwritten (seed {seed})"
    err = rel_err(d_topk, d_topk0)
    assert err <= TOLERANCES["bf16_vs_l0"], f"{case} limit={limit}: d_topk_weights rel_err {err:.3e} (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("extremes", [False, True], ids=["plain", "extremes"])
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("case", MX_OUT_CASES)
def test_dgrad_swiglu_mxfp8_is_the_bf16_op_on_dequantized_gate_up(case, limit, extremes):
    """The MXFP8 backward's down dgrad, reading the saved MXFP8 gate/up itself, writes the BF16 op's bits on their
    dequantization (d_gate, d_up, h), padding rows included, for two grid sizes. `extremes`: gate/up with NaN
    blocks (an Inf in a row before quantizing: scale 0xFF) and rows scaled by 1e-30 (amaxes under the floor)."""
    seed = fresh_seed()
    inputs, sched = _problem(case, seed)
    cfg = CASES[case][0]
    b = {name: t.cuda() for name, t in _backward_operands(sched, cfg.intermediate, cfg.hidden, seed).items()}
    sched, wd = sched.to("cuda"), inputs["w_down"].cuda()  # [E, H, I]
    if extremes:
        first = int(sched.expert_offsets[0])  # a real row
        b["gate"][first, 0], b["up"][first + 1, 5] = float("inf"), float("inf")
        b["gate"][1::5] *= 1e-30
    gate_mx, up_mx = ops.mxfp8_quantize_rowwise(b["gate"]), ops.mxfp8_quantize_rowwise(b["up"])
    expected = ops.grouped_gemm_bf16_dgrad_swiglu(b["dy_rows"], wd, ops.mxfp8_dequantize(*gate_mx),
                                                  ops.mxfp8_dequantize(*up_mx), sched, swiglu_limit=limit)
    for num_sms in (None, 3):
        poison_allocator(4 * sched.num_rows * cfg.intermediate * 2)
        got = ops.grouped_gemm_bf16_dgrad_swiglu_mxfp8(b["dy_rows"], wd, gate_mx, up_mx, sched, swiglu_limit=limit,
                                                       num_sms=num_sms)
        for name, a, e in zip(("d_gate", "d_up", "h"), got, expected):
            _assert_same_bits_nan_aside(a, e, f"{case} limit={limit} extremes={extremes} num_sms={num_sms} {name} "
                                              f"(seed {seed})")
    if extremes:  # the case ran what it is for
        assert (gate_mx[1] == 0xFF).any() and (up_mx[1] == 0xFF).any(), f"{case}: no NaN block (seed {seed})"


def _every_bf16(rows: int) -> torch.Tensor:
    """All 65,536 bf16 bit patterns as [rows, 65536 / rows], the 256 with exponent 0xFF (Inf, NaN) in the
    last rows: a GEMM row with one of them is NaN in every column, so they must not share rows with the others."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)  # [65536]
    special = (bits.view(torch.uint16).to(torch.int32) & 0x7F80) == 0x7F80  # [65536]
    return torch.cat([bits[~special], bits[special]]).view(BF16).view(rows, -1)


def _swiglu_ieee(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """h as the kernels write it: bf16(g · (1 / (1 + exp(-g))) · u) in fp32, each op IEEE-rounded (torch on the
    GPU), the clamps as L0's. mok.reference.swiglu computes the same with torch.sigmoid, a different rounding."""
    g, u = gate.float(), up.float()
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (g * (1.0 / (1.0 + torch.exp(-g))) * u).to(BF16)


def _assert_same_bits_or_both_nan(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a, e = actual.float(), expected.float()
    same = (actual.view(torch.int16) == expected.view(torch.int16)) | (a.isnan() & e.isnan())
    if not same.all():
        i = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int((~same).sum())} of {same.numel()} elements differ; first at {i}: "
                             f"got {actual[tuple(i)].item()}, want {expected[tuple(i)].item()}")


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("limit", [None, 0.75])
def test_swiglu_bits_for_every_bf16_gate(limit):
    """GEMM1's epilogue and the backward's SwiGLU kernel compute h = swiglu(gate, up) in batches (mok/swiglu.cuh:
    the division's fast path for every element, the batch redone when one needs the slow path). Every bf16
    gate, the slow path's (g < -87, NaN) included, gives IEEE division's bits. GEMM1 makes gate and up exact
    copies of x's columns (0/1 weights); the backward kernel takes gate and up as they are."""
    num_tokens, hidden, inter = 1024, 64, 128
    x = _every_bf16(num_tokens).cuda()  # [T, H]: every pattern once
    n = torch.arange(inter)  # [I]
    w_gate = (torch.arange(hidden) == (n % hidden)[:, None]).to(BF16)[None].cuda()  # [1, I, H]: gate = x[:, n % H]
    w_up = (torch.arange(hidden) == ((7 * n + 3) % hidden)[:, None]).to(BF16)[None].cuda()  # [1, I, H]
    sched = make_schedule(torch.zeros(num_tokens, 1, dtype=torch.int64), 1).to("cuda")
    h, gate, up = ops.grouped_gemm_bf16_swiglu_gather(x, w_gate, w_up, sched, swiglu_limit=limit)
    torch.cuda.synchronize()
    g = gate.float()  # [R, I]
    assert (g < -88).any() and g.isnan().any() and (g > 88).any(), "the gates miss the slow path's inputs"
    _assert_same_bits_or_both_nan(h, _swiglu_ieee(gate, up, limit), f"GEMM1 h, limit {limit}")

    gate = _every_bf16(sched.num_rows).repeat(1, inter // hidden).cuda()  # [R, I]: every pattern twice
    up = torch.randn(sched.num_rows, inter, device="cuda").to(BF16)  # [R, I]
    dy_rows = torch.randn(sched.num_rows, hidden, device="cuda").to(BF16)  # [R, H]
    w_down = torch.randn(1, hidden, inter, device="cuda").to(BF16)  # [1, H, I]
    _, _, h_again = ops.grouped_gemm_bf16_dgrad_swiglu(dy_rows, w_down, gate, up, sched, swiglu_limit=limit)
    torch.cuda.synchronize()
    _assert_same_bits_or_both_nan(h_again, _swiglu_ieee(gate, up, limit), f"backward h, limit {limit}")


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", list(CASES))
def test_dgrad_gate_up_matches_l0(case):
    """Backward of gate/up: one fp32 sum over K = 2·intermediate, W_gate/W_up read transposed."""
    seed = fresh_seed()
    inputs, sched = _problem(case, seed)
    cfg = CASES[case][0]
    b = _backward_operands(sched, cfg.intermediate, cfg.hidden, seed)  # gate/up stand in for d_gate/d_up
    wg, wu = inputs["w_gate"], inputs["w_up"]  # [E, I, H] each
    expected = twins.grouped_gemm_bf16_dgrad_gate_up(b["gate"], b["up"], wg, wu, sched)
    poison_allocator(2 * sched.num_rows * cfg.hidden * 2)
    got = ops.grouped_gemm_bf16_dgrad_gate_up(b["gate"].cuda(), b["up"].cuda(), wg.cuda(), wu.cuda(),
                                              sched.to("cuda"))
    _assert_close(got, expected, f"{case} dx_rows", seed)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("which", ["down", "gate"])
@pytest.mark.parametrize("case", list(CASES))
def test_weight_grad_matches_l0(case, which):
    """k-grouped weight gradients: K = each expert's rows (empty experts get zeros), both operands transposed.
    "down": d_w_down = Σ dyᵀ·h ([H, I]); "gate": d_w_gate = Σ d_gateᵀ·x_rows ([I, H])."""
    seed = fresh_seed()
    _, sched = _problem(case, seed)
    cfg = CASES[case][0]
    b = _backward_operands(sched, cfg.intermediate, cfg.hidden, seed)  # zeros in padding rows
    a_rows, b_rows = (b["dy_rows"], b["gate"]) if which == "down" else (b["gate"], b["dy_rows"])
    expected = twins.grouped_gemm_bf16_weight_grad(a_rows, b_rows, sched)  # [E, m, n]
    poison_allocator(2 * expected.numel() * 2)
    got = ops.grouped_gemm_bf16_weight_grad(a_rows.cuda(), b_rows.cuda(), sched.to("cuda"))
    _assert_close(got, expected, f"{case} d_w_{which}", seed)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", ["tiny-top8", "hot-expert", "two-experts-of-8", "pairs"])
def test_weight_grad_stops_at_the_64_row_block_of_the_real_rows(case):
    """K runs over each expert's real rows rounded up to 64, not over all of its padding: padding rows past that
    block hold NaN here, and the result must not see them (those before it must be zeros: the API's rule)."""
    seed = fresh_seed()
    _, sched = _problem(case, seed)
    cfg = CASES[case][0]
    b = _backward_operands(sched, cfg.intermediate, cfg.hidden, seed)
    a_rows, b_rows = b["gate"], b["dy_rows"]
    expected = twins.grouped_gemm_bf16_weight_grad(a_rows, b_rows, sched)  # the real rows only
    offsets, tokens = sched.expert_offsets.tolist(), sched.tokens_per_expert.tolist()
    poisoned = 0
    for e, n in enumerate(tokens):
        past = offsets[e] + -(-n // 64) * 64  # the first row past the 64-row block of the real rows
        a_rows[past:offsets[e + 1]] = float("nan")
        b_rows[past:offsets[e + 1]] = float("nan")
        poisoned += offsets[e + 1] - past
    assert poisoned, f"{case}: no expert has a whole 64-row block of padding (seed {seed})"
    got = ops.grouped_gemm_bf16_weight_grad(a_rows.cuda(), b_rows.cuda(), sched.to("cuda"))
    _assert_close(got, expected, f"{case} d_w_gate", seed)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", ["tiny-top8", "hot-expert", "deep-k"])
def test_gemms_bitwise_repeatable_for_any_grid_size(case):
    """DESIGN §5: same bits run to run and whatever the persistent grid size."""
    seed = fresh_seed()
    inputs, sched = _problem(case, seed)
    sched = sched.to("cuda")
    runs = [(num_sms, _every_kind(inputs, sched, num_sms, f"{case} (seed {seed})"))
            for num_sms in (None, None, 1, 3, 7)]
    for num_sms, outs in runs[1:]:
        for name, a in runs[0][1].items():
            assert torch.equal(a, outs[name]), f"{case} {name}: bits differ with num_sms={num_sms} (seed {seed})"


def _every_kind(inputs: dict, sched, num_sms, what: str) -> dict[str, torch.Tensor]:
    """Every GEMM kind once, chained as the level chains them, on poisoned outputs: name -> bits (bytes, CPU)."""
    x, wg, wu, wd = (inputs[n].cuda() for n in ("x", "w_gate", "w_up", "w_down"))
    poison_allocator(2 * 4 * sched.num_rows * max(wg.shape[1], wd.shape[1]) * 2)
    h, gate, up = ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched, swiglu_limit=1.5, num_sms=num_sms)
    y_rows = ops.grouped_gemm_bf16_nt_contiguous(h, wd, sched, num_sms=num_sms)
    d_gate, d_up, h_again = ops.grouped_gemm_bf16_dgrad_swiglu(y_rows, wd, gate, up, sched, 1.5, num_sms=num_sms)
    # the backward's h is the forward's, bit for bit (one device function): d_w_down sees what GEMM2 saw
    assert bitwise_equal(h_again, h), f"{what}: h recomputed after the dgrad differs"
    dx_rows = ops.grouped_gemm_bf16_dgrad_gate_up(d_gate, d_up, wg, wu, sched, num_sms=num_sms)
    d_w_down = ops.grouped_gemm_bf16_weight_grad(y_rows, h, sched, num_sms=num_sms)
    routed = ops.grouped_gemm_bf16_dgrad_swiglu_route_grads(y_rows, wd, gate, up, inputs["topk_weights"].cuda(),
                                                            sched, 1.5, num_sms=num_sms)
    outs = {"h": h, "gate": gate, "up": up, "y_rows": y_rows, "d_gate": d_gate, "d_up": d_up, "dx_rows": dx_rows,
            "d_w_down": d_w_down, **dict(zip(("routed_d_gate", "routed_d_up", "routed_h", "d_topk"), routed))}
    if wg.shape[1] % ops.BLOCK_SIZE == 0:  # the MXFP8 forward's GEMM1 (row-wise blocks of intermediate)
        h_mx, gate_mx, up_mx = ops.grouped_gemm_bf16_swiglu_gather_mxfp8_out(x, wg, wu, sched, swiglu_limit=1.5,
                                                                             num_sms=num_sms)
        outs.update(h_mx=h_mx, gate_mx=gate_mx[0], gate_mx_scales=gate_mx[1], up_mx=up_mx[0], up_mx_scales=up_mx[1])
        mx_grads = ops.grouped_gemm_bf16_dgrad_swiglu_mxfp8(y_rows, wd, gate_mx, up_mx, sched, 1.5, num_sms=num_sms)
        outs.update(zip(("d_gate_from_mx", "d_up_from_mx", "h_from_mx"), mx_grads))
    return {name: t.cpu().view(torch.uint8) for name, t in outs.items()}


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", ["deep-k", "tiny-top1", "hot-expert", "pairs", "short-tails", "wide-tails"])
def test_gemm_epilogue_edges_store_the_same_bits_on_any_grid(case):
    """Epilogue edges of the TMA stores: n = 200, 520 (boxes cut by the map), 32 and 192 (a box skipped);
    kWeightGrad's m = 520, 200, 32, 192 (rows past m clipped, whole warps skipped); num_sms = 3: several tasks
    per CTA, so staging boxes are rewritten while the previous task's stores may still read them. Every kind stores
    the same bits as on the full grid."""
    seed = fresh_seed()
    inputs, sched = _problem(case, seed)
    sched = sched.to("cuda")
    expected = _every_kind(inputs, sched, None, f"{case} full grid (seed {seed})")
    got = _every_kind(inputs, sched, 3, f"{case} num_sms=3 (seed {seed})")
    for name, a in expected.items():
        assert torch.equal(a, got[name]), f"{case} {name}: num_sms=3 changes bits (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
def test_gemm_launches_overlapping_on_two_streams_store_their_own_bits():
    """GEMM2 launched eight times over two streams, all queued behind one gate so that each stream's launches start
    together with the other's, each on half the SMs, stores what one launch alone stores, every time: launches
    share no device state."""
    seed = fresh_seed()
    cfg = MoEConfig("two-streams", 4096, 1024, 512, 16, 4)
    inputs = make_inputs(cfg, seed=seed)
    sched = make_schedule(inputs["topk_idx"], cfg.num_experts).to("cuda")
    g = torch.Generator().manual_seed(seed)
    a_rows = torch.randn(sched.num_rows, cfg.intermediate, generator=g).to(BF16).cuda()  # [R, I]
    w = inputs["w_down"].cuda()  # [E, H, I]
    half = torch.cuda.get_device_properties(0).multi_processor_count // 2
    sched.gemm_tensors = ops.gemm_schedule_tensors(sched, "cuda")  # made once: no allocation in the launches below
    expected = ops.grouped_gemm_bf16_nt_contiguous(a_rows, w, sched, num_sms=half)
    streams = [torch.cuda.Stream() for _ in range(2)]
    nbytes = sched.num_rows * cfg.hidden * 2
    for stream in streams:  # four poisoned blocks cached per stream: the outputs reuse them, no cudaMalloc below
        with torch.cuda.stream(stream):
            blocks = [torch.full((nbytes,), 0xFF, dtype=torch.uint8, device="cuda") for _ in range(4)]
            del blocks
    # both streams wait behind a spinning kernel, so all eight launches are queued before any runs: the first of
    # each stream then start together, on half the SMs each
    gate, ready = torch.cuda.Stream(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(gate):
        torch.cuda._sleep(100_000_000)  # ~60 ms of clocks
        ready.record(gate)
    for stream in streams:
        stream.wait_event(ready)
    outs = []
    for _ in range(4):
        for stream in streams:
            with torch.cuda.stream(stream):
                outs.append(ops.grouped_gemm_bf16_nt_contiguous(a_rows, w, sched, num_sms=half))
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert torch.equal(out, expected), f"launch {i} (stream {i % 2}) differs from one launch alone (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
def test_gemm_launch_replays_from_a_cuda_graph():
    """GEMM2 captured in a CUDA graph replays to one eager launch's bits, twice."""
    seed = fresh_seed()
    inputs, sched = _problem("deep-k", seed)
    sched = sched.to("cuda")
    cfg = CASES["deep-k"][0]
    a_rows = torch.randn(sched.num_rows, cfg.intermediate, generator=torch.Generator().manual_seed(seed))
    a_rows, w = a_rows.to(BF16).cuda(), inputs["w_down"].cuda()
    expected = ops.grouped_gemm_bf16_nt_contiguous(a_rows, w, sched)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = ops.grouped_gemm_bf16_nt_contiguous(a_rows, w, sched)
    for replay in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected), f"replay {replay} differs from the eager launch (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_gemm1_then_gemm2_match_l0_moe_forward(shape, limit):
    """The routed experts' forward through both kernels equals L0's saved gate/up and per-route y."""
    seed = fresh_seed()
    inputs = make_inputs(TINY_SHAPES[shape], seed=seed)
    _, saved = moe_forward(inputs["x"], inputs["topk_idx"], inputs["topk_weights"], inputs["w_gate"],
                           inputs["w_up"], inputs["w_down"], swiglu_limit=limit)
    sched = make_schedule(inputs["topk_idx"].cuda(), TINY_SHAPES[shape].num_experts)
    x, wg, wu, wd = (inputs[n].cuda() for n in ("x", "w_gate", "w_up", "w_down"))
    h, gate, up = ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched, swiglu_limit=limit)
    y = scatter_routes(ops.grouped_gemm_bf16_nt_contiguous(h, wd, sched), sched)  # [T, K, H]
    route_rows = sched.route_to_row.reshape(-1)  # [T·K]
    _assert_close(gate[route_rows], saved.gate, f"{shape} gate", seed)
    _assert_close(up[route_rows], saved.up, f"{shape} up", seed)
    _assert_close(y, saved.y, f"{shape} y", seed)
