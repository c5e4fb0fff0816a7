"""Every level against L0 under the named tolerances of DESIGN §9, forward and every gradient.

CPU: L1 on the tiny shapes (its per-expert / CPU grouped_mm path). GPU (marked): L0 and L1 on the
device, on tiny shapes and on the standard shapes scaled down in tokens, plus bitwise repeatability.
New levels join by adding their name to LEVELS_UNDER_TEST.
"""

import pytest
import torch

from mok import reference as L0
from mok.config import STANDARD_SHAPES, TINY_SHAPES
from mok.layer import get_level
from mok.routing import hot_expert_routing
from mok.testing import GRAD_NAMES, TOLERANCES, bitwise_equal, make_inputs, poison_allocator, rel_err, run_level

LEVELS_UNDER_TEST = ["torch"]
TOL = {"bf16": TOLERANCES["bf16_vs_l0"], "mxfp8": TOLERANCES["mxfp8_vs_l0_mxfp8"]}


def poison():
    """Fill the caching allocator with NaNs so an output a level forgets to write is never a
    lucky zero: allocate, fill and free a large block before each run (GPU only)."""
    if torch.cuda.is_available():
        poison_allocator(256 << 20)


def check_against_l0(level_name, inputs, precision, limit):
    out0, grads0 = run_level(L0, inputs, precision=precision, swiglu_limit=limit)
    poison()
    out, grads = run_level(get_level(level_name), inputs, precision=precision, swiglu_limit=limit)
    assert out.dtype == torch.bfloat16 and out.shape == out0.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, out0) <= TOL[precision], "out"
    for name, g, g0 in zip(GRAD_NAMES, grads, grads0):
        if g0 is None:
            assert g is None, name
            continue
        assert g.dtype == g0.dtype and g.shape == g0.shape, name
        assert torch.isfinite(g).all(), name
        assert rel_err(g, g0) <= TOL[precision], name


@pytest.mark.parametrize("level", LEVELS_UNDER_TEST)
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("cfg", list(TINY_SHAPES.values()), ids=lambda c: c.name)
def test_level_matches_l0_cpu(level, precision, cfg):
    check_against_l0(level, make_inputs(cfg, seed=21), precision, limit=0.8 if cfg.has_shared else None)


@pytest.mark.parametrize("level", LEVELS_UNDER_TEST)
def test_level_hot_expert_and_empty_experts_cpu(level):
    cfg = TINY_SHAPES["tiny-noshared"]
    inputs = make_inputs(cfg, seed=8, routing_fn=lambda T, E, K, g: hot_expert_routing(T, E - 2, K, generator=g))
    check_against_l0(level, inputs, "bf16", None)


# --- GPU ----------------------------------------------------------------------------------------

def _gpu_shape(cfg, num_tokens=512):
    """Standard shape with fewer tokens: the full width, expert count and top-k the kernels tile
    for, at a size L0's Python loop checks in seconds."""
    return cfg.scaled(num_tokens=min(cfg.num_tokens, num_tokens))


@pytest.mark.gpu
@pytest.mark.parametrize("level", LEVELS_UNDER_TEST)
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("cfg", list(TINY_SHAPES.values()) + [_gpu_shape(c) for c in STANDARD_SHAPES.values()],
                         ids=lambda c: c.name)
def test_level_matches_l0_gpu(level, precision, cfg, device):
    inputs = make_inputs(cfg, device=device, seed=31, draw_on=device)  # GBs of weights: draw them there
    check_against_l0(level, inputs, precision, limit=7.0)


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["reference"] + LEVELS_UNDER_TEST)
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_level_repeat_runs_bitwise_gpu(level, precision, device):
    cfg = _gpu_shape(STANDARD_SHAPES["qwen3-30b-a3b"], 1000)
    a = run_level(get_level(level), make_inputs(cfg, device=device, seed=41, draw_on=device), precision=precision)
    inputs = make_inputs(cfg, device=device, seed=41, draw_on=device)
    poison()
    b = run_level(get_level(level), inputs, precision=precision)
    assert bitwise_equal(a[0], b[0])
    for name, x, y in zip(GRAD_NAMES, a[1], b[1]):
        assert bitwise_equal(x, y), name


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_reference_gpu_matches_cpu(precision, device):
    """L0 is one spec on every device: GPU and CPU agree within the bf16 tolerance."""
    cfg = TINY_SHAPES["tiny"]
    out_c, g_c = run_level(L0, make_inputs(cfg, seed=5), precision=precision)
    out_g, g_g = run_level(L0, make_inputs(cfg, device=device, seed=5), precision=precision)
    assert rel_err(out_g.cpu(), out_c) <= TOL[precision]
    for name, a, b in zip(GRAD_NAMES, g_g, g_c):
        if b is not None:
            assert rel_err(a.cpu(), b) <= TOL[precision], name


def test_l1_grouped_mm_fallback_is_per_call(monkeypatch):
    """A shape torch._grouped_mm does not take (bf16 rows of 36: strides not a multiple of 16 bytes) falls back
    to the per-expert loop for that call only; a later call takes torch._grouped_mm again."""
    ran, failed, grouped_mm = [], [], torch._grouped_mm

    def spy(*args, **kwargs):
        try:
            out = grouped_mm(*args, **kwargs)
        except RuntimeError:
            failed.append(args[0].shape)
            raise
        ran.append(args[0].shape)
        return out

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    monkeypatch.setattr(get_level("torch"), "GROUPED_MM_DEVICES", ("cuda", "cpu"))  # the CPU's, slow, for this test
    odd = make_inputs(TINY_SHAPES["tiny"].scaled(intermediate=36), seed=4)
    level = get_level("torch")
    out, _ = run_level(level, odd)
    ref_out, _ = run_level(L0, odd)
    assert failed and rel_err(out, ref_out) < TOLERANCES["bf16_vs_l0"]
    ran.clear(), failed.clear()
    inputs = make_inputs(TINY_SHAPES["tiny"], seed=5)
    run_level(level, inputs)
    assert len(ran) == 9 and not failed  # every routed GEMM: 3 forward, 3 dgrad, 3 wgrad
