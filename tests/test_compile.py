"""torch.compile(fullgraph=True) through mok (DESIGN §9): mok.moe and mok.MoE are mok's custom ops
(mok.library), which Dynamo traces without a graph break and inductor leaves as they are, so compiled and eager give
the same bits, out and every gradient, router included.

CPU: levels "reference" and "torch" in bf16 and mxfp8 (both run mxfp8 on the CPU), and the fused level's wiring with
its kernels as L0 twins (as tests/test_fused.py); torch.library.opcheck of the ops (schema, fake = real shapes and
dtypes of out and of every saved tensor, autograd registration, AOT tracing with dynamic shapes); the host checks
(expert ids, finite logits) still raise under compile. GPU (Hopper): the fused level, the same checks. The tiny shape
keeps each compile near a second on 2 CPU cores.
"""

from __future__ import annotations

import pytest
import torch

import mok
from mok import routing, twins
from mok.config import TINY_SHAPES
from mok.testing import bitwise_equal, make_inputs, moe_args

CFG = TINY_SHAPES["tiny"]  # T=37, H=64, I=96, E=4, K=2, shared 64: irregular, and mxfp8's 32-multiples


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles from nothing and counts its own graph breaks."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _no_graph_break():
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def _leaves(inputs: dict) -> list:
    return [a.detach().clone().requires_grad_() if a is not None and a.is_floating_point() else a
            for a in moe_args(inputs)]


def _moe_step(fn, inputs: dict) -> list:
    """out and the gradients of x, topk_weights and every weight: [out, d_x, d_topk_weights, d_w_*...]."""
    args = _leaves(inputs)
    out = fn(*args)
    wrt = [a for a in args if a is not None and a.requires_grad]
    return [out.detach(), *torch.autograd.grad(out, wrt, inputs["d_out"])]


def _assert_same_bits(eager: list, compiled: list, what: str):
    assert len(eager) == len(compiled), what
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert bitwise_equal(a, b), f"{what}: output {i} (0: out, then the gradients in order)"


def _check_moe_compiles(backend: str, precision: str, device="cpu", cfg=CFG):
    inputs = make_inputs(cfg, device=device, seed=5)

    def fn(*args):
        return mok.moe(*args, precision=precision, swiglu_limit=1.5, backend=backend)

    eager = _moe_step(fn, inputs)
    compiled = _moe_step(torch.compile(fn, fullgraph=True), inputs)  # fullgraph: a graph break raises
    _no_graph_break()
    _assert_same_bits(eager, compiled, f"mok.moe {backend} {precision}")


def _module_step(layer, x, d_out) -> list:
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    return [out.detach(), *torch.autograd.grad(out, [x, *layer.parameters()], d_out)]


def _check_module_compiles(backend: str, precision: str, device="cpu", dtype=torch.bfloat16, route_tile=None,
                           dynamic=None):
    torch.manual_seed(0)
    layer = mok.MoE(64, 96, num_experts=4, num_topk=2, shared_intermediate=32, backend=backend, precision=precision,
                    route_tile=route_tile, device=device).to(dtype)
    x = torch.randn(2, 48, 64, device=device).to(dtype)  # 96 tokens: 48 routes per expert, route_tile 16 rounds
    d_out = torch.randn(2, 48, 64, device=device).to(dtype)
    eager = _module_step(layer, x, d_out)
    compiled = _module_step(torch.compile(layer, fullgraph=True, dynamic=dynamic), x, d_out)
    _no_graph_break()
    _assert_same_bits(eager, compiled, f"mok.MoE {backend} {precision} {dtype} route_tile={route_tile}")


# ---- CPU -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_compiled_moe_gives_eagers_bits(backend, precision):
    _check_moe_compiles(backend, precision)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_compiled_module_gives_eagers_bits(backend, precision):
    """The router too: inductor would fuse its softmax and normalization; inside its op it keeps eager's bits."""
    _check_module_compiles(backend, precision)


def test_compiled_module_with_route_tile_fp32_master_weights_and_dynamic_shapes():
    """fp32 parameters and x (casts around the ops, in the graph), the rounded router, symbolic shapes in the fakes."""
    _check_module_compiles("torch", "bf16", dtype=torch.float32, route_tile=16, dynamic=True)


@pytest.mark.parametrize("tile", [None, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_op_gives_autograds_bits(dtype, tile):
    """The router op's backward is autograd's formulas written out: the same bits as autograd through
    routing.softmax_topk on x·w_routerᵀ (what mok.MoE ran before it was an op)."""
    torch.manual_seed(1)
    x = torch.randn(96, 64).to(dtype).requires_grad_()  # [T, H]
    w_router = torch.randn(8, 64, requires_grad=True)  # [E, H]
    d_topk_weights = torch.randn(96, 2)  # [T, K]
    idx, weights = routing.softmax_topk(x.float() @ w_router.float().T, 2, tile=tile)
    want = torch.autograd.grad(weights, (x, w_router), d_topk_weights)
    got_idx, got_weights, _ = torch.ops.mok.softmax_topk_router(x, w_router, 2, tile)
    got = torch.autograd.grad(got_weights, (x, w_router), d_topk_weights)
    assert bitwise_equal(got_idx, idx) and bitwise_equal(got_weights, weights)
    assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1])


