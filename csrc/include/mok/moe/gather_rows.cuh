// Dispatch of token rows into the schedule's rows (mok.schedule.gather_rows, bit for bit: a copy):
//   out[r] = x[row_to_token[r]], and zeros where row_to_token[r] < 0 (padding and spare rows).
// The backward's weight gradients read x in this order (docs/l2_fused.md). A row_to_token entry at or past
// num_tokens reads nothing and gives a NaN row: never a stray read, never silent.
//
// Bytes: 2·hidden read per real row (each token's row once per route), 2·hidden written per row. A pure
// copy, so the limit is bytes in flight: each thread keeps kGatherVecs 16-byte loads in flight (the combine
// kernel with one route per row kept 2 and ran at a third of copy speed, `bench parts` gather_x).
#pragma once

#include "mok/common.cuh"

namespace mok::moe {

constexpr int kGatherThreads = 256;
constexpr int kGatherVecs = 4;  // 16-byte vectors per thread, all loaded before any is stored
constexpr int64_t kGatherBlockVecs = static_cast<int64_t>(kGatherThreads) * kGatherVecs;

// Block b owns the vectors [b · kGatherBlockVecs, (b + 1) · kGatherBlockVecs) of out (row-major, 8 bf16 each);
// thread t the vectors t, t + 256, ...: every warp load and store instruction covers 512 contiguous bytes.
__global__ void __launch_bounds__(kGatherThreads)
    gather_rows_kernel(const uint4* __restrict__ x, const int32_t* __restrict__ row_to_token, uint4* __restrict__ out,
                       int64_t num_tokens, int64_t num_vecs, int64_t vecs_per_row) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kGatherBlockVecs + threadIdx.x;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u), nan = make_uint4(0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u, 0x7FC07FC0u);
  uint4 v[kGatherVecs];
#pragma unroll
  for (int i = 0; i < kGatherVecs; ++i) {
    const int64_t vec = first + i * kGatherThreads;
    const int64_t row = vec / vecs_per_row;
    const int64_t token = vec < num_vecs ? row_to_token[row] : -1;
    const int64_t col = vec - row * vecs_per_row;
    v[i] = token < 0 ? zero : token >= num_tokens ? nan : ld_stream_v4(x + token * vecs_per_row + col);
  }
#pragma unroll
  for (int i = 0; i < kGatherVecs; ++i) {
    const int64_t vec = first + i * kGatherThreads;
    if (vec < num_vecs) st_v4(out + vec, v[i]);
  }
}

// x bf16 [num_tokens, hidden]; row_to_token int32 [num_rows]; out bf16 [num_rows, hidden]; hidden % 8 == 0 and
// both row buffers 16-byte aligned (checked in mok/ops/).
inline cudaError_t launch_gather_rows(const void* x, const int32_t* row_to_token, void* out, int64_t num_tokens,
                                      int64_t num_rows, int64_t hidden, cudaStream_t stream) {
  if (hidden % 8 != 0) return cudaErrorInvalidValue;
  const int64_t vecs_per_row = hidden / 8, num_vecs = num_rows * vecs_per_row;
  if (num_vecs == 0) return cudaSuccess;
  const int64_t num_blocks = ceil_div(num_vecs, kGatherBlockVecs);
  if (num_blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  gather_rows_kernel<<<static_cast<unsigned>(num_blocks), kGatherThreads, 0, stream>>>(
      static_cast<const uint4*>(x), row_to_token, static_cast<uint4*>(out), num_tokens, num_vecs, vecs_per_row);
  return cudaGetLastError();
}

}  // namespace mok::moe
