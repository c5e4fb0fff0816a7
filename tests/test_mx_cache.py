"""mok.mxfp8_weight_cache (mok.mx_cache): the `fused` level's MXFP8 weight round trips reused across calls.

CPU, the level's kernels replaced by their L0 twins (as tests/test_fused.py's CPU tests): the same bits with and
without the cache (forward and every gradient, per call and accumulated over micro-batches through mok.moe),
the round trips of the routed weights computed once per context (counted on the quantizers), recomputed after
an in-place update, dropped and freed when the context exits (normally or by an exception), shared by nested
contexts, never used in bf16; and the lookup's rules on its own (version, `.data` caveat, freed weights).
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

import mok
from mok import fused, mx_cache, ops, twins
from mok.config import TINY_SHAPES
from mok.testing import GRAD_NAMES, bitwise_equal, fresh_seed, make_inputs, moe_args, run_level

WEIGHTS = ("w_gate", "w_up", "w_down")  # the routed weights: the only tensors the cache holds


@pytest.fixture
def quantizer_calls(monkeypatch) -> list:
    """Every kernel replaced by its L0 twin, no device check; each call of the three weight quantizers the cache
    stands in front of is logged as (name, rank, dim) (dual: dim None)."""
    twins.install(monkeypatch.setattr)
    log = []

    def fake_quantize(x, dim=-1, counts=None):
        log.append(("fake_quantize", x.dim(), dim))
        return twins.mxfp8_fake_quantize(x, dim, counts)

    def fake_quantize_dual(x, counts=None):
        log.append(("fake_quantize_dual", x.dim(), None))
        return twins.mxfp8_fake_quantize_dual(x, counts)

    def quantize_rowwise(x):
        log.append(("quantize_rowwise", x.dim(), -1))
        return twins.mxfp8_quantize_rowwise(x)

    monkeypatch.setattr(ops, "mxfp8_fake_quantize", fake_quantize)
    monkeypatch.setattr(ops, "mxfp8_fake_quantize_dual", fake_quantize_dual)
    monkeypatch.setattr(ops, "mxfp8_quantize_rowwise", quantize_rowwise)
    return log


def _weight_calls(log: list) -> list:
    """The logged quantizer calls on weights (rank 3: [E, *, *]; activations are rank 2), then clears the log."""
    calls = [c for c in log if c[1] == 3]
    log.clear()
    return calls


def _inputs(shape: str, seed: int) -> dict:
    """make_inputs with each routed weight scaled by 2^(a_row + b_col), a, b random ints in [-6, 6] (exact):
    with plain N(0, σ) weights a round trip hardly depends on its direction, so a row-wise one reused where
    the column-wise one belongs would go unseen (the reason of tests/test_fused.py's _wide_range)."""
    inputs = make_inputs(TINY_SHAPES[shape], seed=seed)
    g = torch.Generator().manual_seed(seed)
    for name in WEIGHTS:
        w = inputs[name]  # [E, rows, cols]
        rows = torch.randint(-6, 7, (*w.shape[:-1], 1), generator=g)  # [E, rows, 1]
        cols = torch.randint(-6, 7, (w.shape[0], 1, w.shape[-1]), generator=g)  # [E, 1, cols]
        inputs[name] = (w.float() * torch.exp2((rows + cols).float())).to(w.dtype)
    return inputs


def _assert_same_bits(a, b, what: str) -> None:
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert bitwise_equal(out_a, out_b), f"{what}: out"
    for name, ga, gb in zip(GRAD_NAMES, grads_a, grads_b):
        assert bitwise_equal(ga, gb), f"{what}: {name}"


# (MOK_MX_WEIGHTS, weight quantizer calls of one forward + backward without the cache): the round trips along
# K in the forward (row-wise, dim -1) and in the backward (column-wise, dim -2); mainloop quantizes the forward's
# weights instead. CACHED: the calls inside a context, where the dequantize path makes both round trips of a
# weight in one dual call.
CALLS = {"dequantize": sorted([("fake_quantize", 3, -1)] * 3 + [("fake_quantize", 3, -2)] * 3),
         "mainloop": sorted([("quantize_rowwise", 3, -1)] * 3 + [("fake_quantize", 3, -2)] * 3)}
CACHED = {"dequantize": [("fake_quantize_dual", 3, None)] * 3, "mainloop": CALLS["mainloop"]}


@pytest.mark.parametrize("shape", ["tiny", "tiny-noshared"])
@pytest.mark.parametrize("path", list(CALLS))
def test_same_bits_and_each_weight_quantized_once(quantizer_calls, monkeypatch, path, shape):
    """Inside one context the first call computes every routed weight's round trips (6, by 3 dual calls in the
    dequantize path), the second none, and both give the bits of a call without the cache; the cache holds the
    documented memory."""
    monkeypatch.setattr(fused, "DEFAULT_MX_WEIGHTS", path)
    seed = fresh_seed()
    inputs = _inputs(shape, seed)
    plain = run_level(fused, inputs, precision="mxfp8", swiglu_limit=0.7)
    assert sorted(_weight_calls(quantizer_calls)) == CALLS[path]
    with mok.mxfp8_weight_cache():
        first = run_level(fused, inputs, precision="mxfp8", swiglu_limit=0.7)
        assert sorted(_weight_calls(quantizer_calls)) == CACHED[path], f"seed {seed}"
        second = run_level(fused, inputs, precision="mxfp8", swiglu_limit=0.7)
        assert _weight_calls(quantizer_calls) == [], f"second call quantized weights again (seed {seed})"
        n = sum(inputs[w].numel() for w in WEIGHTS)
        held = {"dequantize": 2 * 2 * n, "mainloop": 2 * n + n + n // 32}  # bf16 copies; E4M3 + a scale per 32
        assert mx_cache.nbytes() == held[path], f"{path}: {mx_cache.nbytes()} bytes held, expected {held[path]}"
    _assert_same_bits(first, plain, f"{path} first call (seed {seed})")
    _assert_same_bits(second, plain, f"{path} second call (seed {seed})")


def test_gradient_accumulation_through_mok_moe(quantizer_calls):
    """The use it is for: micro-batches through the autograd op with one set of weights; the accumulated
    weight gradients are the uncached ones bit for bit, from 3 dual weight round trips in all instead of 6 round
    trips per micro-batch."""
    seed = fresh_seed()
    batches = [make_inputs(TINY_SHAPES["tiny"], seed=seed + i) for i in range(3)]  # fresh x, routing, d_out
    names = [n for n in batches[0] if n.startswith("w_")]  # routed and shared weights

    def accumulate(context) -> list:
        params = {n: batches[0][n].clone().requires_grad_() for n in names}
        with context:
            for b in batches:
                mok.moe(*moe_args({**b, **params}), precision="mxfp8", backend="fused").backward(b["d_out"])
        return [params[n].grad for n in names]

    plain = accumulate(contextlib.nullcontext())
    assert len(_weight_calls(quantizer_calls)) == 6 * len(batches)
    cached = accumulate(mok.mxfp8_weight_cache())
    assert _weight_calls(quantizer_calls) == CACHED["dequantize"]
    for n, a, b in zip(names, cached, plain):
        assert bitwise_equal(a, b), f"{n} (seed {seed})"


@pytest.mark.parametrize("name", WEIGHTS)
def test_in_place_update_inside_the_context_recomputes(quantizer_calls, name):
    """An optimizer-like in-place update bumps the weight's _version: its round trips are recomputed, by one
    dual call (the others reused), and the results are a fresh uncached run's with the updated weight."""
    seed = fresh_seed()
    inputs = _inputs("tiny", seed)
    with mok.mxfp8_weight_cache():
        before = run_level(fused, inputs, precision="mxfp8")
        _weight_calls(quantizer_calls)
        with torch.no_grad():
            inputs[name].add_(1)
        after = run_level(fused, inputs, precision="mxfp8")
        assert _weight_calls(quantizer_calls) == CACHED["dequantize"][:1], f"{name}: both round trips again"
    fresh = run_level(fused, inputs, precision="mxfp8")
    _assert_same_bits(after, fresh, f"{name} updated (seed {seed})")
    assert not bitwise_equal(after[0], before[0]), f"{name}: the update changed nothing to test (seed {seed})"


def _cached_values() -> list:
    """Weak references to every tensor the open cache holds."""
    values = [e.value if isinstance(e.value, tuple) else (e.value,) for e in mx_cache._store.values()]
    return [weakref.ref(t) for v in values for t in v]


@pytest.mark.parametrize("how", ["exit", "exception"])
def test_leaving_the_context_drops_and_frees_the_cache(quantizer_calls, how):
    inputs = make_inputs(TINY_SHAPES["tiny"], seed=fresh_seed())
    with pytest.raises(RuntimeError) if how == "exception" else contextlib.nullcontext():
        with mok.mxfp8_weight_cache():
            run_level(fused, inputs, precision="mxfp8")
            held = _cached_values()
            assert len(held) == 6 and mx_cache.active()
            if how == "exception":
                raise RuntimeError("a failing micro-batch")
    assert not mx_cache.active() and mx_cache._store is None and mx_cache.nbytes() == 0
    gc.collect()
    assert all(r() is None for r in held), "cached round trips still alive after the context"
    _weight_calls(quantizer_calls)
    run_level(fused, inputs, precision="mxfp8")
    assert len(_weight_calls(quantizer_calls)) == 6, "outside the context every call quantizes again"


def test_nested_contexts_share_the_outer_cache(quantizer_calls):
    inputs = make_inputs(TINY_SHAPES["tiny"], seed=fresh_seed())
    with mok.mxfp8_weight_cache():
        run_level(fused, inputs, precision="mxfp8")
        _weight_calls(quantizer_calls)
        with mok.mxfp8_weight_cache():
            run_level(fused, inputs, precision="mxfp8")
        assert _weight_calls(quantizer_calls) == [] and mx_cache.nbytes() > 0  # the inner exit kept it
    assert mx_cache._store is None


def test_bf16_never_touches_the_cache(quantizer_calls, monkeypatch):
    def refuse(*args):
        raise AssertionError("bf16 asked the cache")

    monkeypatch.setattr(mx_cache, "lookup", refuse)
    inputs = make_inputs(TINY_SHAPES["tiny"], seed=fresh_seed())
    with mok.mxfp8_weight_cache():
        run_level(fused, inputs, precision="bf16")
        assert mx_cache._store == {}
    assert quantizer_calls == []


def test_lookup_rules():
    """The key and the validation on their own: a hit while the version holds, a miss after an in-place update,
    none after a write through .data (the documented caveat), freed weights' entries dropped, inference tensors
    and calls outside a context never stored."""
    computed = []

    def get(w):
        return mx_cache.lookup(w, ("test",), lambda: computed.append(1) or w.clone())

    w = torch.randn(2, 32, 32, dtype=torch.bfloat16)
    get(w)
    assert len(computed) == 1 and not mx_cache.active()
    with mx_cache.mxfp8_weight_cache():
        for _ in range(2):
            get(w)
        assert len(computed) == 2  # one compute for two calls
        get(w[:])  # a view with the same address, shape and stride: the same entry
        assert len(computed) == 2
        w.mul_(2)
        assert bitwise_equal(get(w), w) and len(computed) == 3
        w.data.mul_(2)  # .data does not bump w._version: the cache cannot see this write
        assert bitwise_equal(get(w), w / 2) and len(computed) == 3
        other = torch.randn(2, 32, 32, dtype=torch.bfloat16)
        del w
        get(other)
        assert len(mx_cache._store) == 1, "the freed weight's entry was kept"
        with torch.inference_mode():
            frozen = torch.randn(2, 32, 32, dtype=torch.bfloat16)
        get(frozen)
        get(frozen)
        assert len(computed) == 6 and len(mx_cache._store) == 1


def test_a_new_tensor_at_a_freed_weights_address_is_a_miss():
    """Same address, shape, stride and _version (0), other values: the weak reference to the freed weight's
    storage is what tells them apart (two torch.frombuffer tensors over one buffer, one after the other)."""
    buf = bytearray(2 * 32 * 32 * 2)
    with mx_cache.mxfp8_weight_cache():
        old = torch.frombuffer(buf, dtype=torch.bfloat16).view(2, 32, 32)
        address = old.data_ptr()
        mx_cache.lookup(old, ("test",), old.clone)
        del old
        buf[:] = bytes(range(256)) * (len(buf) // 256)  # new values, written around torch: no version bump
        new = torch.frombuffer(buf, dtype=torch.bfloat16).view(2, 32, 32)
        assert new.data_ptr() == address and new._version == 0
        assert bitwise_equal(mx_cache.lookup(new, ("test",), new.clone), new), "stale value for a new tensor"


# ---- GPU -------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
def test_cached_weights_give_the_uncached_bits_on_the_gpu(monkeypatch):
    """The kernels themselves (no twins): two forward+backward calls inside the context give the bits of a call
    outside it, and the second call runs no weight round trip (the kernels' outputs are reused, not recomputed):
    the first runs one dual round trip per routed weight."""
    seed = fresh_seed()
    inputs = make_inputs(TINY_SHAPES["tiny-top8"], device="cuda", seed=seed, draw_on="cuda")
    expected = run_level(fused, inputs, precision="mxfp8", swiglu_limit=1.0)
    weight_calls = []
    kernel, dual = ops.mxfp8_fake_quantize, ops.mxfp8_fake_quantize_dual

    def counted(x, dim=-1, counts=None):
        weight_calls.extend([dim] if x.dim() == 3 else [])
        return kernel(x, dim, counts=counts)

    def counted_dual(x, counts=None):
        weight_calls.extend(["dual"] if x.dim() == 3 else [])
        return dual(x, counts=counts)

    monkeypatch.setattr(ops, "mxfp8_fake_quantize", counted)
    monkeypatch.setattr(ops, "mxfp8_fake_quantize_dual", counted_dual)
    with mok.mxfp8_weight_cache():
        for call in range(2):
            out, grads = run_level(fused, inputs, precision="mxfp8", swiglu_limit=1.0)
            assert bitwise_equal(out, expected[0]), f"out: call {call} differs from the uncached bits (seed {seed})"
            for name, a, b in zip(GRAD_NAMES, grads, expected[1]):
                assert bitwise_equal(a, b), f"{name}: call {call} differs from the uncached bits (seed {seed})"
            assert weight_calls == (["dual"] * 3 if call == 0 else []), weight_calls
            weight_calls.clear()
