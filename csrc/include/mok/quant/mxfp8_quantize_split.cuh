// BF16 -> MXFP8 dual quantization (row-wise + column-wise from one read of x), warp-specialized. In each
// CTA a producer warp streams 32 x 512 tiles of x into a ring of shared-memory stages with the bulk copy engine;
// consumer warps come in groups, one group per tile: row warps write the row-wise half, column
// warps the column-wise half, all from the same shared tile. Same numerics helpers as the other quantizers
// (mxfp8.cuh), so the same bits as L0. Why this layout, and the measurements: docs/mxfp8_kernels.md, "Dual,
// warp-specialized" and "Tiles of 512 columns".
//
// Bytes: per bf16 element 2 read + 2 written (+ 2/32 for the scales); no byte of x is read twice from HBM.
#pragma once

#include "mok/quant/mxfp8_quantize.cuh"

namespace mok::mxfp8 {

// ---- the tile -------------------------------------------------------------------------------------------
// 32 rows (one column-wise block) x kTileCols columns of bf16, one bulk copy per row. A tile is quantized in
// spans of 256 columns (8 row-wise blocks): lane l of either consumer warp owns the span's columns
// [8 l, 8 l + 8) in every row, so a warp's 16-byte shared load reads 512 contiguous bytes of one row
// (conflict-free), and a warp's 8-byte store writes 256 contiguous bytes of one output row: two whole
// 128-byte lines per store instruction. kTileCols = 512 (32 KB: 1 KB read per row, two spans; the longer
// pieces suit the 7168-column rows: docs/mxfp8_kernels.md).
constexpr int kSplitSpanCols = kWarpSize * kChunkElems;  // 256
static_assert(kSplitSpanCols % kBlockSize == 0, "a span holds whole row-wise blocks");

// kGroups consumer groups and kStages shared-memory stages per CTA; a group has, for each span of the tile,
// kRowWarps row warps (the tile's rows split evenly among them) and one column warp. Warp 0 produces;
// group g is warps 1 + g kGroupWarps ..., span by span, each span's column warp last.
template <int Groups, int Stages, int RowWarps, int TileCols>
struct SplitDual {
  static constexpr int kGroups = Groups, kStages = Stages, kRowWarps = RowWarps, kTileCols = TileCols;
  static constexpr int kSpans = kTileCols / kSplitSpanCols;
  static constexpr int kRowBytes = kTileCols * 2;             // a tile row in shared memory, bf16
  static constexpr int kStageBytes = kBlockSize * kRowBytes;  // 16 or 32 KB
  static constexpr int kSpanWarps = kRowWarps + 1;
  static constexpr int kGroupWarps = kSpans * kSpanWarps;
  static constexpr int kWarps = 1 + kGroups * kGroupWarps;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kRowsPerRowWarp = kBlockSize / kRowWarps;
  static constexpr int kBarrierBytes = 128 * static_cast<int>(ceil_div(2 * kStages * 8, 128));  // full, empty
  static constexpr int kSmemBytes = kBarrierBytes + kStages * kStageBytes;
  // CTAs per SM that shared memory allows (228 KB per SM on sm_90, 1 KB of it reserved per CTA): the
  // register budget of __launch_bounds__ must not be what stops them.
  static constexpr int kMinCtasPerSm = (228 * 1024) / (kSmemBytes + 1024);
  // NOTE: group g consumes the CTA's tiles k = g, g + kGroups, ... in order, and tile k sits in stage
  // k % kStages. With kGroups | kStages every fill of a stage goes to the same group, which waits for fill
  // f only after it consumed fill f - 1: a phase-parity wait never sees a phase two fills old.
  static_assert(kStages % kGroups == 0, "each stage always serves the same consumer group");
  static_assert(kTileCols % kSplitSpanCols == 0, "a tile is whole spans");
  static_assert(kBlockSize % kRowWarps == 0, "the row warps split the tile's 32 rows evenly");
  static_assert(kMinCtasPerSm >= 1, "the stages fit in one SM's shared memory (227 KB per CTA at most)");
};

// ---- producer: warp 0 -----------------------------------------------------------------------------------
// Fills stage k % kStages with the CTA's k-th tile (global tile blockIdx.x + k gridDim.x) once all warps
// of its group released the stage's previous fill. Lane r copies tile row r; a partial last column tile
// copies only its columns (cols % 32 == 0: a multiple of 64 bytes), the rest of the stage is stale.
template <typename Cfg>
MOK_DEVICE void produce_split_tiles(const uint8_t* x, uint8_t* stages, uint64_t* full, uint64_t* empty,
                                    int64_t cols, uint32_t col_tiles, uint32_t num_tiles) {
  constexpr int kStages = Cfg::kStages;
  const int lane = static_cast<int>(lane_id());
  uint32_t k = 0;
  for (uint32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x, ++k) {
    const uint32_t stage = k % kStages, fill = k / kStages;
    if (fill > 0) ptx::mbarrier_wait_parity(&empty[stage], (fill - 1) & 1u);
    const int64_t row = static_cast<int64_t>(tile / col_tiles) * kBlockSize + lane;
    const int64_t col0 = static_cast<int64_t>(tile % col_tiles) * Cfg::kTileCols;
    const uint32_t row_bytes = static_cast<uint32_t>(min(static_cast<int64_t>(Cfg::kTileCols), cols - col0)) * 2;
    if (lane == 0) ptx::mbarrier_arrive_expect_tx(&full[stage], row_bytes * kBlockSize);
    __syncwarp();
    ptx::bulk_copy_g2s(stages + stage * Cfg::kStageBytes + lane * Cfg::kRowBytes, x + (row * cols + col0) * 2,
                       row_bytes, &full[stage]);
  }
}

// ---- consumers: one tile each ---------------------------------------------------------------------------
// `src`: this lane's 16-byte chunk of the span in tile row 0 (row r is r * kRowBytes further); row0, col: the
// chunk's first row and column in x. Lanes with `valid` false (columns past the end) compute on stale
// shared memory and store nothing.

template <int kRowBytes>
MOK_DEVICE uint4 ld_stage(const uint8_t* src, int row) {
  return *reinterpret_cast<const uint4*>(src + row * kRowBytes);  // ld.shared.v4 (src is in smem)
}

// Row warp: the row-wise half of tile rows [first_row, first_row + kRows). Rows 8 at a time: 8 shared
// loads, then 4 independent shuffle chains (row_block_scales2: one pair of shuffles per two rows), then
// the stores, so that the chains overlap. The 4 lanes of a 32-column block share `valid` (cols % 32 == 0).
// Per row the warp stores 256 contiguous E4M3 bytes; a block's 8 scale bytes of a batch (one per row) are
// stored by its 4 lanes, 2 each (lane j of the 4: rows j and j + 4), so every lane stores and no lane
// branches on its position.
template <int kRows, int kRowBytes>
MOK_DEVICE void quantize_split_tile_rows(const uint8_t* src, int first_row, int64_t row0, int64_t col,
                                         int64_t cols, bool valid, const TiledOut& out) {
  constexpr int kBatch = 8;
  static_assert(kRows % kBatch == 0 && kBatch == 2 * kChunksPerBlock, "whole batches of rows, 2 per block lane");
  const int sub = static_cast<int>(lane_id()) & (kChunksPerBlock - 1);  // this lane's place in its block
  const int64_t scale_cols = cols / kBlockSize;
  uint8_t* data = out.data_row + (row0 + first_row) * cols + col;  // [row0 + first_row, col]
  uint8_t* scales = out.scales_row + (row0 + first_row + sub) * scale_cols + col / kBlockSize;  // [.. + sub, col / 32]
#pragma unroll 1
  for (int r0 = first_row; r0 < first_row + kRows; r0 += kBatch) {
    uint4 v[kBatch];
    Scale s[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) v[i] = ld_stage<kRowBytes>(src, r0 + i);  // tile row r0 + i
#pragma unroll
    for (int i = 0; i < kBatch; i += 2) row_block_scales2(v[i], v[i + 1], s[i], s[i + 1]);
    if (valid) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) st_v2(data + i * cols, quantize8(v[i], s[i]));  // [row0 + r0 + i, col..+8)
      uint32_t lo = s[0].byte, hi = s[4].byte;  // rows sub and sub + 4 of the batch
#pragma unroll
      for (int j = 1; j < kChunksPerBlock; ++j) {
        lo = sub == j ? s[j].byte : lo;
        hi = sub == j ? s[j + kChunksPerBlock].byte : hi;
      }
      st_u8(scales, lo);
      st_u8(scales + kChunksPerBlock * scale_cols, hi);
    }
    data += kBatch * cols;
    scales += kBatch * scale_cols;
  }
}

