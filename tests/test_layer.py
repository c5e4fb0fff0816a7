"""The user-facing API: `mok.moe` (autograd) and `mok.MoE`, backend resolution, bad input."""

from types import SimpleNamespace

import pytest
import torch

import mok
from mok import fused, library, torch_native
from mok import reference as L0
from mok.config import TINY_SHAPES
from mok.testing import GRAD_NAMES, bitwise_equal, make_inputs, moe_args, run_level

CFG = TINY_SHAPES["tiny"]


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_autograd_returns_the_level_gradients(backend):
    inputs = make_inputs(CFG, seed=1)
    args = [a.clone().requires_grad_() if a.is_floating_point() else a for a in moe_args(inputs)]
    out = mok.moe(*args, swiglu_limit=1.5, backend=backend)
    out.backward(inputs["d_out"])
    ref_out, ref_grads = run_level(mok.layer.get_level(backend), inputs, swiglu_limit=1.5)
    assert bitwise_equal(out.detach(), ref_out)
    grads = [args[0].grad, args[2].grad, *(a.grad for a in args[3:])]
    for name, g, r in zip(GRAD_NAMES, grads, ref_grads):
        assert bitwise_equal(g, r), name


def test_module_forward_backward_and_router_gradient():
    torch.manual_seed(0)
    layer = mok.MoE(64, 96, num_experts=4, num_topk=2, shared_intermediate=32, backend="reference")
    x = torch.randn(3, 7, 64).to(torch.bfloat16).requires_grad_()
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name  # the router too, via topk_weights
    assert x.grad.abs().sum() > 0


def test_module_route_tile_rounds_the_routers_choice(monkeypatch):
    torch.manual_seed(1)
    layer = mok.MoE(32, 48, num_experts=8, num_topk=2, backend="reference", route_tile=16)
    x = torch.randn(96, 32).to(torch.bfloat16)  # 192 routes: 24 per expert on average
    seen, moe = {}, mok.layer.moe
    monkeypatch.setattr(mok.layer, "moe", lambda x, idx, w, *a, **k: seen.update(idx=idx, w=w) or moe(x, idx, w,
                                                                                                      *a, **k))
    layer(x)
    assert bool((torch.bincount(seen["idx"].view(-1), minlength=8) % 16 == 0).all())
    torch.testing.assert_close(seen["w"].sum(-1), torch.ones(96))
    logits = x.float() @ layer.w_router.T
    assert torch.equal(seen["idx"], mok.routing.softmax_topk(logits, 2, tile=16)[0])


def test_auto_backend_runs_on_cpu():
    inputs = make_inputs(CFG, seed=2)
    out = mok.moe(*moe_args(inputs))  # auto: the deepest level available here
    ref, _ = L0.forward(*moe_args(inputs))
    assert mok.testing.rel_err(out, ref) < 1e-2


def test_unknown_or_unbuilt_backend(monkeypatch):
    inputs = make_inputs(CFG, seed=2)
    with pytest.raises(ValueError, match="backend"):
        mok.moe(*moe_args(inputs), backend="cuda-magic")
    monkeypatch.setitem(mok.levels.LEVELS, "future", "mok.future_level")  # a level named but not written
    with pytest.raises(NotImplementedError, match="not built"):
        mok.moe(*moe_args(inputs), backend="future")


def _bad(**changes):
    inputs = make_inputs(CFG, seed=3)
    inputs.pop("d_out")
    kwargs = {"precision": changes.pop("precision", "bf16"), "swiglu_limit": changes.pop("swiglu_limit", None)}
    for name, fn in changes.items():
        inputs[name] = fn(inputs[name])
    return inputs, kwargs


