"""MXFP8 quantization, L0 reference: the bit-exact spec the CUDA kernels match (DESIGN §4).

Recipe (MoK's, after NVIDIA arXiv 2506.08027; "ceil" / RCEIL rule):
    blocks of BLOCK_SIZE = 32 consecutive elements along `dim` (the GEMM's K) share one scale;
    amax = max |x| over the block, in fp32 (exact);
    s    = max(amax, 1e-12f) / 448.0f          one IEEE fp32 division, round to nearest even;
    e    = ceil(log2(s))                        exactly, from the bits of s; clamped to [-127, 127];
    scale byte (E8M0) = e + 127;  data q = e4m3_rn_satfinite(x * 2^-e);  dequantized q * 2^e.

Edge cases (DESIGN §12 has the same table; tests/test_mxfp8.py tests each row):

    | block holds                      | scale byte      | data bytes                             |
    |----------------------------------|-----------------|----------------------------------------|
    | a NaN (anywhere)                 | 0xFF (E8M0 NaN) | all 0x7F (E4M3 NaN), whole block       |
    | ±Inf, no NaN                     | 0xFF            | all 0x7F: MX cannot encode Inf         |
    | only zeros                       | 79 (e = -48)    | +0.0 -> 0x00, -0.0 -> 0x80 (sign kept) |
    | amax < 1e-12 (all bf16 subnormals) | 79 (e = -48)  | ±0 (0x00 / 0x80); a bf16 subnormal is ±0 in any block |
    | amax = 448 * 2^k                 | 127 + k         | amax -> 0x7E (448)                     |
    | amax = 450 * 2^k (next bf16 up)  | 128 + k         | amax -> 0x76 (225 rounds to 224)       |
    | |x| >= 1.9375 * 2^127 (bf16 top) | 247 (e = 120)   | 0x78 (256): dequantizes to ±Inf        |
    | saturation, ceil rule            | -               | never: |x * 2^-e| <= 448 for finite fp32 x |
    | saturation, floor rule           | -               | scaled amax in [256, 512): > 448 -> ±0x7E |

Inputs: bf16 (the spec: every MXFP8 operand is quantized from BF16) or fp32 (same recipe; handy
for tests and notebooks). Any rank; blocks run along `dim`, whose size must be a multiple of 32
(`pad_to_block` zero-pads; zeros never change a block's amax).

NOTE (for kernel writers): the spec divides. torch on CUDA turns `t / python_scalar` into a multiply by
the reciprocal; an exhaustive check over every positive fp32 amax found the same ceil exponent either
way (fl(1/448) rounds up), but the divisor here is a tensor so the code is the spec. Also
`fmaxf(NaN, 1e-12f)` is 1e-12f in CUDA: find non-finite blocks separately. torch's fp32 -> e4m3fn cast
gives NaN from 464 up in 2.11 (CPU and CUDA) but saturates in 2.13: the clamp makes `quantize` not care.
"""

from __future__ import annotations

import math

import torch

BLOCK_SIZE = 32  # elements per scale, along the GEMM's K dimension
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E4M3_EMAX = 8  # floor(log2(448)): emax_elem of OCP's floor rule
SCALE_NAN = 0xFF  # E8M0 NaN code
SCALE_BIAS = 127  # E8M0 bias: scale = 2^(byte - 127)
E4M3_NAN = 0x7F  # the NaN byte written for every element of a NaN/Inf block
AMAX_MIN = 1e-12  # amax floor, so an all-zero block gets a finite scale
RULES = ("ceil", "floor")  # "floor" = OCP's suggested rule, reference-only


# ---- exact power-of-two arithmetic from fp32 bits ----------------------------------------------


