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
// amax with two shuffles. kRoundTrip (mxfp8_fake_quantize.cuh): `data` receives the dequantized bf16 (16
// bytes per chunk, dequantize8 on the scale's 2^e) and `scales` is unused.

template <int kChunksPerThread, int kThreads, bool kRoundTrip = false>
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
    if (chunk >= num_chunks) continue;
    if constexpr (kRoundTrip) {
      const float e = scale_byte_to_f32(s.byte);
      const float scale[8] = {e, e, e, e, e, e, e, e};
      st_v4(data + chunk * 16, dequantize8(quantize8(v[i], s), scale));  // [chunk] 8 bf16
    } else {
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

// Outputs of the column-wise / dual kernels (the row-wise pair is null for column-wise only). The round-trip
// kernels (mxfp8_fake_quantize.cuh) write the dequantized bf16 instead: round_trip_col (and _row for dual).
struct TiledOut {
  uint8_t* data_col;    // [rows, cols] E4M3
  uint8_t* scales_col;  // [rows / 32, cols] E8M0
  uint8_t* data_row;    // [rows, cols] E4M3 (dual)
  uint8_t* scales_row;  // [rows, cols / 32] E8M0 (dual)
  uint8_t* round_trip_col = nullptr;  // [rows, cols] bf16: dequantize(quantize(x, dim -2))
  uint8_t* round_trip_row = nullptr;  // [rows, cols] bf16: dequantize(quantize(x, dim -1)) (dual)
};

// The E8M0 bytes of 8 consecutive columns' scales, column 0 in the lowest byte (one 8-byte store).
MOK_DEVICE uint2 scale_bytes8(const Scale (&s)[8]) {
  return make_uint2(s[0].byte | (s[1].byte << 8) | (s[2].byte << 16) | (s[3].byte << 24),
                    s[4].byte | (s[5].byte << 8) | (s[6].byte << 16) | (s[7].byte << 24));
}

// Row-wise scales of two rows at once (dual): `a` and `b` are this lane's 8-column chunks of the two rows,
// and lanes xor 1, 2 hold the other 3 chunks of the same 32-column block. The two rows' amaxes travel
// packed in one word, so one pair of shuffles serves both. All 32 lanes must call it.
MOK_DEVICE void row_block_scales2(uint4 a, uint4 b, Scale& sa, Scale& sb) {
  uint32_t amax2 = amax2_fold(amax2_acc(0u, a)) | (amax2_fold(amax2_acc(0u, b)) << 16);
  amax2 = warp_vmaxu2_xor(warp_vmaxu2_xor(amax2, 1), 2);
  sa = scale_from_amax_bits(amax2 & 0xFFFFu);
  sb = scale_from_amax_bits(amax2 >> 16);
}

// Quantizes a thread's kRowsPerThread chunks `v` (8 columns from `col`, rows row0 + row_lane + kRowLanes
// * i) column-wise and, for kDual, row-wise, and stores both (kRoundTrip: their dequantization, bf16, and
// no scales: mxfp8_dequantize's bits, through its own dequantize8). All 32 lanes must call it (shuffles); lanes
// with `valid` false (columns past the end) compute on whatever they hold and store nothing. NOTE: the
// shuffles only mix lanes of equal `valid`: col lanes of one column (xor >= kColLanes), or the 4 col
// lanes of one row-wise block (xor 1, 2; dual needs cols % 32 == 0). kEvictFirst: the column-wise round trip's
// stores ask L2 to drop their lines first (the gathered kernel's; common.cuh's eviction hints).
template <int kRowLanes, bool kDual, bool kRoundTrip = false, bool kEvictFirst = false>
MOK_DEVICE void quantize_and_store_tile(const uint4 (&v)[ColTile<kRowLanes>::kRowsPerThread], int64_t row0,
                                        int64_t col, int64_t cols, bool valid, int row_lane, int col_lane,
                                        const TiledOut& out) {
  constexpr int kRowsPerThread = ColTile<kRowLanes>::kRowsPerThread;
  // ---- column scales: per-thread max over its rows, then over the row lanes
  uint32_t acc[4] = {0u, 0u, 0u, 0u};  // column pairs (2k, 2k + 1)
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    acc[0] = amax2_acc(acc[0], v[i].x);
    acc[1] = amax2_acc(acc[1], v[i].y);
    acc[2] = amax2_acc(acc[2], v[i].z);
    acc[3] = amax2_acc(acc[3], v[i].w);
  }
  Scale cs[8];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int m = ColTile<kRowLanes>::kColLanes; m < kWarpSize; m <<= 1) acc[k] = warp_vmaxu2_xor(acc[k], m);
    cs[2 * k] = scale_from_amax_bits(acc[k] & 0xFFFFu);
    cs[2 * k + 1] = scale_from_amax_bits(acc[k] >> 16);
  }
  float col_inv[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) col_inv[k] = cs[k].inv;
  const uint2 col_nan = nan_byte_mask(cs);

  // ---- row scales (dual): this thread's 8 columns, two rows per word, then over the block's 4 col lanes
  Scale rs[kRowsPerThread];
  if constexpr (kDual) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread / 2; ++i) row_block_scales2(v[2 * i], v[2 * i + 1], rs[2 * i], rs[2 * i + 1]);
  }
  if (!valid) return;  // no shuffles below

  if constexpr (kRoundTrip) {  // q · 2^e per element, as mxfp8_dequantize computes it from the stored bytes
    float col_scale[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) col_scale[k] = scale_byte_to_f32(cs[k].byte);
    [[maybe_unused]] const uint64_t drop = kEvictFirst ? l2_evict_first_policy() : 0;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t offset = (row0 + row_lane + kRowLanes * i) * cols + col;  // [row, col] element index
      const uint4 col_words = dequantize8(quantize8(v[i], col_inv, col_nan), col_scale);
      if constexpr (kEvictFirst) {
        st_hint_v4(out.round_trip_col + offset * 2, col_words, drop);
      } else {
        st_v4(out.round_trip_col + offset * 2, col_words);
      }
      if constexpr (kDual) {
        const float s = scale_byte_to_f32(rs[i].byte);
        const float row_scale[8] = {s, s, s, s, s, s, s, s};
        st_v4(out.round_trip_row + offset * 2, dequantize8(quantize8(v[i], rs[i]), row_scale));
      }
    }
  } else {
    // ---- stores: E4M3 bytes and scales
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t offset = (row0 + row_lane + kRowLanes * i) * cols + col;  // [row, col] element index
      st_v2(out.data_col + offset, quantize8(v[i], col_inv, col_nan));
      if constexpr (kDual) st_v2(out.data_row + offset, quantize8(v[i], rs[i]));
    }
    if (row_lane == 0)
      st_v2(out.scales_col + (row0 / kBlockSize) * cols + col, scale_bytes8(cs));  // [row0/32, col..+8)
    if constexpr (kDual) {
      // The block's 4 col lanes all hold its kRowsPerThread row scales; lane j of the 4 stores a share.
      constexpr int kRowsPerLane = kRowsPerThread / kChunksPerBlock;
      const int sub = col_lane % kChunksPerBlock;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        if (i / kRowsPerLane == sub) {
          const int64_t row = row0 + row_lane + kRowLanes * i;
          st_u8(out.scales_row + row * (cols / kBlockSize) + col / kBlockSize, rs[i].byte);
        }
      }
    }
  }
}

