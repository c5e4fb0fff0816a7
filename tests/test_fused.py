"""L2 `fused` (mok.fused) against L0: forward and every gradient, determinism, backend resolution.

GPU (Hopper), in bf16 and mxfp8 (against L0 in the same precision): the tiny shapes and the four standard
shapes at 512 tokens (full width, expert count and top-k), with and without the shared expert, with and
without a swiglu_limit, under DESIGN §9's tolerances; the shared expert's path through the routed kernels
(a one-expert schedule of all tokens) against L0's shared-expert forward; bitwise identical bits run to
run and for two persistent grid sizes (num_sms); in mxfp8, zero padding rows under every column-wise
quantized operand and a smaller saved state than bf16's. CPU: the level's wiring with every kernel
replaced by its L0 twin gives L0's bits in both precisions; backend resolution (auto picks L2 only on
sm_90) and clear errors. Inputs are drawn fresh every run (the seed is in each failure message); the
allocator is poisoned with NaN before the level runs.
"""

from __future__ import annotations

import inspect
import weakref

import pytest
import torch

import mok
from mok import fused, ops, testing, twins
from mok import reference as L0
from mok.config import STANDARD_SHAPES, TINY_SHAPES
from mok.layer import resolve_backend
from mok.routing import hot_expert_routing
from mok.testing import GRAD_NAMES, TOLERANCES, bitwise_equal, fresh_seed, make_inputs, moe_args, run_level

TOL = {"bf16": TOLERANCES["bf16_vs_l0"], "mxfp8": TOLERANCES["mxfp8_vs_l0_mxfp8"]}  # against L0 in that precision
SHARED_KEYS = ("w_shared_gate", "w_shared_up", "w_shared_down")
# The GEMMs' fp32 sums run in another order than L0's, which flips the bf16 rounding of a fraction of the
# outputs that grows with K (12% at K = 3072, and cancellation makes some flips several ulps): on short
# sums nearly every element must be within one bf16 ulp; long sums are held to the §9 tolerance.
WITHIN_ONE_ULP = 0.999


def _cases():
    """(cfg, with_shared): every shape, and the shapes with a shared expert also without it."""
    shapes = list(TINY_SHAPES.values()) + [c.scaled(num_tokens=min(c.num_tokens, 512))
                                           for c in STANDARD_SHAPES.values()]
    return [(c, s) for c in shapes for s in ([True, False] if c.has_shared else [False])]


def _inputs(cfg, with_shared: bool, seed: int, routing_fn=None) -> dict:
    inputs = make_inputs(cfg, device="cuda", seed=seed, draw_on="cuda", routing_fn=routing_fn)
    if not with_shared:
        inputs.update(dict.fromkeys(SHARED_KEYS))
    return inputs


def _check_against_l0(inputs: dict, limit, what: str, precision: str = "bf16") -> None:
    tol = TOL[precision]
    out0, grads0 = run_level(L0, inputs, precision=precision, swiglu_limit=limit)
    testing.poison_allocator(256 << 20)
    out, grads = run_level(fused, inputs, precision=precision, swiglu_limit=limit)
    assert out.dtype == torch.bfloat16 and out.shape == out0.shape, what
    assert torch.isfinite(out).all(), f"{what}: out has non-finite (unwritten?) elements"
    err = testing.rel_err(out, out0)
    assert err <= tol, f"{what}: out rel_err {err:.3e}"
    for name, g, g0 in zip(GRAD_NAMES, grads, grads0):
        if g0 is None:
            assert g is None, f"{what}: {name}"
            continue
        assert g.dtype == g0.dtype and g.shape == g0.shape, f"{what}: {name}"
        assert torch.isfinite(g).all(), f"{what}: {name} has non-finite elements"
        err = testing.rel_err(g, g0)
        assert err <= tol, f"{what}: {name} rel_err {err:.3e}"


# ---- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("limit", [None, 1.0])
@pytest.mark.parametrize("cfg,with_shared", _cases(), ids=lambda v: v.name if hasattr(v, "name") else
                         ("shared" if v else "noshared"))
