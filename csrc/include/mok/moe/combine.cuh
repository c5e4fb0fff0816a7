// Fixed-order combine of per-route rows into tokens (DESIGN §3, §5), bit-exact with L0's
// mok.reference.combine (and, without weights, with the d_x sum of mok.reference.moe_backward):
//   out[t] = bf16( ((0 + w[t,0]·y[r(t,0)]) + w[t,1]·y[r(t,1)]) + ... + shared[t] ),  r = route_to_row
// in fp32, increasing k, then the shared expert. Each product and each sum is rounded on its own
// (`__fmul_rn` / `__fadd_rn`: nvcc may not contract them into an FMA), exactly as torch's
// `acc += w * y` runs two kernels. No weights: every w is 1 (the product step is skipped; w·y = y).
// No atomics: every output element is one thread's sum, so the bits never depend on scheduling.
//
// Bytes per token: K row reads of 2·hidden (gathered, each row contiguous) + 2·hidden shared +
// 2·hidden written; bandwidth-bound (a handful of flops per 2 bytes).
#pragma once

#include <cuda_bf16.h>

#include "mok/common.cuh"

namespace mok::moe {

constexpr int kCombineThreads = 256;                       // 8 warps per CTA
constexpr int kCombineWarps = kCombineThreads / kWarpSize;
constexpr int kVecElems = 8;                               // bf16 per 16-byte vector
constexpr int kVecsPerLane = 2;                            // 16 columns per thread
constexpr int kTileVecs = kWarpSize * kVecsPerLane;        // a warp's tile: 64 vectors = 512 columns
constexpr int kTopkBatch = 4;                              // route rows loaded before they are summed
static_assert(kCombineThreads % kWarpSize == 0, "whole warps: a warp owns one tile of one token row");
static_assert(kVecElems * 2 == sizeof(uint4), "a vector is one 16-byte load of bf16");

// ---- fp32 accumulation of 8 bf16 ---------------------------------------------------------------------

struct Acc8 {
  float v[kVecElems];
};

MOK_DEVICE void acc_zero(Acc8& a) {
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) a.v[i] = 0.0f;  // +0: 0 + (-0) = +0, as torch's zeros() + ...
}

// a += w·y (w_is_one: a += y), element by element, two roundings each (no FMA).
MOK_DEVICE void acc_add(Acc8& a, uint4 y, float w, bool w_is_one) {
  const uint32_t words[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = bf16_lo_as_f32(words[i]), hi = bf16_hi_as_f32(words[i]);
    a.v[2 * i] = __fadd_rn(a.v[2 * i], w_is_one ? lo : __fmul_rn(w, lo));
    a.v[2 * i + 1] = __fadd_rn(a.v[2 * i + 1], w_is_one ? hi : __fmul_rn(w, hi));
  }
}

// A sum that read a bad route's row: NaN, never silently wrong.
MOK_DEVICE void acc_nan(Acc8& a) {
#pragma unroll
  for (int i = 0; i < kVecElems; ++i) a.v[i] = __int_as_float(0x7FC00000);
}