def exp2_exact(k: torch.Tensor) -> torch.Tensor:
    """2^k as fp32, exactly, for integer k in [-149, 127] (subnormals included), built from bits."""
    k = k.to(torch.int32)
    normal = (k + 127).clamp(1, 254) << 23  # biased exponent field, mantissa 0
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)  # one mantissa bit: 2^(k + 149) * 2^-149
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _log2_parts(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For fp32 v >= 0 (finite): (floor(log2 v), v is not a power of two), both from the bits.
    Subnormals are first scaled by 2^64 (exact) so their leading bit lands in the exponent field;
    v = 0 gives floor = -191 (clamped away by callers)."""
    bits = v.view(torch.int32)  # [...] sign bit is 0
    is_subnormal = (bits >> 23) == 0
    v = torch.where(is_subnormal, v * 2.0**64, v)  # exact: power-of-two scaling of a tiny value
    bits = v.view(torch.int32)
    floor_log2 = (bits >> 23) - 127 - torch.where(is_subnormal, 64, 0).to(torch.int32)
    has_fraction = (bits & 0x7FFFFF) != 0
    return floor_log2.to(torch.int32), has_fraction


def scale_exponent(amax: torch.Tensor, rule: str = "ceil") -> torch.Tensor:
    """Unbiased E8M0 scale exponent per block, int32, in [-127, 127], from fp32 `amax` (>= 0).

    rule="ceil":  e = ceil(log2(fp32(max(amax, 1e-12) / 448)))      (the recipe, DESIGN §4)
    rule="floor": e = floor(log2(max(amax, 1e-12))) - 8             (OCP's suggestion; reference only:
                  the scaled amax lands in [256, 512) and values above 448 saturate)
    Non-finite amax comes out as 127; `quantize` maps such blocks to SCALE_NAN itself."""
    if rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES}, got {rule!r}")
    if amax.dtype != torch.float32:
        raise TypeError(f"amax: expected dtype torch.float32, got {amax.dtype}")
    amax = torch.maximum(amax, torch.full_like(amax, AMAX_MIN))  # [...] fp32 constant 1e-12f
    if rule == "ceil":
        s = amax / torch.full_like(amax, E4M3_MAX)  # [...] true IEEE division (tensor divisor)
        floor_log2, has_fraction = _log2_parts(s)
        e = floor_log2 + has_fraction.to(torch.int32)  # ceil(log2 s)
    else:
        floor_log2, _ = _log2_parts(amax)
        e = floor_log2 - E4M3_EMAX
    return e.clamp(-SCALE_BIAS, SCALE_BIAS)  # [...] int32


# ---- validation ---------------------------------------------------------------------------------


def _check_dim(name: str, t: torch.Tensor, dim: int) -> int:
    if t.dim() == 0:
        raise ValueError(f"{name}: expected a tensor of rank >= 1, got a 0-dim tensor")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"dim: expected in [{-t.dim()}, {t.dim() - 1}] for {name} of shape "
                         f"{tuple(t.shape)}, got {dim}")
    return dim % t.dim()


def _check_input(x: torch.Tensor, dim: int, rule: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x: expected dtype torch.bfloat16 or torch.float32, got {x.dtype}")
    if rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES}, got {rule!r}")
    dim = _check_dim("x", x, dim)
    if x.shape[dim] % BLOCK_SIZE != 0:
        raise ValueError(f"x: size along dim {dim} must be a multiple of {BLOCK_SIZE}, got shape "
                         f"{tuple(x.shape)} (size {x.shape[dim]}); pad with pad_to_block(x, dim)")
    return dim


# ---- quantize / dequantize ----------------------------------------------------------------------


def quantize(x: torch.Tensor, dim: int = -1, rule: str = "ceil") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize `x` in blocks of 32 along `dim`.

    Returns (data, scales): data float8_e4m3fn with x's shape; scales uint8 (E8M0, biased) with x's
    shape except size[dim] // 32. Both contiguous, in x's layout (no swizzle)."""
    dim = _check_input(x, dim, rule)
    xb = x.movedim(dim, -1).float()  # [..., K] fp32 (exact from bf16)
    xb = xb.unflatten(-1, (-1, BLOCK_SIZE))  # [..., K / 32, 32]
    finite = torch.isfinite(xb).all(dim=-1)  # [..., K / 32] False if any NaN/Inf in the block
    amax = torch.where(torch.isfinite(xb), xb.abs(), 0.0).amax(dim=-1)  # [..., K / 32] fp32
    e = scale_exponent(amax, rule)  # [..., K / 32] int32 in [-127, 127]
    scaled = xb * exp2_exact(-e).unsqueeze(-1)  # [..., K / 32, 32] exact unless < 2^-126 (-> ±0 anyway)
    scaled = scaled.clamp(-E4M3_MAX, E4M3_MAX)  # satfinite; |v| in (448, 464) rounds to 448 anyway
    data = scaled.to(torch.float8_e4m3fn).view(torch.uint8)  # [..., K / 32, 32] RNE
    data = torch.where(finite.unsqueeze(-1), data, E4M3_NAN)  # [..., K / 32, 32] NaN/Inf blocks -> 0x7F
    scales = torch.where(finite, e + SCALE_BIAS, SCALE_NAN).to(torch.uint8)  # [..., K / 32]
    data = data.flatten(-2).view(torch.float8_e4m3fn).movedim(-1, dim).contiguous()  # x.shape
    scales = scales.movedim(-1, dim).contiguous()  # x.shape with size[dim] // 32
    return data, scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, dim: int = -1,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q * 2^e in fp32 (exact unless it overflows), cast to `dtype`; a 0xFF scale gives NaN for its
    whole block."""
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"data: expected dtype torch.float8_e4m3fn, got {data.dtype}")
    if scales.dtype != torch.uint8:
        raise TypeError(f"scales: expected dtype torch.uint8, got {scales.dtype}")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating-point dtype, got {dtype}")
    dim = _check_dim("data", data, dim)
    expected = list(data.shape)
    if expected[dim] % BLOCK_SIZE != 0:
        raise ValueError(f"data: size along dim {dim} must be a multiple of {BLOCK_SIZE}, got shape "
                         f"{tuple(data.shape)}")
    expected[dim] //= BLOCK_SIZE
    if list(scales.shape) != expected:
        raise ValueError(f"scales: expected shape {tuple(expected)} for data of shape "
                         f"{tuple(data.shape)} and dim {dim}, got {tuple(scales.shape)}")
    q = data.movedim(dim, -1).float().unflatten(-1, (-1, BLOCK_SIZE))  # [..., K / 32, 32] fp32
    sb = scales.movedim(dim, -1).to(torch.int32)  # [..., K / 32] biased exponent
    scale = exp2_exact((sb - SCALE_BIAS).clamp(-SCALE_BIAS, SCALE_BIAS))  # [..., K / 32] fp32
    scale = torch.where(sb == SCALE_NAN, math.nan, scale)  # [..., K / 32] NaN block
    out = (q * scale.unsqueeze(-1)).flatten(-2)  # [..., K] fp32
    return out.movedim(-1, dim).to(dtype).contiguous()  # data.shape


# ---- conveniences -------------------------------------------------------------------------------


def quantize_rowwise(x: torch.Tensor, rule: str = "ceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks along the last dim (the K of `x @ W.T` for x [rows, K])."""
    return quantize(x, dim=-1, rule=rule)


def quantize_colwise(x: torch.Tensor, rule: str = "ceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks along dim -2 (the token dim: the K of a weight-gradient GEMM)."""
    return quantize(x, dim=-2, rule=rule)


def pad_to_block(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Zero-pad `x` at the end of `dim` up to a multiple of 32 (blocks stay aligned to index 0).
    Returns `x` itself when no padding is needed."""
    dim = _check_dim("x", x, dim)
    pad = -x.shape[dim] % BLOCK_SIZE
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)  # x.shape with size[dim] rounded up to 32


def quantize_padded(x: torch.Tensor, dim: int = -1, rule: str = "ceil") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize(pad_to_block(x, dim), dim)`: data and scales of the padded tensor."""
    return quantize(pad_to_block(x, dim), dim=dim, rule=rule)


def fake_quantize(x: torch.Tensor, dim: int = -1, rule: str = "ceil", pad: bool = False) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype: exact MXFP8 emulation (what the L0 MoE reference uses).
    pad=True zero-pads `dim` to a multiple of 32 first and slices the result back to x's shape."""
    xp = pad_to_block(x, dim) if pad else x
    data, scales = quantize(xp, dim=dim, rule=rule)
    out = dequantize(data, scales, dim=dim, dtype=x.dtype)  # xp.shape
    return out.narrow(dim, 0, x.shape[dim]) if pad else out  # x.shape


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio, 10·log10(Σ ref² / Σ (ref - approx)²), in dB (fp64 sums).
    +inf when approx equals ref; NaN if either holds NaN."""
    if ref.shape != approx.shape:
        raise ValueError(f"approx: expected shape {tuple(ref.shape)} (ref's), got {tuple(approx.shape)}")
    ref64, approx64 = ref.double(), approx.double()
    signal = ref64.square().sum().item()
    noise = (ref64 - approx64).square().sum().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf
