// Rows read from other ranks through a table of their buffers' base addresses: the megakernel's pull_x, pull_dy,
// combine and combine_dx bodies (docs/megakernel.md, "The tables"), here as kernels of their own. peers[s] is rank
// s's buffer as this process sees it: a peer GPU's memory (symmetric memory), another process's buffer on the same
// GPU (CUDA IPC), or another tensor of this process; the kernels cannot tell which. Every rank's buffer has the same
// capacity (symmetric memory allocates one size on every rank), which bounds each read.
//
//   pull_rows:     out[r] = src[pull_rank[r]] row pull_token[r]; zeros where pull_rank[r] < 0 (padding rows).
//                  With weights (pull_dy): out[r] = bf16(fp32(that row) · w), w = weights[pull_rank[r]]
//                  [pull_token[r] · num_topk + pull_k[r]]: one rounding, L0's dy = bf16(d_out·w).
//   combine_peers: combine_rows (moe/combine.cuh, the same fixed order and bits) with route (t, k)'s row at
//                  y[combine_rank[t, k]] row combine_row[t, k].
// A rank, token or row outside its bounds is never read: its row (pull) or token (combine) is NaN.
//
// Loads take the read-only path (ld.global.nc): the peers' rows were written by kernels that ended before this one
// started (the caller's barrier orders them across ranks). Inside one persistent launch the same bodies would
// read after a counter's acquire, without .nc.
#pragma once

#include "mok/moe/combine.cuh"

namespace mok::moe {

constexpr int kPullWarps = 8;  // warps per CTA
constexpr int kPullVecs = 4;   // 16-byte loads in flight per lane
constexpr int64_t kPullChunkVecs = kWarpSize * kPullVecs;  // one warp's piece of a row: 2 KB

struct PullRows {
  const uint4* const* src;      // [num_ranks] each rank's [capacity, vecs_per_row]
  const float* const* weights;  // [num_ranks] each rank's [capacity, num_topk], or null: a plain copy
  const int32_t* pull_rank;     // [num_rows]
  const int32_t* pull_token;    // [num_rows]
  const int32_t* pull_k;        // [num_rows] (read with weights only)
  uint4* out;                   // [num_rows, vecs_per_row]
  int64_t num_rows, vecs_per_row, capacity;
  int num_ranks, num_topk;
};

// 8 bf16 times w: each fp32 product (`__fmul_rn`, no contraction) rounded to bf16, as torch's
// (d_out.float() * w).to(bfloat16); -0 stays -0.
MOK_DEVICE uint4 scale_bf16x8(uint4 v, float w) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
  Acc8 a;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    a.v[2 * i] = __fmul_rn(w, bf16_lo_as_f32(words[i]));
    a.v[2 * i + 1] = __fmul_rn(w, bf16_hi_as_f32(words[i]));
  }
  return acc_to_bf16(a);
}

// Warp w of the grid copies chunk (w % chunks) of row (w / chunks).
__global__ void __launch_bounds__(kPullWarps * kWarpSize) pull_rows_kernel(PullRows p, int64_t chunks) {
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kPullWarps + threadIdx.x / kWarpSize;
  const int64_t r = warp / chunks;
  if (r >= p.num_rows) return;
  const int64_t v0 = (warp % chunks) * kPullChunkVecs + lane_id();
  const int s = p.pull_rank[r];
  const int64_t t = p.pull_token[r];
  const bool padding = s < 0;
  bool ok = !padding && s < p.num_ranks && t >= 0 && t < p.capacity;
  float w = 1.0f;
  if (ok && p.weights != nullptr) {
    const int k = p.pull_k[r];
    ok = k >= 0 && k < p.num_topk;
    if (ok) w = p.weights[s][t * p.num_topk + k];
  }
  const uint32_t word = padding ? 0u : 0x7FC07FC0u;  // +0, or two bf16 NaNs for a bad entry
  const uint4 fill = make_uint4(word, word, word, word);
  const uint4* row = ok ? p.src[s] + t * p.vecs_per_row : nullptr;
  uint4 v[kPullVecs];
#pragma unroll
  for (int i = 0; i < kPullVecs; ++i) {
    const int64_t vec = v0 + i * kWarpSize;
    v[i] = ok && vec < p.vecs_per_row ? ld_stream_v4(row + vec) : fill;
  }
#pragma unroll
  for (int i = 0; i < kPullVecs; ++i) {
    const int64_t vec = v0 + i * kWarpSize;
    if (vec < p.vecs_per_row) st_v4(p.out + r * p.vecs_per_row + vec, ok && p.weights ? scale_bf16x8(v[i], w) : v[i]);
  }
}