# Each case names the argument the error must name.
BAD_INPUTS = {
    "x-dtype": ("x", dict(x=lambda t: t.float())),
    "x-3d": ("x", dict(x=lambda t: t[None])),
    "x-noncontig": ("x", dict(x=lambda t: t.T.contiguous().T)),
    "idx-dtype": ("topk_idx", dict(topk_idx=lambda t: t.int())),
    "idx-range": ("topk_idx", dict(topk_idx=lambda t: t + CFG.num_experts - 1)),
    "idx-negative": ("topk_idx", dict(topk_idx=lambda t: t - CFG.num_experts)),
    "idx-tokens": ("topk_idx", dict(topk_idx=lambda t: t[:-1])),
    "weights-dtype": ("topk_weights", dict(topk_weights=lambda t: t.bfloat16())),
    "weights-shape": ("topk_weights", dict(topk_weights=lambda t: t[:, :1].contiguous())),
    "w_up-shape": ("w_up", dict(w_up=lambda t: t[:-1])),
    "w_down-layout": ("w_down", dict(w_down=lambda t: t.transpose(1, 2).contiguous())),
    "w_gate-dtype": ("w_gate", dict(w_gate=lambda t: t.half())),
    "shared-partial": ("w_shared", dict(w_shared_up=lambda t: None)),
    "shared-shape": ("w_shared_down", dict(w_shared_down=lambda t: t[:, 1:].contiguous())),
    "precision": ("precision", dict(precision="fp4")),
    "limit": ("swiglu_limit", dict(swiglu_limit=-1.0)),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=str)
def test_bad_input_names_the_argument(case):
    name, changes = BAD_INPUTS[case]
    inputs, kwargs = _bad(**changes)
    with pytest.raises(ValueError, match=name):
        mok.moe(**inputs, **kwargs, backend="reference")


def test_mxfp8_needs_block_multiples():
    cfg = CFG.scaled(intermediate=48)
    inputs = make_inputs(cfg, seed=1)
    inputs.pop("d_out")
    with pytest.raises(ValueError, match="intermediate"):
        mok.moe(**inputs, precision="mxfp8", backend="reference")


def test_device_mismatch_is_named():
    inputs = make_inputs(CFG, seed=1)
    inputs.pop("d_out")
    inputs["w_up"] = inputs["w_up"].to("meta")
    with pytest.raises(ValueError, match="w_up"):
        mok.moe(**inputs, backend="reference")


@pytest.mark.parametrize("option,value,takers", [("num_sms", 8, "'fused', 'megakernel'"),
                                                ("mx_weights", "mainloop", "'fused'")])
def test_fused_options_are_refused_by_levels_without_them(option, value, takers):
    """num_sms and mx_weights are the Hopper levels' options: given to another level, a clear error, not ignored."""
    inputs = make_inputs(CFG, seed=2)
    with pytest.raises(ValueError, match=rf"{option}: expected None for backend 'torch' \(levels that take it: "
                                         rf"\[{takers}\]\), got"):
        mok.moe(*moe_args(inputs), backend="torch", **{option: value})
    assert mok.MoE(64, 96, 4, 2, backend="torch").num_sms is None  # unset: the level's default


@pytest.mark.parametrize("kwargs,match", [({"num_sms": 0}, "num_sms: expected None"),
                                          ({"num_sms": True}, "num_sms: expected None"),
                                          ({"mx_weights": "registers"}, "mx_weights: expected one of")])
def test_fused_options_are_checked_before_any_kernel(kwargs, match):
    """Bad option values name the argument on any machine: they are checked before the level needs a GPU."""
    inputs = make_inputs(CFG, seed=3)
    with pytest.raises(ValueError, match=match):
        fused.forward(*moe_args(inputs), **kwargs)


# ---- the autograd contract: version checks, retain_graph, no silent double backward ------------------

def _leaf_args(seed=1):
    inputs = make_inputs(CFG, seed=seed)
    return inputs, [a.clone().requires_grad_() if a.is_floating_point() else a for a in moe_args(inputs)]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("position,name", [(0, "x"), (2, "topk_weights"), (3, "w_gate"), (8, "w_shared_down")])