def test_fused_matches_l0(cfg, with_shared, limit, precision):
    seed = fresh_seed()
    _check_against_l0(_inputs(cfg, with_shared, seed), limit, f"{cfg.name} {precision} limit={limit} (seed {seed})",
                      precision)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_fused_hot_expert_and_empty_experts(precision):
    seed = fresh_seed()
    cfg = TINY_SHAPES["tiny-noshared"]
    routing_fn = lambda T, E, K, g: hot_expert_routing(T, E - 2, K, generator=g)  # last two experts empty
    _check_against_l0(_inputs(cfg, False, seed, routing_fn), None, f"hot expert {precision} (seed {seed})", precision)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("limit", [None, 1.0])
@pytest.mark.parametrize("cfg", [TINY_SHAPES["tiny"], STANDARD_SHAPES["dsv4pro-rank"].scaled(num_tokens=300)],
                         ids=lambda c: c.name)
def test_shared_expert_through_routed_kernels_matches_l0(cfg, limit):
    """The shared expert as one routed expert over all tokens (row t = token t) gives L0's shared
    forward: its gate/up and its output."""
    seed = fresh_seed()
    inputs = _inputs(cfg, True, seed)
    x, ws = inputs["x"], [inputs[k] for k in SHARED_KEYS]
    y0, gate0, up0 = L0.expert_forward(x, *ws, swiglu_limit=limit)  # [T, H], [T, I_sh] x2
    sched = fused.shared_schedule(x.shape[0], x.device)
    assert torch.equal(sched.route_to_row[:, 0].cpu(), torch.arange(x.shape[0]))  # row t = token t
    testing.poison_allocator(256 << 20)
    rows = fused.experts_forward(x, *(w[None] for w in ws), sched, limit, None)
    for name, a, e in zip(("shared", "gate", "up"), rows, (y0, gate0, up0)):
        a = a[: x.shape[0]]
        err = testing.rel_err(a, e)
        assert err <= TOL["bf16"], f"{name}: rel_err {err:.3e} (seed {seed})"
        if cfg.hidden <= 128:  # short sums: nearly every element within one ulp (long ones: rel_err only)
            ulps = (a.view(torch.int16).int() - e.view(torch.int16).int()).abs()  # same sign: ulp distance
            close = ((ulps <= 1) | (a == e)).float().mean().item()
            assert close >= WITHIN_ONE_ULP, f"{name}: only {close:.4f} of elements within 1 ulp (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("cfg", [STANDARD_SHAPES["dsv4pro-rank"].scaled(num_tokens=512), TINY_SHAPES["tiny"]],
                         ids=lambda c: c.name)
def test_fused_mxfp8_weight_paths_give_the_same_bits(cfg):
    """mx_weights: dequantizing the weights in the GEMM mainloops changes no bit of the layer."""
    seed = fresh_seed()
    inputs = _inputs(cfg, True, seed)
    runs = {}
    for path in fused.MX_WEIGHTS:
        testing.poison_allocator(256 << 20)
        runs[path] = run_level(fused, inputs, precision="mxfp8", swiglu_limit=1.0, mx_weights=path)
    (out_a, grads_a), (out_b, grads_b) = runs.values()
    assert bitwise_equal(out_a, out_b), f"out: bits differ between weight paths (seed {seed})"
    for name, a, b in zip(GRAD_NAMES, grads_a, grads_b):
        assert bitwise_equal(a, b), f"{name}: bits differ between weight paths (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("cfg", [STANDARD_SHAPES["dsv4pro-rank"].scaled(num_tokens=512), TINY_SHAPES["tiny-top8"]],
                         ids=lambda c: c.name)
def test_fused_bitwise_across_runs_and_grid_sizes(cfg, precision):
    """DESIGN §5: the same bits run to run and whatever the persistent grid size (num_sms)."""
    seed = fresh_seed()
    inputs = _inputs(cfg, True, seed)
    runs = []
    for num_sms in (132, 37, 132, None):  # None: all SMs
        testing.poison_allocator(256 << 20)
        runs.append((num_sms, run_level(fused, inputs, precision=precision, swiglu_limit=1.0, num_sms=num_sms)))
    (_, (out_a, grads_a)) = runs[0]
    for num_sms, (out, grads) in runs[1:]:
        assert bitwise_equal(out, out_a), f"{precision} out: bits differ with num_sms={num_sms} (seed {seed})"
        for name, a, b in zip(GRAD_NAMES, grads_a, grads):
            assert bitwise_equal(a, b), f"{precision} {name}: bits differ with num_sms={num_sms} (seed {seed})"


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("cfg", [TINY_SHAPES["tiny"], STANDARD_SHAPES["qwen3-30b-a3b"].scaled(num_tokens=300)],
                         ids=lambda c: c.name)