// Round to nearest even, 8 fp32 -> 8 bf16 in one 16-byte vector (NaN -> canonical NaN, as torch on sm_90).
MOK_DEVICE uint4 acc_to_bf16(const Acc8& a) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(a.v[2 * i], a.v[2 * i + 1]);  // .x = low half
    words[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// ---- kernel --------------------------------------------------------------------------------------------
// Warp w of the grid owns tile (w % tiles_per_row) of token (w / tiles_per_row): lane l handles the
// vectors tile·64 + l and tile·64 + 32 + l of the row (each warp load instruction reads 512 contiguous
// bytes). Route rows are loaded kTopkBatch at a time (up to 8 16-byte loads in flight per thread), then
// summed in increasing k. Routes says where route t·num_topk + k's row is (`row(route)`: its first vector, or
// null for an entry out of bounds, which reads nothing and yields NaN): LocalRoutes below, or another rank's
// rows (moe/peer_rows.cuh).

// Route (t, k)'s row in this rank's y_rows: y_rows[route_to_row[t, k]].
template <typename Index>
struct LocalRoutes {
  const uint4* y_rows;        // [num_rows, vecs_per_row]
  const Index* route_to_row;  // [num_tokens · num_topk]
  int64_t num_rows, vecs_per_row;
  MOK_DEVICE const uint4* row(int64_t route) const {
    const int64_t r = static_cast<int64_t>(route_to_row[route]);
    return r >= 0 && r < num_rows ? y_rows + r * vecs_per_row : nullptr;
  }
};

template <typename Routes>
__global__ void __launch_bounds__(kCombineThreads)
    combine_rows_kernel(const Routes routes, const float* __restrict__ topk_weights,
                        const uint4* __restrict__ shared, uint4* __restrict__ out, int64_t num_tokens, int num_topk,
                        int64_t vecs_per_row, int64_t tiles_per_row) {
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / kWarpSize;
  const int64_t token = warp / tiles_per_row;
  if (token >= num_tokens) return;  // no shuffles or barriers below
  const int64_t vec0 = (warp % tiles_per_row) * kTileVecs + lane_id();
  const bool has_weights = topk_weights != nullptr;
  const float* weights = has_weights ? topk_weights + token * num_topk : nullptr;  // [num_topk]

  Acc8 acc[kVecsPerLane];
#pragma unroll
  for (int j = 0; j < kVecsPerLane; ++j) acc_zero(acc[j]);
  bool bad_row = false;

  for (int k0 = 0; k0 < num_topk; k0 += kTopkBatch) {
    // ---- load: up to kTopkBatch route rows x kVecsPerLane vectors ----
    uint4 y[kTopkBatch][kVecsPerLane];
#pragma unroll
    for (int b = 0; b < kTopkBatch; ++b) {
      const uint4* row = k0 + b < num_topk ? routes.row(token * num_topk + k0 + b) : nullptr;
      bad_row |= (k0 + b < num_topk) && row == nullptr;
#pragma unroll
      for (int j = 0; j < kVecsPerLane; ++j) {
        const int64_t vec = vec0 + j * kWarpSize;
        y[b][j] = row != nullptr && vec < vecs_per_row ? ld_stream_v4(row + vec) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    // ---- sum in increasing k ----
#pragma unroll
    for (int b = 0; b < kTopkBatch; ++b) {
      if (k0 + b >= num_topk) break;
      const float w = has_weights ? weights[k0 + b] : 1.0f;
#pragma unroll
      for (int j = 0; j < kVecsPerLane; ++j) acc_add(acc[j], y[b][j], w, !has_weights);
    }
  }

  // ---- shared expert, rounding, store ----
#pragma unroll
  for (int j = 0; j < kVecsPerLane; ++j) {
    const int64_t vec = vec0 + j * kWarpSize;
    if (vec >= vecs_per_row) continue;
    if (shared != nullptr) acc_add(acc[j], ld_stream_v4(shared + token * vecs_per_row + vec), 1.0f, true);
    if (bad_row) acc_nan(acc[j]);
    st_v4(out + token * vecs_per_row + vec, acc_to_bf16(acc[j]));
  }
}

// ---- host launchers --------------------------------------------------------------------------------------

// Any row source; hidden % 8 == 0 and every pointer 16-byte aligned (checked in mok/ops/).
template <typename Routes>
inline cudaError_t launch_combine(const Routes& routes, const float* topk_weights, const void* shared, void* out,
                                  int64_t num_tokens, int64_t num_topk, int64_t hidden, cudaStream_t stream) {
  if (hidden % kVecElems != 0 || num_topk < 0 || num_topk > (1 << 20)) return cudaErrorInvalidValue;
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  const int64_t vecs_per_row = hidden / kVecElems;
  const int64_t tiles_per_row = ceil_div(vecs_per_row, kTileVecs);
  const int64_t num_blocks = ceil_div(num_tokens * tiles_per_row, kCombineWarps);
  if (num_blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  combine_rows_kernel<Routes><<<static_cast<unsigned>(num_blocks), kCombineThreads, 0, stream>>>(
      routes, topk_weights, static_cast<const uint4*>(shared), static_cast<uint4*>(out), num_tokens,
      static_cast<int>(num_topk), vecs_per_row, tiles_per_row);
  return cudaGetLastError();
}

// y_rows bf16 [num_rows, hidden]; route_to_row [num_tokens, num_topk] (int32 or int64); topk_weights fp32
// [num_tokens, num_topk] or null (weights 1); shared bf16 [num_tokens, hidden] or null; out bf16
// [num_tokens, hidden].
template <typename Index>
inline cudaError_t launch_combine_rows(const void* y_rows, const Index* route_to_row, const float* topk_weights,
                                       const void* shared, void* out, int64_t num_tokens, int64_t num_topk,
                                       int64_t num_rows, int64_t hidden, cudaStream_t stream) {
  const LocalRoutes<Index> routes{static_cast<const uint4*>(y_rows), route_to_row, num_rows, hidden / kVecElems};
  return launch_combine(routes, topk_weights, shared, out, num_tokens, num_topk, hidden, stream);
}

}  // namespace mok::moe