def test_input_modified_in_place_after_forward_raises(backend, position, name):
    inputs, args = _leaf_args()
    out = mok.moe(*args, backend=backend)
    with torch.no_grad():
        args[position].mul_(2)  # e.g. an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(inputs["d_out"])


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_retain_graph_backward_twice_gives_the_same_gradients(backend):
    inputs, args = _leaf_args()
    out = mok.moe(*args, swiglu_limit=1.5, backend=backend)
    grads = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    first = torch.autograd.grad(out, grads, inputs["d_out"], retain_graph=True)
    second = torch.autograd.grad(out, grads, inputs["d_out"], retain_graph=True)
    for a, b in zip(first, second):
        assert bitwise_equal(a, b)
    out.backward(inputs["d_out"], retain_graph=True)
    out.backward(inputs["d_out"])
    for p, g in zip(grads, first):
        assert bitwise_equal(p.grad, g * 2)  # bf16/fp32: doubling is exact
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward(inputs["d_out"])  # the saved tensors were freed by the last backward


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("d_out_requires_grad", [False, True])
def test_double_backward_raises(backend, d_out_requires_grad):
    """create_graph=True gives the first-order gradients; differentiating them raises instead of returning
    wrong (or, when d_out is a constant, silently missing) second derivatives."""
    inputs, args = _leaf_args()
    out = mok.moe(*args, backend=backend)
    d_out = inputs["d_out"].clone().requires_grad_(d_out_requires_grad)
    d_x, d_w_gate = torch.autograd.grad(out, (args[0], args[3]), d_out, create_graph=True)
    ref = torch.autograd.grad(mok.moe(*args, backend=backend), (args[0], args[3]), inputs["d_out"])
    assert bitwise_equal(d_x.detach(), ref[0]) and bitwise_equal(d_w_gate.detach(), ref[1])
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(d_x.float().square().sum() + d_w_gate.float().sum(), args[3])


