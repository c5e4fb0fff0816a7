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

// L0's swiglu (mok.reference.swiglu) on bf16-exact inputs, in fp32: g = min(g, L), u = clamp(u, -L, L)
// (NaN passes through, as torch.clamp), then silu(g)·u = (g·sigmoid(g))·u with IEEE expf and division.
MOK_DEVICE float swiglu(float g, float u, float limit, bool has_limit) {
  if (has_limit) {
    g = g > limit ? limit : g;
    u = u < -limit ? -limit : u;
    u = u > limit ? limit : u;
  }
  const float sigmoid = 1.0f / (1.0f + expf(-g));
  return g * sigmoid * u;
}

// L0's swiglu_backward (mok.reference) for one element, in fp32, from bf16-exact gate, up and d_h: with a
// limit L the clamped inputs pass no gradient (g > L; u outside [-L, L]), as torch.clamp. Also h =
// swiglu(g, u), the same expression as swiglu() above, so the forward's bits.
struct SwiGLUGrad {
  float d_gate, d_up, h;
};
MOK_DEVICE SwiGLUGrad swiglu_backward(float g, float u, float d_h, float limit, bool has_limit) {
  float g_pass = 1.0f, u_pass = 1.0f;
  if (has_limit) {
    g_pass = g <= limit ? 1.0f : 0.0f;
    u_pass = (u >= -limit && u <= limit) ? 1.0f : 0.0f;
    g = g > limit ? limit : g;
    u = u < -limit ? -limit : (u > limit ? limit : u);
  }
  const float s = 1.0f / (1.0f + expf(-g));
  return {d_h * u * s * (1.0f + g * (1.0f - s)) * g_pass, d_h * g * s * u_pass, g * s * u};
}

}  // namespace mok