// Column warp: the column-wise half. A lane holds all 32 rows of its 8 columns, so the block amax needs no
// shuffle: pass 1 reads the 32 rows for the amax, pass 2 reads them again to quantize (shared memory is
// cheap; keeping 32 chunks in registers is not). Stores: 256 contiguous scale bytes, then per row 256
// contiguous E4M3 bytes.
template <int kRowBytes>
MOK_DEVICE void quantize_split_tile_cols(const uint8_t* src, int64_t row0, int64_t col, int64_t cols, bool valid,
                                         const TiledOut& out) {
  uint32_t acc[4] = {0u, 0u, 0u, 0u};  // column pairs (2k, 2k + 1)
#pragma unroll 8
  for (int r = 0; r < kBlockSize; ++r) {
    const uint4 v = ld_stage<kRowBytes>(src, r);
    acc[0] = amax2_acc(acc[0], v.x);
    acc[1] = amax2_acc(acc[1], v.y);
    acc[2] = amax2_acc(acc[2], v.z);
    acc[3] = amax2_acc(acc[3], v.w);
  }
  Scale cs[8];
  float inv[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    cs[k] = scale_from_amax_bits(k % 2 == 0 ? acc[k / 2] & 0xFFFFu : acc[k / 2] >> 16);
    inv[k] = cs[k].inv;
  }
  const uint2 nan_mask = nan_byte_mask(cs);
  if (!valid) return;
  st_v2(out.scales_col + (row0 / kBlockSize) * cols + col, scale_bytes8(cs));  // [row0 / 32, col .. col + 8)
  uint8_t* data = out.data_col + row0 * cols + col;  // [row0, col]
#pragma unroll 8
  for (int r = 0; r < kBlockSize; ++r, data += cols) st_v2(data, quantize8(ld_stage<kRowBytes>(src, r), inv, nan_mask));
}