def test_mxfp8_column_wise_operands_have_zero_padding_rows(cfg, monkeypatch):
    """Column-wise MXFP8 blocks over the schedule's row arrays are L0's per-expert blocks only if every
    padding row is zero (mok.fused's MXFP8 comment): checked on the operands the quantize kernels receive."""
    seed = fresh_seed()
    inputs = _inputs(cfg, True, seed)
    testing.poison_allocator(256 << 20)
    _check_padding_rows_of_colwise_operands(monkeypatch, inputs, f"{cfg.name} (seed {seed})")


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("cfg", [TINY_SHAPES["tiny"], STANDARD_SHAPES["dsv4pro-rank"].scaled(num_tokens=512)],
                         ids=lambda c: c.name)
def test_saved_state_of_each_precision(cfg):
    """gate/up are saved as MXFP8 (1 + 1/32 bytes per element) instead of bf16 (2): exactly that saving."""
    _check_saved_bytes(_inputs(cfg, True, fresh_seed()))


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_autograd_and_auto_backend_on_hopper(precision):
    """mok.moe(backend="auto") on an H100/H200 runs L2 in both precisions, with L2's own gradients."""
    assert resolve_backend("auto", torch.device("cuda"), precision) == "fused"
    inputs = _inputs(TINY_SHAPES["tiny"], True, fresh_seed())
    args = [a.clone().requires_grad_() if a.is_floating_point() else a for a in moe_args(inputs)]
    out = mok.moe(*args, precision=precision, swiglu_limit=1.5)
    out.backward(inputs["d_out"])
    ref_out, ref_grads = run_level(fused, inputs, precision=precision, swiglu_limit=1.5)
    assert bitwise_equal(out.detach(), ref_out)
    grads = [args[0].grad, args[2].grad, *(a.grad for a in args[3:])]
    for name, g, r in zip(GRAD_NAMES, grads, ref_grads):
        assert bitwise_equal(g, r), name


# ---- shared by the GPU and CPU tests -------------------------------------------------------------------


def _check_saved_bytes(inputs: dict) -> None:
    """What each precision saves beyond the other: mxfp8 keeps gate/up [R, I] each as e4m3 data + one scale byte
    per 32 instead of bf16, and y_rows [R, H] for the router gradient, which bf16 takes from the expert backward
    (nothing of size [R, H] saved); all else alike."""
    saved = {p: fused.forward(*moe_args(inputs), precision=p)[1] for p in ("bf16", "mxfp8")}
    nbytes = {p: testing.saved_nbytes(s) for p, s in saved.items()}
    num_rows, hidden, intermediate = saved["bf16"].sched.num_rows, inputs["x"].shape[1], inputs["w_gate"].shape[1]
    assert saved["bf16"].y_rows is None and saved["mxfp8"].y_rows.shape == (num_rows, hidden)
    gate_up_saving, y_rows = 2 * num_rows * intermediate * (2 - 1 - 1 / 32), num_rows * hidden * 2
    assert nbytes["bf16"] - nbytes["mxfp8"] == gate_up_saving - y_rows, (nbytes, gate_up_saving, y_rows)
    assert saved["mxfp8"].gate is None and saved["mxfp8"].gate_mx[0].dtype == torch.float8_e4m3fn


def _check_padding_rows_of_colwise_operands(monkeypatch, inputs: dict, what: str) -> None:
    """Run the mxfp8 forward and backward with the column-wise quantizers spied on; every row array [R, *]
    they quantize (h_rows, dy, d_gate, d_up: 4) must hold exact zeros in the padding rows, and so must the x
    rows that mxfp8_fake_quantize_gathered round-trips straight from x (the spare rows past the schedule's real
    rows hold anything: no GEMM reads them)."""
    seen = []

    def spy(name):
        kernel = getattr(ops, name)

        def recorded(x, *args, **kwargs):
            out = kernel(x, *args, **kwargs)
            if name.endswith("gathered"):  # its input is x itself: check what it made of the padding rows
                seen.append((name, out.clone()))
            elif name.endswith("dual") or args[0] == -2:  # fake_quantize(x, dim): column-wise calls only
                seen.append((name, x.clone()))
            return out
        return recorded

    for name in ("mxfp8_fake_quantize", "mxfp8_fake_quantize_dual", "mxfp8_fake_quantize_gathered"):
        monkeypatch.setattr(ops, name, spy(name))
    out, saved = fused.forward(*moe_args(inputs), precision="mxfp8")
    fused.backward(saved, inputs["d_out"])
    padding = saved.sched.row_to_token < 0  # [R]
    padding[int(saved.sched.expert_offsets[-1]):] = False  # spare rows
    row_arrays = [(name, t) for name, t in seen if t.dim() == 2]  # the 3D ones are the weights
    assert len(row_arrays) == 5, f"{what}: {[(n, tuple(t.shape)) for n, t in seen]}"
    assert padding.any(), f"{what}: no padding rows to check"
    for name, t in row_arrays:
        assert t.shape[0] == saved.sched.num_rows, f"{what}: {name} {tuple(t.shape)}"
        assert (t[padding] == 0).all(), f"{what}: {name} of width {t.shape[1]} has non-zero padding rows"


