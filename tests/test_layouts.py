"""mok.layouts: a fused w_gate_up [E, 2I, H] in Hugging Face's (concat) or SonicMoE's (interleaved) convention, split
for mok and back; gradients land in the fused weight's own layout; mok.MoE(gate_up_layout=...) holds one."""

import pytest
import torch

import mok
from mok.config import TINY_SHAPES
from mok.testing import bitwise_equal, fresh_seed, make_inputs, moe_args

CFG = TINY_SHAPES["tiny"]


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_split_then_join_is_the_identity_and_rows_land_where_named(layout):
    w = torch.randn(3, 2 * 5, 8).bfloat16()  # [E, 2I, H]
    gate, up = mok.split_gate_up(w, layout)
    assert gate.shape == up.shape == (3, 5, 8) and gate.is_contiguous() and up.is_contiguous()
    first_up_row = 5 if layout == "concat" else 1  # where up's row 0 sits in w_gate_up
    assert torch.equal(gate[:, 0], w[:, 0]) and torch.equal(up[:, 0], w[:, first_up_row])
    assert torch.equal(mok.join_gate_up(gate, up, layout), w)


@pytest.mark.parametrize("bad, match", [(("concat", torch.zeros(2, 5, 4)), "w_gate_up: expected a tensor"),
                                       (("rows", torch.zeros(2, 6, 4)), "layout: expected one of")])
def test_bad_layouts_are_named(bad, match):
    layout, w = bad
    with pytest.raises(ValueError, match=match):
        mok.split_gate_up(w, layout)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_moe_on_a_split_weight_gives_the_separate_weights_bits(backend, layout):
    """out and every gradient as with separate weights; d_w_gate_up is (d_w_gate, d_w_up) joined in its layout."""
    inputs = make_inputs(CFG, seed=fresh_seed())
    args = [a.clone().requires_grad_() if a is not None and a.is_floating_point() else a for a in moe_args(inputs)]
    out = mok.moe(*args, backend=backend)
    out.backward(inputs["d_out"])
    fused = mok.join_gate_up(inputs["w_gate"], inputs["w_up"], layout).requires_grad_()
    args2 = [a.detach().clone().requires_grad_() if a is not None and a.is_floating_point() else a
             for a in moe_args(inputs)]
    args2[3:5] = mok.split_gate_up(fused, layout)
    out2 = mok.moe(*args2, backend=backend)
    out2.backward(inputs["d_out"])
    assert bitwise_equal(out, out2)
    assert bitwise_equal(fused.grad, mok.join_gate_up(args[3].grad, args[4].grad, layout))
    assert bitwise_equal(args2[0].grad, args[0].grad) and bitwise_equal(args2[5].grad, args[5].grad)


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_module_holds_one_fused_weight(layout):
    torch.manual_seed(0)
    plain = mok.MoE(64, 96, num_experts=4, num_topk=2, shared_intermediate=32, backend="torch")
    fused = mok.MoE(64, 96, num_experts=4, num_topk=2, shared_intermediate=32, backend="torch", gate_up_layout=layout)
    assert not hasattr(fused, "w_gate") and fused.w_gate_up.shape == (4, 192, 64) and "gate_up_layout" in repr(fused)
    with torch.no_grad():
        for name, p in fused.named_parameters():
            p.copy_(mok.join_gate_up(plain.w_gate, plain.w_up, layout) if name == "w_gate_up"
                    else getattr(plain, name))
    x = torch.randn(2, 19, 64).bfloat16()
    out, out_fused = plain(x), fused(x)
    out.sum().backward(), out_fused.sum().backward()
    assert bitwise_equal(out, out_fused)
    assert bitwise_equal(fused.w_gate_up.grad, mok.join_gate_up(plain.w_gate.grad, plain.w_up.grad, layout))
    with pytest.raises(ValueError, match="gate_up_layout: expected None"):
        mok.MoE(64, 96, 4, 2, gate_up_layout="halves")
