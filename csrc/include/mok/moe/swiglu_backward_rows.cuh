// The SwiGLU backward over the schedule's rows, after the down-projection dgrad GEMM (kDownDgrad):
//   (d_gate[r], d_up[r], h[r]) = bf16(swiglu_backward_n(gate[r], up[r], d_h[r])) (h = swiglu(gate[r], up[r]))
// with padding rows (row_to_token[r] < 0) written as zeros whatever the inputs hold. d_h may be d_gate's own
// buffer (in place: each thread reads its 8 elements before it writes them). Rows from *real_num_rows on (the
// schedule's spare rows; null: none) are neither read nor written.
//
// NOTE: this ran inside the GEMM's epilogue until 2ed96d2, where it made the GEMM 2-4x slower than the same
// GEMM without it (0.26-0.47 of a dense GEMM, `python -m mok.bench parts`), and again at a58e282 with
// swiglu_backward_n: 1.4-2.0x slower. The epilogue runs with the tensor cores idle, and its gate/up loads and
// arithmetic come on top of every task (docs/l2_fused.md, "The SwiGLU backward in the dgrad epilogue, again").
// As its own pass it moves 12 bytes per element (d_h, gate, up in; d_gate, d_up, h out) at memory speed.
#pragma once

#include "mok/common.cuh"
#include "mok/swiglu.cuh"

namespace mok::moe {

constexpr int kSwiGLUThreads = 256;

// One 16-byte vector (8 columns) per thread per step, grid-stride over rows x (n / 8) vectors.
__global__ void __launch_bounds__(kSwiGLUThreads)
    swiglu_backward_rows_kernel(const uint16_t* d_h, const uint16_t* gate, const uint16_t* up,
                                const int32_t* row_to_token, const int32_t* real_num_rows, uint16_t* d_gate,
                                uint16_t* d_up, uint16_t* h, int64_t num_rows, int64_t n, float limit,
                                bool has_limit) {
  if (real_num_rows != nullptr && *real_num_rows < num_rows) num_rows = *real_num_rows < 0 ? 0 : *real_num_rows;
  const int64_t vecs_per_row = n / 8, num_vecs = num_rows * vecs_per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < num_vecs;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = v * 8;  // first element: row v / vecs_per_row, n % 8 == 0
    uint4 out_g = make_uint4(0, 0, 0, 0), out_u = out_g, out_h = out_g;
    if (row_to_token[v / vecs_per_row] >= 0) {
      const uint4 dh4 = *reinterpret_cast<const uint4*>(d_h + at);  // plain load: d_h may alias d_gate
      const uint4 g4 = ld_stream_v4(gate + at), u4 = ld_stream_v4(up + at);
      const uint32_t dh_w[4] = {dh4.x, dh4.y, dh4.z, dh4.w}, g_w[4] = {g4.x, g4.y, g4.z, g4.w};
      const uint32_t u_w[4] = {u4.x, u4.y, u4.z, u4.w};
      float g[8], u[8], dh[8];  // element 2i + j = word i's half j (j = 0: low)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        g[2 * i] = bf16_lo_as_f32(g_w[i]), g[2 * i + 1] = bf16_hi_as_f32(g_w[i]);
        u[2 * i] = bf16_lo_as_f32(u_w[i]), u[2 * i + 1] = bf16_hi_as_f32(u_w[i]);
        dh[2 * i] = bf16_lo_as_f32(dh_w[i]), dh[2 * i + 1] = bf16_hi_as_f32(dh_w[i]);
      }
      swiglu_backward_n(g, u, dh, limit, has_limit);  // g, u, dh <- d_gate, d_up, h
      out_g = make_uint4(pack_bf16x2(g[0], g[1]), pack_bf16x2(g[2], g[3]), pack_bf16x2(g[4], g[5]),
                         pack_bf16x2(g[6], g[7]));
      out_u = make_uint4(pack_bf16x2(u[0], u[1]), pack_bf16x2(u[2], u[3]), pack_bf16x2(u[4], u[5]),
                         pack_bf16x2(u[6], u[7]));
      out_h = make_uint4(pack_bf16x2(dh[0], dh[1]), pack_bf16x2(dh[2], dh[3]), pack_bf16x2(dh[4], dh[5]),
                         pack_bf16x2(dh[6], dh[7]));
    }
    st_v4(d_gate + at, out_g);
    st_v4(d_up + at, out_u);
    st_v4(h + at, out_h);
  }
}

// rows = the row buffers' rows (the grid is sized for them); real_num_rows: int32 [1] on the device or null;
// n = intermediate (% 8 == 0); every pointer 16-byte aligned.
inline cudaError_t launch_swiglu_backward_rows(const void* d_h, const void* gate, const void* up,
                                               const int32_t* row_to_token, const int32_t* real_num_rows,
                                               void* d_gate, void* d_up, void* h, int64_t num_rows, int64_t n,
                                               float limit, bool has_limit, cudaStream_t stream) {
  if (n % 8 != 0) return cudaErrorInvalidValue;
  const int64_t num_vecs = num_rows * (n / 8);
  if (num_vecs == 0) return cudaSuccess;
  int device = 0, num_sms = 0;  // elementwise: the grid size changes no bits, so always one full wave
  cudaError_t err = cudaGetDevice(&device);
  if (err || (err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device))) return err;
  const int64_t blocks_needed = (num_vecs + kSwiGLUThreads - 1) / kSwiGLUThreads;
  const int64_t resident = static_cast<int64_t>(num_sms) * (2048 / kSwiGLUThreads);
  const int grid = static_cast<int>(blocks_needed < resident ? blocks_needed : resident);
  swiglu_backward_rows_kernel<<<grid, kSwiGLUThreads, 0, stream>>>(
      static_cast<const uint16_t*>(d_h), static_cast<const uint16_t*>(gate), static_cast<const uint16_t*>(up),
      row_to_token, real_num_rows, static_cast<uint16_t*>(d_gate), static_cast<uint16_t*>(d_up),
      static_cast<uint16_t*>(h), num_rows, n, limit, has_limit);
  return cudaGetLastError();
}

}  // namespace mok::moe