// Where a tiled kernel's rows come from. kGather: row r of its input is x's row `row_to_token[r]` of
// `num_src_rows` (a schedule's dispatch, mok.schedule.gather_rows: zeros where it is negative, NaN past x, never
// read there); the other instantiations read row r itself and ignore both. Every instantiation: with
// `real_num_rows` set (a schedule's counts[0] on the device: its rows past it are spare, never read by a GEMM),
// a 32-row block that starts at or past *real_num_rows is neither read nor written.
struct RowSource {
  const int32_t* row_to_token = nullptr;  // [rows]
  int64_t num_src_rows = 0;
  const int32_t* real_num_rows = nullptr;  // [1] on the device, or null: every row
};

// kDual = false: column-wise only. kDual = true: also row-wise. One warp tile per warp, loads straight
// from global memory (all issued before any use). kGather: rows through `src` (the backward's x rows gathered
// and round-tripped in one pass, without the gathered copy in memory).
template <int kRowLanes, int kWarps, bool kDual, bool kRoundTrip = false, bool kGather = false>
__global__ void __launch_bounds__(kWarps * kWarpSize)
    quantize_tiled_kernel(const uint8_t* __restrict__ x, TiledOut out, int64_t rows, int64_t cols, RowSource src) {
  using Tile = ColTile<kRowLanes>;
  const int64_t col_tiles = ceil_div(cols, Tile::kCols);
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (tile >= (rows / kBlockSize) * col_tiles) return;  // whole warps leave together
  const int lane = static_cast<int>(lane_id());
  const int row_lane = lane / Tile::kColLanes, col_lane = lane % Tile::kColLanes;
  const int64_t row0 = (tile / col_tiles) * kBlockSize;                       // first row of the block
  if (src.real_num_rows != nullptr && row0 >= __ldg(src.real_num_rows)) return;  // a spare block: whole warps
  const int64_t col = (tile % col_tiles) * Tile::kCols + col_lane * kChunkElems;  // first of 8 columns
  const bool valid = col < cols;  // cols % 8 == 0: a chunk is all in or all out

  uint4 v[Tile::kRowsPerThread];
  // Gathered: x's rows are read once per route, the routes of a token far apart in the row order, while the kernel
  // writes K times x's bytes through L2: x's loads ask L2 to keep it (evict_last), the stores to drop theirs first.
  [[maybe_unused]] const uint64_t keep = kGather ? l2_evict_last_policy() : 0;
#pragma unroll
  for (int i = 0; i < Tile::kRowsPerThread; ++i) {
    int64_t row = row0 + row_lane + kRowLanes * i;
    if constexpr (kGather) {
      row = src.row_to_token[row];
      if (row < 0 || row >= src.num_src_rows) {  // padding or spare row: zeros; a token past x: NaN
        const uint32_t fill = row < 0 ? 0u : 0x7FC07FC0u;  // two bf16 quiet NaNs
        v[i] = make_uint4(fill, fill, fill, fill);
        continue;
      }
      v[i] = valid ? ld_keep_v4(x + (row * cols + col) * 2, keep) : make_uint4(0u, 0u, 0u, 0u);
    } else {
      v[i] = valid ? ld_stream_v4(x + (row * cols + col) * 2) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  quantize_and_store_tile<kRowLanes, kDual, kRoundTrip, kGather>(v, row0, col, cols, valid, row_lane, col_lane, out);
}

// ---- host launchers (x, data, scales: device pointers, 16-byte aligned) ------------------------------
// Why these shapes (4 chunks per thread; warp tiles of 4 row lanes × 8 warps per CTA, straight from global memory)
// and what else was measured: docs/mxfp8_kernels.md.

inline cudaError_t launch_quantize_rowwise(const void* x, void* data, void* scales, int64_t numel,
                                           cudaStream_t stream) {
  if (numel % kBlockSize != 0) return cudaErrorInvalidValue;
  if (numel == 0) return cudaSuccess;
  constexpr int kThreads = 256, kChunks = 4;
  const int64_t num_chunks = numel / kChunkElems;
  quantize_rowwise_kernel<kChunks, kThreads><<<ceil_div(num_chunks, int64_t{kChunks} * kThreads), kThreads, 0,
                                               stream>>>(static_cast<const uint8_t*>(x), static_cast<uint8_t*>(data),
                                                         static_cast<uint8_t*>(scales), num_chunks);
  return cudaGetLastError();
}

// Column-wise: rows = product of all dims but the last (a multiple of 32), cols % 8 == 0. (Dual:
// launch_quantize_dual_split, mxfp8_quantize_split.cuh.)
inline cudaError_t launch_quantize_colwise(const void* x, void* data, void* scales, int64_t rows, int64_t cols,
                                           cudaStream_t stream) {
  if (rows % kBlockSize != 0 || cols % kChunkElems != 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  constexpr int kRowLanes = 4, kWarps = 8;
  const TiledOut out{static_cast<uint8_t*>(data), static_cast<uint8_t*>(scales), nullptr, nullptr};
  const int64_t tiles = (rows / kBlockSize) * ceil_div(cols, ColTile<kRowLanes>::kCols);
  quantize_tiled_kernel<kRowLanes, kWarps, false><<<ceil_div(tiles, kWarps), kWarps * kWarpSize, 0, stream>>>(
      static_cast<const uint8_t*>(x), out, rows, cols, RowSource{});
  return cudaGetLastError();
}

}  // namespace mok::mxfp8