// src / weights: device arrays of num_ranks pointers (weights may be null); pull_* int32 [num_rows]; out bf16
// [num_rows, hidden]; hidden % 8 == 0, every row 16-byte aligned (checked in mok/ops/).
inline cudaError_t launch_pull_rows(const void* const* src, const float* const* weights, const int32_t* pull_rank,
                                    const int32_t* pull_token, const int32_t* pull_k, void* out, int64_t num_rows,
                                    int64_t hidden, int64_t capacity, int num_ranks, int num_topk,
                                    cudaStream_t stream) {
  if (hidden % 8 != 0 || num_ranks < 1 || num_topk < 1) return cudaErrorInvalidValue;
  if (num_rows == 0 || hidden == 0) return cudaSuccess;
  const PullRows p{reinterpret_cast<const uint4* const*>(src), weights, pull_rank, pull_token, pull_k,
                   static_cast<uint4*>(out), num_rows, hidden / 8, capacity, num_ranks, num_topk};
  const int64_t chunks = ceil_div(p.vecs_per_row, kPullChunkVecs);
  const int64_t blocks = ceil_div(num_rows * chunks, kPullWarps);
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  pull_rows_kernel<<<static_cast<unsigned>(blocks), kPullWarps * kWarpSize, 0, stream>>>(p, chunks);
  return cudaGetLastError();
}

// Route (t, k)'s row on its owner rank: combine_rows_kernel's row source for combine_peers.
struct PeerRoutes {
  const uint4* const* rows;     // [num_ranks] each rank's [capacity, vecs_per_row]
  const int32_t* combine_rank;  // [num_tokens · num_topk]
  const int32_t* combine_row;   // [num_tokens · num_topk]
  int64_t capacity, vecs_per_row;
  int num_ranks;
  MOK_DEVICE const uint4* row(int64_t route) const {
    const int s = combine_rank[route];
    const int64_t r = combine_row[route];
    return s >= 0 && s < num_ranks && r >= 0 && r < capacity ? rows[s] + r * vecs_per_row : nullptr;
  }
};

// rows: a device array of num_ranks pointers; combine_rank, combine_row int32 [num_tokens, num_topk]; topk_weights
// fp32 [num_tokens, num_topk] or null (weights 1); shared bf16 [num_tokens, hidden] or null; out bf16
// [num_tokens, hidden]. hidden % 8 == 0, 16-byte aligned rows.
inline cudaError_t launch_combine_peers(const void* const* rows, const int32_t* combine_rank,
                                        const int32_t* combine_row, const float* topk_weights, const void* shared,
                                        void* out, int64_t num_tokens, int64_t num_topk, int64_t capacity,
                                        int64_t hidden, int num_ranks, cudaStream_t stream) {
  if (num_ranks < 1) return cudaErrorInvalidValue;
  const PeerRoutes routes{reinterpret_cast<const uint4* const*>(rows), combine_rank, combine_row, capacity,
                          hidden / kVecElems, num_ranks};
  return launch_combine(routes, topk_weights, shared, out, num_tokens, num_topk, hidden, stream);
}

}  // namespace mok::moe
