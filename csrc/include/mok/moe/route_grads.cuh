// Routed-gradient prep for the backward (DESIGN §3), from one pass over d_out and y_rows:
//   dy_rows[r]          = bf16(fp32(d_out[t]) · w[t,k])   one rounded product, then bf16: bit for bit L0's
//                          (d_out.float()[:, None, :] * w[:, :, None]).to(bf16) gathered into rows
//   d_topk_weights[t,k] = Σ_h fp32(d_out[t,h]) · fp32(y_rows[r,h])   fp32, in a fixed order (below)
// for r = route_to_row[t,k]; padding rows of dy_rows are zeros.
//
// Fixed order of the dot product (no atomics, no dependence on the grid): thread i of the token's CTA sums
// its vectors i, i + 128, ... (8 elements each, in element order) with FMAs; the 32 lanes of a warp are
// combined by a butterfly (xor 16, 8, 4, 2, 1); then warps 0..3 in order. Not torch's order, so the value
// differs from L0's `.sum(-1)` by a few fp32 rounding errors of Σ_h |d_out·y| (tests/test_ops_route_grads.py).
//
// Bytes per token: 2·H (d_out, read once for every batch of 8 routes; re-reads hit L1) + K·2·H (y rows)
// read, K·2·H (dy rows) written; plus the padding rows' zeros. Bandwidth-bound.
#pragma once

#include <cuda_bf16.h>

#include "mok/api.h"
#include "mok/common.cuh"

