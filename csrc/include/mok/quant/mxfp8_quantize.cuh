// BF16 -> MXFP8 quantization kernels: row-wise (blocks along dim -1), column-wise (blocks along dim -2)
// and dual (both from one read of x). Outputs in the logical layout: data has x's shape (E4M3 bytes),
// scales have the blocked dim divided by 32 (E8M0 bytes). A 3D tensor [experts, rows, cols] is handled
// as the 2D [experts * rows, cols]: row-wise blocks never cross a row, and with rows % 32 == 0 no
// column-wise block crosses an expert.
//
// Bytes: per bf16 element, 2 read + 1 written (+ 1/32 for the scale); dual writes 2 + 2/32.
#pragma once

#include "mok/quant/mxfp8.cuh"

namespace mok::mxfp8 {

// ---- row-wise: a flat stream of 32-element blocks ----------------------------------------------------
// Thread = one 16-byte chunk per step, kChunksPerThread steps whose loads are all issued first (bytes in
// flight). A warp step reads 512 contiguous bytes; 4 consecutive lanes hold one block and reduce its
// amax with two shuffles.

template <int kChunksPerThread, int kThreads>
__global__ void __launch_bounds__(kThreads)
    quantize_rowwise_kernel(const uint8_t* __restrict__ x, uint8_t* __restrict__ data,
                            uint8_t* __restrict__ scales, int64_t num_chunks) {
  static_assert(kThreads % kWarpSize == 0, "whole warps: every lane joins the shuffles");
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kChunksPerThread * kThreads + threadIdx.x;

  uint4 v[kChunksPerThread];
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    const int64_t chunk = first + static_cast<int64_t>(i) * kThreads;
    v[i] = chunk < num_chunks ? ld_stream_v4(x + chunk * 16) : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int i = 0; i < kChunksPerThread; ++i) {
    const int64_t chunk = first + static_cast<int64_t>(i) * kThreads;
    uint32_t amax2 = amax2_acc(0u, v[i]);
    amax2 = warp_vmaxu2_xor(amax2, 1);  // NOTE: num_chunks % 4 == 0, so a block's 4 lanes agree on
    amax2 = warp_vmaxu2_xor(amax2, 2);  // `chunk < num_chunks`; out-of-range lanes still shuffle
    const Scale s = scale_from_amax_bits(amax2_fold(amax2));
    if (chunk < num_chunks) {
      st_v2(data + chunk * 8, quantize8(v[i], s));  // [chunk] 8 E4M3 bytes
      if ((threadIdx.x & 3) == 0) st_u8(scales + chunk / kChunksPerBlock, s.byte);
    }
  }
}

// ---- column-wise and dual: 32-row warp tiles --------------------------------------------------------
// Warp tile: 32 rows (one column-wise block) x kColLanes * 8 columns. Lane = row_lane * kColLanes +
// col_lane: a thread owns the 16-byte chunk of 8 columns at col_lane, in rows row_lane + kRowLanes * i.
// One warp load reads kRowLanes row segments of kColLanes * 16 bytes (whole 128-byte lines).
// Column amax: per-thread max over its rows, then shuffles across row lanes (lane bits >= kColLanes).
// Row amax (dual): 4 col lanes = 32 columns = one row-wise block: shuffles xor 1, 2.

template <int kRowLanes>
struct ColTile {
  static constexpr int kColLanes = kWarpSize / kRowLanes;
  static constexpr int kRowsPerThread = kBlockSize / kRowLanes;
  static constexpr int kCols = kColLanes * kChunkElems;
  static_assert(kRowLanes * kRowsPerThread == kBlockSize, "a warp tile is one 32-row block");
  static_assert(kColLanes % kChunksPerBlock == 0, "row-wise blocks (dual) stay inside a warp tile");
};

