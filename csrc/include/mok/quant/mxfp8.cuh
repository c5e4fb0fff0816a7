// MXFP8 numerics on the device (DESIGN §4, "ceil" rule), bit-exact with the L0 spec mok/mxfp8.py:
//   amax = max|x| over 32 elements; s = fp32(max(amax, 1e-12f) / 448); e = ceil(log2 s) in [-127, 127];
//   scale byte (E8M0) = e + 127; q = e4m3_rn_satfinite(x * 2^-e); a block holding NaN or ±Inf gets
//   scale 0xFF and every data byte 0x7F. Dequantized value: q * 2^e in fp32, rounded to bf16.
// Inputs are bf16, which is what makes the all-integer exponent below exact (see scale_from_amax_bits).
#pragma once

#include "mok/common.cuh"

namespace mok::mxfp8 {

constexpr int kBlockSize = 32;                  // elements per E8M0 scale, along K
constexpr uint32_t kScaleBias = 127;            // E8M0: scale = 2^(byte - 127)
constexpr uint32_t kScaleNaN = 0xFF;            // E8M0 NaN: the scale of a NaN/Inf block
constexpr uint32_t kE4M3NaNx4 = 0x7F7F7F7Fu;    // four E4M3 NaN bytes: the data of a NaN/Inf block
constexpr uint32_t kBf16AbsMask2 = 0x7FFF7FFFu; // clears the sign of both bf16 halves of a word
constexpr uint32_t kBf16InfBits = 0x7F80u;      // |x| bits >= this: ±Inf or NaN
constexpr uint32_t kAmaxMinF32Bits = 0x2B8CBCCCu;  // fp32 bits of 1e-12f, the amax floor
constexpr int kExpAtAmaxFloor = -48;            // ceil(log2(fp32(1e-12f / 448)))
constexpr int kChunkElems = 8;                             // a chunk: one 16-byte bf16 load
constexpr int kChunksPerBlock = kBlockSize / kChunkElems;  // 4 lanes share a row-wise block
static_assert(kChunksPerBlock == 4, "row-wise amax reduces over lanes xor 1, 2");


// ---- block amax, as bf16 bits ------------------------------------------------------------------------
// |x| as bits (sign cleared) orders like |x| for finite values and Inf, and every NaN is above Inf:
// a per-halfword unsigned max (`vmax2`) finds the amax and flags NaN/Inf blocks in one pass, where a
// float max would drop NaNs (fmaxf(NaN, y) = y).

MOK_DEVICE uint32_t amax2_acc(uint32_t acc, uint32_t w) { return __vmaxu2(acc, w & kBf16AbsMask2); }
MOK_DEVICE uint32_t amax2_acc(uint32_t acc, uint4 v) {
  return amax2_acc(amax2_acc(amax2_acc(amax2_acc(acc, v.x), v.y), v.z), v.w);
}
MOK_DEVICE uint32_t amax2_fold(uint32_t acc) { return max(acc & 0xFFFFu, acc >> 16); }

// ---- scale -------------------------------------------------------------------------------------------

struct Scale {
  uint32_t byte;  // E8M0 biased exponent, kScaleNaN for a NaN/Inf block
  float inv;      // 2^-e, exact: the multiplier applied before E4M3 rounding
  bool finite;    // false: NaN/Inf block
};

// The ceil exponent from bits alone, exact for every bf16 amax a = m * 2^k (m = 1 + M/128, 7-bit M):
//   a >= 1e-12f (always a normal number): s = fp32(a / 448) = fp32((m / 1.75) * 2^(k-8)). For m < 1.75,
//   m / 1.75 lies in (1/2, 1) at least 2^-8 from both ends, so s stays in (2^(k-9), 2^(k-8)) after
//   rounding: e = k - 8. For m = 1.75, s = 2^(k-8) exactly: e = k - 8. For m > 1.75, m / 1.75 lies in
//   (1, 8/7) at least 2^-8 above 1: e = k - 7. With k = E - 127: e = E - 135 + (M > 96) (1.75 = 1 + 96/128).
//   a < 1e-12f (zeros, subnormals, tiny normals): s = fp32(1e-12f / 448), e = -48.
// Range: e in [-48, 120] (bf16 E <= 254), so the spec's clamp to [-127, 127] never bites, and 2^-e is
// a normal fp32 built straight from its exponent field. (Checked against the L0 spec on every bf16.)
MOK_DEVICE Scale scale_from_amax_bits(uint32_t amax_bits) {
  const uint32_t biased_exp = amax_bits >> 7;  // E: bf16 exponent field
  const uint32_t mantissa = amax_bits & 0x7Fu;  // M: bf16 mantissa field
  int e = static_cast<int>(biased_exp) - 135 + (mantissa > 96u ? 1 : 0);
  e = (amax_bits << 16) < kAmaxMinF32Bits ? kExpAtAmaxFloor : e;
  Scale s;
  s.finite = amax_bits < kBf16InfBits;
  s.byte = s.finite ? static_cast<uint32_t>(e + static_cast<int>(kScaleBias)) : kScaleNaN;
  s.inv = __uint_as_float(static_cast<uint32_t>(127 - e) << 23);  // 2^-e, biased exponent 127 - e
  return s;
}

// 2^e from an E8M0 byte, as fp32 bits: byte << 23 for 1..254; byte 0 is 2^-127, a subnormal (bit 22);
// byte 0xFF is NaN.
MOK_DEVICE float scale_byte_to_f32(uint32_t byte) {
  const uint32_t bits = byte == 0u ? 0x00400000u : (byte == kScaleNaN ? 0x7FC00000u : byte << 23);
  return __uint_as_float(bits);
}

// ---- E4M3 conversions --------------------------------------------------------------------------------
// cvt.rn.satfinite.e4m3x2.f32 d, a, b: round to nearest even, |v| > 448 saturates to ±448 (never hit by
// finite inputs under the ceil rule: |x * 2^-e| <= 448); the sign of a zero is kept (-0 -> 0x80).
// `a` lands in the upper byte, so the call below puts x0 in byte 0 (lowest address).

MOK_DEVICE uint32_t f32x4_to_e4m3x4(float x0, float x1, float x2, float x3) {
  uint32_t out;
  asm("{\n\t.reg .b16 lo, hi;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
      "mov.b32 %0, {lo, hi};\n\t}"
      : "=r"(out)
      : "f"(x0), "f"(x1), "f"(x2), "f"(x3));
  return out;
}

// Two E4M3 bytes (element 0 in the low byte) to fp32, exactly (via f16x2, which holds every E4M3 value).
MOK_DEVICE float2 e4m3x2_to_f32x2(uint32_t two_bytes) {
  float2 f;
  asm("{\n\t.reg .b32 h;\n\t.reg .b16 lo, hi, in;\n\t"
      "cvt.u16.u32 in, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 h, in;\n\t"
      "mov.b32 {lo, hi}, h;\n\t"
      "cvt.f32.f16 %0, lo;\n\t"
      "cvt.f32.f16 %1, hi;\n\t}"
      : "=f"(f.x), "=f"(f.y)
      : "r"(two_bytes));
  return f;
}

// Two fp32 to a bf16x2 word (round to nearest even; element 0 in the low half).
MOK_DEVICE uint32_t f32x2_to_bf16x2(float lo, float hi) {
  uint32_t out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

// ---- 8 elements at a time: one 16-byte bf16 chunk <-> one 8-byte E4M3 chunk --------------------------

// One scale for all 8 (row-wise: the chunk lies inside one block).
MOK_DEVICE uint2 quantize8(uint4 v, const Scale& s) {
  uint2 q;
  q.x = f32x4_to_e4m3x4(bf16_lo_as_f32(v.x) * s.inv, bf16_hi_as_f32(v.x) * s.inv,
                        bf16_lo_as_f32(v.y) * s.inv, bf16_hi_as_f32(v.y) * s.inv);
  q.y = f32x4_to_e4m3x4(bf16_lo_as_f32(v.z) * s.inv, bf16_hi_as_f32(v.z) * s.inv,
                        bf16_lo_as_f32(v.w) * s.inv, bf16_hi_as_f32(v.w) * s.inv);
  if (!s.finite) q = make_uint2(kE4M3NaNx4, kE4M3NaNx4);
  return q;
}

// Two elements of one block, a bf16x2 word (the GEMM epilogues' unit): two E4M3 bytes, element 0 in the low
// byte; quantize8's bits.
MOK_DEVICE uint32_t quantize2(uint32_t w, const Scale& s) {
  uint16_t q;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;"
      : "=h"(q)
      : "f"(bf16_lo_as_f32(w) * s.inv), "f"(bf16_hi_as_f32(w) * s.inv));
  return s.finite ? q : kE4M3NaNx4 & 0xFFFFu;
}

// The word's round trip, back to bf16x2: mxfp8_fake_quantize's bits (dequantize8 on the scale byte's 2^e).
MOK_DEVICE uint32_t round_trip2(uint32_t w, const Scale& s) {
  const float e = scale_byte_to_f32(s.byte);
  const float2 f = e4m3x2_to_f32x2(quantize2(w, s));
  return f32x2_to_bf16x2(f.x * e, f.y * e);
}

// One scale per element (column-wise: the 8 elements are 8 columns, each in its own block).
// `nan_mask` holds 0xFF in the bytes of NaN/Inf columns (see nan_byte_mask).
MOK_DEVICE uint2 quantize8(uint4 v, const float (&inv)[8], uint2 nan_mask) {
  uint2 q;
  q.x = f32x4_to_e4m3x4(bf16_lo_as_f32(v.x) * inv[0], bf16_hi_as_f32(v.x) * inv[1],
                        bf16_lo_as_f32(v.y) * inv[2], bf16_hi_as_f32(v.y) * inv[3]);
  q.y = f32x4_to_e4m3x4(bf16_lo_as_f32(v.z) * inv[4], bf16_hi_as_f32(v.z) * inv[5],
                        bf16_lo_as_f32(v.w) * inv[6], bf16_hi_as_f32(v.w) * inv[7]);
  q.x = (q.x & ~nan_mask.x) | (kE4M3NaNx4 & nan_mask.x);
  q.y = (q.y & ~nan_mask.y) | (kE4M3NaNx4 & nan_mask.y);
  return q;
}

MOK_DEVICE uint2 nan_byte_mask(const Scale (&s)[8]) {
  uint2 m = make_uint2(0u, 0u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    m.x |= (s[k].finite ? 0u : 0xFFu) << (8 * k);
    m.y |= (s[k + 4].finite ? 0u : 0xFFu) << (8 * k);
  }
  return m;
}

// Dequantize 8 E4M3 bytes with per-element scales (fp32 products are exact; NaN scale -> NaN).
MOK_DEVICE uint4 dequantize8(uint2 q, const float (&scale)[8]) {
  uint4 out;
  uint32_t* o = &out.x;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t word = k < 2 ? q.x : q.y;
    const float2 f = e4m3x2_to_f32x2(word >> (16 * (k & 1)));
    o[k] = f32x2_to_bf16x2(f.x * scale[2 * k], f.y * scale[2 * k + 1]);
  }
  return out;
}

}  // namespace mok::mxfp8
