// Plain device-to-device copy kernels: the bandwidth ceilings the quantizer benchmark (mok/bench_quant.py)
// compares each quantizer call with, at the same byte count and under the same timing (kernels in a CUDA
// graph). Why a kernel and not cudaMemcpyAsync: captured in a graph, a memcpy becomes a memcpy node, which
// ran at ~2.7 TB/s on the H200 against ~4.2 for an eager copy (docs/mxfp8_kernels.md).
//
// variant 0 (the benchmark's same-size copy): the row-wise quantizer's access pattern
//   (quantize_rowwise_kernel<4, 256>): a thread copies 4 16-byte chunks, all loads issued before any store; a
//   warp step reads and writes 512 contiguous bytes.
// variant 1: the same with 8 chunks per thread (twice the bytes in flight).
// variant 2: the bulk-copy engine both ways: a persistent grid of one-warp CTAs, each streaming 16 KB pieces
//   through a ring of shared-memory stages (cp.async.bulk in, cp.async.bulk out), no data through registers.
// variant 3: dual quantization's streams without its arithmetic: each 16-byte chunk's 8 low bytes go to the
//   first half of dst and its 8 high bytes to the second half, both at the chunk's element index (dual writes
//   its row-wise and column-wise E4M3 at x's element index in two tensors). One read stream, two write streams.
#pragma once

#include "mok/common.cuh"

namespace mok {

template <int kChunksPerThread, int kThreads, bool kTwoStreams>
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
    if (chunk >= num_chunks) continue;
    if constexpr (kTwoStreams) {  // bytes 0, 2, 4, ... and 1, 3, 5, ... of the chunk
      const uint2 lo{__byte_perm(v[i].x, v[i].y, 0x6420), __byte_perm(v[i].z, v[i].w, 0x6420)};
      const uint2 hi{__byte_perm(v[i].x, v[i].y, 0x7531), __byte_perm(v[i].z, v[i].w, 0x7531)};
      st_v2(dst + chunk * 8, lo);
      st_v2(dst + num_chunks * 8 + chunk * 8, hi);
    } else {
      st_v4(dst + chunk * 16, v[i]);
    }
  }
}

// Variant 2. Lane 0 does everything: piece k of this CTA (global piece blockIdx.x + k·gridDim.x) lands in
// stage k % kStages on full[stage], goes out by a bulk store (one bulk group per piece), and the stage is
// refilled with piece k + kStages once that store has read it (wait_group.read: at most one younger group).
constexpr int kBulkPieceBytes = 16 * 1024, kBulkStages = 4;

__global__ void __launch_bounds__(kWarpSize)
    copy_bytes_bulk_kernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t nbytes) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // [kBulkStages]
  uint8_t* stages = smem + 128;
  if (threadIdx.x != 0) return;
  const int64_t num_pieces = ceil_div(nbytes, int64_t{kBulkPieceBytes});
  const auto piece_bytes = [&](int64_t piece) {
    return static_cast<uint32_t>(min(int64_t{kBulkPieceBytes}, nbytes - piece * kBulkPieceBytes));
  };
  const auto load = [&](int64_t piece, int stage) {
    ptx::mbarrier_arrive_expect_tx(&full[stage], piece_bytes(piece));
    ptx::bulk_copy_g2s(stages + stage * kBulkPieceBytes, src + piece * kBulkPieceBytes, piece_bytes(piece),
                       &full[stage]);
  };
  for (int s = 0; s < kBulkStages; ++s) ptx::mbarrier_init(&full[s], 1);
  ptx::fence_mbarrier_init();
  for (int s = 0; s < kBulkStages; ++s) {
    const int64_t piece = blockIdx.x + static_cast<int64_t>(s) * gridDim.x;
    if (piece < num_pieces) load(piece, s);
  }
  int64_t k = 0;
  for (int64_t piece = blockIdx.x; piece < num_pieces; piece += gridDim.x, ++k) {
    const int stage = static_cast<int>(k % kBulkStages);
    ptx::mbarrier_wait_parity(&full[stage], static_cast<uint32_t>(k / kBulkStages) & 1u);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst + piece * kBulkPieceBytes),
                 "r"(ptx::smem_addr(stages + stage * kBulkPieceBytes)), "r"(piece_bytes(piece))
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k == 0) continue;
    // piece k - 1's store has read its stage: refill that stage with piece k - 1 + kBulkStages
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    const int64_t next = piece + static_cast<int64_t>(kBulkStages - 1) * gridDim.x;
    if (next < num_pieces) load(next, static_cast<int>((k - 1) % kBulkStages));
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// src, dst: device pointers, 16-byte aligned, not overlapping; nbytes % 16 == 0; variant in [0, 4).
inline cudaError_t launch_copy_bytes(const void* src, void* dst, int64_t nbytes, int variant, cudaStream_t stream) {
  if (nbytes % 16 != 0 || variant < 0 || variant > 3) return cudaErrorInvalidValue;
  if (nbytes == 0) return cudaSuccess;
  const auto* in = static_cast<const uint8_t*>(src);
  auto* out = static_cast<uint8_t*>(dst);
  const int64_t num_chunks = nbytes / 16;
  constexpr int kThreads = 256;
  switch (variant) {
    case 0:
      copy_bytes_kernel<4, kThreads, false><<<ceil_div(num_chunks, int64_t{4} * kThreads), kThreads, 0, stream>>>(
          in, out, num_chunks);
      break;
    case 1:
      copy_bytes_kernel<8, kThreads, false><<<ceil_div(num_chunks, int64_t{8} * kThreads), kThreads, 0, stream>>>(
          in, out, num_chunks);
      break;
    case 2: {
      constexpr int kSmem = 128 + kBulkStages * kBulkPieceBytes;
      unsigned grid = 0;
      const int64_t pieces = ceil_div(nbytes, int64_t{kBulkPieceBytes});
      const cudaError_t err = persistent_grid<copy_bytes_bulk_kernel>(kWarpSize, kSmem, pieces, &grid);
      if (err != cudaSuccess) return err;
      copy_bytes_bulk_kernel<<<grid, kWarpSize, kSmem, stream>>>(in, out, nbytes);
      break;
    }
    default:
      copy_bytes_kernel<4, kThreads, true><<<ceil_div(num_chunks, int64_t{4} * kThreads), kThreads, 0, stream>>>(
          in, out, num_chunks);
  }
  return cudaGetLastError();
}

}  // namespace mok