// Loads a thread's kRowsPerThread chunks and computes its 8 column scales (all lanes must call).
template <int kRowLanes>
MOK_DEVICE void load_tile_and_col_scales(const uint8_t* __restrict__ x, int64_t row0, int64_t col,
                                         int64_t cols, bool valid, int row_lane,
                                         uint4 (&v)[ColTile<kRowLanes>::kRowsPerThread], Scale (&cs)[8]) {
  constexpr int kRowsPerThread = ColTile<kRowLanes>::kRowsPerThread;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t row = row0 + row_lane + kRowLanes * i;
    v[i] = valid ? ld_stream_v4(x + (row * cols + col) * 2) : make_uint4(0u, 0u, 0u, 0u);
  }
  uint32_t acc[4] = {0u, 0u, 0u, 0u};  // column pairs (2k, 2k + 1)
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    acc[0] = amax2_acc(acc[0], v[i].x);
    acc[1] = amax2_acc(acc[1], v[i].y);
    acc[2] = amax2_acc(acc[2], v[i].z);
    acc[3] = amax2_acc(acc[3], v[i].w);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int m = ColTile<kRowLanes>::kColLanes; m < kWarpSize; m <<= 1) acc[k] = warp_vmaxu2_xor(acc[k], m);
    cs[2 * k] = scale_from_amax_bits(acc[k] & 0xFFFFu);
    cs[2 * k + 1] = scale_from_amax_bits(acc[k] >> 16);
  }
}

// kDual = false: column-wise only. kDual = true: also row-wise, into data_row / scales_row.
template <int kRowLanes, int kWarps, bool kDual>
__global__ void __launch_bounds__(kWarps * kWarpSize)
    quantize_tiled_kernel(const uint8_t* __restrict__ x, uint8_t* __restrict__ data_col,
                          uint8_t* __restrict__ scales_col, uint8_t* __restrict__ data_row,
                          uint8_t* __restrict__ scales_row, int64_t rows, int64_t cols) {
  using Tile = ColTile<kRowLanes>;
  constexpr int kRowsPerThread = Tile::kRowsPerThread;
  const int64_t col_tiles = ceil_div(cols, Tile::kCols);
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (tile >= (rows / kBlockSize) * col_tiles) return;  // whole warps leave together
  const int lane = static_cast<int>(lane_id());
  const int row_lane = lane / Tile::kColLanes, col_lane = lane % Tile::kColLanes;
  const int64_t row0 = (tile / col_tiles) * kBlockSize;                       // first row of the block
  const int64_t col = (tile % col_tiles) * Tile::kCols + col_lane * kChunkElems;  // first of 8 columns
  const bool valid = col < cols;  // cols % 8 == 0: a chunk is all in or all out

  uint4 v[kRowsPerThread];
  Scale cs[8];
  load_tile_and_col_scales<kRowLanes>(x, row0, col, cols, valid, row_lane, v, cs);
  float col_inv[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) col_inv[k] = cs[k].inv;
  const uint2 col_nan = nan_byte_mask(cs);

  Scale rs[kRowsPerThread];
  if constexpr (kDual) {
    // Row amax of this thread's 8 columns, two rows per word, then over the block's 4 col lanes.
    uint32_t acc[kRowsPerThread / 2];
#pragma unroll
    for (int i = 0; i < kRowsPerThread / 2; ++i) {
      acc[i] = amax2_fold(amax2_acc(0u, v[2 * i])) | (amax2_fold(amax2_acc(0u, v[2 * i + 1])) << 16);
      acc[i] = warp_vmaxu2_xor(warp_vmaxu2_xor(acc[i], 1), 2);
      rs[2 * i] = scale_from_amax_bits(acc[i] & 0xFFFFu);
      rs[2 * i + 1] = scale_from_amax_bits(acc[i] >> 16);
    }
  }
  if (!valid) return;  // no shuffles below

#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t offset = (row0 + row_lane + kRowLanes * i) * cols + col;  // [row, col] element index
    st_v2(data_col + offset, quantize8(v[i], col_inv, col_nan));
    if constexpr (kDual) st_v2(data_row + offset, quantize8(v[i], rs[i]));
  }
  if (row_lane == 0) {  // [row0 / 32, col .. col + 8) of the column-wise scales
    uint2 bytes;
    bytes.x = cs[0].byte | (cs[1].byte << 8) | (cs[2].byte << 16) | (cs[3].byte << 24);
    bytes.y = cs[4].byte | (cs[5].byte << 8) | (cs[6].byte << 16) | (cs[7].byte << 24);
    st_v2(scales_col + (row0 / kBlockSize) * cols + col, bytes);
  }
  if constexpr (kDual) {
    // The block's 4 col lanes all hold its kRowsPerThread row scales; lane j of the 4 stores a share.
    constexpr int kRowsPerLane = kRowsPerThread / kChunksPerBlock;
    const int sub = col_lane % kChunksPerBlock;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      if (i / kRowsPerLane == sub) {
        const int64_t row = row0 + row_lane + kRowLanes * i;
        st_u8(scales_row + row * (cols / kBlockSize) + col / kBlockSize, rs[i].byte);
      }
    }
  }
}