def _wide_range(inputs: dict, seed: int, span: int = 6) -> dict:
    """inputs with every float tensor scaled by 2^(a_row + b_col), a and b random ints in [-span, span]
    (exact in bf16). With N(0, σ) data, an MXFP8 round trip hardly depends on the block direction (rounding
    to 3 mantissa bits is scale-free; only elements below 2^-6 of their block's scale round differently), so
    quantizing an operand along the wrong dim would go unseen; across rows and columns that differ by up to
    2^(2·span), the small elements of a block land in E4M3's subnormals or flush to zero, and the direction
    shows."""
    g = torch.Generator().manual_seed(seed)
    scaled = dict(inputs)
    for name, t in inputs.items():
        if t is None or not t.is_floating_point() or name == "topk_weights":
            continue
        rows = torch.randint(-span, span + 1, (*t.shape[:-1], 1), generator=g)  # [..., rows, 1]
        cols = torch.randint(-span, span + 1, (*t.shape[:-2], 1, t.shape[-1]), generator=g)  # [..., 1, cols]
        scaled[name] = (t.float() * torch.exp2((rows + cols).float())).to(t.dtype)  # exact: powers of two
    return scaled


def _use_twins(monkeypatch) -> None:
    """Every kernel the level calls replaced by its L0 twin (mok.twins), and no device check."""
    twins.install(monkeypatch.setattr)


# ---- CPU -----------------------------------------------------------------------------------------------


def _assert_twin_level_is_l0(shape: str, precision: str, limit) -> None:
    """The level (its kernels already twins) on fresh inputs of `shape` gives L0's out and gradients
    (testing.twin_level_mismatches: bit for bit, but the bf16 routed gradients). In mxfp8 the inputs span a wide
    range, so that a slip in which dim an operand is quantized along changes bits."""
    seed = fresh_seed()
    inputs = make_inputs(TINY_SHAPES[shape], seed=seed)
    inputs = _wide_range(inputs, seed) if precision == "mxfp8" else inputs
    out0, grads0 = run_level(L0, inputs, precision=precision, swiglu_limit=limit)
    out, grads = run_level(fused, inputs, precision=precision, swiglu_limit=limit)
    assert bitwise_equal(out, out0), f"{shape} {precision}: out (seed {seed})"
    assert testing.twin_level_mismatches(grads, grads0, precision) == [], f"{shape} {precision} (seed {seed})"


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("limit", [None, 0.7])
@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_fused_wiring_with_l0_twins_is_l0(monkeypatch, shape, limit, precision):
    """The level's Python (schedules, the shared expert as a one-expert schedule, what is saved, the order of
    the gradients; in mxfp8 which operand is quantized along which dim, and the MXFP8 saved gate/up) with
    every kernel replaced by its L0 twin (mok.twins) must give L0's bits exactly, in the same precision; the
    kernels themselves are held to their twins on the GPU (tests/test_ops_gemm.py, test_ops_combine.py,
    test_ops_quant.py)."""
    _use_twins(monkeypatch)
    _assert_twin_level_is_l0(shape, precision, limit)


@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_fused_wiring_with_mx_weights_in_the_mainloop_is_l0(monkeypatch, shape):
    """mx_weights="mainloop" (as the default, which MOK_MX_WEIGHTS sets): the forward hands quantized weights to the
    MXFP8 GEMMs (twins: the BF16 GEMM on their dequantization), L0's mxfp8 bits still."""
    _use_twins(monkeypatch)
    monkeypatch.setattr(fused, "DEFAULT_MX_WEIGHTS", "mainloop")
    _assert_twin_level_is_l0(shape, "mxfp8", 0.7)


