// BF16 -> MXFP8 -> BF16 in one pass ("fake quantization", L0's mok.mxfp8.fake_quantize): what a BF16 GEMM
// of MXFP8 operands reads, without the E4M3 bytes and scales in HBM between a quantize and a dequantize
// kernel. Per element 2 bytes read + 2 written, against 2 + 1 + 1 + 2 (and two launches) for the pair; the
// same bits, by the same functions (quantize8, then dequantize8 on the scale byte's 2^e).
//   row-wise: quantize_rowwise_kernel's flat stream of 32-element blocks, kRoundTrip = true;
//   column-wise and dual: quantize_tiled_kernel's 32-row warp tiles, kRoundTrip = true.
#pragma once

#include "mok/quant/mxfp8_quantize.cuh"

namespace mok::mxfp8 {

// x, out: bf16 [numel], numel % 32 == 0.
inline cudaError_t launch_fake_quantize_rowwise(const void* x, void* out, int64_t numel, cudaStream_t stream) {
  if (numel % kBlockSize != 0) return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  constexpr int kThreads = 256, kChunks = 4;  // as launch_quantize_rowwise
  const int64_t num_chunks = numel / kChunkElems;
  quantize_rowwise_kernel<kChunks, kThreads, true><<<ceil_div(num_chunks, int64_t{kChunks} * kThreads), kThreads, 0,
                                                      stream>>>(static_cast<const uint8_t*>(x),
                                                                static_cast<uint8_t*>(out), nullptr, num_chunks);
  return cudaGetLastError();
}

// Column-wise (out_row null) or dual: x, out_col, out_row bf16 [rows, cols]; rows % 32 == 0, cols % 8 == 0
// (dual: cols % 32 == 0). real_num_rows (device, or null): the 32-row blocks from it on are left untouched.
inline cudaError_t launch_fake_quantize_tiled(const void* x, void* out_col, void* out_row, int64_t rows,
                                              int64_t cols, const int32_t* real_num_rows, cudaStream_t stream) {
  const bool dual = out_row != nullptr;
  if (rows % kBlockSize != 0 || cols % kChunkElems != 0 || (dual && cols % kBlockSize != 0))
    return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  TiledOut out{nullptr, nullptr, nullptr, nullptr};
  out.round_trip_col = static_cast<uint8_t*>(out_col);
  out.round_trip_row = static_cast<uint8_t*>(out_row);
  constexpr int kWarps = 8;
  const int64_t tiles = (rows / kBlockSize) * ceil_div(cols, ColTile<4>::kCols);
  const auto kernel =
      dual ? quantize_tiled_kernel<4, kWarps, true, true> : quantize_tiled_kernel<4, kWarps, false, true>;
  kernel<<<ceil_div(tiles, kWarps), kWarps * kWarpSize, 0, stream>>>(static_cast<const uint8_t*>(x), out, rows, cols,
                                                                       RowSource{nullptr, 0, real_num_rows});
  return cudaGetLastError();
}

// Column-wise, of rows gathered by a schedule: out [rows, cols] = the column-wise round trip of
// gather_rows(x, row_to_token), x bf16 [num_src_rows, cols]; rows % 32 == 0, cols % 8 == 0. The 32 rows of a
// block are read straight from x (a token's row once per route, against the gather's once plus a write and a
// read of the gathered copy). real_num_rows as in launch_fake_quantize_tiled.
inline cudaError_t launch_fake_quantize_gathered_colwise(const void* x, const int32_t* row_to_token, void* out,
                                                         int64_t rows, int64_t num_src_rows, int64_t cols,
                                                         const int32_t* real_num_rows, cudaStream_t stream) {
  if (rows % kBlockSize != 0 || cols % kChunkElems != 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  TiledOut tiled{nullptr, nullptr, nullptr, nullptr};
  tiled.round_trip_col = static_cast<uint8_t*>(out);
  constexpr int kWarps = 8;
  const int64_t tiles = (rows / kBlockSize) * ceil_div(cols, ColTile<4>::kCols);
  quantize_tiled_kernel<4, kWarps, false, true, true><<<ceil_div(tiles, kWarps), kWarps * kWarpSize, 0, stream>>>(
      static_cast<const uint8_t*>(x), tiled, rows, cols, RowSource{row_to_token, num_src_rows, real_num_rows});
  return cudaGetLastError();
}

}  // namespace mok::mxfp8