// ---- host launchers (x, data, scales: device pointers, 16-byte aligned) ------------------------------
// variant: 0 = default; others are kept for the benchmark's record of what was tried (docs/).

inline cudaError_t launch_quantize_rowwise(const void* x, void* data, void* scales, int64_t numel,
                                           int variant, cudaStream_t stream) {
  if (numel % kBlockSize != 0) return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t num_chunks = numel / kChunkElems;
  auto launch = [&](auto kernel, int chunks_per_thread) {
    kernel<<<ceil_div(num_chunks, int64_t(chunks_per_thread) * kThreads), kThreads, 0, stream>>>(
        static_cast<const uint8_t*>(x), static_cast<uint8_t*>(data), static_cast<uint8_t*>(scales),
        num_chunks);
    return cudaGetLastError();
  };
  switch (variant) {
    case 0: return launch(quantize_rowwise_kernel<4, kThreads>, 4);
    case 1: return launch(quantize_rowwise_kernel<2, kThreads>, 2);
    case 2: return launch(quantize_rowwise_kernel<8, kThreads>, 8);
    default: return cudaErrorInvalidValue;
  }
}

// rows = product of all dims but the last (a multiple of 32), cols % 8 == 0.
// data_row / scales_row are null for column-wise only.
inline cudaError_t launch_quantize_tiled(const void* x, void* data_col, void* scales_col, void* data_row,
                                         void* scales_row, int64_t rows, int64_t cols, int variant,
                                         cudaStream_t stream) {
  const bool dual = data_row != nullptr;
  if (rows % kBlockSize != 0 || cols % kChunkElems != 0 || (dual && cols % kBlockSize != 0))
    return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  auto launch = [&](auto kernel, int tile_cols, int warps) {
    const int64_t tiles = (rows / kBlockSize) * ceil_div(cols, tile_cols);
    kernel<<<ceil_div(tiles, warps), warps * kWarpSize, 0, stream>>>(
        static_cast<const uint8_t*>(x), static_cast<uint8_t*>(data_col), static_cast<uint8_t*>(scales_col),
        static_cast<uint8_t*>(data_row), static_cast<uint8_t*>(scales_row), rows, cols);
    return cudaGetLastError();
  };
  // variant: row lanes (rows per thread = 32 / row lanes) x warps per CTA. Fewer rows per thread means
  // fewer registers, so more resident warps; more rows, more bytes in flight per thread.
  //   0: 4 x 8    1: 2 x 8    2: 8 x 8    3: 4 x 4    4: 8 x 4
  switch (variant * 2 + (dual ? 1 : 0)) {
    case 0: return launch(quantize_tiled_kernel<4, 8, false>, ColTile<4>::kCols, 8);
    case 1: return launch(quantize_tiled_kernel<4, 8, true>, ColTile<4>::kCols, 8);
    case 2: return launch(quantize_tiled_kernel<2, 8, false>, ColTile<2>::kCols, 8);
    case 3: return launch(quantize_tiled_kernel<2, 8, true>, ColTile<2>::kCols, 8);
    case 4: return launch(quantize_tiled_kernel<8, 8, false>, ColTile<8>::kCols, 8);
    case 5: return launch(quantize_tiled_kernel<8, 8, true>, ColTile<8>::kCols, 8);
    case 6: return launch(quantize_tiled_kernel<4, 4, false>, ColTile<4>::kCols, 4);
    case 7: return launch(quantize_tiled_kernel<4, 4, true>, ColTile<4>::kCols, 4);
    case 8: return launch(quantize_tiled_kernel<8, 4, false>, ColTile<8>::kCols, 4);
    case 9: return launch(quantize_tiled_kernel<8, 4, true>, ColTile<8>::kCols, 4);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace mok::mxfp8
