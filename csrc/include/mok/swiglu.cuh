// SwiGLU and its backward on bf16-exact inputs, in fp32, exactly as L0 (mok.reference.swiglu,
// swiglu_backward): one device function per formula, so every kernel that evaluates one (GEMM1's epilogue,
// the backward's elementwise pass) gives the same bits. Torch-free.
#pragma once

#include <cuda_bf16.h>

#include "mok/common.cuh"

namespace mok {

MOK_DEVICE float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

MOK_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---- sigmoid for n elements at once ----------------------------------------------------------------------
// `1.0f / d` (IEEE, --prec-div) compiles to an approximate reciprocal, one Newton step and a branch to a slow path
// for d outside [2^-126, 2^126) (and Inf, NaN). That branch per element kept the compiler from interleaving the
// elements' dependent chains (expf, reciprocal, products): GEMM1's epilogue would run its 64 SwiGLUs per thread
// one after another, a quarter of its consumer warps' time (Nsight Compute; docs/gemm.md). So the
// helpers below take the fast path for all n elements, with the compiler's instructions, and redo the batch
// by the division only when an element needs the slow path: the same bits as `1.0f / d` everywhere.

// Whether the fast path below is `1.0f / d` rounded as IEEE: d's exponent field in [1, 252], the compiler's own
// test (sm_90, CUDA 13.0 SASS of `1.0f / d`).
MOK_DEVICE bool reciprocal_fast_path(float d) {
  return ((__float_as_uint(d) + 0x1800000u) & 0x7f800000u) > 0x1ffffffu;
}

// The compiler's fast path of `1.0f / d`: MUFU.RCP, then r + r·(1 − d·r), correctly rounded where
// reciprocal_fast_path(d) holds.
MOK_DEVICE float reciprocal_fast(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return __fmaf_rn(r, -__fmaf_rn(d, r, -1.0f), r);
}

// s[i] = 1 / (1 + expf(-g[i])), each as that expression in fp32 gives it.
template <int N>
MOK_DEVICE void sigmoid_n(const float (&g)[N], float (&s)[N]) {
  bool fast = true;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float d = 1.0f + expf(-g[i]);
    s[i] = reciprocal_fast(d);
    fast = fast && reciprocal_fast_path(d);
  }
  if (!fast) {  // g < -87 or NaN somewhere in the batch: rare
#pragma unroll
    for (int i = 0; i < N; ++i) s[i] = 1.0f / (1.0f + expf(-g[i]));
  }
}

// ---- SwiGLU and its backward ------------------------------------------------------------------------------

// L0's clamps (torch.clamp: NaN passes through): g = min(g, L), u = clamp(u, -L, L).
MOK_DEVICE float clamp_gate(float g, float limit) { return g > limit ? limit : g; }
MOK_DEVICE float clamp_up(float u, float limit) {
  u = u < -limit ? -limit : u;
  return u > limit ? limit : u;
}

// L0's swiglu (mok.reference.swiglu) on bf16-exact inputs, in fp32, for n elements: with a limit the clamps
// above, then silu(g)·u = (g·sigmoid(g))·u with IEEE expf and division. g becomes h.
template <int N>
MOK_DEVICE void swiglu_n(float (&g)[N], float (&u)[N], float limit, bool has_limit) {
  if (has_limit) {
#pragma unroll
    for (int i = 0; i < N; ++i) g[i] = clamp_gate(g[i], limit), u[i] = clamp_up(u[i], limit);
  }
  float s[N];
  sigmoid_n(g, s);
#pragma unroll
  for (int i = 0; i < N; ++i) g[i] = g[i] * s[i] * u[i];
}

// L0's swiglu_backward (mok.reference) for n elements, in fp32, from bf16-exact gate, up and d_h: with a limit
// L the clamped inputs pass no gradient (g > L; u outside [-L, L]), as torch.clamp. Also h = swiglu(g, u),
// swiglu_n's expression, so the forward's bits. Outputs in place: g becomes d_gate, u d_up, d_h h.
template <int N>
MOK_DEVICE void swiglu_backward_n(float (&g)[N], float (&u)[N], float (&d_h)[N], float limit, bool has_limit) {
  float g_pass[N], u_pass[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    g_pass[i] = !has_limit || g[i] <= limit ? 1.0f : 0.0f;
    u_pass[i] = !has_limit || (u[i] >= -limit && u[i] <= limit) ? 1.0f : 0.0f;
    if (has_limit) g[i] = clamp_gate(g[i], limit), u[i] = clamp_up(u[i], limit);
  }
  float s[N];
  sigmoid_n(g, s);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float d_gate = d_h[i] * u[i] * s[i] * (1.0f + g[i] * (1.0f - s[i])) * g_pass[i];
    const float d_up = d_h[i] * g[i] * s[i] * u_pass[i];
    d_h[i] = g[i] * s[i] * u[i];
    g[i] = d_gate, u[i] = d_up;
  }
}

}  // namespace mok