// One warp of group `group`, in span `role / kSpanWarps`: row warp `role % kSpanWarps` < kRowWarps, or the
// span's column warp. It takes the CTA's tiles k = group, group + kGroups, ... and releases each stage with one
// arrival.
template <typename Cfg>
MOK_DEVICE void consume_split_tiles(const uint8_t* stages, uint64_t* full, uint64_t* empty, const TiledOut& out,
                                    int64_t cols, uint32_t col_tiles, uint32_t num_tiles, int group, int role) {
  const int lane = static_cast<int>(lane_id());
  uint32_t k = group;
  for (uint32_t tile = blockIdx.x + group * gridDim.x; tile < num_tiles;
       tile += Cfg::kGroups * gridDim.x, k += Cfg::kGroups) {
    const uint32_t stage = k % Cfg::kStages;
    ptx::mbarrier_wait_parity(&full[stage], (k / Cfg::kStages) & 1u);
    const int64_t row0 = static_cast<int64_t>(tile / col_tiles) * kBlockSize;
    const int span = role / Cfg::kSpanWarps, span_role = role % Cfg::kSpanWarps;
    const uint8_t* src = stages + stage * Cfg::kStageBytes + span * kSplitSpanCols * 2 + lane * 16;
    const int64_t col =
        static_cast<int64_t>(tile % col_tiles) * Cfg::kTileCols + span * kSplitSpanCols + lane * kChunkElems;
    if (span_role < Cfg::kRowWarps) {  // warp-uniform
      quantize_split_tile_rows<Cfg::kRowsPerRowWarp, Cfg::kRowBytes>(src, span_role * Cfg::kRowsPerRowWarp, row0,
                                                                     col, cols, col < cols, out);
    } else {
      quantize_split_tile_cols<Cfg::kRowBytes>(src, row0, col, cols, col < cols, out);
    }
    __syncwarp();  // every lane's shared loads are done (their values are used above)
    if (lane == 0) ptx::mbarrier_arrive_expect_tx(&empty[stage], 0);  // a plain arrival: 0 bytes expected
  }
}

