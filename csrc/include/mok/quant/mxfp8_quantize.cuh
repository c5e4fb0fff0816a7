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

// ---- column-wise and dual, pipelined: CTA tiles staged through shared memory by the bulk copy engine ----
// A persistent grid (one CTA per resident slot) walks the CTA tiles in order: CTA b takes tiles b, b + G,
// b + 2G, ... (G = gridDim.x). A CTA tile is 32 rows x kTileCols = kWarps * 64 columns (32 KB of bf16 at 8
// warps); warp w quantizes its columns [64 w, 64 w + 64) with quantize_tiled_kernel<4>'s register layout,
// reading its 8 chunks from shared memory instead of global memory. A tile's 32 row segments arrive by 32
// 1D bulk copies (lane r of warp 0 copies row r) into one of kNumStages stages, completing on the stage's
// mbarrier: kNumStages - 1 tiles stream in while the CTA quantizes one, so the loads never wait on the
// quantization (the old kernels' latency limit: dual spent its long compute phase with nothing in flight).
// Per tile: wait for the stage's phase -> read 8 x 16 B per thread into registers -> __syncthreads (every
// warp is done with the stage) -> warp 0 refills the stage with the tile kNumStages ahead -> quantize and
// store from registers. Shared reads: 8 lanes of one row lane read 128 contiguous bytes of one row, so the
// 4 phases of a 16-byte warp load are conflict-free.
constexpr int kPipelineBarrierBytes = 128;  // the stages' mbarriers, then the stages (128-byte aligned)

template <int kWarps, int kNumStages>
struct PipelinedTile {
  static constexpr int kTileCols = kWarps * ColTile<4>::kCols;
  static constexpr int kRowBytes = kTileCols * 2;  // a row segment of a stage, bf16
  static constexpr int kStageBytes = kBlockSize * kRowBytes;
  static constexpr int kSmemBytes = kPipelineBarrierBytes + kNumStages * kStageBytes;
  static_assert(kNumStages * 8 <= kPipelineBarrierBytes, "the mbarriers fit before the stages");
  static_assert(kRowBytes % 128 == 0, "stage rows stay 16-byte aligned for the bulk copies");
};

