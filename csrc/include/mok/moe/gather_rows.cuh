// Dispatch of token rows into the schedule's rows (mok.schedule.gather_rows, bit for bit: a copy):
//   out[r] = x[row_to_token[r]], and zeros where row_to_token[r] < 0 (padding rows).
// The backward's weight gradients read x in this order (docs/fused.md). With real_num_rows set (a no-sync
// schedule's counts[0] on the device), the spare rows from it on are not written: no kernel reads them, and at
// dsv4pro they are 20% of the buffer.
//
// Token-major: each token's row is read from HBM once and stored into its K rows (route_to_row), so x's bytes
// are read once, not K times (a row-major gather re-reads a token's row for each of its routes, long after L2
// has dropped it; docs/fused.md). Every row is written by exactly one warp:
//   * token warps: token t, slot k stores row r = route_to_row[t, k] iff row_to_token[r] == t and
//     row_to_k[r] == k (the schedule's two views of the route agree);
//   * row warps: every other row, zeros where row_to_token[r] < 0, NaN otherwise (a token id past num_tokens,
//     or views that disagree): the schedule is trusted, but never read past x, and never silently wrong.
// Bytes: 2·hidden read per token, 2·hidden written per real row.
#pragma once

#include "mok/common.cuh"

namespace mok::moe {

constexpr int kGatherWarps = 8;  // warps per CTA
constexpr int kGatherThreads = kGatherWarps * kWarpSize;
constexpr int kGatherVecs = 4;  // 16-byte loads in flight per lane, all issued before any store
// A token warp copies one chunk of a row (2 KB): many warps per token keep every SM busy even when tokens are
// few and rows long (one warp per whole row leaves SMs idle at 2048 tokens).
constexpr int64_t kGatherChunkVecs = kWarpSize * kGatherVecs;

struct GatherRows {
  const uint4* x;               // [num_tokens, vecs_per_row]
  const int32_t* row_to_token;  // [num_rows]
  const int64_t* row_to_k;      // [num_rows]
  const int64_t* route_to_row;  // [num_tokens, num_topk]
  const int32_t* real_num_rows;  // [1] on the device, or null: rows from *real_num_rows on are left alone
  uint4* out;                   // [num_rows, vecs_per_row]
  int64_t num_tokens, num_topk, num_rows, vecs_per_row;
};

// Token warp: copies vectors [v0, v0 + kGatherChunkVecs) of token t's row into the rows of its routes, 32 routes
// per pass. Lane l looks up the row of route k0 + l; a warp store covers 512 contiguous bytes of one row.
MOK_DEVICE void gather_token_chunk(const GatherRows& g, int64_t t, int64_t v0) {
  const int lane = static_cast<int>(lane_id());
  const uint4* src = g.x + t * g.vecs_per_row;
  uint4 v[kGatherVecs];
#pragma unroll
  for (int i = 0; i < kGatherVecs; ++i) {
    const int64_t vec = v0 + i * kWarpSize + lane;
    if (vec < g.vecs_per_row) v[i] = ld_stream_v4(src + vec);
  }
  for (int64_t k0 = 0; k0 < g.num_topk; k0 += kWarpSize) {
    const int64_t k = k0 + lane;
    const int64_t row = k < g.num_topk ? g.route_to_row[t * g.num_topk + k] : -1;
    const bool mine = row >= 0 && row < g.num_rows && g.row_to_token[row] == t && g.row_to_k[row] == k;
    for (uint32_t left = __ballot_sync(kFullMask, mine); left != 0; left &= left - 1) {
      const int64_t r = __shfl_sync(kFullMask, row, __ffs(left) - 1);
#pragma unroll
      for (int i = 0; i < kGatherVecs; ++i) {
        const int64_t vec = v0 + i * kWarpSize + lane;
        if (vec < g.vecs_per_row) st_v4(g.out + r * g.vecs_per_row + vec, v[i]);
      }
    }
  }
}

// Row warp: row r, filled with zeros or NaN unless a token warp owns it. One row per warp, so that the spare
// rows (all at the end of the buffer) spread over many warps.
MOK_DEVICE void fill_unowned_row(const GatherRows& g, int64_t r) {
  const int64_t t = g.row_to_token[r], k = g.row_to_k[r];
  if (t >= 0 && t < g.num_tokens && k >= 0 && k < g.num_topk && g.route_to_row[t * g.num_topk + k] == r) return;
  const uint32_t word = t < 0 ? 0u : 0x7FC07FC0u;  // +0, or two bf16 NaNs
  const uint4 fill = make_uint4(word, word, word, word);
  uint4* dst = g.out + r * g.vecs_per_row;
  for (int64_t vec = lane_id(); vec < g.vecs_per_row; vec += kWarpSize) st_v4(dst + vec, fill);
}

// CTAs [0, row_ctas): one row per warp (first, so that the padding's zeros overlap the copies); the rest: one
// (token, chunk) per warp, a token's chunks in consecutive warps.
__global__ void __launch_bounds__(kGatherThreads) gather_rows_kernel(GatherRows g, int64_t row_ctas) {
  const int64_t warp = static_cast<int64_t>(threadIdx.x) / kWarpSize;
  if (blockIdx.x < row_ctas) {
    const int64_t r = static_cast<int64_t>(blockIdx.x) * kGatherWarps + warp;
    const int64_t rows = g.real_num_rows != nullptr ? __ldg(g.real_num_rows) : g.num_rows;  // token rows lie below
    if (r < g.num_rows && r < rows) fill_unowned_row(g, r);
  } else {
    const int64_t chunks = ceil_div(g.vecs_per_row, kGatherChunkVecs);
    const int64_t w = (static_cast<int64_t>(blockIdx.x) - row_ctas) * kGatherWarps + warp, t = w / chunks;
    if (t < g.num_tokens) gather_token_chunk(g, t, (w - t * chunks) * kGatherChunkVecs);
  }
}

// x bf16 [num_tokens, hidden]; row_to_token int32 [num_rows]; row_to_k int64 [num_rows]; route_to_row int64
// [num_tokens, num_topk]; real_num_rows int32 [1] or null; out bf16 [num_rows, hidden]; hidden % 8 == 0 and both
// row buffers 16-byte aligned (checked in mok/ops/).
inline cudaError_t launch_gather_rows(const void* x, const int32_t* row_to_token, const int64_t* row_to_k,
                                      const int64_t* route_to_row, const int32_t* real_num_rows, void* out,
                                      int64_t num_tokens, int64_t num_topk, int64_t num_rows, int64_t hidden,
                                      cudaStream_t stream) {
  if (hidden % 8 != 0 || num_topk < 0) return cudaErrorInvalidValue;
  if (num_rows == 0 || hidden == 0) return cudaSuccess;
  const GatherRows g{static_cast<const uint4*>(x), row_to_token, row_to_k, route_to_row, real_num_rows,
                     static_cast<uint4*>(out), num_tokens, num_topk, num_rows, hidden / 8};
  const int64_t token_ctas = ceil_div(num_tokens * ceil_div(hidden / 8, kGatherChunkVecs), kGatherWarps);
  const int64_t row_ctas = ceil_div(num_rows, kGatherWarps);
  if (token_ctas + row_ctas > 0x7FFFFFFF) return cudaErrorInvalidValue;
  gather_rows_kernel<<<static_cast<unsigned>(token_ctas + row_ctas), kGatherThreads, 0, stream>>>(g, row_ctas);
  return cudaGetLastError();
}

}  // namespace mok::moe
