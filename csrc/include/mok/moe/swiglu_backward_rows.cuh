// The SwiGLU backward over the schedule's rows, after the down-projection dgrad GEMM (kDownDgrad):
//   (d_gate[r], d_up[r], h[r]) = bf16(swiglu_backward_n(gate[r], up[r], d_h[r])) (h = swiglu(gate[r], up[r]))
// with padding rows (row_to_token[r] < 0) written as zeros whatever the inputs hold. d_h may be d_gate's own
// buffer (in place: each thread reads its 8 elements before it writes them). Rows from *real_num_rows on (the
// schedule's spare rows; null: none) are neither read nor written.
//
// NOTE: its own pass, not the dgrad GEMM's epilogue: there it runs with the tensor cores idle, its gate/up loads
// and arithmetic on top of every task, and makes the GEMM several times slower (docs/gemm.md). As its own pass it
// moves 12 bytes per element (d_h, gate, up in; d_gate, d_up, h out) at memory speed.
//
// The MXFP8 backward (kMx) reads the forward's saved gate/up as they are, row-wise MXFP8 (E4M3 data and one
// E8M0 scale per 32 columns), and dequantizes each 8-element chunk in registers to mxfp8_dequantize's bits
// (dequantize8): 2 · (1 + 1/32) bytes read per element instead of two dequantize kernels' 2 · (1 + 1/32 + 2)
// and then 2 · 2 here.
// NOTE: not fused with the round trips the next GEMMs read (d_gate, d_up both ways, h column-wise): one kernel in
// 32-row tiles needs 122 registers, runs 16 warps per SM and a long compute phase after each tile's loads, slower
// than the separate kernels (docs/fused.md).
#pragma once

#include "mok/common.cuh"
#include "mok/quant/mxfp8.cuh"
#include "mok/swiglu.cuh"

namespace mok::moe {

constexpr int kSwiGLUThreads = 256;

// 8 elements of gate or up from element `at` on (a multiple of 8): bf16, or (kMx) E4M3 at `m` with the scales of
// its 32-element blocks at `scales` ([rows, n / 32], n % 32 == 0: element at's block is at / 32).
template <bool kMx>
MOK_DEVICE uint4 load_gate_up8(const void* m, const uint8_t* scales, int64_t at) {
  if constexpr (kMx) {
    const uint2 q = ld_stream_v2(static_cast<const uint8_t*>(m) + at);
    const float s = mxfp8::scale_byte_to_f32(ld_stream_u8(scales + at / mxfp8::kBlockSize));
    const float scale[8] = {s, s, s, s, s, s, s, s};
    return mxfp8::dequantize8(q, scale);
  } else {
    return ld_stream_v4(static_cast<const uint16_t*>(m) + at);
  }
}

// Optional route gradients (route_weights non-null): d_h holds the *unweighted* down dgrad g = bf16(d_out[t]·Wd[e])
// of row r's route (t, k) with weight w = route_weights[row_to_route[r]]; the SwiGLU backward runs on d_h = w·g,
// h is written as bf16(w·h) (d_w_down's operand beside the unweighted d_out rows: Σ d_outᵀ·(w·h) = Σ dyᵀ·h), and
// d_topk_weights[row_to_route[r]] = Σ_i g[i]·bf16(h[i]) (= ⟨d_out[t], y[t, k]⟩, DESIGN §3, without y): each lane
// sums its vectors in column order, then a fixed butterfly over the warp, so the bits do not depend on the grid.
struct SwiGLUBackwardRows {
  const uint16_t* d_h;
  const void *gate, *up;
  const uint8_t *gate_scales, *up_scales;  // kMx: the row-wise scales of gate, up
  const int32_t* row_to_token;
  const float* route_weights;  // null: no route gradients (row_to_route, d_topk_weights unused)
  const int64_t* row_to_route;
  float* d_topk_weights;
  uint16_t *d_gate, *d_up, *h;
  int64_t n;
  float limit;
  bool has_limit;
};

// Row r by one warp (lane l takes the row's 8-column vectors l, l + 32, ...). load_d_h(at) reads d_h's 8 elements
// at `at` (the kernel: a plain load, d_h may alias d_gate; the chain kernel: from L2, another CTA wrote them).
template <bool kMx, typename LoadDh>
MOK_DEVICE void swiglu_backward_row(const SwiGLUBackwardRows& a, int64_t r, int lane, LoadDh load_d_h) {
  const int64_t n = a.n;
  const bool real = a.row_to_token[r] >= 0;
  const int64_t route = real && a.route_weights != nullptr ? a.row_to_route[r] : -1;
  const float w = route >= 0 ? a.route_weights[route] : 1.0f;
  float dot = 0.0f;
  for (int64_t at = r * n + lane * 8; at < (r + 1) * n; at += kWarpSize * 8) {
    uint4 out_g = make_uint4(0, 0, 0, 0), out_u = out_g, out_h = out_g;
    if (real) {
      const uint4 dh4 = load_d_h(at);
      const uint4 g4 = load_gate_up8<kMx>(a.gate, a.gate_scales, at), u4 = load_gate_up8<kMx>(a.up, a.up_scales, at);
      const uint32_t dh_w[4] = {dh4.x, dh4.y, dh4.z, dh4.w}, g_w[4] = {g4.x, g4.y, g4.z, g4.w};
      const uint32_t u_w[4] = {u4.x, u4.y, u4.z, u4.w};
      float g[8], u[8], dh[8], dg[8];  // element 2i + j = word i's half j (j = 0: low)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        g[2 * i] = bf16_lo_as_f32(g_w[i]), g[2 * i + 1] = bf16_hi_as_f32(g_w[i]);
        u[2 * i] = bf16_lo_as_f32(u_w[i]), u[2 * i + 1] = bf16_hi_as_f32(u_w[i]);
        dg[2 * i] = bf16_lo_as_f32(dh_w[i]), dg[2 * i + 1] = bf16_hi_as_f32(dh_w[i]);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) dh[i] = route >= 0 ? w * dg[i] : dg[i];
      swiglu_backward_n(g, u, dh, a.limit, a.has_limit);  // g, u, dh <- d_gate, d_up, h
      if (route >= 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dot = fmaf(dg[i], __bfloat162float(__float2bfloat16_rn(dh[i])), dot);  // ⟨g, h⟩, h as GEMM2 read it
          dh[i] = w * dh[i];
        }
      }
      out_g = make_uint4(pack_bf16x2(g[0], g[1]), pack_bf16x2(g[2], g[3]), pack_bf16x2(g[4], g[5]),
                         pack_bf16x2(g[6], g[7]));
      out_u = make_uint4(pack_bf16x2(u[0], u[1]), pack_bf16x2(u[2], u[3]), pack_bf16x2(u[4], u[5]),
                         pack_bf16x2(u[6], u[7]));
      out_h = make_uint4(pack_bf16x2(dh[0], dh[1]), pack_bf16x2(dh[2], dh[3]), pack_bf16x2(dh[4], dh[5]),
                         pack_bf16x2(dh[6], dh[7]));
    }
    st_v4(a.d_gate + at, out_g);
    st_v4(a.d_up + at, out_u);
    st_v4(a.h + at, out_h);
  }
  if (a.route_weights != nullptr) {  // warp-uniform
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(kFullMask, dot, offset);
    if (lane == 0 && route >= 0) a.d_topk_weights[route] = dot;
  }
}

