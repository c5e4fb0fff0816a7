"""CUDA graphs (DESIGN §9): a forward+backward of mok.moe and of mok.MoE captured once and replayed gives eager's
bits, in both precisions and inside mxfp8_weight_cache; expert ids outside [0, E) met in a replay raise at the next
eager call or at mok.check_errors(), never by a host query during capture. GPU only."""

from __future__ import annotations

import contextlib

import pytest
import torch

import mok
from mok.config import TINY_SHAPES
from mok.testing import bitwise_equal, fresh_seed, make_inputs, moe_args

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]
CFG = TINY_SHAPES["tiny"]


def _step(args, d_out, precision):
    """One forward+backward of mok.moe on the fused level: (out, grads), the grads by autograd.grad."""
    out = mok.moe(*args, backend="fused", precision=precision)
    leaves = [a for a in args if a is not None and a.requires_grad]
    return (out, *torch.autograd.grad(out, leaves, d_out))


def _captured(fn, warmups: int = 2):
    """fn captured in a CUDA graph after warm-up calls on a side stream (torch's recipe): (graph, its outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_captured_step_replays_eagers_bits(precision, cached):
    if cached and precision == "bf16":
        pytest.skip("the weight cache holds mxfp8 round trips only")
    inputs = make_inputs(CFG, device="cuda", seed=fresh_seed(), draw_on="cuda")
    args = [a.clone().requires_grad_() if a is not None and a.is_floating_point() else a for a in moe_args(inputs)]
    with mok.mxfp8_weight_cache() if cached else contextlib.nullcontext():
        eager = [t.detach().clone() for t in _step(args, inputs["d_out"], precision)]  # no eager graph kept alive
        graph, outs = _captured(lambda: _step(args, inputs["d_out"], precision))
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            assert all(bitwise_equal(a, b) for a, b in zip(outs, eager))
    mok.check_errors()  # clean ids: nothing to raise


def test_module_step_with_its_router_replays():
    torch.manual_seed(0)
    layer = mok.MoE(64, 96, num_experts=4, num_topk=2, shared_intermediate=64, backend="fused", device="cuda")
    x = torch.randn(37, 64, device="cuda").bfloat16().requires_grad_()

    def step():
        out = layer(x)
        return (out, *torch.autograd.grad(out, [x, *layer.parameters()], torch.ones_like(out)))

    eager = [t.detach().clone() for t in step()]
    graph, outs = _captured(step)
    graph.replay()
    torch.cuda.synchronize()
    assert all(bitwise_equal(a, b) for a, b in zip(outs, eager))


def test_bad_ids_in_a_replay_raise_at_check_errors():
    inputs = make_inputs(CFG, device="cuda", seed=fresh_seed(), draw_on="cuda")
    args = list(moe_args(inputs))
    idx = args[1]
    graph, _ = _captured(lambda: mok.moe(*args, backend="fused"))
    idx[0, 0] = CFG.num_experts  # out of range, written into the captured input: the replay sees it
    graph.replay()
    with pytest.raises(ValueError, match="topk_idx: expected expert ids"):
        mok.check_errors()
    mok.check_errors()  # raised once, then reset


@pytest.mark.parametrize("backend,check", [("torch", False), ("reference", False), ("fused", True)])
def test_a_capture_of_a_level_that_reads_the_device_raises_and_leaves_cuda_usable(backend, check):
    inputs = make_inputs(CFG, device="cuda", seed=fresh_seed(), draw_on="cuda")
    args = list(moe_args(inputs))
    mok.moe(*args, backend=backend)  # warm, outside the capture
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="inside a CUDA graph capture"):
        _captured(lambda: mok.moe(*args, backend=backend, check=check), warmups=0)
    out = mok.moe(*args, backend="fused")  # the context still works
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