// ---- the kernel: a persistent grid, CTA b walks the tiles b, b + G, b + 2G, ... (G = gridDim.x) -----------
template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinCtasPerSm)
    quantize_dual_split_kernel(const uint8_t* __restrict__ x, TiledOut out, int64_t rows, int64_t cols) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // [kStages] the stage's tile landed (1 arrival + bytes)
  uint64_t* empty = full + Cfg::kStages;               // [kStages] its group is done (kGroupWarps arrivals)
  uint8_t* stages = smem + Cfg::kBarrierBytes;         // [kStages][32][kTileCols] bf16
  // NOTE: tile indices in 32 bits (the launcher checks num_tiles < 2^31).
  const uint32_t col_tiles = static_cast<uint32_t>(ceil_div(cols, Cfg::kTileCols));
  const uint32_t num_tiles = static_cast<uint32_t>(rows / kBlockSize) * col_tiles;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], Cfg::kGroupWarps);
    }
    ptx::fence_mbarrier_init();
  }
  __syncthreads();

  const int warp = static_cast<int>(threadIdx.x / kWarpSize);
  if (warp == 0) {
    produce_split_tiles<Cfg>(x, stages, full, empty, cols, col_tiles, num_tiles);
  } else {
    const int group = (warp - 1) / Cfg::kGroupWarps, role = (warp - 1) % Cfg::kGroupWarps;
    consume_split_tiles<Cfg>(stages, full, empty, out, cols, col_tiles, num_tiles, group, role);
  }
}

// ---- host launcher -----------------------------------------------------------------------------------
// One consumer group, 2 stages of 32 × 512 columns (64 KB: 3 CTAs per SM), one row warp and one column warp per
// 256-column span: 5 warps (docs/mxfp8_kernels.md, "Tiles of 512 columns").
using DualSplitConfig = SplitDual<1, 2, 1, 512>;

// rows = product of all dims but the last; rows % 32 == 0 and cols % 32 == 0.
inline cudaError_t launch_quantize_dual_split(const void* x, void* data_row, void* scales_row, void* data_col,
                                              void* scales_col, int64_t rows, int64_t cols, cudaStream_t stream) {
  using Cfg = DualSplitConfig;
  if (rows % kBlockSize != 0 || cols % kBlockSize != 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  const TiledOut out{static_cast<uint8_t*>(data_col), static_cast<uint8_t*>(scales_col),
                     static_cast<uint8_t*>(data_row), static_cast<uint8_t*>(scales_row)};
  const int64_t tiles = (rows / kBlockSize) * ceil_div(cols, Cfg::kTileCols);
  if (tiles >= (int64_t{1} << 31)) return cudaErrorInvalidValue;  // the kernel counts tiles in 32 bits
  unsigned grid = 0;
  const cudaError_t err =
      persistent_grid<quantize_dual_split_kernel<Cfg>>(Cfg::kThreads, Cfg::kSmemBytes, tiles, &grid);
  if (err != cudaSuccess) return err;
  quantize_dual_split_kernel<Cfg><<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
      static_cast<const uint8_t*>(x), out, rows, cols);
  return cudaGetLastError();
}

}  // namespace mok::mxfp8