template <int kWarps, int kNumStages, bool kDual>
__global__ void __launch_bounds__(kWarps * kWarpSize)
    quantize_pipelined_kernel(const uint8_t* __restrict__ x, TiledOut out, int64_t rows, int64_t cols) {
  using Tile = ColTile<4>;
  using Pipe = PipelinedTile<kWarps, kNumStages>;
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);       // [kNumStages] mbarriers: stage landed
  uint8_t* stages = smem + kPipelineBarrierBytes;           // [kNumStages][32][kTileCols] bf16
  // NOTE: tile indices in 32 bits (the launcher checks num_tiles < 2^31): cheaper divisions, fewer registers.
  const uint32_t col_tiles = static_cast<uint32_t>(ceil_div(cols, Pipe::kTileCols));
  const uint32_t num_tiles = static_cast<uint32_t>(rows / kBlockSize) * col_tiles;
  const int warp = static_cast<int>(threadIdx.x / kWarpSize), lane = static_cast<int>(lane_id());
  const int row_lane = lane / Tile::kColLanes, col_lane = lane % Tile::kColLanes;
  const int tile_col = warp * Tile::kCols + col_lane * kChunkElems;  // this thread's 8 columns in a tile

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kNumStages; ++s) ptx::mbarrier_init(&full[s], 1);  // one arrival: warp 0, lane 0
    ptx::fence_mbarrier_init();
  }
  __syncthreads();

  // Warp 0 only: start the copy of CTA tile `tile` into `stage`. A partial last column tile copies
  // cols - col0 columns per row (cols % 8 == 0: a multiple of 16 bytes); the rest of the stage is stale.
  auto load = [&](uint32_t tile, int stage) {
    const int64_t row = static_cast<int64_t>(tile / col_tiles) * kBlockSize + lane;
    const int64_t col0 = static_cast<int64_t>(tile % col_tiles) * Pipe::kTileCols;
    const uint32_t bytes = static_cast<uint32_t>(min(static_cast<int64_t>(Pipe::kTileCols), cols - col0)) * 2;
    if (lane == 0) ptx::mbarrier_arrive_expect_tx(&full[stage], bytes * kBlockSize);
    __syncwarp();
    ptx::bulk_copy_g2s(stages + stage * Pipe::kStageBytes + lane * Pipe::kRowBytes, x + (row * cols + col0) * 2,
                       bytes, &full[stage]);
  };
  if (warp == 0) {
#pragma unroll
    for (int s = 0; s < kNumStages; ++s) {
      const uint32_t tile = blockIdx.x + s * gridDim.x;  // gridDim.x <= resident CTAs: no wrap-around
      if (tile < num_tiles) load(tile, s);
    }
  }

  int stage = 0;
  uint32_t parity = 0;  // of the stage's current phase: flips each time the stages wrap around
  for (uint32_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    ptx::mbarrier_wait_parity(&full[stage], parity);
    const uint8_t* src = stages + stage * Pipe::kStageBytes + tile_col * 2;
    uint4 v[Tile::kRowsPerThread];
#pragma unroll
    for (int i = 0; i < Tile::kRowsPerThread; ++i)  // rows row_lane + 4 i of the stage
      v[i] = *reinterpret_cast<const uint4*>(src + (row_lane + 4 * i) * Pipe::kRowBytes);
    __syncthreads();  // NOTE: every warp has its chunks in registers: the stage may be overwritten
    const uint32_t next = tile + kNumStages * gridDim.x;
    if (warp == 0 && next < num_tiles) load(next, stage);

    const int64_t row0 = static_cast<int64_t>(tile / col_tiles) * kBlockSize;
    const int64_t col = static_cast<int64_t>(tile % col_tiles) * Pipe::kTileCols + tile_col;
    quantize_and_store_tile<4, kDual>(v, row0, col, cols, col < cols, row_lane, col_lane, out);
    if (++stage == kNumStages) {
      stage = 0;
      parity ^= 1u;
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

template <int kWarps, int kNumStages, bool kDual>
inline cudaError_t launch_quantize_pipelined(const uint8_t* x, const TiledOut& out, int64_t rows, int64_t cols,
                                             cudaStream_t stream) {
  using Pipe = PipelinedTile<kWarps, kNumStages>;
  constexpr int kThreads = kWarps * kWarpSize;
  const int64_t tiles = (rows / kBlockSize) * ceil_div(cols, Pipe::kTileCols);
  if (tiles >= (int64_t{1} << 31)) return cudaErrorInvalidValue;  // the kernel counts tiles in 32 bits
  unsigned grid = 0;
  const cudaError_t err =
      persistent_grid<quantize_pipelined_kernel<kWarps, kNumStages, kDual>>(kThreads, Pipe::kSmemBytes, tiles, &grid);
  if (err != cudaSuccess) return err;
  const auto kernel = quantize_pipelined_kernel<kWarps, kNumStages, kDual>;
  kernel<<<grid, kThreads, Pipe::kSmemBytes, stream>>>(x, out, rows, cols);
  return cudaGetLastError();
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
  const auto* in = static_cast<const uint8_t*>(x);
  const TiledOut out{static_cast<uint8_t*>(data_col), static_cast<uint8_t*>(scales_col),
                     static_cast<uint8_t*>(data_row), static_cast<uint8_t*>(scales_row)};
  auto launch = [&](auto kernel, int tile_cols, int warps) {
    const int64_t tiles = (rows / kBlockSize) * ceil_div(cols, tile_cols);
    kernel<<<ceil_div(tiles, warps), warps * kWarpSize, 0, stream>>>(in, out, rows, cols, RowSource{});
    return cudaGetLastError();
  };
  // variant: 1-4 and 8 one warp tile per warp, straight from global memory: row lanes (rows per thread =
  // 32 / row lanes) x warps per CTA. Fewer rows per thread means fewer registers, so more resident warps;
  // more rows, more bytes in flight per thread.
  //   8: 4 x 8    1: 2 x 8    2: 8 x 8    3: 4 x 4    4: 8 x 4
  // 5-7 pipelined (shared-memory stages, persistent grid; 4 row lanes): warps per CTA x stages.
  //   5: 8 x 3 (32 KB tiles, 96 KB)    6: 4 x 4 (16 KB tiles, 64 KB)    7: 8 x 2 (32 KB tiles, 64 KB)
  // 0 (default): 8 for row- and column-wise; dual's default is split variant 23 (quant_mxfp8.cu). The
  // pipelined 5-7 are bit-exact but measured slower (dual 0.816 vs 0.826 of copy on the >1 GB weights,
  // data/bench/quant_pipelined_48bf4dd.csv; docs/mxfp8_kernels.md).
  // 9-16, 22-23 (dual only, warp-specialized) are launch_quantize_dual_split's (mxfp8_quantize_split.cuh).
  if (variant == 0) variant = 8;
  switch (variant * 2 + (dual ? 1 : 0)) {
    case 16: return launch(quantize_tiled_kernel<4, 8, false>, ColTile<4>::kCols, 8);
    case 17: return launch(quantize_tiled_kernel<4, 8, true>, ColTile<4>::kCols, 8);
    case 2: return launch(quantize_tiled_kernel<2, 8, false>, ColTile<2>::kCols, 8);
    case 3: return launch(quantize_tiled_kernel<2, 8, true>, ColTile<2>::kCols, 8);
    case 4: return launch(quantize_tiled_kernel<8, 8, false>, ColTile<8>::kCols, 8);
    case 5: return launch(quantize_tiled_kernel<8, 8, true>, ColTile<8>::kCols, 8);
    case 6: return launch(quantize_tiled_kernel<4, 4, false>, ColTile<4>::kCols, 4);
    case 7: return launch(quantize_tiled_kernel<4, 4, true>, ColTile<4>::kCols, 4);
    case 8: return launch(quantize_tiled_kernel<8, 4, false>, ColTile<8>::kCols, 4);
    case 9: return launch(quantize_tiled_kernel<8, 4, true>, ColTile<8>::kCols, 4);
    case 10: return launch_quantize_pipelined<8, 3, false>(in, out, rows, cols, stream);
    case 11: return launch_quantize_pipelined<8, 3, true>(in, out, rows, cols, stream);
    case 12: return launch_quantize_pipelined<4, 4, false>(in, out, rows, cols, stream);
    case 13: return launch_quantize_pipelined<4, 4, true>(in, out, rows, cols, stream);
    case 14: return launch_quantize_pipelined<8, 2, false>(in, out, rows, cols, stream);
    case 15: return launch_quantize_pipelined<8, 2, true>(in, out, rows, cols, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace mok::mxfp8
