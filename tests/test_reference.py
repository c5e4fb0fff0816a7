"""L0 `reference` against an independent fp64 evaluation (autograd for the gradients), plus the
properties the spec promises: routed/shared structure, limits, empty experts, determinism."""

import pytest
import torch

from mok import reference as L0
from mok.config import TINY_SHAPES, MoEConfig
from mok.routing import hot_expert_routing
from mok.testing import GRAD_NAMES, TOLERANCES, bitwise_equal, fp64_moe, make_inputs, moe_args, rel_err, run_level

# Grid: every tiny shape covers one irregularity (T not a tile multiple, K = 1, K = 8, no shared);
# the limit is chosen so that a good share of gate/up values are clamped on N(0,1) inputs.
SHAPES = list(TINY_SHAPES.values())
LIMITS = [None, 0.5]


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: c.name)
@pytest.mark.parametrize("limit", LIMITS)
def test_forward_and_grads_match_fp64(cfg, limit):
    inputs = make_inputs(cfg, seed=11)
    out, grads = run_level(L0, inputs, swiglu_limit=limit)
    out64, grads64 = fp64_moe(inputs, limit)
    assert out.dtype == torch.bfloat16 and out.shape == inputs["x"].shape
    tol = TOLERANCES["l0_vs_fp64" if limit is None else "l0_vs_fp64_limit"]
    assert rel_err(out, out64) < TOLERANCES["l0_vs_fp64"]
    for name, g, g64 in zip(GRAD_NAMES, grads, grads64):
        if g64 is None:
            assert g is None, name
            continue
        assert g.shape == g64.shape, name
        assert g64.abs().sum() > 0, f"{name}: the fp64 gradient is all zero, the test would be vacuous"
        assert rel_err(g, g64) < tol, name


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: c.name)
def test_mxfp8_close_to_bf16(cfg):
    inputs = make_inputs(cfg, seed=3)
    out_bf, grads_bf = run_level(L0, inputs, precision="bf16")
    out_mx, grads_mx = run_level(L0, inputs, precision="mxfp8")
    assert not bitwise_equal(out_mx, out_bf), "mxfp8 must actually quantize"
    assert rel_err(out_mx, out_bf) < TOLERANCES["mxfp8_vs_l0_bf16"]
    for name, g_mx, g_bf in zip(GRAD_NAMES, grads_mx, grads_bf):
        if g_bf is not None:
            assert rel_err(g_mx, g_bf) < TOLERANCES["mxfp8_vs_l0_bf16"], name


def test_shared_expert_is_bf16_in_mxfp8_mode():
    """Shared-expert gradients do not depend on the routed precision: they stay BF16 (DESIGN §4)."""
    cfg = TINY_SHAPES["tiny"]
    inputs = make_inputs(cfg, seed=5)
    _, g_bf = run_level(L0, inputs, precision="bf16")
    _, g_mx = run_level(L0, inputs, precision="mxfp8")
    for i in (5, 6):  # d_w_shared_gate, d_w_shared_up: functions of x and d_out only
        assert bitwise_equal(g_bf[i], g_mx[i]), GRAD_NAMES[i]


def test_empty_and_hot_experts():
    cfg = MoEConfig("hot", 45, 64, 32, 6, 2)  # expert 0 in every token, experts 4 and 5 in none
    inputs = make_inputs(cfg, seed=2, routing_fn=lambda T, E, K, g: hot_expert_routing(T, E - 2, K, generator=g))
    counts = torch.bincount(inputs["topk_idx"].flatten(), minlength=6)
    assert (counts == 0).any(), "the routing must leave an expert empty for this test"
    out, grads = run_level(L0, inputs)
    out64, grads64 = fp64_moe(inputs, None)
    assert rel_err(out, out64) < TOLERANCES["l0_vs_fp64"]
    d_w_gate = grads[2]
    for e in torch.nonzero(counts == 0).flatten().tolist():
        assert d_w_gate[e].abs().sum() == 0, "an expert without tokens has a zero weight gradient"
    assert rel_err(d_w_gate, grads64[2]) < TOLERANCES["l0_vs_fp64"]


def test_limit_clamps_and_zeroes_gradients():
    g = torch.tensor([-3.0, 0.2, 0.5, 2.0])
    u = torch.tensor([4.0, -0.3, -0.5, 0.1])
    h = L0.swiglu(g, u, limit=0.5)
    assert torch.allclose(h, torch.nn.functional.silu(g.clamp(max=0.5)) * u.clamp(-0.5, 0.5))
    d_gate, d_up = L0.swiglu_backward(g, u, torch.ones(4), limit=0.5)
    assert d_gate[3] == 0 and d_gate[:3].ne(0).all()  # g = 2.0 > L clamped; g = L passes (torch.clamp)
    assert d_up[0] == 0 and d_up[1:].ne(0).all()  # u = 4.0 clamped; u = -L passes


def test_combine_sums_in_increasing_k():
    """Summation order is part of the spec: a case where fp32 order changes the result."""
    y = torch.tensor([[[1.0], [2.0**-24], [2.0**-24]]], dtype=torch.bfloat16)  # [1, 3, 1]
    w = torch.ones(1, 3)
    out = L0.combine(y, w, shared=None)
    acc = torch.zeros(1, dtype=torch.float32)
    for k in range(3):
        acc += y[0, k].float()
    assert out.item() == acc.to(torch.bfloat16).item()


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_repeat_runs_are_bitwise_identical(precision):
    cfg = TINY_SHAPES["tiny-top8"]
    a = run_level(L0, make_inputs(cfg, seed=9), precision=precision, swiglu_limit=1.0)
    b = run_level(L0, make_inputs(cfg, seed=9), precision=precision, swiglu_limit=1.0)
    assert bitwise_equal(a[0], b[0])
    assert all(bitwise_equal(x, y) for x, y in zip(a[1], b[1]))


def test_forward_is_routing_equivariant():
    """Permuting tokens permutes the output: no cross-token leakage in dispatch or combine."""
    cfg = TINY_SHAPES["tiny-noshared"]
    inputs = make_inputs(cfg, seed=4)
    perm = torch.randperm(cfg.num_tokens, generator=torch.Generator().manual_seed(0))
    permuted = dict(inputs, x=inputs["x"][perm], topk_idx=inputs["topk_idx"][perm],
                    topk_weights=inputs["topk_weights"][perm])
    out, _ = L0.forward(*moe_args(inputs))
    out_p, _ = L0.forward(*moe_args(permuted))
    assert bitwise_equal(out[perm], out_p)