// One warp per row, grid-stride over rows.
template <bool kMx>
__global__ void __launch_bounds__(kSwiGLUThreads)
    swiglu_backward_rows_kernel(const SwiGLUBackwardRows a, const int32_t* real_num_rows, int64_t num_rows) {
  if (real_num_rows != nullptr && *real_num_rows < num_rows) num_rows = *real_num_rows < 0 ? 0 : *real_num_rows;
  const int lane = static_cast<int>(lane_id());
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarpSize);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
       r < num_rows; r += warps)
    swiglu_backward_row<kMx>(a, r, lane, [&](int64_t at) {
      return *reinterpret_cast<const uint4*>(a.d_h + at);  // plain load: d_h may alias d_gate
    });
}

// rows = the row buffers' rows (the grid is sized for them); real_num_rows: int32 [1] on the device or null;
// n = intermediate (% 8 == 0; % 32 with scales); every pointer 16-byte aligned. gate_scales, up_scales: null for
// bf16 gate/up, else gate/up are row-wise MXFP8 data with these scales. route_weights (fp32 [T·K]), row_to_route
// (int64 [rows]) and d_topk_weights (fp32 [T·K]): all null, or all set for the route gradients (above).
inline cudaError_t launch_swiglu_backward_rows(const void* d_h, const void* gate, const void* up,
                                               const int32_t* row_to_token, const int32_t* real_num_rows,
                                               void* d_gate, void* d_up, void* h, int64_t num_rows, int64_t n,
                                               float limit, bool has_limit, cudaStream_t stream,
                                               const void* gate_scales = nullptr, const void* up_scales = nullptr,
                                               const float* route_weights = nullptr,
                                               const int64_t* row_to_route = nullptr,
                                               float* d_topk_weights = nullptr) {
  const bool mx = gate_scales != nullptr, routes = route_weights != nullptr;
  if (n % (mx ? mxfp8::kBlockSize : 8) != 0 || mx != (up_scales != nullptr)) return cudaErrorInvalidValue;
  if (routes != (row_to_route != nullptr) || routes != (d_topk_weights != nullptr)) return cudaErrorInvalidValue;
  if (num_rows * n == 0) return cudaSuccess;
  int device = 0, num_sms = 0;  // a row's bits do not depend on the grid, so always one full wave
  cudaError_t err = cudaGetDevice(&device);
  if (err || (err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device))) return err;
  constexpr int kRowsPerBlock = kSwiGLUThreads / kWarpSize;
  const int64_t blocks_needed = (num_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const int64_t resident = static_cast<int64_t>(num_sms) * (2048 / kSwiGLUThreads);
  const int grid = static_cast<int>(blocks_needed < resident ? blocks_needed : resident);
  const SwiGLUBackwardRows a{static_cast<const uint16_t*>(d_h), gate, up, static_cast<const uint8_t*>(gate_scales),
                             static_cast<const uint8_t*>(up_scales), row_to_token, route_weights, row_to_route,
                             d_topk_weights, static_cast<uint16_t*>(d_gate), static_cast<uint16_t*>(d_up),
                             static_cast<uint16_t*>(h), n, limit, has_limit};
  (mx ? swiglu_backward_rows_kernel<true> : swiglu_backward_rows_kernel<false>)<<<grid, kSwiGLUThreads, 0, stream>>>(
      a, real_num_rows, num_rows);
  return cudaGetLastError();
}

}  // namespace mok::moe
