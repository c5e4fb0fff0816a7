// The grouped BF16 GEMMs' tiling constants, shared-memory layout and the 128-byte swizzle (the kernel:
// mok/gemm/grouped_gemm_bf16.cuh).
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "mok/gemm/ptx.cuh"
#include "mok/gemm/tensor_map.cuh"
#include "mok/quant/mxfp8.cuh"
#include "mok/swiglu.cuh"

namespace mok::gemm {

// ---- tiling -------------------------------------------------------------------------------------------

constexpr int kNumConsumerGroups = 2;              // consumer warpgroups
constexpr int WG_M = 64;                           // rows per consumer warpgroup: one m64 wgmma
constexpr int BLOCK_M = kNumConsumerGroups * WG_M;  // rows per task
constexpr int BLOCK_K = 64;                        // k per stage: 64 bf16 = 128 bytes = one swizzled row
constexpr int BLOCK_N_B = 128;                     // rows of each B tile = n of each wgmma
constexpr int kNumStages = 4;                      // shared-memory ring depth (docs/gemm.md, decisions)
// Row-wise tasks come in groups of kGroupM m-tiles, n-tile by n-tile inside a group (decode_task), so the m-tiles
// that share a weight tile run on neighbouring CTAs at the same time (docs/gemm.md, decisions).
constexpr int kGroupM = 8;
static_assert(kGroupM >= 1, "at least one m-tile per group");
constexpr int kWarpgroup = 128;
constexpr int kNumProducerThreads = kWarpgroup;
constexpr int kNumThreads = kWarpgroup * (1 + kNumConsumerGroups);
constexpr int kNumConsumerWarps = kNumConsumerGroups * kWarpgroup / kWarpSize;
// A CTA holds kNumThreads × (its launch registers) and setmaxnreg.inc only takes from that pool (it spins until
// it can): with __launch_bounds__(384, 1) ptxas launches at 168 (65536 / 384 rounded down to 8), so the budgets
// must sum to at most 384 · 168 = 64,512, not 65,536 (a 65,536 split hangs every launch).
constexpr int kLaunchRegs = 65536 / kNumThreads / 8 * 8;
constexpr int kRowBytes = BLOCK_K * 2;
constexpr uint32_t kATileBytes = BLOCK_M * kRowBytes;    // 16 KiB
constexpr uint32_t kBTileBytes = BLOCK_N_B * kRowBytes;  // 16 KiB
constexpr uint32_t kStageBytes = kATileBytes + 2 * kBTileBytes;
constexpr uint32_t kSmemLimit = 227 * 1024;  // shared memory an sm_90 block may use
// MXFP8 weights: the bf16 ring has one stage less, and a landing slot holds a k-block of B0 and B1 as E4M3
// (128 rows × 64 bytes each) plus their scales (2 bytes per row: the two 32-element blocks of the k-block).
constexpr int kMxStages = kNumStages - 1;
constexpr int kNumLanding = 3;
constexpr uint32_t kLandTileBytes = BLOCK_N_B * BLOCK_K;  // 8 KiB of E4M3
constexpr uint32_t kLandScaleBytes = BLOCK_N_B * 2;       // 256 bytes of E8M0
constexpr uint32_t kLandTxBytes = 2 * (kLandTileBytes + kLandScaleBytes);
// Shared memory: [the ring][epilogue staging][landing scales][barriers], the ring being the BF16 kinds'
// kNumStages stages or the MXFP8 kinds' kMxStages stages and landing tiles (the same 192 KiB with 4 stages).
constexpr uint32_t kRingBytes = kNumStages * kStageBytes;
constexpr uint32_t kMxRingBytes = kMxStages * kStageBytes + kNumLanding * 2 * kLandTileBytes;
constexpr uint32_t kMainBytes = kRingBytes > kMxRingBytes ? kRingBytes : kMxRingBytes;  // where staging starts
constexpr uint32_t kLandScalesBytes = kNumLanding * 2 * kLandScaleBytes;
constexpr uint32_t kBarrierBytes = 2 * (kNumStages + kNumLanding) * 8;
// Epilogue staging of each consumer warp, in boxes of its 16 rows × 64 bf16 columns (2 KiB: a TMA store box,
// 128 bytes wide at most with the 128-byte swizzle): as many boxes as the stages leave room for (2 with 4 stages),
// at most a kGateUp task's 6; the warp writes them in turn, so a box is rewritten only after kBoxes - 1 later
// stores were issued.
constexpr int kStoreBoxCols = 64, kStoreBoxRows = 16;
constexpr uint32_t kStoreBoxBytes = kStoreBoxRows * kStoreBoxCols * 2;
constexpr uint32_t kStagingRoom = (kSmemLimit - kMainBytes - kLandScalesBytes - kBarrierBytes - ptx::kSw128AtomBytes) /
                                  (kNumConsumerWarps * kStoreBoxBytes);  // boxes per warp that fit
constexpr int kStoreBoxesPerWarp = kStagingRoom < 6 ? static_cast<int>(kStagingRoom) : 6;
constexpr uint32_t kStagingBytesPerWarp = kStoreBoxesPerWarp * kStoreBoxBytes;
constexpr uint32_t kStagingBytes = kNumConsumerWarps * kStagingBytesPerWarp;
constexpr uint32_t kSmemBytes = kMainBytes + kStagingBytes + kLandScalesBytes + kBarrierBytes + ptx::kSw128AtomBytes;

// The producer warpgroup gathers an A tile as 128 rows × 8 chunks of 16 bytes: thread t copies chunk t % 8
// of rows t / 8 + 16j, j in [0, 8) (8 threads read one row's 128 contiguous bytes).
constexpr int kChunksPerRow = kRowBytes / 16;
constexpr int kRowStride = kNumProducerThreads / kChunksPerRow;
constexpr int kRowsPerThread = BLOCK_M / kRowStride;

static_assert(kRowBytes == 128, "one tile row is one 128-byte swizzle row: BLOCK_K = 64 bf16");
static_assert(BLOCK_M % 8 == 0 && BLOCK_N_B % 8 == 0 && kATileBytes % ptx::kSw128AtomBytes == 0 &&
                  kBTileBytes % ptx::kSw128AtomBytes == 0 && (WG_M * kRowBytes) % ptx::kSw128AtomBytes == 0,
              "tiles and each warpgroup's half of A are whole 8-row atoms (1024-byte aligned)");
static_assert(kRowsPerThread * kRowStride == BLOCK_M && kRowStride * kChunksPerRow == kNumProducerThreads,
              "the producer warpgroup covers every (row, chunk) of an A tile exactly once");
static_assert(kNumProducerThreads == BLOCK_N_B, "MXFP8 weights: producer thread r dequantizes row r of B0 and B1");
static_assert(kSmemBytes <= kSmemLimit, "fits the 227 KiB of shared memory an sm_90 block may use");
static_assert(kMxStages >= 2, "the mainloop keeps one wgmma group in flight: it holds two stages");
static_assert(kNumLanding >= 2 && (kMxStages * kStageBytes) % ptx::kSw128AtomBytes == 0 &&
                  kLandTileBytes % ptx::kSw128AtomBytes == 0,
              "landing tiles are 1024-aligned (the 64-byte swizzle repeats every 512 bytes)");
static_assert(BLOCK_N_B * 2 == 16 * 16, "a staging row is 16 chunks of 16 bytes; 16 lanes store one row");
static_assert(kStoreBoxesPerWarp >= 2, "a warp writes one staging box while the last one drains");
static_assert(kStoreBoxCols * 2 == 128 && kStoreBoxRows * kNumConsumerWarps == BLOCK_M &&
                  BLOCK_N_B % kStoreBoxCols == 0 && kStoreBoxBytes % ptx::kSw128AtomBytes == 0 &&
                  kMainBytes % ptx::kSw128AtomBytes == 0,
              "a store box is one 128-byte swizzle row wide, one warp's rows high, and 1024-byte aligned (TMA "
              "applies the 128B swizzle on the address bits, as sw128_offset does)");

// ---- the 128-byte swizzle ------------------------------------------------------------------------------
// Shared-memory byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a tile of 128-byte rows:
// rows are contiguous, and inside each 1024-byte atom of 8 rows the chunk index is XORed with the row
// index mod 8. This is what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and what a wgmma descriptor of
// layout "128B swizzle" reads: on the byte offset o, bits [4:6] ^= bits [7:9].

MOK_HOST_DEVICE constexpr uint32_t sw128_offset(uint32_t row, uint32_t chunk) {
  return row * 128 + ((chunk ^ (row % 8)) << 4);
}

// Whether `offset` (rows of kRowBytes = kChunks · 16 bytes) is TMA's swizzle of that width, the XOR on the
// address bits: bits [4:4+log2(kChunks)) ^= the same many bits from bit 7 (128 rows: every row of a tile).
template <uint32_t (*offset)(uint32_t, uint32_t), uint32_t kChunks>
constexpr bool is_the_address_xor() {
  for (uint32_t row = 0; row < 128; ++row)
    for (uint32_t chunk = 0; chunk < kChunks; ++chunk) {
      const uint32_t o = row * kChunks * 16 + chunk * 16;
      if (offset(row, chunk) != (o ^ (((o >> 7) & (kChunks - 1)) << 4))) return false;
    }
  return true;
}
static_assert(is_the_address_xor<sw128_offset, 8>(), "sw128_offset is the 128B swizzle: bits [4:6] ^= bits [7:9]");
static_assert(sw128_offset(9, 3) == 9 * 128 + 2 * 16, "row 9 is row 1 of its atom: chunk 3 lands in slot 2");

// The 64-byte swizzle of the E4M3 landing tiles (rows of 64 bytes: 4 chunks of 16): TMA XORs bits [4:5] of
// the byte offset with bits [7:8], so chunk `chunk` of row `row` sits in slot chunk ^ ((row / 2) % 4). A
// producer warp reading one chunk of 8 consecutive rows touches 8 distinct 16-byte slots of a 128-byte
// line: no bank conflict (unswizzled, rows 2 apart would share banks).
MOK_HOST_DEVICE constexpr uint32_t sw64_offset(uint32_t row, uint32_t chunk) {
  return row * 64 + ((chunk ^ ((row / 2) % 4)) << 4);
}

static_assert(is_the_address_xor<sw64_offset, 4>(), "sw64_offset is the 64B swizzle: bits [4:5] ^= bits [7:8]");

}  // namespace mok::gemm
