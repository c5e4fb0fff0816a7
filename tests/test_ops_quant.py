"""MXFP8 kernels (mok.ops) against the L0 spec (mok.mxfp8): bit for bit, data bytes and scale bytes.

The L0 reference runs on the CPU (the spec as written); kernels run on the Hopper GPU. Inputs are
drawn fresh on every run (the seed is in each failure message). Outputs come from a caching
allocator poisoned with 0x55 bytes first, so an element the kernel never writes cannot pass.
"""

from __future__ import annotations

import pytest
import torch

from mok import mxfp8, ops
from mok.testing import fresh_seed, poison_allocator

# ---- helpers ------------------------------------------------------------------------------------


def _random_bf16(shape: tuple, seed: int) -> torch.Tensor:
    """randn with per-row and per-column power-of-two magnitudes (scales spread over ~2^±40) and a
    sprinkle of exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)  # shape fp32
    x = x * torch.exp2(torch.randint(-30, 31, (*shape[:-1], 1), generator=gen).float())  # per-row magnitude
    x = x * torch.exp2(torch.randint(-10, 11, (shape[-1],), generator=gen).float())  # per-column magnitude
    x = torch.where(torch.rand(shape, generator=gen) < 0.02, 0.0, x)  # shape
    return x.bfloat16()


def _assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str, seed: int) -> None:
    a = actual.cpu().view(torch.uint8)  # same shape, raw bytes
    e = expected.view(torch.uint8)  # same shape, raw bytes
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} vs L0 {tuple(e.shape)} (seed {seed})"
    diff = (a != e).nonzero()
    if len(diff):
        first = diff[:4].tolist()
        got = [hex(a[tuple(i)].item()) for i in first]
        want = [hex(e[tuple(i)].item()) for i in first]
        raise AssertionError(f"{what}: {len(diff)} of {a.numel()} bytes differ from L0 (seed {seed}); "
                             f"first at {first}: got {got}, L0 {want}")


def _check_quantize(x: torch.Tensor, seed: int, ops_list=("rowwise", "colwise", "dual")) -> None:
    """Runs each op on x (CPU bf16) on the GPU and compares it with L0 bit for bit."""
    rows, cols = x.shape[-2], x.shape[-1]
    xg = x.cuda()
    ref_row = mxfp8.quantize(x, dim=-1) if cols % 32 == 0 else None
    ref_col = mxfp8.quantize(x, dim=-2) if rows % 32 == 0 else None
    for op in ops_list:
        poison_allocator(4 * x.numel() * 2, byte=0x55)
        if op == "rowwise":
            outs = [("rowwise", ops.mxfp8_quantize_rowwise(xg), ref_row)]
        elif op == "colwise":
            outs = [("colwise", ops.mxfp8_quantize_colwise(xg), ref_col)]
        else:
            got_row, got_col = ops.mxfp8_quantize_dual(xg)
            outs = [("dual/row", got_row, ref_row), ("dual/col", got_col, ref_col)]
        for name, (data, scales), (ref_data, ref_scales) in outs:
            _assert_bytes_equal(scales, ref_scales, f"{name} scales, x {tuple(x.shape)}", seed)
            _assert_bytes_equal(data, ref_data, f"{name} data, x {tuple(x.shape)}", seed)


def _assert_bf16_equal(actual: torch.Tensor, expected: torch.Tensor, what: str, seed: int) -> None:
    """Bit-exact except that any NaN equals any NaN (NaN payloads differ between CPU and GPU casts)."""
    a, e = actual.cpu(), expected
    nan_a, nan_e = a.isnan(), e.isnan()
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ from L0 (seed {seed})"
    _assert_bytes_equal(a[~nan_a].view(torch.int16), e[~nan_e].view(torch.int16), what, seed)


# ---- quantization: random inputs ------------------------------------------------------------------

# Rows and columns off multiples of 128 on purpose (row-wise allows any rows; column-wise any
# multiple of 8 columns); 3D = [experts, rows, cols]; 4104 columns = 64 tiles + a partial one.
ROWWISE_SHAPES = [(1, 32), (37, 96), (130, 224), (257, 7168), (3, 33, 64), (2, 5, 4096), (0, 64)]
COLWISE_SHAPES = [(32, 8), (64, 72), (96, 200), (160, 1024), (3, 64, 96), (2, 32, 4104), (4, 32, 0)]
DUAL_SHAPES = [(32, 32), (64, 96), (96, 224), (320, 2080), (3, 64, 160), (2, 128, 7168)]


QUANTIZE_CASES = ([("rowwise", s) for s in ROWWISE_SHAPES] + [("colwise", s) for s in COLWISE_SHAPES]
                  + [("dual", s) for s in DUAL_SHAPES])


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("op,shape", QUANTIZE_CASES, ids=lambda v: str(v))
def test_quantize_matches_l0(op, shape):
    seed = fresh_seed()
    _check_quantize(_random_bf16(shape, seed), seed, [op])


# Column-wise and dual at shapes that stress their tiling: 24576 x 544 has many tiles per resident warp and
# 544 = 512 + 32 columns leaves a partial last column tile (of dual's 512-column tiles: a second span of 32 valid
# columns); 3D folds experts into rows (1056 = 2 x 512 + 32); 1064 columns (column-wise only: not a multiple of
# 32) leaves a partial warp tile of 40 columns; 65536 x 288: 2048 dual tiles, so every stage of dual's persistent
# CTAs is filled several times; 32 x 32 is one partial tile (dual: a second span wholly past the end); 64 x 7168
# has fewer dual tiles than CTAs.
@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("shape", [(24576, 544), (3, 96, 1056), (64, 1064), (65536, 288), (32, 32), (64, 7168)],
                         ids=str)
def test_colwise_and_dual_tilings_match_l0(shape):
    seed = fresh_seed()
    x = _random_bf16(shape, seed)  # shape
    ref_row = mxfp8.quantize(x, dim=-1) if shape[-1] % 32 == 0 else None
    ref_col = mxfp8.quantize(x, dim=-2)
    xg = x.cuda()  # shape
    poison_allocator(4 * x.numel() * 2, byte=0x55)
    outs = [("colwise", ops.mxfp8_quantize_colwise(xg), ref_col)]
    if ref_row is not None:
        got_row, got_col = ops.mxfp8_quantize_dual(xg)
        outs += [("dual/row", got_row, ref_row), ("dual/col", got_col, ref_col)]
    for name, (data, scales), (ref_data, ref_scales) in outs:
        _assert_bytes_equal(scales, ref_scales, f"{name} scales, x {shape}", seed)
        _assert_bytes_equal(data, ref_data, f"{name} data, x {shape}", seed)


@pytest.mark.gpu
@pytest.mark.sm90
def test_dual_edge_cases_match_l0():
    """Every bf16 amax and the special-value blocks through dual's row warps ([n, 32]: one partial tile per row
    block) and column warps ([32, n])."""
    seed = fresh_seed()
    every = _every_bf16_as_block_amax(seed)  # [65536, 32]
    special = _special_blocks(seed)  # [32 * n, 32]
    for x in (every, every.T.contiguous(), special, special.T.contiguous(), torch.stack([special, -special])):
        _check_quantize(x, seed, ["dual"])


# ---- quantization: edge cases ---------------------------------------------------------------------


def _every_bf16_as_block_amax(seed: int) -> torch.Tensor:
    """[65536, 32]: block i holds bf16 bit pattern i (both signs, NaNs and Infs included) at a random
    position, the other 31 values no larger in magnitude. Covers every amax the ceil rule can see."""
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.arange(0x10000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # [65536]
    others = pattern.float()[:, None] * (2 * torch.rand(0x10000, 31, generator=gen) - 1)  # [65536, 31]
    x = torch.cat([pattern[:, None], others.bfloat16()], dim=1)  # [65536, 32] |others| <= |pattern|
    perm = torch.rand(0x10000, 32, generator=gen).argsort(dim=1)  # [65536, 32]
    return x.gather(1, perm)  # [65536, 32]


def _special_blocks(seed: int) -> torch.Tensor:
    """[num_blocks, 32] bf16 rows of the L0 edge-case table (DESIGN §12), at random positions."""
    gen = torch.Generator().manual_seed(seed)
    nan, inf = float("nan"), float("inf")
    tiny_bits = torch.tensor([0x0001, 0x807F, 0x0040, 0x8001], dtype=torch.int32).to(torch.int16)
    tiny = tiny_bits.view(torch.bfloat16).float()
    floor = torch.tensor(1e-12, dtype=torch.float32)
    below, above = floor.bfloat16().float(), (floor * 1.01).bfloat16().float()  # around the amax floor
    rows = [
        torch.zeros(32), -torch.zeros(32), torch.tensor([0.0, -0.0] * 16),
        torch.cat([tiny, torch.zeros(28)]), torch.full((32,), below.item()), torch.full((32,), above.item()),
        torch.tensor([nan] + [1.0] * 31), torch.tensor([inf] + [1.0] * 31), torch.tensor([-inf] + [2.0] * 31),
        torch.tensor([inf, -inf, nan] + [0.0] * 29), torch.tensor([3.3895e38, -3.3895e38] + [1.0] * 30),
    ]
    for k in range(-30, 31, 3):
        for amax in (448.0, 450.0, 446.0, 1.75, 1.7578125, 1.0, 2.0):  # the ceil rule's flip points
            small = (torch.rand(31, generator=gen) * 2 - 1) * amax
            rows.append(torch.cat([torch.tensor([amax]), small]) * 2.0**k)
            rows.append(-rows[-1])
    x = torch.stack(rows).bfloat16()  # [num_blocks, 32]
    perm = torch.rand(x.shape, generator=gen).argsort(dim=1)  # [num_blocks, 32]
    x = x.gather(1, perm)  # [num_blocks, 32]
    pad = -x.shape[0] % 32  # column-wise and dual need rows % 32 == 0
    return torch.cat([x, torch.ones(pad, 32, dtype=torch.bfloat16)])  # [32 * n, 32]


@pytest.mark.gpu
@pytest.mark.sm90
def test_every_bf16_amax_matches_l0():
    seed = fresh_seed()
    x = _every_bf16_as_block_amax(seed)  # [65536, 32] blocks along rows
    _check_quantize(x, seed, ["rowwise", "dual"])
    _check_quantize(x.T.contiguous(), seed, ["colwise", "dual"])  # [32, 65536] blocks along columns


@pytest.mark.gpu
@pytest.mark.sm90
def test_special_values_match_l0():
    seed = fresh_seed()
    x = _special_blocks(seed)  # [32 * n, 32]
    _check_quantize(x, seed)
    _check_quantize(x.T.contiguous(), seed)  # the same blocks column-wise
    _check_quantize(torch.stack([x, -x]), seed)  # 3D [2, 32 * n, 32]


@pytest.mark.gpu
@pytest.mark.sm90
def test_quantize_is_deterministic():
    x = _random_bf16((4, 256, 1024), fresh_seed()).cuda()  # [experts, rows, cols]
    first = ops.mxfp8_quantize_dual(x)
    second = ops.mxfp8_quantize_dual(x)
    for a, b in zip(first, second):
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


# ---- dequantization -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("shape,dim", [((37, 96), -1), ((3, 5, 64), -1), ((64, 72), -2), ((2, 96, 200), -2),
                                       ((2, 96, 200), 1)], ids=str)
def test_dequantize_every_byte_matches_l0(shape, dim):
    """Random data bytes (all 256 E4M3 codes, NaN too) and scale bytes (0..255: subnormal 2^-127,
    overflow to Inf, the NaN scale)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn)  # shape
    scale_shape = list(shape)
    scale_shape[dim] //= 32
    scales = torch.randint(0, 256, scale_shape, generator=gen, dtype=torch.uint8)  # shape, dim / 32
    poison_allocator(4 * data.numel() * 2, byte=0x55)
    got = ops.mxfp8_dequantize(data.cuda(), scales.cuda(), dim=dim)
    _assert_bf16_equal(got, mxfp8.dequantize(data, scales, dim=dim), f"dequantize {shape} dim {dim}", seed)