@pytest.mark.parametrize("name", twins.KERNELS)
def test_twins_have_the_kernels_signatures(name):
    """A twin stands in for its kernel only if the level can call it the same way."""
    kernel, twin = inspect.signature(getattr(ops, name)), inspect.signature(getattr(twins, name))
    assert list(kernel.parameters) == list(twin.parameters), name
    assert [p.default for p in kernel.parameters.values()] == [p.default for p in twin.parameters.values()], name


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_backward_frees_d_gate_before_d_w_up(monkeypatch, precision):
    """The backward's peak is beside the three weight gradients: each expert group's d_gate rows (d_w_gate's
    operand) are gone before d_w_up is computed. The weight gradients come per group as d_w_down, d_w_gate, d_w_up."""
    _use_twins(monkeypatch)
    operands = []  # weakref of each weight gradient's a_rows, in call order

    def spy(a_rows, b_rows, sched, num_sms=None):
        if len(operands) % 3 == 2:  # d_w_up's call: d_w_gate's operand must be dead
            assert operands[-1]() is None, f"call {len(operands)}: d_gate's rows still alive"
        operands.append(weakref.ref(a_rows))
        return twins.grouped_gemm_bf16_weight_grad(a_rows, b_rows, sched, num_sms)

    monkeypatch.setattr(ops, "grouped_gemm_bf16_weight_grad", spy)
    run_level(fused, make_inputs(TINY_SHAPES["tiny-top8"], seed=fresh_seed()), precision=precision)
    assert len(operands) == 6, "the routed experts and the shared expert, three weight gradients each"


@pytest.mark.parametrize("shape", ["tiny", "tiny-top8"])
def test_saved_state_of_each_precision_with_twins(monkeypatch, shape):
    _use_twins(monkeypatch)
    _check_saved_bytes(make_inputs(TINY_SHAPES[shape], seed=fresh_seed()))


@pytest.mark.parametrize("shape", list(TINY_SHAPES))
def test_mxfp8_padding_rows_are_zero_with_twins(monkeypatch, shape):
    _use_twins(monkeypatch)
    _check_padding_rows_of_colwise_operands(monkeypatch, make_inputs(TINY_SHAPES[shape], seed=fresh_seed()), shape)