def _opcheck_moe(backend: str, precision: str, device="cpu", num_tokens=5, utils=None):
    """opcheck of mok::moe_forward (and, through its autograd, mok::moe_backward): the fake's out and saved tensors
    have the real ones' shapes, dtypes and strides (the level's saved_like is its forward's saved), the schema says
    what the op does, autograd is registered, and AOT tracing with dynamic shapes gives the same results."""
    args = _leaves(make_inputs(CFG.scaled(num_tokens=num_tokens), device=device, seed=7))
    kwargs = {} if utils is None else {"test_utils": utils}
    torch.library.opcheck(torch.ops.mok.moe_forward, (*args, backend, precision, 1.5, None, None, False), **kwargs)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_opcheck_moe(backend, precision):
    _opcheck_moe(backend, precision)


def test_opcheck_router():
    x, w_router = torch.randn(5, 64).requires_grad_(), torch.randn(4, 64, requires_grad=True)
    # NOTE: opcheck's test_aot_dispatch_dynamic sums the outputs into the first one's dtype, int64 here (topk_idx),
    # and fails on adding a float; the module's compiled tests above trace the router's AOT path, dynamic included.
    torch.library.opcheck(torch.ops.mok.softmax_topk_router, (x, w_router, 2, None),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def _use_twins(monkeypatch):
    """The fused level on the CPU: every kernel replaced by its L0 twin, no device check (tests/test_fused.py)."""
    twins.install(monkeypatch.setattr)


@pytest.mark.parametrize("level", ["fused", "megakernel"])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_hopper_levels_wiring_compiles_with_twins(monkeypatch, precision, level):
    """The Hopper levels' saved state (schedule of max_num_rows rows, MXFP8 gate/up, the shared expert's rows) through
    the ops: opcheck (its saved_like against its forward, for a batch and an empty one), and compiled = eager."""
    _use_twins(monkeypatch)
    for num_tokens in (5, 0):
        _opcheck_moe(level, precision, num_tokens=num_tokens, utils=("test_faketensor",))
    _check_moe_compiles(level, precision)


def test_saved_tensors_sharing_memory_are_copied():
    """What the fused kernels save on the GPU and the twins do not: schedule arrays carved from one allocation,
    MXFP8 data and scales in one buffer, a view of an input. An op may not return those as they are: each one
    sharing memory with an input or an earlier output becomes a copy, of the same bits; the others stay."""
    carve = torch.arange(40, dtype=torch.int64)  # make_schedule_cuda: one allocation, narrowed per array
    mx = torch.arange(80, dtype=torch.uint8)  # grouped_gemm_..._mxfp8_out: data [2, 32] e4m3, then scales [2, 1]
    x = torch.randn(4, 8)
    fresh = torch.randn(3)
    outputs = [carve[:8], carve[8:16], carve[16:40].view(4, 6), mx[:64].view(torch.float8_e4m3fn).view(2, 32),
               mx[64:66].view(2, 1), x[1:], fresh]
    got = mok.library._unaliased(outputs, (x, None))
    assert got[0] is outputs[0] and got[3] is outputs[3] and got[6] is fresh  # the first of each storage stays
    storages = [t.untyped_storage()._cdata for t in (*got, x)]
    assert len(set(storages)) == len(storages)
    for a, b in zip(got, outputs):
        assert a.dtype == b.dtype and a.shape == b.shape and bitwise_equal(a, b)


def test_host_checks_still_raise_under_compile():
    """The checks that read device values run inside the ops, at run time: the same errors as in eager."""
    inputs = make_inputs(CFG, seed=3)
    args = list(moe_args(inputs))
    args[1] = args[1] + CFG.num_experts - 1  # ids up to 2E - 2

    def fn(*a):
        return mok.moe(*a, backend="torch")

    with pytest.raises(ValueError, match=r"topk_idx: expected expert ids in \[0, 4\)"):
        torch.compile(fn, fullgraph=True)(*args)
    layer = torch.compile(mok.MoE(64, 96, num_experts=4, num_topk=2, backend="torch"), fullgraph=True)
    x = torch.randn(5, 64).bfloat16()
    layer(x)
    with pytest.raises(ValueError, match="logits: expected finite values"):
        layer(torch.full_like(x, float("nan")))


# ---- GPU (Hopper): the fused level ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("level", ["fused", "megakernel"])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_hopper_levels_compile_with_eagers_bits(precision, level):
    _check_moe_compiles(level, precision, device="cuda")
    torch._dynamo.reset()
    _check_module_compiles(level, precision, device="cuda")
    torch._dynamo.reset()
    # opcheck's AOT-dispatch test sums every output, which CUDA cannot for the saved float8 gate/up (torch 2.11)
    utils = None if precision == "bf16" else ("test_schema", "test_autograd_registration", "test_faketensor")
    _opcheck_moe(level, precision, device="cuda", num_tokens=37, utils=utils)
    mok.check_errors()  # clean ids: nothing queued raises