@pytest.mark.gpu
@pytest.mark.sm90
def test_roundtrip_matches_l0_fake_quantize():
    seed = fresh_seed()
    x = _random_bf16((2, 64, 512), seed)  # [experts, rows, cols]
    (dr, sr), (dc, sc) = ops.mxfp8_quantize_dual(x.cuda())
    _assert_bf16_equal(ops.mxfp8_dequantize(dr, sr, -1), mxfp8.fake_quantize(x, -1), "roundtrip row", seed)
    _assert_bf16_equal(ops.mxfp8_dequantize(dc, sc, -2), mxfp8.fake_quantize(x, -2), "roundtrip col", seed)


# ---- the one-pass round trip (mxfp8_fake_quantize) ------------------------------------------------


def _check_fake_quantize(x: torch.Tensor, seed: int, dims=(-1, -2, "dual")) -> None:
    """The one-pass round trip against the quantize + dequantize kernel pair (the same bits, NaN payloads
    included: the same functions) and against L0 (any NaN equals any NaN)."""
    rows, cols = x.shape[-2], x.shape[-1]
    xg = x.cuda()
    for dim in dims:
        if (dim != -2 and cols % 32) or (dim != -1 and rows % 32):
            continue
        poison_allocator(4 * x.numel() * 2, byte=0x55)
        if dim == "dual":
            got = dict(zip((-1, -2), ops.mxfp8_fake_quantize_dual(xg)))
        else:
            got = {dim: ops.mxfp8_fake_quantize(xg, dim)}
        for d, out in got.items():
            quantize = ops.mxfp8_quantize_rowwise if d == -1 else ops.mxfp8_quantize_colwise
            pair = ops.mxfp8_dequantize(*quantize(xg), d)
            what = f"fake_quantize {dim} (dim {d}), x {tuple(x.shape)}"
            same = torch.equal(out.view(torch.int16), pair.view(torch.int16))
            assert same, f"{what}: differs from the quantize + dequantize pair (seed {seed})"
            _assert_bf16_equal(out, mxfp8.fake_quantize(x, d), what, seed)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("shape", sorted(set(ROWWISE_SHAPES + COLWISE_SHAPES + DUAL_SHAPES)), ids=str)
