// MXFP8 -> BF16 dequantization kernels: q * 2^e in fp32 (exact unless it overflows to Inf), rounded to
// bf16; a 0xFF scale gives NaN for its whole block. Row-wise (scales along dim -1) runs over a flat
// stream of blocks; column-wise (scales along dim -2) over 32-row warp tiles, like the quantizer.
// Bytes: per element 1 read + 2 written (+ 1/32 for the scale).
#pragma once

#include "mok/quant/mxfp8.cuh"

namespace mok::mxfp8 {

// ---- row-wise: thread = 8 E4M3 bytes (8-byte load) -> 8 bf16 (16-byte store) per step -------------------

template <int kChunksPerThread, int kThreads>
__global__ void __launch_bounds__(kThreads)
    dequantize_rowwise_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales,
                              uint8_t* __restrict__ out, int64_t num_chunks) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kChunksPerThread * kThreads + threadIdx.x;
  uint2 q[kChunksPerThread];
  uint32_t byte[kChunksPerThread];
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    const int64_t chunk = first + static_cast<int64_t>(i) * kThreads;
    const bool valid = chunk < num_chunks;
    q[i] = valid ? ld_stream_v2(data + chunk * 8) : make_uint2(0u, 0u);
    byte[i] = valid ? ld_stream_u8(scales + chunk / kChunksPerBlock) : 0u;  // 4 lanes, one byte
  }
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    const int64_t chunk = first + static_cast<int64_t>(i) * kThreads;
    const float s = scale_byte_to_f32(byte[i]);
    const float scale[8] = {s, s, s, s, s, s, s, s};
    if (chunk < num_chunks) st_v4(out + chunk * 16, dequantize8(q[i], scale));  // [chunk] 8 bf16
  }
}

// ---- column-wise: thread = 8 columns x (32 / kRowLanes) rows of one block ----------------------------

template <int kRowLanes, int kWarps>
__global__ void __launch_bounds__(kWarps * kWarpSize)
    dequantize_colwise_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scales,
                              uint8_t* __restrict__ out, int64_t rows, int64_t cols) {
  constexpr int kColLanes = kWarpSize / kRowLanes;
  constexpr int kRowsPerThread = kBlockSize / kRowLanes;
  constexpr int kTileCols = kColLanes * kChunkElems;
  const int64_t col_tiles = ceil_div(cols, kTileCols);
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  const int lane = static_cast<int>(lane_id());
  const int row_lane = lane / kColLanes, col_lane = lane % kColLanes;
  const int64_t row0 = (tile / col_tiles) * kBlockSize;
  const int64_t col = (tile % col_tiles) * kTileCols + col_lane * kChunkElems;
  if (tile >= (rows / kBlockSize) * col_tiles || col >= cols) return;  // no shuffles in this kernel

  const uint2 bytes = ld_stream_v2(scales + (row0 / kBlockSize) * cols + col);  // 8 column scales
  float scale[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    scale[k] = scale_byte_to_f32((bytes.x >> (8 * k)) & 0xFFu);
    scale[k + 4] = scale_byte_to_f32((bytes.y >> (8 * k)) & 0xFFu);
  }
  uint2 q[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i)
    q[i] = ld_stream_v2(data + (row0 + row_lane + kRowLanes * i) * cols + col);
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i)
    st_v4(out + ((row0 + row_lane + kRowLanes * i) * cols + col) * 2, dequantize8(q[i], scale));
}

// ---- host launchers ------------------------------------------------------------------------------------

inline cudaError_t launch_dequantize_rowwise(const void* data, const void* scales, void* out, int64_t numel,
                                             cudaStream_t stream) {
  if (numel % kBlockSize != 0) return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  constexpr int kThreads = 256, kChunksPerThread = 4;
  const int64_t num_chunks = numel / kChunkElems;
  dequantize_rowwise_kernel<kChunksPerThread, kThreads>
      <<<ceil_div(num_chunks, kChunksPerThread * kThreads), kThreads, 0, stream>>>(
          static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(scales), static_cast<uint8_t*>(out),
          num_chunks);
  return cudaGetLastError();
}

// rows = product of all dims but the last (a multiple of 32), cols % 8 == 0.
inline cudaError_t launch_dequantize_colwise(const void* data, const void* scales, void* out, int64_t rows,
                                             int64_t cols, cudaStream_t stream) {
  if (rows % kBlockSize != 0 || cols % kChunkElems != 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  constexpr int kRowLanes = 4, kWarps = 8;
  const int64_t tiles = (rows / kBlockSize) * ceil_div(cols, (kWarpSize / kRowLanes) * kChunkElems);
  dequantize_colwise_kernel<kRowLanes, kWarps><<<ceil_div(tiles, kWarps), kWarps * kWarpSize, 0, stream>>>(
      static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(scales), static_cast<uint8_t*>(out),
      rows, cols);
  return cudaGetLastError();
}

}  // namespace mok::mxfp8
