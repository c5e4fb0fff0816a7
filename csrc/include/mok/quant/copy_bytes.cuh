// A plain device-to-device copy kernel: the bandwidth ceiling the quantizer benchmark (mok/bench_quant.py)
// compares each quantizer call with, at the same byte count and under the same timing (kernels in a CUDA
// graph). Why a kernel and not cudaMemcpyAsync: captured in a graph, a memcpy becomes a memcpy node, which
// ran at ~2.7 TB/s on the H200 against ~4.2 for an eager copy (docs/mxfp8_kernels.md).
//
// Same access pattern as the row-wise quantizer's default (quantize_rowwise_kernel<4, 256>): a thread copies
// kChunksPerThread 16-byte chunks, all loads issued before any store; a warp step reads and writes 512
// contiguous bytes.
#pragma once

#include "mok/common.cuh"

namespace mok {

template <int kChunksPerThread, int kThreads>
__global__ void __launch_bounds__(kThreads)
    copy_bytes_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t num_chunks) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kChunksPerThread * kThreads + threadIdx.x;
  uint4 v[kChunksPerThread];
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    const int64_t chunk = first + static_cast<int64_t>(i) * kThreads;
    if (chunk < num_chunks) v[i] = ld_stream_v4(src + chunk * 16);
  }
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    const int64_t chunk = first + static_cast<int64_t>(i) * kThreads;
    if (chunk < num_chunks) st_v4(dst + chunk * 16, v[i]);
  }
}

// src, dst: device pointers, 16-byte aligned, not overlapping; nbytes % 16 == 0.
inline cudaError_t launch_copy_bytes(const void* src, void* dst, int64_t nbytes, cudaStream_t stream) {
  if (nbytes % 16 != 0) return cudaErrorInvalidValue;
  if (nbytes == 0) return cudaSuccess;
  constexpr int kChunksPerThread = 4, kThreads = 256;
  const int64_t num_chunks = nbytes / 16;
  copy_bytes_kernel<kChunksPerThread, kThreads>
      <<<ceil_div(num_chunks, int64_t{kChunksPerThread} * kThreads), kThreads, 0, stream>>>(
          static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), num_chunks);
  return cudaGetLastError();
}

}  // namespace mok
