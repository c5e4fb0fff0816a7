"""MXFP8 L0 reference (mok/mxfp8.py) against hand-computed bytes and an independent scalar model.

The heart of the file is the brute force over all 65536 bf16 bit patterns, checked against
`ref_quantize_block`: pure Python floats, exact log2 from math.frexp, and E4M3 round-to-nearest-even
done by hand on the table of the 127 finite non-negative E4M3 values. No torch in the model.
"""

from __future__ import annotations

import bisect
import math
import struct

import pytest
import torch

from mok import mxfp8
from mok.mxfp8 import dequantize, fake_quantize, quantize, scale_exponent

# ---- the independent scalar model ---------------------------------------------------------------


def e4m3_decode(byte: int) -> float:
    """Value of an E4M3 (fn) byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7F/0xFF are NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0**-9  # subnormal: man/8 * 2^-6
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


E4M3_TABLE = [e4m3_decode(b) for b in range(0x7F)]  # 0, 2^-9, ..., 448: increasing with the byte
assert E4M3_TABLE == sorted(E4M3_TABLE) and E4M3_TABLE[-1] == 448.0


def e4m3_rne_satfinite(y: float) -> int:
    """Byte of the E4M3 value nearest to the finite `y`, ties to the even byte, |y| >= 448 -> ±448."""
    sign = 0x80 if math.copysign(1.0, y) < 0 else 0x00
    a = abs(y)
    if a >= 448.0:
        return sign | 0x7E
    i = bisect.bisect_right(E4M3_TABLE, a) - 1  # TABLE[i] <= a < TABLE[i + 1]
    lo, hi = E4M3_TABLE[i], E4M3_TABLE[i + 1]
    if 2 * a != lo + hi:  # both sides exact in double: few significant bits
        return sign | (i if 2 * a < lo + hi else i + 1)
    return sign | (i if i % 2 == 0 else i + 1)  # tie: even mantissa = even byte


def to_fp32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def ref_scale_exponent(amax: float, rule: str) -> int:
    amax = max(amax, to_fp32(1e-12))
    if rule == "ceil":
        # fp32 / fp32 done in double, then rounded to fp32: double rounding is harmless for one
        # division since 53 >= 2 * 24 + 2, so this is the correctly rounded fp32 quotient.
        s = to_fp32(amax / 448.0)
        m, x = math.frexp(s)  # s = m * 2^x, m in [0.5, 1)
        e = x - 1 if m == 0.5 else x
    else:
        e = math.frexp(amax)[1] - 1 - 8
    return max(-127, min(127, e))


def ref_quantize_block(values: list[float], rule: str = "ceil") -> tuple[int, list[int]]:
    """(scale byte, data bytes) of one block, straight from DESIGN §4."""
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return 0xFF, [0x7F] * len(values)
    e = ref_scale_exponent(max(abs(v) for v in values), rule)
    return e + 127, [e4m3_rne_satfinite(math.ldexp(v, -e)) for v in values]  # ldexp: exact


def bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.bfloat16)


ALL_BF16 = bf16_from_bits(torch.arange(-(2**15), 2**15, dtype=torch.int32))  # [65536] every pattern


def assert_dequant_exact(data, scales, dim=-1):
    """dequantize(fp32) must equal decode(q) * 2^e exactly (NaN where the scale is 0xFF)."""
    out = dequantize(data, scales, dim=dim, dtype=torch.float32).movedim(dim, -1).flatten()
    q = data.movedim(dim, -1).view(torch.uint8).flatten().tolist()
    sb = scales.movedim(dim, -1).repeat_interleave(32, dim=-1).flatten().tolist()
    exp = [math.nan if s == 0xFF else math.ldexp(e4m3_decode(b), s - 127) for b, s in zip(q, sb)]
    exp = torch.tensor(exp, dtype=torch.float32)
    assert torch.equal(out.isnan(), exp.isnan())
    assert torch.equal(out.nan_to_num(0.0).view(torch.int32), exp.nan_to_num(0.0).view(torch.int32))


# ---- golden bytes, worked by hand ---------------------------------------------------------------

NAN, INF = math.nan, math.inf
# (first elements of a block, rest zeros) -> (scale byte, data bytes of those first elements)
GOLDEN = {
    "one": ([1.0], 0x77, [0x78]),  # s = 1/448 -> e = ceil(-8.81) = -8; 1 * 2^8 = 256 = 1.0 * 2^8
    "max": ([448.0], 0x7F, [0x7E]),  # s = 1 exactly -> e = 0; 448 = 1.75 * 2^8
    "neg_max": ([-448.0], 0x7F, [0xFE]),
    "flip_up": ([450.0], 0x80, [0x76]),  # next bf16 above 448: e = 1; 225 -> 224 = 1.75 * 2^7
    "below_max": ([446.0, 1.0], 0x7F, [0x7E, 0x38]),  # 446 -> 448; 1.0 = 2^0
    "flip_k=-10": ([0.4375], 0x75, [0x7E]),  # 448 * 2^-10 -> e = -10 exactly
    "flip_k=-10_up": ([0.439453125], 0x76, [0x76]),  # 450 * 2^-10 -> e = -9
    "rne_ties": ([448.0, 17.0, 19.0, -17.0], 0x7F, [0x7E, 0x58, 0x5A, 0xD8]),  # 17 -> 16, 19 -> 20
    "e4m3_subnormals": ([448.0, 2**-9, 2**-10, 3 * 2**-10, -(2**-9), 2**-6], 0x7F,
                        [0x7E, 0x01, 0x00, 0x02, 0x81, 0x08]),  # 2^-10 ties to 0; 3*2^-10 to 2^-8
    "zeros": ([0.0], 79, [0x00]),  # s = 1e-12/448 -> e = ceil(-48.67) = -48
    "neg_zero": ([-0.0], 79, [0x80]),  # the sign of zero is kept
    "bf16_subnormal": ([2**-133, -(2**-126)], 79, [0x00, 0x80]),  # amax < 1e-12 -> ±0
    "amax_at_clamp": ([1.75 * 2**-40], 79, [0x7E]),  # 448 * 2^-48 = 1.59e-12 -> e = -48
    "amax_below_clamp": ([1.75 * 2**-41], 79, [0x76]),  # 448 * 2^-49 < 1e-12: e = -48, 224
    "nan": ([1.0, NAN], 0xFF, [0x7F, 0x7F]),
    "inf": ([INF, 1.0], 0xFF, [0x7F, 0x7F]),
    "neg_inf": ([-INF], 0xFF, [0x7F]),
    "bf16_max": ([3.3895313892515355e38], 0xF7, [0x78]),  # e = 120; 255 -> 256: dequantizes to Inf
}


@pytest.mark.parametrize("name", list(GOLDEN))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_golden_bytes(name, dtype):
    head, scale_byte, head_bytes = GOLDEN[name]
    x = torch.zeros(3, 64, dtype=dtype)  # [3, 64] the block under test is row 1, block 1
    x[1, 32 : 32 + len(head)] = torch.tensor(head, dtype=dtype)
    x[[0, 2]] = torch.randn(2, 64).to(dtype)  # unrelated neighbours
    data, scales = quantize(x)
    nonfinite = scale_byte == 0xFF
    rest = [0x7F if nonfinite else 0x00] * (32 - len(head))
    assert scales[1, 1].item() == scale_byte
    assert data[1, 32:].view(torch.uint8).tolist() == head_bytes + rest
    assert ref_quantize_block(x[1, 32:].tolist()) == (scale_byte, head_bytes + rest)  # model agrees
    assert scales[1, 0].item() == 79 and scales[[0, 2]].ne(0xFF).all()  # neighbours untouched
    assert_dequant_exact(data, scales)


def test_dequantize_edge_values():
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, 0], x[0, 32], x[0, 64] = -0.0, NAN, 448.0
    out = fake_quantize(x)  # [1, 128]
    assert out.dtype == torch.bfloat16 and torch.signbit(out[0, 0])
    assert out[0, 32:64].isnan().all() and out[0, 64] == 448.0 and out[0, 96:].eq(0).all()
    top = torch.tensor([[1.9375 * 2**127, -1.9296875 * 2**127] + [0.0] * 30], dtype=torch.bfloat16)
    assert fake_quantize(top)[0, :2].tolist() == [math.inf, -240.0 * 2**120]  # 248 ties up to 256


# ---- the brute force: every bf16 bit pattern ----------------------------------------------------


@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_every_bf16_alone_in_its_block(rule):
    """Block b holds ALL_BF16[b] at position b % 32, zeros elsewhere: scale and all 32 bytes."""
    n = ALL_BF16.numel()
    pos = torch.arange(n) % 32  # [65536]
    x = torch.zeros(n, 32, dtype=torch.bfloat16)  # [65536, 32]
    x[torch.arange(n), pos] = ALL_BF16
    data, scales = quantize(x, rule=rule)

    expected_scales, value_bytes, fill = [], [], []
    for v in ALL_BF16.tolist():
        scale_byte, (vb, zb) = ref_quantize_block([v, 0.0], rule)
        expected_scales.append(scale_byte)
        value_bytes.append(vb)
        fill.append(zb)
    expected = torch.tensor(fill, dtype=torch.uint8)[:, None].repeat(1, 32)  # [65536, 32]
    expected[torch.arange(n), pos] = torch.tensor(value_bytes, dtype=torch.uint8)
    assert torch.equal(scales[:, 0], torch.tensor(expected_scales, dtype=torch.uint8))
    assert torch.equal(data.view(torch.uint8), expected)
    assert_dequant_exact(data[::7], scales[::7])  # every 7th block: the fp32 product is exact


@pytest.mark.parametrize(("anchor", "rule"), [(1.0, "ceil"), (3.0e38, "ceil"),
                                              (1e-20, "ceil"), (1.0, "floor")])
def test_every_bf16_beside_a_fixed_amax(anchor, rule):
    """Block b = [anchor, ALL_BF16[b] at 1 + b % 31, zeros]: every value quantized under one scale
    (or setting the scale itself when larger than the anchor). 3e38 drives tiny values below fp32's
    normal range after scaling; 1e-20 sits below the 1e-12 amax floor."""
    anchor = torch.tensor(anchor, dtype=torch.bfloat16).item()
    n = ALL_BF16.numel()
    pos = 1 + torch.arange(n) % 31  # [65536]
    x = torch.zeros(n, 32, dtype=torch.bfloat16)  # [65536, 32]
    x[:, 0] = anchor
    x[torch.arange(n), pos] = ALL_BF16
    data, scales = quantize(x, rule=rule)

    refs = [ref_quantize_block([anchor, v, 0.0], rule) for v in ALL_BF16.tolist()]
    expected = torch.tensor([r[1][2] for r in refs], dtype=torch.uint8)[:, None].repeat(1, 32)
    expected[:, 0] = torch.tensor([r[1][0] for r in refs], dtype=torch.uint8)
    expected[torch.arange(n), pos] = torch.tensor([r[1][1] for r in refs], dtype=torch.uint8)
    assert torch.equal(scales[:, 0], torch.tensor([r[0] for r in refs], dtype=torch.uint8))
    assert torch.equal(data.view(torch.uint8), expected)


def test_scale_exponent_matches_model_on_random_fp32():
    bits = torch.randint(0, 0x7F800000, (20000,), dtype=torch.int32)  # [20000] every finite fp32 >= 0
    amax = bits.view(torch.float32)
    for rule in ("ceil", "floor"):
        got = scale_exponent(amax, rule).tolist()
        assert got == [ref_scale_exponent(a, rule) for a in amax.tolist()]


def test_log2_from_bits_handles_subnormals():
    """Unreachable from scale_exponent (amax >= 1e-12), but the bit helper must be right anyway."""
    bits = torch.randint(1, 0x7F800000, (5000,), dtype=torch.int32)
    bits[:2000] = torch.randint(1, 0x800000, (2000,), dtype=torch.int32)  # fp32 subnormals
    bits[:23] = 1 << torch.arange(23, dtype=torch.int32)  # subnormal powers of two
    v = bits.view(torch.float32)  # [5000]
    floor_log2, has_fraction = mxfp8._log2_parts(v)
    frexps = [math.frexp(a) for a in v.tolist()]
    assert floor_log2.tolist() == [x - 1 for _, x in frexps]
    assert has_fraction.tolist() == [m != 0.5 for m, _ in frexps]


def test_exp2_exact_covers_fp32():
    k = torch.arange(-149, 128)  # [277]
    assert mxfp8.exp2_exact(k).tolist() == [math.ldexp(1.0, i) for i in k.tolist()]


# ---- the ceil rule's flip points ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ceil_flips_exactly_at_448_times_power_of_two(dtype):
    """amax = 448 * 2^k gives e = k; the next representable value above gives k + 1, the one below
    k. Below 448 * 2^-48 the 1e-12 floor holds e at -48 (the smallest scale the recipe produces)."""
    k = torch.arange(-48, 120, dtype=torch.int32)  # [168] 448 * 2^119 is the last below bf16 max
    at = (448.0 * mxfp8.exp2_exact(k)).to(dtype)  # [168] exact in bf16 and fp32
    int_view = torch.int16 if dtype == torch.bfloat16 else torch.int32
    up = (at.view(int_view) + 1).view(dtype)
    down = (at.view(int_view) - 1).view(dtype)
    assert torch.equal(scale_exponent(at.float()), k)
    assert torch.equal(scale_exponent(up.float()), k + 1)
    assert torch.equal(scale_exponent(down.float()), k)
    tiny = torch.tensor([448.0 * 2.0**-49, 1e-12, 1e-30, 0.0])
    assert scale_exponent(tiny).eq(-48).all()


# ---- saturation, the floor rule, round-trip error -----------------------------------------------


def test_floor_rule_differs_and_saturates():
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :3] = torch.tensor([480.0, 1.0, -500.0])
    data, scales = quantize(x, rule="ceil")  # amax 500: s = 1.116 -> e = 1
    assert scales.item() == 128 and data.view(torch.uint8)[0, :3].tolist() == [0x77, 0x30, 0xF8]
    data, scales = quantize(x, rule="floor")  # floor(log2 500) - 8 = 0: 480, 500 -> ±448
    assert scales.item() == 127 and data.view(torch.uint8)[0, :3].tolist() == [0x7E, 0x38, 0xFE]

    x = torch.randn(64, 256, dtype=torch.float32).mul(100).bfloat16()  # [64, 256]
    data, scales = quantize(x, rule="floor")
    scaled = x.float() * mxfp8.exp2_exact(127 - scales.int()).repeat_interleave(32, -1)  # x * 2^-e
    amax_scaled = scaled.abs().unflatten(-1, (-1, 32)).amax(-1)  # [64, 8]
    assert amax_scaled.ge(256).all() and amax_scaled.lt(512).all()
    saturated = scaled.abs() >= 464  # beyond the last rounding midpoint
    assert saturated.any() and data.float().abs()[saturated].eq(448).all()
    assert data.float().abs().max() == 448  # never NaN


def test_ceil_rule_never_saturates():
    x = torch.randn(256, 512).mul(torch.logspace(-30, 30, 256)[:, None]).bfloat16()  # [256, 512]
    _, scales = quantize(x)
    scaled = x.float() * mxfp8.exp2_exact(127 - scales.int()).repeat_interleave(32, -1)
    assert scaled.abs().max() <= 448  # exact in fp32; the ceil rule keeps every block in range


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_error_bound(dtype):
    x = torch.randn(128, 256).mul(torch.logspace(-12, 12, 128)[:, None]).to(dtype)  # [128, 256]
    data, scales = quantize(x)
    out = dequantize(data, scales, dtype=torch.float32)  # [128, 256]
    step = mxfp8.exp2_exact(scales.int() - 127).repeat_interleave(32, -1)  # 2^e per element
    normal = x.float().abs() >= 2.0**-6 * step  # in E4M3's normal range after scaling
    err = (out - x.float()).abs()
    assert normal.float().mean() > 0.9
    assert (err[normal] <= 2.0**-4 * x.float().abs()[normal]).all()  # half an ulp of 3 mantissa bits
    assert (err[~normal] <= 2.0**-10 * step[~normal]).all()  # half the subnormal spacing
    assert mxfp8.sqnr_db(x, fake_quantize(x)) > 25.0


# ---- layouts: dims, ranks, padding --------------------------------------------------------------


def test_colwise_equals_rowwise_of_transpose():
    x = torch.randn(4, 96, 64, dtype=torch.bfloat16)  # [experts, rows, cols]
    data, scales = mxfp8.quantize_colwise(x)  # blocks along rows
    data_t, scales_t = mxfp8.quantize_rowwise(x.mT.contiguous())
    assert data.shape == (4, 96, 64) and scales.shape == (4, 3, 64)
    assert torch.equal(data.view(torch.uint8), data_t.mT.view(torch.uint8))
    assert torch.equal(scales, scales_t.mT)
    assert torch.equal(fake_quantize(x, dim=1), fake_quantize(x.mT, dim=-1).mT)


def test_any_rank_and_dim_equal_per_slice():
    x = torch.randn(3, 64, 5, 2, dtype=torch.bfloat16)  # blocks along dim 1
    data, scales = quantize(x, dim=1)
    assert data.shape == x.shape and scales.shape == (3, 2, 5, 2)
    for i in range(3):
        for j in range(5):
            d, s = quantize(x[i, :, j, :].T.contiguous())  # [2, 64] rowwise
            assert torch.equal(d.view(torch.uint8), data[i, :, j, :].T.view(torch.uint8))
            assert torch.equal(s, scales[i, :, j, :].T)
    assert torch.equal(quantize(x, dim=-3)[1], scales)


def test_padding_aligns_blocks_to_the_segment_start():
    seg = torch.randn(37, 64, dtype=torch.bfloat16)  # an expert segment: 37 rows
    padded = mxfp8.pad_to_block(seg, dim=0)  # [64, 64]
    assert padded.shape == (64, 64) and padded[37:].eq(0).all() and torch.equal(padded[:37], seg)
    assert mxfp8.pad_to_block(padded, dim=0) is padded
    data, scales = mxfp8.quantize_padded(seg, dim=0)
    assert data.shape == (64, 64) and scales.shape == (2, 64)
    for c in range(0, 64, 9):  # the partial block [32, 37) + 27 zero rows
        assert ref_quantize_block(padded[32:, c].tolist()) == (
            scales[1, c].item(), data[32:, c].view(torch.uint8).tolist())
    out = fake_quantize(seg, dim=0, pad=True)  # [37, 64]
    assert out.shape == seg.shape and torch.equal(out, dequantize(data, scales, dim=0)[:37])


def test_empty_and_zero_size():
    data, scales = quantize(torch.zeros(0, 64, dtype=torch.bfloat16))
    assert data.shape == (0, 64) and scales.shape == (0, 2)
    data, scales = quantize(torch.zeros(5, 0, dtype=torch.bfloat16))
    assert data.shape == (5, 0) and scales.shape == (5, 0)


def test_sqnr_db():
    ref = torch.ones(100)
    assert mxfp8.sqnr_db(ref, ref) == math.inf
    assert mxfp8.sqnr_db(ref, ref * 1.1) == pytest.approx(20.0)


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda: quantize(torch.zeros(2, 32, dtype=torch.float16)), TypeError, ["x", "float16"]),
    (lambda: quantize(torch.zeros(2, 32, dtype=torch.int32)), TypeError, ["x", "int32"]),
    (lambda: quantize([1.0] * 32), TypeError, ["x", "list"]),
    (lambda: quantize(torch.zeros(2, 48, dtype=torch.bfloat16)), ValueError, ["x", "dim 1", "48", "32"]),
    (lambda: quantize(torch.zeros(48, 32, dtype=torch.bfloat16), dim=0), ValueError, ["x", "dim 0", "48"]),
    (lambda: quantize(torch.zeros(2, 32, dtype=torch.bfloat16), dim=2), ValueError, ["dim", "got 2"]),
    (lambda: quantize(torch.tensor(1.0, dtype=torch.bfloat16)), ValueError, ["x", "0-dim"]),
    (lambda: quantize(torch.zeros(2, 32, dtype=torch.bfloat16), rule="round"), ValueError, ["rule"]),
    (lambda: scale_exponent(torch.zeros(2, dtype=torch.bfloat16)), TypeError, ["amax", "float32"]),
    (lambda: dequantize(torch.zeros(2, 32), torch.zeros(2, 1, dtype=torch.uint8)), TypeError,
     ["data", "float8_e4m3fn"]),
    (lambda: dequantize(torch.zeros(2, 32).to(torch.float8_e4m3fn), torch.zeros(2, 1)), TypeError,
     ["scales", "uint8"]),
    (lambda: dequantize(torch.zeros(2, 32).to(torch.float8_e4m3fn), torch.zeros(2, 2, dtype=torch.uint8)),
     ValueError, ["scales", "(2, 1)", "(2, 2)"]),
    (lambda: dequantize(torch.zeros(64, 32).to(torch.float8_e4m3fn), torch.zeros(64, 1, dtype=torch.uint8),
                        dim=0), ValueError, ["scales", "(2, 32)"]),
    (lambda: mxfp8.sqnr_db(torch.ones(3), torch.ones(4)), ValueError, ["approx", "(3,)"]),
])
def test_bad_input_is_named(call, error, words):
    with pytest.raises(error) as info:
        call()
    for word in words:
        assert word in str(info.value)


# ---- the same function on a GPU -----------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_matches_cpu_bit_for_bit():
    """Same bytes from CUDA torch (its own casts, its scalar-division rewrite, its reductions)."""
    n = ALL_BF16.numel()
    x = torch.zeros(n, 32, dtype=torch.bfloat16)  # [65536, 32]
    x[torch.arange(n), torch.arange(n) % 32] = ALL_BF16
    x = torch.cat([x, torch.randn(4096, 32).mul(torch.logspace(-20, 20, 4096)[:, None]).bfloat16()])
    for rule in ("ceil", "floor"):
        data, scales = quantize(x, rule=rule)
        data_gpu, scales_gpu = quantize(x.cuda(), rule=rule)
        assert torch.equal(scales, scales_gpu.cpu())
        assert torch.equal(data.view(torch.uint8), data_gpu.cpu().view(torch.uint8))
    amax = torch.randint(0, 0x7F800000, (1 << 20,), dtype=torch.int32).view(torch.float32)
    assert torch.equal(scale_exponent(amax), scale_exponent(amax.cuda()).cpu())
    out = dequantize(data_gpu, scales_gpu, dtype=torch.float32).cpu()
    assert torch.equal(out.nan_to_num(0.0).view(torch.int32),
                       dequantize(data, scales, dtype=torch.float32).nan_to_num(0.0).view(torch.int32))