@pytest.mark.parametrize("capability,precision,expected", [
    ((9, 0), "bf16", "fused"),  # Hopper: L2
    ((9, 0), "mxfp8", "fused"),  # Hopper: L2 (MXFP8 operands into the BF16 kernels)
    ((8, 0), "bf16", "torch"),  # A100: the Hopper kernels do not run there
    ((8, 0), "mxfp8", "torch"),
    ((10, 0), "bf16", "torch"),  # Blackwell: neither (sm_90a code)
])
def test_auto_backend_picks_fused_only_on_hopper(monkeypatch, capability, precision, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_backend("auto", torch.device("cuda", 0), precision) == expected
    assert resolve_backend("auto", torch.device("cpu"), precision) == "torch"
    assert resolve_backend("fused", torch.device("cpu"), precision) == "fused"  # explicit: the level says no


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_fused_on_cpu_is_a_clear_error(precision):
    inputs = make_inputs(TINY_SHAPES["tiny"], seed=fresh_seed())
    with pytest.raises(ValueError, match="x: expected a CUDA tensor on a Hopper GPU for backend 'fused'"):
        mok.moe(*moe_args(inputs), backend="fused", precision=precision)


@pytest.mark.parametrize("arg,changes", [("x", dict(hidden=48)), ("w_gate", dict(intermediate=80))])
def test_fused_mxfp8_dims_not_multiples_of_32_are_a_clear_error(arg, changes):
    """mok.moe rejects these for every level; the level itself says so too (before any device check)."""
    inputs = make_inputs(TINY_SHAPES["tiny"].scaled(**changes), seed=fresh_seed())
    with pytest.raises(ValueError, match=rf"{arg}: expected .* a multiple of 32 for precision 'mxfp8' .*L1"):
        fused.forward(*moe_args(inputs), precision="mxfp8")
    with pytest.raises(ValueError, match="multiple of 32"):
        mok.moe(*moe_args(inputs), backend="fused", precision="mxfp8")


# The level's environment variables: name -> (its reader, [(value or None = unset, what it reads)], [refused
# values], the error's expectation).
ENV = {
    fused.NUM_SMS_ENV: (fused.num_sms_from_env, [(None, None), ("", None), ("0", None), ("37", 37), (" 132 ", 132)],
                        ["-3", "all", "1.5"], "expected unset, 0"),
    fused.MX_WEIGHTS_ENV: (fused.mx_weights_from_env, [(None, "dequantize"), ("", "dequantize"),
                                                       ("mainloop", "mainloop"), (" dequantize ", "dequantize")],
                           ["registers"], "expected unset or one of"),
}


@pytest.mark.parametrize("name,value,expected", [(n, v, e) for n, (_, ok, _, _) in ENV.items() for v, e in ok])
def test_env_readers(name, value, expected):
    assert ENV[name][0]({} if value is None else {name: value}) == expected


@pytest.mark.parametrize("name,value", [(n, v) for n, (_, _, bad, _) in ENV.items() for v in bad])
def test_env_readers_refuse_garbage(name, value):
    with pytest.raises(ValueError, match=f"{name}: {ENV[name][3]}"):
        ENV[name][0]({name: value})


def test_pad_rows_adds_zero_rows_and_copies_only_when_needed():
    t = torch.randn(5, 16).to(torch.bfloat16)  # [T, H]
    rows = fused.pad_rows(t, 8)  # [8, H]: t, then 3 zero rows
    assert rows.shape == (8, 16) and torch.equal(rows[:5], t) and not rows[5:].any()
    assert fused.pad_rows(t, 5) is t  # nothing to add: the kernels read t itself
    wide = torch.randn(5, 32).to(torch.bfloat16)
    for other in (t.float(), wide[:, :16]):  # another dtype, a non-contiguous view: a bf16 contiguous copy
        got = fused.pad_rows(other, 5)
        assert got is not other and got.is_contiguous() and torch.equal(got, other.to(torch.bfloat16))


def _edge_batch_is_l0(cfg, device: str, precision: str) -> None:
    """mok.moe on the fused level with `cfg`'s (tiny) batch: out and every gradient equal L0's within tolerance;
    an empty batch gives out [0, H], d_x [0, H], d_topk_weights [0, K] and zero weight gradients, never None."""
    inputs = make_inputs(cfg, device=device, seed=fresh_seed(), draw_on=device)
    outs = {}
    for backend in ("reference", "fused"):
        args = [a.clone().requires_grad_() if a is not None and a.is_floating_point() else a for a in moe_args(inputs)]
        out = mok.moe(*args, backend=backend, precision=precision)
        out.backward(inputs["d_out"])
        outs[backend] = (out.detach(), [a.grad for a in args if a is not None and a.is_floating_point()])
    (out0, grads0), (out, grads) = outs["reference"], outs["fused"]
    assert out.shape == (cfg.num_tokens, cfg.hidden) and all(g is not None for g in grads)
    # A tensor of a few elements (one token's K router gradients) is no sample for a relative tolerance: where the
    # level is not within it of L0, it must be as close to the fp64 truth as L0 is (bf16's router gradient rounds
    # in other places, DESIGN §3; both ~4% away from fp64 on single tokens).
    truth = testing.fp64_moe({n: t.cpu() for n, t in inputs.items()}, None) if cfg.num_tokens else None
    for i, (got, want) in enumerate(zip([out, *grads], [out0, *grads0])):
        assert got.shape == want.shape
        if testing.rel_err(got, want) > TOL[precision]:
            exact = (truth[0] if i == 0 else truth[1][i - 1]).to(got.dtype).to(got.device)
            assert truth is not None and testing.rel_err(got, exact) <= 1.5 * testing.rel_err(want, exact), i
    if cfg.num_tokens == 0:
        assert all(not g.any() for g in grads)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("num_tokens", [0, 1])
def test_edge_batches_on_the_twins(monkeypatch, num_tokens, precision):
    """Empty and single-token batches through the fused level's wiring (kernels as twins, on the CPU)."""
    _use_twins(monkeypatch)
    _edge_batch_is_l0(TINY_SHAPES["tiny"].scaled(num_tokens=num_tokens), "cpu", precision)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("num_tokens", [0, 1])
def test_edge_batches_on_the_gpu(num_tokens, precision):
    """The same on the kernels: an empty batch launches none (its backward used to fail in the weight gradients)."""
    _edge_batch_is_l0(TINY_SHAPES["tiny"].scaled(num_tokens=num_tokens), "cuda", precision)