namespace mok::moe {

constexpr int kRouteGradsThreads = 128;  // one CTA per token
constexpr int kRouteGradsWarps = kRouteGradsThreads / kWarpSize;
constexpr int kRouteGradsBatch = 8;     // routes of a token handled per pass over its d_out row
constexpr int kRouteGradsVecElems = 8;  // bf16 per 16-byte vector
constexpr int kRouteGradsPadRows = 16;  // padding rows zeroed per CTA
static_assert(kRouteGradsThreads % kWarpSize == 0, "whole warps: the dot product ends in warp shuffles");

// dot += Σ_i d[i]·y[i] over the 8 bf16 of one vector, in element order.
MOK_DEVICE float dot8(float dot, uint4 d, uint4 y) {
  const uint32_t dw[4] = {d.x, d.y, d.z, d.w}, yw[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    dot = __fmaf_rn(bf16_lo_as_f32(dw[i]), bf16_lo_as_f32(yw[i]), dot);
    dot = __fmaf_rn(bf16_hi_as_f32(dw[i]), bf16_hi_as_f32(yw[i]), dot);
  }
  return dot;
}

// bf16(fp32(d[i]) · w) for the 8 bf16 of one vector: one product rounded to fp32, then to bf16 (RNE).
MOK_DEVICE uint4 scale8_to_bf16(uint4 d, float w) {
  const uint32_t dw[4] = {d.x, d.y, d.z, d.w};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair =
        __floats2bfloat162_rn(__fmul_rn(bf16_lo_as_f32(dw[i]), w), __fmul_rn(bf16_hi_as_f32(dw[i]), w));
    out[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

MOK_DEVICE float warp_sum_butterfly(float v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) v = __fadd_rn(v, __shfl_xor_sync(kFullMask, v, mask));
  return v;  // every lane holds the same sum (the butterfly pairs the same operands in the same order)
}

// ---- kernel --------------------------------------------------------------------------------------------------
// CTAs [0, pad_ctas): chunk c of tile i (c < pad_chunks = ceil(block_m / kRouteGradsPadRows)) zeros the padding
// rows of [i·block_m + c·kRouteGradsPadRows, + kRouteGradsPadRows), the padding being [i·block_m +
// tile_num_rows[i], (i + 1)·block_m); tiles from *real_num_rows on (the schedule's spare rows, when the row
// buffers are sized by a bound) exit untouched. CTAs [pad_ctas, pad_ctas + num_tokens): one token each.
// NOTE: with one CTA per tile, last in the grid, the tiles' padding (up to 127 rows of 14 KiB at hidden 7168)
// ran as the kernel's tail, one CTA each: the kernel moved 2.2 TB/s at dsv4pro against 3.5 at qwen3-235b.

__global__ void __launch_bounds__(kRouteGradsThreads)
    route_grads_kernel(const uint4* __restrict__ d_out, const float* __restrict__ topk_weights,
                       const uint4* __restrict__ y_rows, const int64_t* __restrict__ route_to_row,
                       const int64_t* __restrict__ tile_num_rows, const int32_t* __restrict__ real_num_rows,
                       uint4* __restrict__ dy_rows,
                       float* __restrict__ d_topk_weights, int64_t num_tokens, int num_topk, int64_t num_rows,
                       int64_t vecs_per_row, int64_t block_m, int64_t pad_chunks, int64_t pad_ctas) {
  if (blockIdx.x < pad_ctas) {  // ---- padding rows of one chunk of one tile ----
    const int64_t tile = blockIdx.x / pad_chunks;
    const int64_t chunk_row0 = tile * block_m + blockIdx.x % pad_chunks * kRouteGradsPadRows;
    if (real_num_rows != nullptr && tile * block_m >= *real_num_rows) return;
    const int64_t first_row = max(chunk_row0, tile * block_m + tile_num_rows[tile]);
    const int64_t last_row = min(chunk_row0 + kRouteGradsPadRows, (tile + 1) * block_m);
    for (int64_t v = first_row * vecs_per_row + threadIdx.x; v < last_row * vecs_per_row; v += kRouteGradsThreads)
      st_v4(dy_rows + v, make_uint4(0, 0, 0, 0));
    return;
  }

  extern __shared__ float s_partial[];  // [kRouteGradsWarps][num_topk] warp sums
  const int64_t token = blockIdx.x - pad_ctas;
  const int lane = static_cast<int>(lane_id()), warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const uint4* d_row = d_out + token * vecs_per_row;  // [vecs_per_row]

  for (int k0 = 0; k0 < num_topk; k0 += kRouteGradsBatch) {
    int64_t row[kRouteGradsBatch];
    float weight[kRouteGradsBatch], dot[kRouteGradsBatch];
    bool ok[kRouteGradsBatch];  // a route of this batch with a row id in [0, num_rows)
#pragma unroll
    for (int b = 0; b < kRouteGradsBatch; ++b) {
      const bool in_batch = k0 + b < num_topk;
      row[b] = in_batch ? route_to_row[token * num_topk + k0 + b] : -1;
      ok[b] = in_batch && row[b] >= 0 && row[b] < num_rows;
      weight[b] = in_batch ? topk_weights[token * num_topk + k0 + b] : 0.0f;
      dot[b] = 0.0f;
    }
    for (int64_t v = threadIdx.x; v < vecs_per_row; v += kRouteGradsThreads) {
      const uint4 d = __ldg(d_row + v);  // L1-allocating: the next batch of routes reads it again
      uint4 y[kRouteGradsBatch];
#pragma unroll
      for (int b = 0; b < kRouteGradsBatch; ++b)
        y[b] = ok[b] ? ld_stream_v4(y_rows + row[b] * vecs_per_row + v) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int b = 0; b < kRouteGradsBatch; ++b) {
        if (!ok[b]) continue;
        dot[b] = dot8(dot[b], d, y[b]);
        st_v4(dy_rows + row[b] * vecs_per_row + v, scale8_to_bf16(d, weight[b]));
      }
    }
#pragma unroll
    for (int b = 0; b < kRouteGradsBatch; ++b) {
      const float sum = warp_sum_butterfly(dot[b]);
      if (lane == 0 && k0 + b < num_topk) s_partial[warp * num_topk + k0 + b] = ok[b] ? sum : __int_as_float(0x7FC00000);
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < num_topk; k += kRouteGradsThreads) {
    float sum = s_partial[k];
#pragma unroll
    for (int w = 1; w < kRouteGradsWarps; ++w) sum = __fadd_rn(sum, s_partial[w * num_topk + k]);
    d_topk_weights[token * num_topk + k] = sum;
  }
}

// ---- host launcher --------------------------------------------------------------------------------------------
// Shapes and alignment as in mok/api.h (checked in mok/ops/); num_tiles = num_rows / block_m.

inline cudaError_t launch_route_grads(const void* d_out, const float* topk_weights, const void* y_rows,
                                      const int64_t* route_to_row, const int64_t* tile_num_rows,
                                      const int32_t* real_num_rows, void* dy_rows,
                                      float* d_topk_weights, int64_t num_tokens, int64_t num_topk, int64_t num_rows,
                                      int64_t hidden, int64_t block_m, cudaStream_t stream) {
  if (hidden % kRouteGradsVecElems != 0 || num_topk < 1 || num_topk > kRouteGradsMaxTopk || block_m < 1 ||
      num_rows % block_m != 0)
    return cudaErrorInvalidValue;
  const int64_t pad_chunks = ceil_div(block_m, int64_t{kRouteGradsPadRows});
  const int64_t pad_ctas = num_rows / block_m * pad_chunks;
  const int64_t num_blocks = pad_ctas + num_tokens;
  if (num_blocks == 0) return cudaSuccess;
  if (num_blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  const size_t smem = kRouteGradsWarps * num_topk * sizeof(float);
  route_grads_kernel<<<static_cast<unsigned>(num_blocks), kRouteGradsThreads, smem, stream>>>(
      static_cast<const uint4*>(d_out), topk_weights, static_cast<const uint4*>(y_rows), route_to_row, tile_num_rows,
      real_num_rows, static_cast<uint4*>(dy_rows), d_topk_weights, num_tokens, static_cast<int>(num_topk), num_rows,
      hidden / kRouteGradsVecElems, block_m, pad_chunks, pad_ctas);
  return cudaGetLastError();
}

}  // namespace mok::moe