def test_module_double_backward_raises():
    """The router (its own op) and the experts: a create_graph=True backward, then differentiating it raises."""
    torch.manual_seed(0)
    layer = mok.MoE(64, 96, num_experts=4, num_topk=2, backend="reference")
    x = torch.randn(5, 64).bfloat16().requires_grad_()
    out = layer(x)
    (d_x,) = torch.autograd.grad(out, x, torch.ones_like(out), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(d_x.float().square().sum(), layer.w_router)


# ---- mok.MoE: dtypes, arguments, small batches --------------------------------------------------------

def _module(**kwargs):
    torch.manual_seed(0)
    return mok.MoE(64, 96, num_experts=4, num_topk=2, shared_intermediate=32, **{"backend": "reference", **kwargs})


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_module_fp32_master_weights_match_the_bf16_module(backend):
    """.float() (fp32 master weights) casts to bf16 at the call: the same bits out, the bf16 gradients in fp32."""
    layer = _module(backend=backend)
    master = _module(backend=backend).float()
    assert all(p.dtype == torch.float32 for p in master.parameters())
    x = torch.randn(2, 9, 64).to(torch.bfloat16)
    d_out = torch.randn(2, 9, 64).to(torch.bfloat16)
    outs = [m(x) for m in (layer, master)]
    assert outs[1].dtype == torch.bfloat16 and bitwise_equal(outs[0], outs[1])
    for out in outs:
        out.backward(d_out)
    for (name, p), q in zip(layer.named_parameters(), master.parameters()):
        assert q.grad.dtype == torch.float32 and bitwise_equal(q.grad, p.grad.float()), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_module_follows_to_dtype(dtype):
    """.to(dtype) used to break the router (fp32 x @ bf16 w_router); the output comes back in x's dtype."""
    layer = _module().to(dtype)
    x = torch.randn(5, 64).to(dtype).requires_grad_()
    y = layer(x)
    assert y.dtype == dtype and y.shape == x.shape
    y.float().square().sum().backward()
    assert x.grad.dtype == dtype
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.dtype == dtype and p.grad.abs().sum() > 0, name


BAD_MODULE_ARGS = {
    "hidden": ((0, 96, 4, 2), {}, ValueError),
    "intermediate": ((64, -1, 4, 2), {}, ValueError),
    "num_experts": ((64, 96, 2.0, 2), {}, TypeError),
    "num_topk": ((64, 96, 4, 5), {}, ValueError),
    "shared_intermediate": ((64, 96, 4, 2, -32), {}, ValueError),
    "precision": ((64, 96, 4, 2), {"precision": "fp8"}, ValueError),
    "swiglu_limit": ((64, 96, 4, 2), {"swiglu_limit": 0.0}, ValueError),
    "backend": ((64, 96, 4, 2), {"backend": "cuda"}, ValueError),
    "route_tile": ((64, 96, 4, 2), {"route_tile": 0}, ValueError),
}


@pytest.mark.parametrize("name", BAD_MODULE_ARGS)
def test_module_checks_its_arguments_at_construction(name):
    args, kwargs, error = BAD_MODULE_ARGS[name]
    with pytest.raises(error, match=rf"^{name}: expected"):
        mok.MoE(*args, **kwargs)


def test_module_repr_and_wrong_hidden_size():
    layer = _module(route_tile=16)
    assert repr(layer) == ("MoE(hidden=64, intermediate=96, num_experts=4, num_topk=2, shared_intermediate=32, "
                           "precision='bf16', backend='reference', route_tile=16)")
    with pytest.raises(ValueError, match=r"x: expected a tensor \[\.\.\., hidden=64\], got \[3, 48\]"):
        layer(torch.randn(3, 48).to(torch.bfloat16))


def test_module_route_tile_falls_back_to_top_k_on_small_batches(monkeypatch):
    """Fewer than route_tile·E/K tokens cannot be rounded (round_to_tiles refuses such a tile): plain top-k."""
    layer = mok.MoE(32, 48, num_experts=8, num_topk=2, backend="reference", route_tile=16)
    seen, moe = {}, mok.layer.moe
    monkeypatch.setattr(mok.layer, "moe", lambda x, idx, w, *a, **k: seen.update(idx=idx) or moe(x, idx, w, *a, **k))
    for num_tokens in (1, 63):  # 64 tokens = 128 routes = 16 per expert: the smallest batch it rounds
        x = torch.randn(num_tokens, 32).to(torch.bfloat16)
        layer(x).float().sum().backward()
        assert torch.equal(seen["idx"], mok.routing.softmax_topk(x.float() @ layer.w_router.T, 2)[0])
    x = torch.randn(64, 32).to(torch.bfloat16)
    layer(x)
    assert torch.equal(seen["idx"], mok.routing.softmax_topk(x.float() @ layer.w_router.T, 2, tile=16)[0])


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_activation_checkpointing_recomputes_the_same_bits(backend):
    """torch.utils.checkpoint(layer, x, use_reentrant=False): the layer keeps nothing, the backward recomputes the
    forward, and the gradients equal a plain forward+backward's bit for bit."""
    torch.manual_seed(0)
    layer = mok.MoE(64, 96, num_experts=4, num_topk=2, shared_intermediate=32, backend=backend)
    x = torch.randn(37, 64).bfloat16()
    grads = []
    for checkpointed in (False, True):
        xi = x.clone().requires_grad_()
        out = torch.utils.checkpoint.checkpoint(layer, xi, use_reentrant=False) if checkpointed else layer(xi)
        grads.append(torch.autograd.grad(out, [xi, *layer.parameters()], torch.ones_like(out)))
    for plain, recomputed in zip(*grads):
        assert bitwise_equal(plain, recomputed)


def test_a_level_that_reads_the_device_refuses_a_cuda_graph_capture(monkeypatch):
    """Inside a capture only the fused level without check=True runs: another level's first host read would
    invalidate the capture and poison the CUDA context, so mok.moe raises before any launch (GPU: test_graphs)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = SimpleNamespace(is_cuda=True)  # what the check reads of x
    for level in (L0, torch_native):
        with pytest.raises(ValueError, match="backend: expected 'fused' with check=False inside a CUDA graph"):
            library._check_capturable(level, x, check_ids=False)
    with pytest.raises(ValueError, match=r"got fused, check=True"):
        library._check_capturable(fused, x, check_ids=True)
    library._check_capturable(fused, x, check_ids=False)  # no host read: runs
    library._check_capturable(L0, SimpleNamespace(is_cuda=False), check_ids=True)  # CPU tensors: no capture


@pytest.mark.gpu
@pytest.mark.sm90
def test_the_custom_op_backward_with_a_shared_expert_runs():
    """mok.moe's backward runs on autograd's device thread, which can hold an unread CUDA error from an earlier call:
    the launches must not report it as theirs (it failed here with "invalid argument" before bindings.cpp's
    LaunchGuard cleared it). Its gradients are fused.backward's bits."""
    from mok.config import MoEConfig

    inp = make_inputs(MoEConfig("op-shared", 256, 256, 128, 8, 2, shared_intermediate=128), "cuda")
    args = [a.requires_grad_() if a is not None and a.is_floating_point() and i != 2 else a
            for i, a in enumerate(moe_args(inp))]
    mok.moe(*args, backend="fused").backward(inp["d_out"])
    with torch.no_grad():
        _, saved = fused.forward(*moe_args(inp))
        want = fused.backward(saved, inp["d_out"])
    got = [args[0].grad, *(a.grad for a in args[3:])]
    assert all(bitwise_equal(g, w) for g, w in zip(got, [want[0], *want[2:]]))