def test_fake_quantize_is_the_quantize_dequantize_pair(shape):
    seed = fresh_seed()
    _check_fake_quantize(_random_bf16(shape, seed), seed)


@pytest.mark.gpu
@pytest.mark.sm90
def test_fake_quantize_special_values_and_every_amax():
    seed = fresh_seed()
    x = _special_blocks(seed)  # [32 * n, 32]
    _check_fake_quantize(x, seed)
    _check_fake_quantize(x.T.contiguous(), seed)
    amax = _every_bf16_as_block_amax(seed)  # [65536, 32]
    _check_fake_quantize(amax, seed, dims=(-1,))
    _check_fake_quantize(amax.T.contiguous(), seed, dims=(-2,))


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("real", [0, 40, 96, 256, 1000], ids=str)
def test_fake_quantize_stops_at_counts(real):
    """With a schedule's counts the column-wise and dual round trips write the 32-row blocks that start before
    counts[0] (a block it cuts into is written whole) with the unbounded op's bits, and leave every later row
    as it was: a NaN sentinel, through the raw binding (the ops allocate their outputs)."""
    seed = fresh_seed()
    x = _random_bf16((256, 224), seed).cuda()  # [rows, cols]
    written = min(256, -(-real // 32) * 32)
    counts = torch.tensor([real, 0], dtype=torch.int32, device="cuda")
    want_row, want_col = ops.mxfp8_fake_quantize_dual(x)
    ext = ops.load_extension()
    for dual in (True, False):
        out_col, out_row = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
        ext.mxfp8_fake_quantize(x=x, out=out_col, out_row=out_row if dual else None, rowwise=False, counts=counts)
        for what, out, want in [("col", out_col, want_col)] + ([("row", out_row, want_row)] if dual else []):
            what = f"{'dual' if dual else 'colwise'} {what}, counts[0] = {real} (seed {seed})"
            assert torch.equal(out[:written].view(torch.int16), want[:written].view(torch.int16)), what
            assert torch.isnan(out[written:]).all(), f"{what}: wrote a row past the blocks before counts[0]"
    got = ops.mxfp8_fake_quantize(x, -2, counts=counts)
    assert torch.equal(got[:written].view(torch.int16), want_col[:written].view(torch.int16)), f"op, seed {seed}"


# ---- bad input ------------------------------------------------------------------------------------


def test_cpu_tensor_is_rejected_before_any_build():
    x = torch.randn(64, 64).bfloat16()  # [rows, cols] on the CPU
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        ops.mxfp8_quantize_rowwise(x)
    with pytest.raises(ValueError, match=r"x: expected dtype torch.bfloat16, got torch.float32"):
        ops.mxfp8_quantize_colwise(x.float())
    with pytest.raises(ValueError, match=r"x: expected a 2D \[rows, cols\] or 3D"):
        ops.mxfp8_quantize_dual(x.flatten())
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        ops.mxfp8_fake_quantize(x, -2)
    with pytest.raises(ValueError, match="x: expected a CUDA tensor"):
        ops.mxfp8_fake_quantize_dual(x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_no_gpu_gives_a_clear_error():
    with pytest.raises(RuntimeError, match="need a Hopper GPU"):
        ops.load_extension()


@pytest.mark.gpu
@pytest.mark.sm90
def test_bad_inputs_raise_clear_errors():
    x = torch.randn(64, 96, device="cuda").bfloat16()  # [rows, cols]
    with pytest.raises(ValueError, match=r"x: expected a contiguous tensor"):
        ops.mxfp8_quantize_rowwise(x.T)
    with pytest.raises(ValueError, match=r"x: expected a 16-byte aligned"):
        ops.mxfp8_quantize_rowwise(x.flatten()[4:4 + 32 * 96].view(32, 96))  # 8-byte offset
    with pytest.raises(ValueError, match=r"x: expected cols \(last dim\) a multiple of 32"):
        ops.mxfp8_quantize_rowwise(x[:, :80].contiguous())
    with pytest.raises(ValueError, match=r"x: expected rows \(dim -2\) a multiple of 32"):
        ops.mxfp8_quantize_colwise(x[:40].contiguous())
    with pytest.raises(ValueError, match=r"x: expected cols \(last dim\) a multiple of 8"):
        ops.mxfp8_quantize_colwise(x[:, :36].contiguous())
    data, scales = ops.mxfp8_quantize_rowwise(x)
    with pytest.raises(ValueError, match=r"scales: expected shape \(2, 96\)"):
        ops.mxfp8_dequantize(data, scales, dim=-2)
    with pytest.raises(ValueError, match=r"dim: expected -1 or -2"):
        ops.mxfp8_dequantize(data, scales, dim=-3)
    with pytest.raises(ValueError, match=r"scales: expected dtype torch.uint8"):
        ops.mxfp8_dequantize(data, scales.int(), dim=-1)
    counts = torch.tensor([32, 0], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"counts: expected None or a schedule's int32 counts tensor"):
        ops.mxfp8_fake_quantize(x, -2, counts=counts.long())
    with pytest.raises(ValueError, match=r"counts: expected a contiguous tensor on cuda"):
        ops.mxfp8_fake_quantize_dual(x, counts=counts.cpu())
    with pytest.raises(ValueError, match=r"counts: expected None for a row-wise round trip"):
        ops.mxfp8_fake_quantize(x, -1, counts=counts)
    with pytest.raises(ValueError, match=r"counts: expected None for x of rank 3"):
        ops.mxfp8_fake_quantize(x.view(2, 32, 96), -2, counts=counts)
