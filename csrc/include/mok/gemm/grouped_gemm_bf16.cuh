// Grouped BF16 GEMMs over the route schedule (mok/schedule.py), sm_90a: persistent, warp-specialized,
// wgmma with fp32 accumulators in registers, weights by TMA, activation rows by TMA or gathered with
// 16-byte cp.async.
//
// For every row r of the schedule (e = the tile's expert, t = row_to_token[r]; padding rows t = -1 are
// written as zeros in every output), in L0's rounding points (mok.reference.expert_forward/_backward):
//   kGateUp       gate[r] = bf16(x[t]·Wg[e]ᵀ), up[r] = bf16(x[t]·Wu[e]ᵀ), h[r] = bf16(swiglu_n(gate[r], up[r]))
//                 (x rows gathered through row_to_token: the dispatch is fused)
//   kDown         out[r] = bf16(a[r]·W[e]ᵀ)                          (the down projection, or any NT GEMM)
//   kDownDgrad    d_h[r] = bf16(dy[r]·Wd[e])  (Wd [E, H, I] read MN-major; the SwiGLU backward runs after it
//                 as an elementwise kernel, mok/moe/swiglu_backward_rows.cuh: see the note there)
//   kGateUpDgrad  dx[r] = bf16(d_gate[r]·Wg[e] + d_up[r]·Wu[e])      (one fp32 sum over K = 2·I, MN-major B)
//   kWeightGrad   dW[e] = bf16(Σ_{r in e's segment} a[r]ᵀ·b[r])  [M, N] (a k-grouped GEMM: K = e's real rows,
//                 rounded up to 64 within the segment's zero padding rows; both operands MN-major; d_w_down
//                 from dy/h rows, d_w_gate/d_w_up from d_gate/d_up and x rows)
//   kGateUpMxOut  kGateUp for the MXFP8 forward (DESIGN §4): gate and up leave as MXFP8, row-wise (E4M3 data
//                 and E8M0 scales, mxfp8_quantize_rowwise's bits) and h as its row-wise round trip (bf16,
//                 mxfp8_fake_quantize's bits): GEMM2's operand and the backward's saved gate/up, with no kernel
//                 between (a warp's 16 × 128 tile holds whole 32-column blocks: `rowwise_blocks`)
//   kGateUpMx, kDownMx   kGateUp and kDown with MXFP8 weights (E4M3 data [E, n, k] and E8M0 scales along k):
//                 the producer dequantizes each weight tile in shared memory to exactly the bf16 that
//                 mxfp8_dequantize writes (mok/quant/mxfp8.cuh), so the outputs are the BF16 kinds' bits on
//                 dequantized weights, with a weight read of 1 + 1/32 bytes per element instead of 2.
//
// Task = one output tile: BLOCK_M = 128 rows (one expert) × kTaskN columns, over the full K in one CTA (no
// split-K: every output is one fp32 sum in a fixed order, bitwise identical for any grid size). CTA b
// takes tasks b, b + grid, b + 2·grid, ... in increasing order (m-major: neighbouring CTAs share A rows,
// and a wave covers few experts, so their weight tiles are read from HBM about once per wave).
//
// Roles (384 threads = 3 warpgroups): warpgroup 0 = producer (gives registers back), warpgroups 1 and 2 =
// consumers, each owning 64 of the tile's 128 rows (one wgmma m64n256k16 per k16 slice into two accumulators of
// 64 floats, B0's columns and B1's; two m64n128k16 with MOK_GEMM_N256=0).
// Both roles walk the same (task, k-block) sequence through a ring of kNumStages shared-memory stages;
// stage s is handed over with two mbarriers:
//   full[s]:  gathered A: 128 arrivals (cp.async.mbarrier.arrive.noinc of every producer thread: fires when
//             that thread's copies have landed) + 1 arrive.expect_tx (B bytes);
//             A by TMA: 1 arrive.expect_tx (A + B bytes).
//   empty[s]: 8 arrivals = lane 0 of each consumer warp, once its wgmmas reading s have completed (16 in the
//             MOK_GEMM_MULTICAST build: both CTAs' warps of a 2-CTA cluster, "the CTA's work units" below).
// The consumers keep one wgmma group in flight: k-block kb's MMAs run while kb - 1's stage is released.
//
// MXFP8 weights (kGateUpMx, kDownMx) take one more hop: thread 0 loads the E4M3 tiles of B0 and B1 (128 rows
// × 64 bytes each, 64-byte swizzle) and their scales by TMA into a ring of kNumLanding landing slots, up to
// kNumLanding - 1 k-blocks ahead; producer thread r then dequantizes row r of both into the stage's bf16 B
// tiles (the layout TMA writes for the BF16 kinds), fences, and arrives on full[s]. These kinds run
// kNumStages - 1 bf16 stages: the landing ring takes the fourth one's shared memory.
//
// Stage layout (bytes; every tile 1024-aligned): [A 128 rows × 128 B][B0 16 KiB][B1 16 KiB], 48 KiB.
//   kGateUp: B0 = Wg[e] rows n0..n0+127, B1 = Wu[e] rows n0..n0+127 (gate and up of the same columns, so the
//            epilogue holds both in registers); the others: B0/B1 = columns n0..n0+127 / n0+128..n0+255.
//   K-major B (nn.Linear rows, the forward): 128 rows of 128 bytes. MN-major B (the backward reads the
//   weights transposed): two boxes of 64 k-rows × 64 n (128 bytes), n0.. then n0+64.. (8 KiB apart).
#pragma once

#include <cuda_bf16.h>

#include <algorithm>
#include <type_traits>

#include "mok/gemm/ptx.cuh"
#include "mok/gemm/tensor_map.cuh"
#include "mok/quant/mxfp8.cuh"
#include "mok/swiglu.cuh"

namespace mok::gemm {

// ---- build switches (-D, from the environment at JIT-build time: mok/ops/core.py) -------------------------
// MOK_GEMM_TMA_STORE=1: the epilogues write global memory with TMA bulk tensor stores, issued by one lane per
// consumer warp and awaited only before the staging is written again (so they drain during the next task's
// mainloop); 0: every lane re-reads the staging and writes 16-byte st.global (the path before TMA stores).
// MOK_GEMM_NUM_STAGES: the shared-memory ring depth; with TMA stores, the staging takes what the stages leave.
#ifndef MOK_GEMM_TMA_STORE
#define MOK_GEMM_TMA_STORE 1
#endif
#ifndef MOK_GEMM_NUM_STAGES
#define MOK_GEMM_NUM_STAGES 4
#endif
// MOK_GEMM_MULTICAST=1: the BF16 row-wise kinds whose A comes by TMA (GEMM2 and both dgrads) run on clusters of
// 2 CTAs that take an expert's m-tiles two at a time and load each k-block's weight tile once for both, by TMA
// multicast. 0 (default): one CTA per task. Alone, those kernels ran up to 20% faster on clusters; inside the
// layer, no pass moved beyond the noise (docs/l2_fused.md, "B multicast"), so the simpler launch stays default.
#ifndef MOK_GEMM_MULTICAST
#define MOK_GEMM_MULTICAST 0
#endif
// MOK_GEMM_DEFER_EPILOGUE=1: the weight gradients' consumers hold a finished tile in registers as bf16 and store it
// during the next task's first k-blocks, under their MMAs (`Epilogue` below); 0: they store it before the next
// task starts, as the other kinds always do.
#ifndef MOK_GEMM_DEFER_EPILOGUE
#define MOK_GEMM_DEFER_EPILOGUE 1
#endif
// MOK_GEMM_GROUP_M=G (default 8): the single-CTA row-wise kinds number their tasks in groups of G m-tiles, n-tile
// by n-tile inside a group (decode_task), so the m-tiles that share a weight tile run on neighbouring CTAs at the
// same time; 1: m-major (the m-tiles of one n-tile num_n_tiles tasks apart, often a wave apart), with which
// dsv4pro's GEMM1, GEMM2 and gate/up dgrad ran 1.11-1.19x slower, its layer 1.03-1.04x (docs/l2_fused.md, "Task
// order").
#ifndef MOK_GEMM_GROUP_M
#define MOK_GEMM_GROUP_M 8
#endif
// MOK_GEMM_SKIP_PADDING_HALF=1: in a row-wise tile whose last 64 rows are all padding (an expert's last tile with
// at most 64 routes), the second consumer warpgroup releases each stage as it lands instead of multiplying, so
// the first has the tensor cores to itself; the epilogue zeroes padding rows either way. 0 (default): both multiply.
// NOTE: 1 measured 1.03-1.35x slower on the H200: those tasks end early, the CTAs fall out of step, and the grouped
// order's weight tiles stop being shared in L2 (docs/l2_fused.md, "The padding-half skip, measured").
#ifndef MOK_GEMM_SKIP_PADDING_HALF
#define MOK_GEMM_SKIP_PADDING_HALF 0
#endif
// MOK_GEMM_TRACE=1 (a probe): lane 0 of each consumer warpgroup's first warp records, per task, its SM clock at the
// task's start, after its mainloop and after its epilogue into g_trace (read and cleared by
// grouped_gemm_bf16_trace; tools/task_timeline.py). No device printf: a call inside the consumers serializes
// their wgmmas (ptxas C7510).
#ifndef MOK_GEMM_TRACE
#define MOK_GEMM_TRACE 0
#endif
// MOK_GEMM_DYNAMIC=1: the single-CTA BF16 kinds take their tasks from a counter in device memory (producer thread 0,
// atomicAdd, in task order) instead of the static stride, so the tasks in flight stay a contiguous window of the
// order however unevenly they run: the m-tiles that share a weight tile keep running together (the static stride
// lets CTAs drift apart: docs/l2_fused.md, "The padding-half skip, measured"). Which CTA runs a task never changes
// the bits. Launches of one kind must be stream-ordered (one counter per kind and module, reset by the last CTA).
// NOTE: measured neutral alone and reverted at 19c02bf ("Tasks from a counter"); back, default off, because the
// fold (MOK_GEMM_FOLD) makes tasks uneven by design: with the static stride a CTA's share of the
// longer tasks decides the kernel's end (counted on the CPU, docs/l2_fused.md "Tails folded into the previous tile").
#ifndef MOK_GEMM_DYNAMIC
#define MOK_GEMM_DYNAMIC 0
#endif

// MOK_GEMM_N256=1 (default): each k16 slice of a consumer warpgroup is one m64n256k16 over B0|B1, so its A slice is
// read from shared memory once; 0: two m64n128k16 (A read twice). The same fragments and bits. At the power cap,
// where a kernel's time is its energy, 1 ran every pass but one 0.6-1.7% faster (docs/l2_fused.md, "One wgmma over
// B0|B1, at the cap").
#ifndef MOK_GEMM_N256
#define MOK_GEMM_N256 1
#endif
// MOK_GEMM_FOLD (docs/l2_fused.md, "Tails folded into the previous tile"): an expert's short tail (its last m-tile,
// at most kFoldRows routes) is multiplied by the task of the expert's previous m-tile in the BF16 row-wise kinds
// (kGateUp, kDown, kDownDgrad, kGateUpDgrad). That task also loads the tail's first kFoldRows A rows with each
// k-block (a 4 KiB box per stage, in a ring after the stages: these kinds' epilogue staging falls to one box per
// warp) and multiplies them per k16 slice, in each consumer warpgroup, by its 64 columns of B0 and of B1 as the
// A operand (two m64n32k16: the tail's outputs transposed). In steps, so that each can be timed before the next is
// trusted:
//   1  a probe: the fold's loads, MMAs, registers and shared memory, its accumulators dropped; the tails' own tasks
//      still run, so every output keeps its bits;
//   2  a probe: also skips the tails' tasks, whose rows then stay unwritten: for timing only (`bench ab --parts`
//      times each build's kernels on the default build's intermediates; mok.ops warns when it loads it);
//   3  the fold: the folding task also writes the tail's rows (transposed in shared memory by stmatrix.trans, its
//      padding rows as zeros), so the tails' tasks are skipped and every output is written.
// With the static task stride the longer folding tasks pile up on some CTAs; tasks from the counter
// (MOK_GEMM_DYNAMIC=1) are what the fold was sized with (tools/fold_makespan.py).
#ifndef MOK_GEMM_FOLD
#define MOK_GEMM_FOLD 0
#endif

#if MOK_GEMM_TRACE
constexpr int kTraceWords = 8;  // kind, CTA, consumer warpgroup, unit, rows 64.. padding (+2: folds), 3 clocks
constexpr int kTraceRecords = 1 << 18;
__device__ long long g_trace[kTraceRecords * kTraceWords];
__device__ int g_trace_count;
#endif

// ---- tiling -------------------------------------------------------------------------------------------

constexpr int kNumConsumerGroups = 2;              // consumer warpgroups
constexpr int WG_M = 64;                           // rows per consumer warpgroup: one m64 wgmma
constexpr int BLOCK_M = kNumConsumerGroups * WG_M;  // rows per task
constexpr int BLOCK_K = 64;                        // k per stage: 64 bf16 = 128 bytes = one swizzled row
constexpr int BLOCK_N_B = 128;                     // rows of each B tile = n of each wgmma
constexpr int kNumStages = MOK_GEMM_NUM_STAGES;    // shared-memory ring depth (4; 3 frees room for staging)
constexpr bool kMulticastBuild = MOK_GEMM_MULTICAST != 0;
constexpr bool kDeferEpilogue = MOK_GEMM_DEFER_EPILOGUE != 0;
constexpr int kGroupM = MOK_GEMM_GROUP_M;           // m-tiles per group of the row-wise task order
constexpr bool kDynamicBuild = MOK_GEMM_DYNAMIC != 0;
constexpr int kUnitSlots = 2;                      // kDynamic: the ring that passes fetched units to the roles
constexpr bool kSkipPaddingHalf = MOK_GEMM_SKIP_PADDING_HALF != 0;
constexpr bool kN256 = MOK_GEMM_N256 != 0;
constexpr bool kFoldBuild = MOK_GEMM_FOLD != 0;
constexpr bool kFoldSkipsTails = MOK_GEMM_FOLD >= 2;
constexpr bool kFoldWritesTails = MOK_GEMM_FOLD == 3;
static_assert(kGroupM >= 1, "MOK_GEMM_GROUP_M: at least one m-tile per group");
constexpr int kClusterSize = 2;                    // multicast kinds: CTAs per cluster, one m-tile each
constexpr int kWarpgroup = 128;
constexpr int kNumProducerThreads = kWarpgroup;
constexpr int kNumThreads = kWarpgroup * (1 + kNumConsumerGroups);
constexpr int kNumConsumerWarps = kNumConsumerGroups * kWarpgroup / kWarpSize;
// A CTA holds kNumThreads × (its launch registers) and setmaxnreg.inc only takes from that pool (it spins until
// it can): with __launch_bounds__(384, 1) ptxas launches at 168 (65536 / 384 rounded down to 8), so the budgets
// must sum to at most 384 · 168 = 64,512, not 65,536 (a 65,536 split hung every launch, in a first version of
// the MXFP8 kinds).
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
// MOK_GEMM_FOLD's kinds: a tail's first kFoldRows A rows per stage (the N of a transposed m64n32k16) right after the
// ring, in what is the others' staging; their staging follows, with fewer boxes (Tile::kStagingOffset).
constexpr int kFoldRows = 32;
constexpr uint32_t kFoldTileBytes = kFoldRows * kRowBytes;  // 4 KiB
constexpr uint32_t kLandScalesBytes = kNumLanding * 2 * kLandScaleBytes;
constexpr uint32_t kUnitRingBytes = kDynamicBuild ? kUnitSlots * (2 * 8 + 8) : 0;  // full, empty, the unit (padded)
constexpr uint32_t kBarrierBytes = 2 * (kNumStages + kNumLanding) * 8 + kUnitRingBytes;
// Epilogue staging of each consumer warp, in boxes of its 16 rows × 64 bf16 columns (2 KiB: a TMA store box,
// 128 bytes wide at most with the 128-byte swizzle). st.global path: 2 boxes, one 16 × 128 tile. TMA path: as
// many boxes as the stages leave room for (2 with 4 stages, 5 with 3; 1 in MOK_GEMM_FOLD's kinds, beside their
// tail ring), at most a kGateUp task's 6; the warp writes them in turn, so a box is rewritten only after
// kBoxes - 1 later stores were issued (1 box: after its last store has read it).
constexpr bool kTmaStore = MOK_GEMM_TMA_STORE != 0;
constexpr int kStoreBoxCols = 64, kStoreBoxRows = 16;
constexpr uint32_t kStoreBoxBytes = kStoreBoxRows * kStoreBoxCols * 2;
// The store boxes per consumer warp when the staging starts `staging_offset` bytes into shared memory.
constexpr int store_boxes_from(uint32_t staging_offset) {
  const uint32_t room = (kSmemLimit - staging_offset - kLandScalesBytes - kBarrierBytes - ptx::kSw128AtomBytes) /
                        (kNumConsumerWarps * kStoreBoxBytes);
  return !kTmaStore ? 2 : room < 6 ? static_cast<int>(room) : 6;
}
constexpr int kStoreBoxesPerWarp = store_boxes_from(kMainBytes);
constexpr uint32_t kStagingBytesPerWarp = kStoreBoxesPerWarp * kStoreBoxBytes;
constexpr uint32_t kStagingBytes = kNumConsumerWarps * kStagingBytesPerWarp;
constexpr uint32_t kSmemBytes = kMainBytes + kStagingBytes + kLandScalesBytes + kBarrierBytes + ptx::kSw128AtomBytes;

// The producer warpgroup gathers an A tile as 128 rows × 8 chunks of 16 bytes: thread t copies chunk t % 8
// of rows t / 8 + 16j, j in [0, 8) (8 threads read one row's 128 contiguous bytes).
constexpr int kChunksPerRow = kRowBytes / 16;
constexpr int kRowStride = kNumProducerThreads / kChunksPerRow;
constexpr int kRowsPerThread = BLOCK_M / kRowStride;
constexpr int kFoldRowsPerThread = kFoldRows / kRowStride;  // MOK_GEMM_FOLD's gathered tail rows

static_assert(kRowBytes == 128, "one tile row is one 128-byte swizzle row: BLOCK_K = 64 bf16");
static_assert(BLOCK_M % 8 == 0 && BLOCK_N_B % 8 == 0 && kATileBytes % ptx::kSw128AtomBytes == 0 &&
                  kBTileBytes % ptx::kSw128AtomBytes == 0 && (WG_M * kRowBytes) % ptx::kSw128AtomBytes == 0,
              "tiles and each warpgroup's half of A are whole 8-row atoms (1024-byte aligned)");
static_assert(kRowsPerThread * kRowStride == BLOCK_M && kFoldRowsPerThread * kRowStride == kFoldRows &&
                  kRowStride * kChunksPerRow == kNumProducerThreads,
              "the producer warpgroup covers every (row, chunk) of an A tile exactly once");
static_assert(kNumProducerThreads == BLOCK_N_B, "MXFP8 weights: producer thread r dequantizes row r of B0 and B1");
static_assert(kSmemBytes <= kSmemLimit, "fits the 227 KiB of shared memory an sm_90 block may use");
static_assert(kMxStages >= 2, "the mainloop keeps one wgmma group in flight: it holds two stages");
static_assert(kNumLanding >= 2 && (kMxStages * kStageBytes) % ptx::kSw128AtomBytes == 0 &&
                  kLandTileBytes % ptx::kSw128AtomBytes == 0,
              "landing tiles are 1024-aligned (the 64-byte swizzle repeats every 512 bytes)");
static_assert(BLOCK_N_B * 2 == 16 * 16, "a staging row is 16 chunks of 16 bytes; 16 lanes store one row");
static_assert(kStoreBoxesPerWarp >= 2 && kStagingBytesPerWarp >= 16 * BLOCK_N_B * 2,
              "the st.global path stages a 16 × 128 tile; the TMA path writes one box while the last one drains");
static_assert(!kFoldBuild || (kTmaStore && kFoldTileBytes % ptx::kSw128AtomBytes == 0),
              "MOK_GEMM_FOLD's ring leaves room for the TMA path's staging only; its tiles are whole atoms");
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

// ---- parameters ----------------------------------------------------------------------------------------

enum class Gemm { kGateUp, kDown, kDownDgrad, kGateUpDgrad, kWeightGrad, kGateUpMx, kDownMx, kGateUpMxOut };

struct Params {
  const uint16_t* a;               // kGateUp: x [num_tokens, k], gathered; else A rows [num_rows, k], by TMA
  const uint16_t* a2;              // kGateUpDgrad: d_up rows (A of the second half of K; a = d_gate)
  const int32_t* row_to_token;     // [num_rows], -1 = padding (GEMM1 gathers through it)
  const int32_t* tile_to_expert;   // [num_rows / BLOCK_M]
  uint16_t* out;                   // [num_rows, n] bf16: h, out, d_h or dx
  uint16_t* gate;                  // kGateUp: gate out [num_rows, n]; kGateUpMxOut: see mx_of
  uint16_t* up;                    // kGateUp: up out [num_rows, n]; kGateUpMxOut: see mx_of
  const int32_t* expert_offsets;   // kWeightGrad: [num_experts + 1] segment starts (rows, multiples of 128)
  const int32_t* expert_rows;      // kWeightGrad: [num_experts] each segment's real rows (its tokens)
  const int32_t* real_num_rows;    // row-wise kinds: [1] the schedule's padded rows (a multiple of BLOCK_M),
                                   // written on the device; null = num_rows. Tiles past it are never run.
  int num_rows;                    // rows of the row buffers, a multiple of BLOCK_M
  int m;                           // kWeightGrad: output rows of each dW[e] (else the tiles cover num_rows)
  int n;                           // output columns (intermediate for GEMM1, hidden for GEMM2), % 8 == 0
  int k;                           // reduction length, % 8 == 0 (kGateUpDgrad: of each half, = intermediate;
                                   // kWeightGrad: unused, K is each expert's rows)
  int num_m_tiles, num_n_tiles;    // tiles per output matrix: ceil(rows / BLOCK_M), ceil(n / kTaskN)
  int num_tasks;                   // the most tasks (row-wise kinds: num_rows' tiles); see num_tasks_of
  float swiglu_limit;              // used when has_limit
  int has_limit;
};

// kGateUpMxOut's gate (or up) in MXFP8, one buffer at p.gate (p.up): E4M3 data [num_rows, n] (n % 32 == 0), then
// the row-wise E8M0 scales [num_rows, n / 32]. NOTE: one pointer, not two: any field more in Params changed the
// PTX of every kind (nvcc 13.0), and the other kinds are measured as they are.
struct MxOut {
  uint8_t *data, *scales;
};
MOK_HOST_DEVICE MxOut mx_of(uint16_t* buffer, const Params& p) {
  uint8_t* data = reinterpret_cast<uint8_t*>(buffer);
  return {data, data + static_cast<int64_t>(p.num_rows) * p.n};
}

// The Params every kind over the schedule's rows (all but kWeightGrad) starts from: A (x for the gather kinds),
// the schedule, the output, n and k; the entry points (csrc/gemm_*.cu) add what their kind needs.
inline Params rows_params(const void* a, const int32_t* row_to_token, const int32_t* tile_to_expert,
                          const int32_t* real_num_rows, void* out, int64_t num_rows, int64_t n, int64_t k) {
  Params p{};
  p.a = static_cast<const uint16_t*>(a);
  p.row_to_token = row_to_token;  // padding rows (-1) are written as zeros
  p.tile_to_expert = tile_to_expert;
  p.real_num_rows = real_num_rows;
  p.out = static_cast<uint16_t*>(out);
  p.num_rows = static_cast<int>(num_rows);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  return p;
}

template <Gemm kGemm>
struct Tile {
  static constexpr bool kMx = kGemm == Gemm::kGateUpMx || kGemm == Gemm::kDownMx;  // MXFP8 weights
  static constexpr bool kMxOut = kGemm == Gemm::kGateUpMxOut;  // MXFP8 gate/up, h round-tripped
  static constexpr bool kSwiGLU =  // B0 = Wg, B1 = Wu
      kGemm == Gemm::kGateUp || kGemm == Gemm::kGateUpMx || kMxOut;
  static constexpr bool kGather = kSwiGLU;  // A gathered by cp.async, else by TMA
  static constexpr bool kMajorMN =  // B transposed: the backward reads the weights, or rows, N-contiguous
      kGemm == Gemm::kDownDgrad || kGemm == Gemm::kGateUpDgrad || kGemm == Gemm::kWeightGrad;
  static constexpr bool kMajorMNA = kGemm == Gemm::kWeightGrad;  // A transposed: rows of [rows, M] as M × K
  static constexpr int kTaskN = kSwiGLU ? BLOCK_N_B : 2 * BLOCK_N_B;  // output columns
  static constexpr int kB1Offset = kSwiGLU ? 0 : BLOCK_N_B;  // B1's first column vs B0's
  static constexpr int kStages = kMx ? kMxStages : kNumStages;
  // Clusters of kClusterSize CTAs sharing each k-block's B by multicast (MOK_GEMM_MULTICAST; not the MXFP8
  // kinds, whose B goes through the landing ring, nor kWeightGrad, whose tasks run different K).
  // NOTE: nor the gathered GEMM1: it measured 7-15% slower on clusters, where GEMM2 and the dgrads measured up
  // to 17% faster (H200, parts vs parts_multicast at c25bf99).
  static constexpr bool kMulticast = kMulticastBuild && !kMx && !kGather && kGemm != Gemm::kWeightGrad;
  // MOK_GEMM_FOLD's kinds: the BF16 row-wise GEMMs (the weights' tile as the tail MMA's A operand, K-major in the
  // forward, MN-major in the dgrads), not on clusters.
  static constexpr bool kFold = kFoldBuild && !kMulticast && (kGemm == Gemm::kGateUp || kGemm == Gemm::kDown ||
                                                              kGemm == Gemm::kDownDgrad || kGemm == Gemm::kGateUpDgrad);
  static constexpr bool kDynamic = kDynamicBuild && !kMulticast && !kMx;  // MOK_GEMM_DYNAMIC
  // The epilogue staging: after the ring, or in a folding kind after its tail ring, with the boxes left there.
  static constexpr uint32_t kStagingOffset = kMainBytes + (kFold ? kNumStages * kFoldTileBytes : 0);
  static constexpr int kStoreBoxes = kFold ? store_boxes_from(kStagingOffset) : kStoreBoxesPerWarp;
  static constexpr uint32_t kStagingBytesPerWarp = kStoreBoxes * kStoreBoxBytes;
  static_assert(kStoreBoxes >= 1 && kStagingOffset + kNumConsumerWarps * kStagingBytesPerWarp <= kMainBytes +
                                                                                                      kStagingBytes,
                "a folding kind's tail ring and staging fit in the others' staging");
  // full[s]: the cp.async arrivals of a gathered A, the dequantizing threads' arrivals, and one
  // arrive.expect_tx when TMA writes into the stage (A unless gathered, B unless dequantized).
  static constexpr bool kTmaIntoStage = !kGather || !kMx;
  static constexpr uint32_t kFullArrivals =
      (kGather ? kNumProducerThreads : 0) + (kMx ? kNumProducerThreads : 0) + (kTmaIntoStage ? 1 : 0);
  static constexpr uint32_t kTmaBytes = (kGather ? 0 : kATileBytes) + (kMx ? 0 : 2 * kBTileBytes);
  // setmaxnreg budgets (128 · producer + 256 · consumer <= 384 · kLaunchRegs; ptxas allocates each role's
  // code within its budget): the dequantizing producer needs more than 88 in kGateUpMx, whose producer also
  // gathers A (4 bytes spilled); 120 / 192 is the split that spills nowhere. A producer that only issues TMA
  // (one thread) needs few: 40 leaves the consumers 232 for the held tile. GEMM1 folding tails (MOK_GEMM_FOLD) spilled
  // 4-8 bytes at 56 / 224 (with MOK_GEMM_DYNAMIC or the tail's epilogue); 64 / 216 spills nowhere.
  static constexpr bool kWideGather = kGather && kFold;
  static constexpr int kProducerRegs = kMx ? 120 : kWideGather ? 64 : kGather ? 56 : 40;
  static constexpr int kConsumerRegs = kMx ? 192 : kWideGather ? 216 : kGather ? 224 : 232;
  static_assert(kNumProducerThreads * kProducerRegs + kNumConsumerGroups * kWarpgroup * kConsumerRegs <=
                    kNumThreads * kLaunchRegs &&
                    kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0,
                "the register budgets fit the CTA's launch registers (setmaxnreg takes multiples of 8)");
  static constexpr uint32_t kBHalfBytes = kBTileBytes / 2;  // MN-major: one 64-column box
};

// k-blocks of one task; kGateUpDgrad runs both halves of K (d_gate·Wg, then d_up·Wu) one after the other.
template <Gemm kGemm>
MOK_HOST_DEVICE int num_k_blocks_of(int k) {
  const int half = static_cast<int>(ceil_div(k, BLOCK_K));
  return kGemm == Gemm::kGateUpDgrad ? 2 * half : half;
}

// Where a task's output tile sits and which K it runs. Row-wise kinds: tasks [0, num_tasks) are the real m-tiles ×
// n-tiles, in groups of kGroupM m-tiles (the last group may be smaller), m fastest inside a group (kGroupM = 1:
// m-major). kWeightGrad numbers (expert, m_tile, n_tile) and runs K over the expert's segment of rows
// [k_row0, k_row0 + 64·num_k_blocks):
// its real rows, then padding rows (zeros in both operands) up to the next multiple of 64, never all of the
// segment's padding (dsv4pro pads its experts' 256 rows by 25% on average).
struct Task {
  int m_tile, n_tile, expert, k_row0, num_k_blocks;
};

template <Gemm kGemm>
MOK_DEVICE Task decode_task(const Params& p, int task, int num_k_blocks, int num_tasks) {
  if constexpr (kGemm == Gemm::kWeightGrad) {
    const int n_tile = task % p.num_n_tiles, mt = task / p.num_n_tiles;
    const int expert = mt / p.num_m_tiles, row0 = p.expert_offsets[expert];
    return {mt % p.num_m_tiles, n_tile, expert, row0, (p.expert_rows[expert] + BLOCK_K - 1) / BLOCK_K};
  } else {
    const int group_tasks = kGroupM * p.num_n_tiles;
    const int m_first = task / group_tasks * kGroupM, in_group = task % group_tasks;
    const int real_m_tiles = num_tasks / p.num_n_tiles, group_m = min(kGroupM, real_m_tiles - m_first);
    const int mt = m_first + in_group % group_m;
    return {mt, in_group / group_m, p.tile_to_expert[mt], 0, num_k_blocks};
  }
}

// The tasks this launch runs. Row-wise kinds: the m tiles of the schedule's real rows, read once at kernel
// start from device memory (the host sized the row buffers and the grid by a static bound without a sync;
// tasks are m-major, so the first real_tiles · num_n_tiles tasks are exactly the real tiles'). kWeightGrad:
// static, experts × m tiles × n tiles (each task's K comes from expert_offsets).
template <Gemm kGemm>
MOK_DEVICE int num_tasks_of(const Params& p) {
  if (kGemm == Gemm::kWeightGrad || p.real_num_rows == nullptr) return p.num_tasks;
  const int real_tasks = (*p.real_num_rows / BLOCK_M) * p.num_n_tiles;
  return real_tasks < p.num_tasks ? real_tasks : p.num_tasks;  // never past the buffers, whatever it holds
}

// MOK_GEMM_FOLD: whether task t would fold its expert's tail, the next m-tile, when that tile is the expert's
// (segments are padded to whole tiles, so t's own tile is then full) and holds at most kFoldRows real rows (real
// rows come first: row kFoldRows is padding). Producer and consumers ask alike.
template <Gemm kGemm>
MOK_DEVICE bool folds_tail(const Params& p, const Task& t, int num_tasks) {
  if constexpr (!Tile<kGemm>::kFold) {
    return false;
  } else {
    const int next = t.m_tile + 1;
    return next < num_tasks / p.num_n_tiles && p.tile_to_expert[next] == t.expert &&
           p.row_to_token[next * BLOCK_M + kFoldRows] < 0;
  }
}

// MOK_GEMM_FOLD >= 2: whether task t is such a tail, whose work the previous m-tile's task takes (not run).
template <Gemm kGemm>
MOK_DEVICE bool skips_tail(const Params& p, const Task& t) {
  if constexpr (!Tile<kGemm>::kFold || !kFoldSkipsTails) {
    return false;
  } else {
    return t.m_tile > 0 && p.tile_to_expert[t.m_tile - 1] == t.expert &&
           p.row_to_token[t.m_tile * BLOCK_M + kFoldRows] < 0;
  }
}

// ---- the CTA's work units --------------------------------------------------------------------------------
// One unit per task, or (multicast kinds) per pair: m-tiles 2j and 2j + 1 of the schedule at n-tile
// u % num_n_tiles (j = u / num_n_tiles), CTA rank r of the cluster taking m-tile 2j + r. Both CTAs walk the same
// units, every row-wise task runs all of K, so both walk the same stage sequence and a multicast box lands in the
// same stage of each. A pair whose tiles belong to one expert shares B (`shared`: each CTA loads one B piece
// into both CTAs); a pair across two experts loads B per CTA as the other kinds do; a pair without its second
// tile (an odd number of real m-tiles, the last unit's) leaves CTA 1 without a task (`active` false: it keeps
// the ring's pace and the cluster's barriers, and computes and stores nothing).
struct Work {
  Task t;
  bool active, shared;
};

struct Units {
  int first, step, count;  // this CTA's units: first, first + step, ... < count
};

static_assert(kClusterSize == 2, "a pair of m-tiles per cluster");

template <Gemm kGemm>
MOK_DEVICE Units units_of(const Params& p, int num_tasks) {
  if constexpr (!Tile<kGemm>::kMulticast) {
    return {static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), num_tasks};
  } else {  // the row-wise kinds' tasks are real m-tiles × n-tiles (num_tasks_of)
    const int real_m_tiles = num_tasks / p.num_n_tiles;
    return {static_cast<int>(blockIdx.x) / kClusterSize, static_cast<int>(gridDim.x) / kClusterSize,
            (real_m_tiles + kClusterSize - 1) / kClusterSize * p.num_n_tiles};
  }
}

template <Gemm kGemm>
MOK_DEVICE Work decode_work(const Params& p, int unit, int num_k_blocks, int num_tasks) {
  if constexpr (!Tile<kGemm>::kMulticast) {
    return {decode_task<kGemm>(p, unit, num_k_blocks, num_tasks), true, false};
  } else {
    const int real_m_tiles = num_tasks / p.num_n_tiles;
    const int m_first = unit / p.num_n_tiles * kClusterSize;
    const int m_tile = m_first + static_cast<int>(ptx::cluster_cta_rank());
    const bool active = m_tile < real_m_tiles;
    const bool shared = m_first + 1 < real_m_tiles && p.tile_to_expert[m_first] == p.tile_to_expert[m_first + 1];
    const Task t{m_tile, unit % p.num_n_tiles, p.tile_to_expert[active ? m_tile : m_first], 0, num_k_blocks};
    return {t, active, shared};
  }
}

// ---- the CTA's sequence of work units ------------------------------------------------------------------
// Static: first, first + step, ... < count (units_of). kDynamic: producer thread 0 takes each next unit from the
// launch's counter and passes it through a ring of kUnitSlots in shared memory to the roles that read it (the
// consumer warps; the producer's gather warps); the last CTA to run out resets the counter for the next launch.
#if MOK_GEMM_DYNAMIC
__device__ int g_unit_counter[8];    // per Gemm kind: the next unit to hand out
__device__ unsigned g_ctas_done[8];  // per Gemm kind: CTAs that ran out
#endif

struct UnitRing {
  uint64_t* full;   // [kUnitSlots] the writer's arrival: the slot holds the next unit
  uint64_t* empty;  // [kUnitSlots] each reader warp's arrival: the slot may be rewritten
  int* unit;        // [kUnitSlots] a unit, or -1: none left
};

template <Gemm kGemm>
struct UnitFeed {
  Units units;
  UnitRing ring;

  // Reader warps of a slot: the consumers', and the producer's when it gathers (TMA producers: thread 0 alone,
  // which writes the units and reads none).
  static constexpr int kReaderWarps =
      kNumConsumerWarps + (Tile<kGemm>::kGather ? kNumProducerThreads / kWarpSize : 0);

  // The CTA's i-th unit from the counter, or -1 when there is none; every role calls it for i = 0, 1, ... until -1
  // (`writer`: producer thread 0; every other caller reads, with its whole warp).
  MOK_DEVICE int next(int i, bool writer) const {
    if constexpr (Tile<kGemm>::kDynamic) {
#if MOK_GEMM_DYNAMIC
      const int slot = i % kUnitSlots;
      const uint32_t phase = (i / kUnitSlots) & 1;
      if (writer) {
        ptx::mbarrier_wait_parity(&ring.empty[slot], phase ^ 1);  // its readers are done with its last unit
        const int unit = atomicAdd(&g_unit_counter[static_cast<int>(kGemm)], 1);
        ring.unit[slot] = unit < units.count ? unit : -1;
        ptx::mbarrier_arrive(&ring.full[slot]);  // release: the readers see the unit
        if (unit >= units.count && atomicAdd(&g_ctas_done[static_cast<int>(kGemm)], 1u) == gridDim.x - 1) {
          // every CTA has taken its last unit: none reads the counter again in this launch
          g_unit_counter[static_cast<int>(kGemm)] = 0;
          g_ctas_done[static_cast<int>(kGemm)] = 0;
        }
        if (!Tile<kGemm>::kGather) return unit < units.count ? unit : -1;
      }
      ptx::mbarrier_wait_parity(&ring.full[slot], phase);
      const int unit = ring.unit[slot];
      __syncwarp();
      if (lane_id() == 0) ptx::mbarrier_arrive(&ring.empty[slot]);
      return unit;
#endif
    }
    return -1;
  }
};

// body(unit) for each of the CTA's work units in order: the static stride (units_of), or the counter's (kDynamic).
template <Gemm kGemm, typename Body>
MOK_DEVICE void for_each_unit(const Params& p, int num_tasks, const UnitRing& ring, bool writer, Body body) {
  const Units units = units_of<kGemm>(p, num_tasks);
  if constexpr (Tile<kGemm>::kDynamic) {
    const UnitFeed<kGemm> feed{units, ring};
    for (int i = 0, unit; (unit = feed.next(i, writer)) >= 0; ++i) body(unit);
  } else {
    for (int unit = units.first; unit < units.count; unit += units.step) body(unit);
  }
}

MOK_DEVICE uint8_t* stage_a(uint8_t* smem, uint32_t stage) { return smem + stage * kStageBytes; }
MOK_DEVICE uint8_t* stage_b(uint8_t* smem, uint32_t stage, int which) {  // which: 0 = B0, 1 = B1
  return smem + stage * kStageBytes + kATileBytes + which * kBTileBytes;
}
MOK_DEVICE uint8_t* stage_fold(uint8_t* smem, uint32_t stage) {  // MOK_GEMM_FOLD's tail rows
  return smem + kMainBytes + stage * kFoldTileBytes;
}
// MXFP8 landing slot `slot`: the E4M3 tile of B0 or B1, and its scales (row r's two bytes at 2r).
MOK_DEVICE uint8_t* land_tile(uint8_t* smem, uint32_t slot, int which) {
  return smem + kMxStages * kStageBytes + (2 * slot + which) * kLandTileBytes;
}
MOK_DEVICE uint8_t* land_scales(uint8_t* smem, uint32_t slot, int which) {  // after the staging: 128-aligned
  return smem + kMainBytes + kStagingBytes + (2 * slot + which) * kLandScaleBytes;
}

// ---- producer: warpgroup 0 -----------------------------------------------------------------------------

// MOK_GEMM_FOLD, A by TMA: A's rows (a2's: kGateUpDgrad's second half of K) in boxes of a tail's kFoldRows, which the
// kernel's tmap_gate and tmap_up carry in these kinds (the SwiGLU kinds' stores use them otherwise).
struct FoldMaps {
  const CUtensorMap *a, *a2;
};

// Thread 0: the tensor-map loads of one stage (B0, B1, and A unless it is gathered). tmap_b1 is Wu for
// kGateUp and kGateUpDgrad (its second half of K), unused otherwise; tmap_a2 is d_up for kGateUpDgrad.
// MN-major operands come as boxes of 64 columns × 64 k-rows, two per 128 columns (8 KiB apart).
// Multicast kinds: a shared pair's CTA rank r loads only B piece r, into both CTAs (the stage's full[] counts the
// same bytes either way); a CTA without a task loads nothing and arrives with no bytes.
template <Gemm kGemm>
MOK_DEVICE void issue_tma(const CUtensorMap* tmap_a, const CUtensorMap* tmap_a2, const CUtensorMap* tmap_b0,
                          const CUtensorMap* tmap_b1, const FoldMaps& fold_maps, uint8_t* smem, uint64_t* bar,
                          uint32_t stage, const Work& w, int kb, int k, bool fold) {
  using T = Tile<kGemm>;
  if (!w.active) {
    ptx::mbarrier_arrive_expect_tx(bar, 0);
    return;
  }
  const Task& t = w.t;
  const int half_blocks = static_cast<int>(ceil_div(k, BLOCK_K));
  const bool second = kGemm == Gemm::kGateUpDgrad && kb >= half_blocks;
  const int k0 = t.k_row0 + (second ? kb - half_blocks : kb) * BLOCK_K;
  const int batch = kGemm == Gemm::kWeightGrad ? 0 : t.expert;  // kWeightGrad's operands are row matrices
  const int n0 = t.n_tile * T::kTaskN, m0 = t.m_tile * BLOCK_M;
  const CUtensorMap* b_first = second ? tmap_b1 : tmap_b0;
  const CUtensorMap* b_second = T::kSwiGLU ? tmap_b1 : b_first;
  // MOK_GEMM_FOLD, A by TMA: the tail's first kFoldRows rows of this half's A (boxes of 64 × kFoldRows)
  const bool fold_by_tma = T::kFold && !T::kGather && fold;
  ptx::mbarrier_arrive_expect_tx(bar, T::kTmaBytes + (fold_by_tma ? kFoldTileBytes : 0));
  if (fold_by_tma)
    ptx::tma_load_3d(stage_fold(smem, stage), second ? fold_maps.a2 : fold_maps.a, k0, m0 + BLOCK_M, 0, bar);
  if constexpr (T::kMajorMNA) {  // map dims (m, rows, 1)
    ptx::tma_load_3d(stage_a(smem, stage), tmap_a, m0, k0, 0, bar);
    ptx::tma_load_3d(stage_a(smem, stage) + kATileBytes / 2, tmap_a, m0 + 64, k0, 0, bar);
  } else if constexpr (!T::kGather) {  // map dims (k, rows, 1)
    ptx::tma_load_3d(stage_a(smem, stage), second ? tmap_a2 : tmap_a, k0, m0, 0, bar);
  }
  const auto load_b = [&](uint8_t* dst, const CUtensorMap* map, int c0, int c1) {
    if (T::kMulticast && w.shared) {
      ptx::tma_load_3d_multicast(dst, map, c0, c1, batch, bar, (1u << kClusterSize) - 1);
    } else {
      ptx::tma_load_3d(dst, map, c0, c1, batch, bar);
    }
  };
  for (int which = 0; which < (T::kMx ? 0 : 2); ++which) {  // MXFP8 B: issue_landing
    if (T::kMulticast && w.shared && which != static_cast<int>(ptx::cluster_cta_rank())) continue;
    const CUtensorMap* map = which == 0 ? b_first : b_second;
    const int col = n0 + which * T::kB1Offset;
    if constexpr (T::kMajorMN) {  // map dims (n, k, experts), box (64, 64, 1)
      load_b(stage_b(smem, stage, which), map, col, k0);
      load_b(stage_b(smem, stage, which) + T::kBHalfBytes, map, col + 64, k0);
    } else {  // map dims (k, n, experts), box (64, 128, 1)
      load_b(stage_b(smem, stage, which), map, k0, col);
    }
  }
}

// The landing barriers of the MXFP8 kinds: land_full[slot] (thread 0's arrive.expect_tx + the bytes),
// land_empty[slot] (one arrival per producer thread, once it has read the slot).
struct Landing {
  const CUtensorMap *b0, *b1, *s0, *s1;  // E4M3 data maps (k, n, E) and scale maps (2n, k-blocks, E)
  uint64_t *full, *empty;
};

// Thread 0: the CTA's k-block j of the MXFP8 kinds into landing slot j % kNumLanding (every task of these
// kinds runs all of K: k-block j is task blockIdx.x + (j / num_k_blocks)·gridDim.x, k-block j % num_k_blocks),
// once all producer threads have read the slot's previous k-block.
template <Gemm kGemm>
MOK_DEVICE void issue_landing(const Landing& land, const Params& p, uint8_t* smem, int j, int num_k_blocks,
                              int num_tasks) {
  using T = Tile<kGemm>;
  const uint32_t slot = j % kNumLanding;
  if (j >= kNumLanding) ptx::mbarrier_wait_parity(&land.empty[slot], (j / kNumLanding - 1) & 1);
  const int kb = j % num_k_blocks;
  const Task t = decode_task<kGemm>(p, static_cast<int>(blockIdx.x) + (j / num_k_blocks) * gridDim.x, num_k_blocks,
                                    num_tasks);
  const int n0 = t.n_tile * T::kTaskN, n1 = n0 + T::kB1Offset;
  ptx::mbarrier_arrive_expect_tx(&land.full[slot], kLandTxBytes);
  ptx::tma_load_3d(land_tile(smem, slot, 0), land.b0, kb * BLOCK_K, n0, t.expert, &land.full[slot]);
  ptx::tma_load_3d(land_tile(smem, slot, 1), land.b1, kb * BLOCK_K, n1, t.expert, &land.full[slot]);
  ptx::tma_load_3d(land_scales(smem, slot, 0), land.s0, 2 * n0, kb, t.expert, &land.full[slot]);
  ptx::tma_load_3d(land_scales(smem, slot, 1), land.s1, 2 * n1, kb, t.expert, &land.full[slot]);
}

// Producer thread `row`: row `row` of B0 and B1 from landing slot `slot` (64 E4M3 bytes each, two scales)
// to the stage's bf16 tiles, exactly as mxfp8_dequantize computes each element (mxfp8::dequantize8). A
// tile's 4 shared loads go out before its first conversion (all 8 at once spilled in kDownMx).
MOK_DEVICE void dequantize_b_row(uint8_t* smem, uint32_t slot, uint32_t stage, uint32_t row) {
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    uint4 q[4];
#pragma unroll
    for (int c = 0; c < 4; ++c)
      q[c] = *reinterpret_cast<const uint4*>(land_tile(smem, slot, which) + sw64_offset(row, c));
    const uint32_t scale_bytes = *reinterpret_cast<const uint16_t*>(land_scales(smem, slot, which) + 2 * row);
    uint8_t* b_tile = stage_b(smem, stage, which);
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // E4M3 chunk c: k 16c .. 16c + 15, in scale block c / 2
      // NOTE: a cheaper-looking path (one cvt per two elements, then integer ops and a bf16 multiply by
      // 2^(112+e), exact for scale bytes 10..142) measured slower: the mxfp8 forward took 10.7 / 14.5 / 3.8 /
      // 39.8 ms on the four standard shapes against 8.8 / 11.2 / 3.0 / 30.3 with this one (H200, moe bench
      // with MXFP8 weights in the mainloop at c8c131e and 70824c8; data/bench/mx_gemm_ab.csv has its GEMMs).
      const float s = mxfp8::scale_byte_to_f32((scale_bytes >> (8 * (c / 2))) & 0xFFu);
      const float scale[8] = {s, s, s, s, s, s, s, s};
      *reinterpret_cast<uint4*>(b_tile + sw128_offset(row, 2 * c)) =
          mxfp8::dequantize8(make_uint2(q[c].x, q[c].y), scale);
      *reinterpret_cast<uint4*>(b_tile + sw128_offset(row, 2 * c + 1)) =
          mxfp8::dequantize8(make_uint2(q[c].z, q[c].w), scale);
    }
  }
}

template <Gemm kGemm>
MOK_DEVICE void produce(const CUtensorMap* tmap_a, const CUtensorMap* tmap_a2, const CUtensorMap* tmap_b0,
                        const CUtensorMap* tmap_b1, const FoldMaps& fold_maps, const Landing& land, const Params& p,
                        uint8_t* smem, uint64_t* full, uint64_t* empty, const UnitRing& ring, int num_tasks,
                        int num_k_blocks) {
  using T = Tile<kGemm>;
  const uint32_t thread = threadIdx.x;  // 0..127
  if (!T::kGather && !T::kMx && thread != 0) return;  // TMA only: one thread issues everything
  const uint32_t chunk = thread % kChunksPerRow;
  const uint32_t row_in_tile = thread / kChunksPerRow;
  // MXFP8: thread 0 keeps the landing ring kNumLanding - 1 k-blocks ahead of the stage it fills.
  int num_landings = 0;  // this CTA's k-blocks
  if constexpr (T::kMx) {
    if (static_cast<int>(blockIdx.x) < num_tasks)
      num_landings = ((num_tasks - 1 - static_cast<int>(blockIdx.x)) / gridDim.x + 1) * num_k_blocks;
    for (int j = 0; thread == 0 && j < kNumLanding - 1 && j < num_landings; ++j)
      issue_landing<kGemm>(land, p, smem, j, num_k_blocks, num_tasks);
  }
  uint32_t it = 0;  // position in the (task, k-block) sequence, shared with the consumers
  for_each_unit<kGemm>(p, num_tasks, ring, thread == 0, [&](int unit) {
    const Work w = decode_work<kGemm>(p, unit, num_k_blocks, num_tasks);
    const Task& t = w.t;
    if (skips_tail<kGemm>(p, t)) return;
    const bool fold = folds_tail<kGemm>(p, t, num_tasks);
    int32_t token[kRowsPerThread];  // source row of each of this thread's A rows, -1 = zero row
    int32_t fold_token[kFoldRowsPerThread];  // the same for the tail rows MOK_GEMM_FOLD gathers
    if constexpr (T::kGather) {
#pragma unroll
      for (int j = 0; j < kRowsPerThread; ++j)
        token[j] = p.row_to_token[t.m_tile * BLOCK_M + row_in_tile + kRowStride * j];
#pragma unroll
      for (int j = 0; j < kFoldRowsPerThread; ++j)
        fold_token[j] = fold ? p.row_to_token[(t.m_tile + 1) * BLOCK_M + row_in_tile + kRowStride * j] : -1;
    }
    for (int kb = 0; kb < t.num_k_blocks; ++kb, ++it) {
      const uint32_t stage = it % T::kStages, phase = (it / T::kStages) & 1;
      if constexpr (T::kMx) {  // before waiting for the stage: the landing runs ahead of the consumers too
        const int ahead = static_cast<int>(it) + kNumLanding - 1;
        if (thread == 0 && ahead < num_landings) issue_landing<kGemm>(land, p, smem, ahead, num_k_blocks, num_tasks);
      }
      ptx::mbarrier_wait_parity(&empty[stage], phase ^ 1);  // the slot is free (in both CTAs)
      if constexpr (T::kTmaIntoStage) {
        if (thread == 0)
          issue_tma<kGemm>(tmap_a, tmap_a2, tmap_b0, tmap_b1, fold_maps, smem, &full[stage], stage, w, kb, p.k, fold);
      }
      if constexpr (T::kGather) {
        uint8_t* a_tile = stage_a(smem, stage);
        const int col = kb * BLOCK_K + static_cast<int>(chunk) * 8;  // first element of this thread's chunk
#pragma unroll
        for (int j = 0; j < kRowsPerThread; ++j) {
          const bool real = token[j] >= 0 && col < p.k;  // k % 8 == 0: a chunk is all in or all out
          const uint16_t* src = real ? p.a + static_cast<int64_t>(token[j]) * p.k + col : p.a;
          ptx::cp_async_16_zfill(a_tile + sw128_offset(row_in_tile + kRowStride * j, chunk), src, real ? 16 : 0);
        }
        if (T::kFold && fold) {
#pragma unroll
          for (int j = 0; j < kFoldRowsPerThread; ++j) {
            const bool real = fold_token[j] >= 0 && col < p.k;
            const uint16_t* src = real ? p.a + static_cast<int64_t>(fold_token[j]) * p.k + col : p.a;
            ptx::cp_async_16_zfill(stage_fold(smem, stage) + sw128_offset(row_in_tile + kRowStride * j, chunk), src,
                                   real ? 16 : 0);
          }
        }
        ptx::cp_async_mbarrier_arrive_noinc(&full[stage]);
      }
      if constexpr (T::kMx) {
        const uint32_t slot = it % kNumLanding;
        ptx::mbarrier_wait_parity(&land.full[slot], (it / kNumLanding) & 1);
        dequantize_b_row(smem, slot, stage, thread);
        ptx::fence_proxy_async_shared();  // the bf16 rows, before the consumers' wgmma reads them
        ptx::mbarrier_arrive(&land.empty[slot]);
        ptx::mbarrier_arrive(&full[stage]);
      }
    }
  });
  if constexpr (T::kGather) ptx::cp_async_wait_all();  // NOTE: no copies in flight behind an exited thread
}

// ---- epilogues: registers -> shared memory -> global --------------------------------------------------

constexpr int kAccPerThread = WG_M * BLOCK_N_B / kWarpgroup;  // 64 fp32 per accumulator

// A consumer warp's staging area (Tile::kStagingBytesPerWarp) and, on the TMA path, the box its next store writes.
struct Staging {
  uint8_t* smem;
  int box;
};

// One output matrix of an epilogue: rows [0, num_rows) × columns [0, n) of `ptr` (row stride n) for st.global;
// the same matrix as entry `batch` of tensor map `tmap` (dims (n, rows, batch)) for TMA stores. kAllRows: the
// schedule's outputs, whose tiles cover their rows exactly (no bound to check).
struct Output {
  uint16_t* ptr;
  const CUtensorMap* tmap;
  int batch, n, num_rows;
};
constexpr int kAllRows = INT32_MAX;

// st.global path: a warp's fragment of one 128-column accumulator (16 rows × 128 columns, thread (lane l)
// holding rows l/4 and l/4 + 8, columns 8i + 2(l%4) + {0, 1}, i in [0, 16)) goes to its staging area with
// stmatrix, then back out as 16-byte chunks, 16 lanes per 256-byte row: full-line global stores instead of
// 4-byte ones scattered over 8 rows. Chunk c of staging row r sits at slot c ^ (r % 8) (bank-conflict free
// both ways).
MOK_DEVICE uint32_t staging_offset(uint32_t row, uint32_t chunk) { return row * 256 + ((chunk ^ (row % 8)) << 4); }

// values(i, h) -> the bf16x2 word of column pair i, row half h (h = 0: row l/4, h = 1: row l/4 + 8).
// Writes columns [col0, col0 + 128) of rows row0 .. row0 + 15 of `out` (row stride n); columns >= n and rows
// >= num_rows skipped.
template <typename Values>
MOK_DEVICE void store_tile_v4(uint8_t* staging, uint16_t* out, int row0, int col0, int n, uint32_t lane,
                              Values values, int num_rows) {
  const uint32_t matrix = lane / 8, matrix_row = lane % 8 + 8 * (matrix & 1);
#pragma unroll
  for (int i = 0; i < BLOCK_N_B / 8; i += 2) {  // matrices (h, i) = (0, i), (1, i), (0, i + 1), (1, i + 1)
    ptx::stmatrix_x4(staging + staging_offset(matrix_row, i + (matrix >> 1)), values(i, 0), values(i, 1),
                     values(i + 1, 0), values(i + 1, 1));
  }
  __syncwarp();
  const uint32_t chunk = lane % 16;
  const int col = col0 + 8 * static_cast<int>(chunk);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t row = 2 * j + lane / 16;
    const uint4 v = *reinterpret_cast<const uint4*>(staging + staging_offset(row, chunk));
    if (col < n && row0 + static_cast<int>(row) < num_rows)  // n % 8 == 0: a chunk is all in or all out
      st_v4(out + static_cast<int64_t>(row0 + row) * n + col, v);
  }
  __syncwarp();  // the staging area is reused by the next call
}

// TMA path: the same 16 × 128 tile as two boxes of 64 columns, in a staging area of kBoxes boxes. Per box: lane 0
// waits until the box's staging was read by the store issued kBoxes boxes ago (its bulk groups complete in
// order), stmatrix writes the 8 column groups with the 128-byte swizzle the tensor map reads (the box is
// 1024-aligned, so sw128_offset is the address XOR TMA applies), every lane fences its writes to the async proxy,
// and lane 0 issues the store and commits it as one group. Boxes entirely past n or m are skipped (the map clips the
// rest: a partial box writes only columns < n and rows < num_rows).
template <int kBoxes, typename Values>
MOK_DEVICE void store_tile_tma(Staging& st, const Output& out, int row0, int col0, uint32_t lane, Values values) {
  const uint32_t matrix = lane / 8, matrix_row = lane % 8 + 8 * (matrix & 1);
#pragma unroll
  for (int b = 0; b < BLOCK_N_B / kStoreBoxCols; ++b) {
    const int col = col0 + b * kStoreBoxCols;
    if (col >= out.n || row0 >= out.num_rows) break;  // warp-uniform
    uint8_t* box = st.smem + st.box * kStoreBoxBytes;
    if (lane == 0) ptx::bulk_wait_group_read<kBoxes - 1>();
    __syncwarp();  // no lane writes the box before its last store has read it
#pragma unroll
    for (int c = 0; c < kStoreBoxCols / 8; c += 2) {  // chunk c of a box row: the tile's 8 columns i = 8b + c
      const int i = b * (kStoreBoxCols / 8) + c;
      ptx::stmatrix_x4(box + sw128_offset(matrix_row, c + (matrix >> 1)), values(i, 0), values(i, 1),
                       values(i + 1, 0), values(i + 1, 1));
    }
    ptx::fence_proxy_async_shared();  // this lane's stmatrix writes, before the TMA engine reads them
    __syncwarp();
    if (lane == 0) {
      ptx::tma_store_3d(out.tmap, box, col, row0, out.batch);
      ptx::bulk_commit_group();
    }
    st.box = st.box + 1 == kBoxes ? 0 : st.box + 1;
  }
}

// Columns [col0, col0 + 128) of rows row0 .. row0 + 15 of `out`, by the path the build selected.
template <int kBoxes, typename Values>
MOK_DEVICE void store_tile(Staging& st, const Output& out, int row0, int col0, uint32_t lane, Values values) {
  if constexpr (kTmaStore) {
    store_tile_tma<kBoxes>(st, out, row0, col0, lane, values);
  } else {
    store_tile_v4(st.smem, out.ptr, row0, col0, out.n, lane, values, out.num_rows);
  }
}

// kGateUpMxOut's E4M3 tiles: a warp's 16 rows × 128 one-byte columns [col0, col0 + 128) of `data` ([rows, n],
// n % 16 == 0) are one staging box, 128 bytes a row like a bf16 box. `fill(put)` calls put(i, h, two_bytes) for
// every word position of the accumulator layout (columns 8i + 2(l%4) + {0, 1}, row half h), which lands as a
// 2-byte store at its place in the 128-byte swizzle (a row's 8 lanes hit 8 distinct 16-byte slots). Then the
// box leaves as store_tile's boxes do: one TMA store through `tmap` (uint8, box 128 × 16), or 16-byte st.global.
static_assert(BLOCK_N_B * kStoreBoxRows == static_cast<int>(kStoreBoxBytes), "a warp's E4M3 tile is one store box");
template <int kBoxes, typename Fill>
MOK_DEVICE void store_tile_e4m3(Staging& st, uint8_t* data, const CUtensorMap* tmap, int n, int row0, int col0,
                                uint32_t lane, Fill fill) {
  uint8_t* box = st.smem + (kTmaStore ? st.box * kStoreBoxBytes : 0);
  if (kTmaStore && lane == 0) ptx::bulk_wait_group_read<kBoxes - 1>();
  __syncwarp();  // no lane writes the box before its last store has read it
  fill([&](int i, int h, uint32_t two_bytes) {
    const uint32_t row = lane / 4 + 8 * h, byte = 8 * (i % 2) + 2 * (lane % 4);
    *reinterpret_cast<uint16_t*>(box + sw128_offset(row, i / 2) + byte) = static_cast<uint16_t>(two_bytes);
  });
  if constexpr (kTmaStore) {
    ptx::fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0) {
      ptx::tma_store_3d(tmap, box, col0, row0, 0);
      ptx::bulk_commit_group();
    }
    st.box = st.box + 1 == kBoxes ? 0 : st.box + 1;
  } else {
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // lane: 16-byte chunk lane % 8 of rows lane / 8 + 4j
      const uint32_t row = lane / 8 + 4 * j, chunk = lane % 8;
      const int col = col0 + 16 * static_cast<int>(chunk);
      if (col < n) st_v4(data + static_cast<int64_t>(row0 + row) * n + col,
                         *reinterpret_cast<const uint4*>(box + sw128_offset(row, chunk)));
    }
    __syncwarp();  // the staging area is reused by the next call
  }
}

// The row-wise MXFP8 blocks of a warp's 16 × 128 tile in the accumulator layout, word(i, h) = the bf16x2 of
// columns 8i + 2(l%4) + {0, 1} in row half h: block b of a row is i in [4b, 4b + 4) across the quad of lanes that
// holds the row, so its amax is a max over 4 words and the lanes xor 1, 2 (both row halves in one word:
// mxfp8_quantize's amax on bits, NaN/Inf flagged). Calls on_block(b, scale of row half 0, of row half 1); every
// lane of the warp must call it (shuffles).
template <typename Word, typename OnBlock>
MOK_DEVICE void rowwise_blocks(Word word, OnBlock on_block) {
  static_assert(BLOCK_N_B % mxfp8::kBlockSize == 0 && mxfp8::kBlockSize == 4 * 8, "a block: 4 lanes × 4 words");
#pragma unroll
  for (int b = 0; b < BLOCK_N_B / mxfp8::kBlockSize; ++b) {
    uint32_t amax[2] = {0u, 0u};
#pragma unroll
    for (int i = 4 * b; i < 4 * b + 4; ++i)
      amax[0] = mxfp8::amax2_acc(amax[0], word(i, 0)), amax[1] = mxfp8::amax2_acc(amax[1], word(i, 1));
    uint32_t both = mxfp8::amax2_fold(amax[0]) | (mxfp8::amax2_fold(amax[1]) << 16);
    both = warp_vmaxu2_xor(warp_vmaxu2_xor(both, 1), 2);
    on_block(b, mxfp8::scale_from_amax_bits(both & 0xFFFFu), mxfp8::scale_from_amax_bits(both >> 16));
  }
}

// Before the consumer exits: its last stores have finished (the global writes, not only the staging reads).
MOK_DEVICE void drain_stores(uint32_t lane) {
  if (kTmaStore && lane == 0) ptx::bulk_wait_group<0>();
}

// The output tensor maps of the TMA path (kernel parameters; unused by the st.global path), boxes of
// kStoreBoxCols × kStoreBoxRows: dims (n, num_rows, 1), kWeightGrad's out (n, m, num_experts).
struct Outputs {
  const CUtensorMap *out, *gate, *up;  // gate, up: the SwiGLU kinds only (kGateUpMxOut: their E4M3 data)
};

// The epilogue of one consumer warp: its 16 rows of a finished task's tile. kGateUp stores gate, up and h =
// swiglu(gate, up) from the accumulators at once (gate and up first: the accumulators then die as h is computed,
// which kGateUpMx's 192 registers need). The others pack the tile as bf16, two 16 × 128 pieces (columns n0.. and
// n0 + 128..; word w of an accumulator is pack_bf16x2(acc[2w], acc[2w + 1]), so stmatrix's values(i, h), column
// pair i and row half h, is word 2i + h), and store them at once or, with kDefer (the weight gradients), hold them
// while the next task's first two k-blocks multiply and store one after each of their wgmma commits
// (mma_k_blocks): the tensor cores keep working through most of the epilogue. 64 words beside the 128 accumulator
// floats fit the consumers' 232 registers (ptxas -v, CUDA 13.0), not on the st.global path. Padding rows of the
// schedule's outputs are stored as zeros whatever the weights hold (0·Inf would be NaN).
template <Gemm kGemm, bool kDefer>
struct Epilogue {
  using T = Tile<kGemm>;
  static_assert(!(kDefer && T::kSwiGLU), "kGateUp stores its tile at once");
  static constexpr int kWords = kAccPerThread / 2;
  static constexpr int kPieces = 2;
  uint32_t words[kPieces][kWords];  // acc0, acc1 packed
  int row0, n0, expert;             // this warp's 16 rows, the tile's first column, kWeightGrad's dW[expert]
  bool real[2];                     // row halves l/4 and l/4 + 8 are routes (always, in kWeightGrad)
  int next = kPieces;               // the piece to store next; kPieces: nothing held

  MOK_DEVICE void finish(const float (&acc0)[kAccPerThread], const float (&acc1)[kAccPerThread], const Params& p,
                       const Outputs& o, Staging& st, int row0_, int n0_, int expert_, uint32_t lane) {
    row0 = row0_, n0 = n0_, expert = expert_;
    real[0] = kGemm == Gemm::kWeightGrad || p.row_to_token[row0 + lane / 4] >= 0;
    real[1] = kGemm == Gemm::kWeightGrad || p.row_to_token[row0 + lane / 4 + 8] >= 0;
    if constexpr (T::kMxOut) {
      store_mx_piece(mx_of(p.gate, p), o.gate, p, st, lane, acc0);
      store_mx_piece(mx_of(p.up, p), o.up, p, st, lane, acc1);
    } else if constexpr (T::kSwiGLU) {
      store_piece_from(p, o, st, lane, 0, acc_values(acc0));
      store_piece_from(p, o, st, lane, 1, acc_values(acc1));
    }
    if constexpr (T::kSwiGLU) {
      // h in batches of 8 elements (swiglu_n: see mok/swiglu.cuh for why batches; 16 spilled), packed as the
      // stores read it: word k = elements 2k, 2k + 1
      constexpr int kBatch = 8;
      uint32_t h_words[kWords];
#pragma unroll
      for (int b = 0; b < kAccPerThread; b += kBatch) {
        float g[kBatch], u[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) g[j] = round_bf16(acc0[b + j]), u[j] = round_bf16(acc1[b + j]);
        swiglu_n(g, u, p.swiglu_limit, p.has_limit != 0);
#pragma unroll
        for (int j = 0; j < kBatch; j += 2) h_words[(b + j) / 2] = pack_bf16x2(g[j], g[j + 1]);
      }
      if constexpr (T::kMxOut) {  // h's row-wise round trip in place (padding rows: zeros, as stored)
        const auto word = [&](int i, int h) { return real[h] ? h_words[2 * i + h] : 0u; };
        rowwise_blocks(word, [&](int b, const mxfp8::Scale& s0, const mxfp8::Scale& s1) {
#pragma unroll
          for (int i = 4 * b; i < 4 * b + 4; ++i) {
            h_words[2 * i] = mxfp8::round_trip2(word(i, 0), s0);
            h_words[2 * i + 1] = mxfp8::round_trip2(word(i, 1), s1);
          }
        });
      }
      store_tile<T::kStoreBoxes>(st, {p.out, o.out, 0, p.n, kAllRows}, row0, n0, lane,
                 [&](int i, int h) { return real[h] ? h_words[2 * i + h] : 0u; });
    } else {
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        words[0][w] = pack_bf16x2(acc0[2 * w], acc0[2 * w + 1]);
        words[1][w] = pack_bf16x2(acc1[2 * w], acc1[2 * w + 1]);
      }
      next = 0;
    }
  }

  // The next piece, if one is held (each branch names its piece at compile time: the words stay registers).
  MOK_DEVICE void store_next(const Params& p, const Outputs& o, Staging& st, uint32_t lane) {
    if (next == 0) {
      store_piece<0>(p, o, st, lane);
    } else if (next == 1) {
      store_piece<1>(p, o, st, lane);
    }
    if (next < kPieces) ++next;
  }

  MOK_DEVICE void store_rest(const Params& p, const Outputs& o, Staging& st, uint32_t lane) {
    while (next < kPieces) store_next(p, o, st, lane);
  }

  template <int kPiece>
  MOK_DEVICE void store_piece(const Params& p, const Outputs& o, Staging& st, uint32_t lane) {
    store_piece_from(p, o, st, lane, kPiece, [&](int i, int h) { return real[h] ? words[kPiece][2 * i + h] : 0u; });
  }

  MOK_DEVICE auto acc_values(const float* acc) const {  // stmatrix's values of an accumulator, packed as read
    return [acc, this](int i, int h) {
      return real[h] ? pack_bf16x2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]) : 0u;
    };
  }

  // kGateUpMxOut's gate or up from its accumulator: the bf16 values (zeros in padding rows) quantized row-wise, the
  // E4M3 box by store_tile_e4m3 and each block's scale byte by the quad lane b of its row (st.global).
  MOK_DEVICE void store_mx_piece(MxOut mx, const CUtensorMap* tmap, const Params& p, Staging& st, uint32_t lane,
                                 const float* acc) const {
    const auto word = acc_values(acc);
    const int64_t scale_cols = p.n / mxfp8::kBlockSize;
    store_tile_e4m3<T::kStoreBoxes>(st, mx.data, tmap, p.n, row0, n0, lane, [&](auto put) {
      rowwise_blocks(word, [&](int b, const mxfp8::Scale& s0, const mxfp8::Scale& s1) {
#pragma unroll
        for (int i = 4 * b; i < 4 * b + 4; ++i)
          put(i, 0, mxfp8::quantize2(word(i, 0), s0)), put(i, 1, mxfp8::quantize2(word(i, 1), s1));
        const int col = n0 + mxfp8::kBlockSize * b;
        if (lane % 4 == static_cast<uint32_t>(b) && col < p.n) {
          uint8_t* s = mx.scales + (row0 + lane / 4) * scale_cols + col / mxfp8::kBlockSize;
          st_u8(s, s0.byte);
          st_u8(s + 8 * scale_cols, s1.byte);
        }
      });
    });
  }

  // Piece `piece` (0 or 1) of the tile: kGateUp's gate or up, the others' columns n0 + 128 · piece.. (if < n).
  template <typename Values>
  MOK_DEVICE void store_piece_from(const Params& p, const Outputs& o, Staging& st, uint32_t lane, int piece,
                                   Values values) const {
    if constexpr (T::kSwiGLU) {
      const Output out{piece == 0 ? p.gate : p.up, piece == 0 ? o.gate : o.up, 0, p.n, kAllRows};
      store_tile<T::kStoreBoxes>(st, out, row0, n0, lane, values);
    } else if (piece == 0 || n0 + BLOCK_N_B < p.n) {
      const Output out = kGemm == Gemm::kWeightGrad
                             ? Output{p.out + static_cast<int64_t>(expert) * p.m * p.n, o.out, expert, p.n, p.m}
                             : Output{p.out, o.out, 0, p.n, kAllRows};
      store_tile<T::kStoreBoxes>(st, out, row0, n0 + piece * BLOCK_N_B, lane, values);
    }
  }
};

// ---- consumers: warpgroups 1 and 2 ---------------------------------------------------------------------

MOK_DEVICE void fence_accumulators(float (&acc0)[kAccPerThread], float (&acc1)[kAccPerThread]) {
#pragma unroll
  for (int i = 0; i < kAccPerThread; ++i) ptx::fence_operand(acc0[i]), ptx::fence_operand(acc1[i]);
}

// MOK_GEMM_FOLD's transposed tail accumulators of a consumer warpgroup: its 64 rows of B0 (w0) and of B1 (w1)
// × the tail's kFoldRows rows.
constexpr int kFoldAccPerThread = WG_M * kFoldRows / kWarpgroup;  // 16
struct FoldAcc {
  float w0[kFoldAccPerThread], w1[kFoldAccPerThread];
};

MOK_DEVICE void fence_accumulators(FoldAcc& f) {
#pragma unroll
  for (int i = 0; i < kFoldAccPerThread; ++i) ptx::fence_operand(f.w0[i]), ptx::fence_operand(f.w1[i]);
}

// MOK_GEMM_FOLD=3: a consumer warp's share of a folded tail's outputs, after its own tile's epilogue. The fold
// accumulators hold the tail transposed: w0[4i + 2h + j] is column c0 + 16·warp + 8h + l/4 (c0: this warpgroup's
// first B0 column; w1: B1's) of tail row 8i + 2(l%4) + j. Each 32 × 16 piece goes through the staging box transposed
// (stmatrix.trans: box row r = tail row r, 32 bytes), then out by 16-byte st.global. Tail rows past the routes are
// zeros, in the piece and in rows kFoldRows.. of the tail's tile, which the skipped task used to write: every output
// row is written, as without the fold.
template <Gemm kGemm>
MOK_DEVICE void store_folded_tail(const FoldAcc& f, const Params& p, const Staging& st, int tail_row0, int n0,
                                  uint32_t group, uint32_t warp, uint32_t lane) {
  using T = Tile<kGemm>;
  constexpr int kPieceRowBytes = 16 * 2;  // a piece's row: 16 bf16 columns
  static_assert(kFoldRows * kPieceRowBytes <= static_cast<int>(kStoreBoxBytes), "a piece fits one staging box");
  bool real[kFoldRows / 8][2];  // tail row 8i + 2(l%4) + j is a route
#pragma unroll
  for (int i = 0; i < kFoldRows / 8; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) real[i][j] = p.row_to_token[tail_row0 + 8 * i + 2 * (lane % 4) + j] >= 0;
  const auto masked = [&](const float* v) {  // word(i, h): rows 8i + 2(l%4) + {0, 1} of column 8h + l/4
    return [&real, v](int i, int h) {
      return pack_bf16x2(real[i][0] ? v[4 * i + 2 * h] : 0.0f, real[i][1] ? v[4 * i + 2 * h + 1] : 0.0f);
    };
  };
  const auto store_piece = [&](uint16_t* out, int col0, auto word) {
    uint8_t* box = st.smem;
    if (lane == 0) ptx::bulk_wait_group_read<0>();  // no TMA store still reads the box
    __syncwarp();
    const uint32_t m = lane / 8, q = lane % 8;  // this lane's address: row q of matrix m, (i, h) = (2c + m/2, m%2)
#pragma unroll
    for (int c = 0; c < 2; ++c)
      ptx::stmatrix_x4_trans(box + (8 * (2 * c + m / 2) + q) * kPieceRowBytes + 16 * (m % 2), word(2 * c, 0),
                             word(2 * c, 1), word(2 * c + 1, 0), word(2 * c + 1, 1));
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // 64 chunks of 16 bytes: row chunk / 2, columns 8 · (chunk % 2)..
      const uint32_t chunk = lane + 32 * k, row = chunk / 2;
      const int col = col0 + 8 * static_cast<int>(chunk % 2);
      if (col < p.n)
        st_v4(out + static_cast<int64_t>(tail_row0 + row) * p.n + col,
              *reinterpret_cast<const uint4*>(box + row * kPieceRowBytes + 16 * (chunk % 2)));
    }
    __syncwarp();  // the box is written again by the next piece
  };
  const int col0 = n0 + static_cast<int>(group) * WG_M + 16 * static_cast<int>(warp);
  if constexpr (T::kSwiGLU) {  // w0 = gate, w1 = up of the same columns; h as the tile's epilogue computes it
    float h[kFoldAccPerThread];
#pragma unroll
    for (int b = 0; b < kFoldAccPerThread; b += 8) {
      float g[8], u[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) g[j] = round_bf16(f.w0[b + j]), u[j] = round_bf16(f.w1[b + j]);
      swiglu_n(g, u, p.swiglu_limit, p.has_limit != 0);
#pragma unroll
      for (int j = 0; j < 8; ++j) h[b + j] = g[j];
    }
    store_piece(p.gate, col0, masked(f.w0));
    store_piece(p.up, col0, masked(f.w1));
    store_piece(p.out, col0, masked(h));
  } else {
    store_piece(p.out, col0, masked(f.w0));
    store_piece(p.out, col0 + BLOCK_N_B, masked(f.w1));
  }
  // rows kFoldRows.. of the tail's tile: zeros, the CTA's 256 consumer threads over every output's columns
  constexpr int kChunks = T::kTaskN / 8, kTotal = (BLOCK_M - kFoldRows) * kChunks;
  const int thread = static_cast<int>((group * kWarpgroup / kWarpSize + warp) * kWarpSize + lane);
  for (int c = thread; c < kTotal; c += kNumConsumerGroups * kWarpgroup) {
    const int col = n0 + 8 * (c % kChunks);
    const int64_t at = static_cast<int64_t>(tail_row0 + kFoldRows + c / kChunks) * p.n + col;
    if (col >= p.n) continue;
    st_v4(p.out + at, make_uint4(0, 0, 0, 0));
    if constexpr (T::kSwiGLU) st_v4(p.gate + at, make_uint4(0, 0, 0, 0)), st_v4(p.up + at, make_uint4(0, 0, 0, 0));
  }
}

// This warp's release of a stage: to its own CTA's empty[stage], or (multicast kinds, kCluster) to the same
// barrier in every CTA of the cluster, whose producers may write this CTA's stage next (lane 0 only).
template <bool kCluster>
MOK_DEVICE void release_stage(uint64_t* empty) {
  if constexpr (kCluster) {
#pragma unroll
    for (uint32_t cta = 0; cta < kClusterSize; ++cta) ptx::mbarrier_arrive_cluster(empty, cta);
  } else {
    ptx::mbarrier_arrive(empty);
  }
}

// The mainloop of one task: k-block by k-block, wait for the stage, 4 k16 steps of one n256 wgmma, keep one
// group in flight and release the previous stage. `under_mma()` runs after each of the first kUnderMma k-blocks'
// wgmmas are issued, before their wait (a held tile's pieces); those k-blocks are peeled off the loop, so the loop
// is the code it is without a held tile and the held words are dead in it. kFold (MOK_GEMM_FOLD): each k16
// slice also multiplies this warpgroup's 64 rows of B0 and of B1 by the stage's tail rows into `fold`. Returns the
// position in the stage sequence after the task.
template <int kStages, bool kGather, bool kMajorMNA, bool kMajorMN, bool kCluster, bool kFold, int kUnderMma,
          typename UnderMma>
MOK_DEVICE uint32_t mma_k_blocks(float (&acc0)[kAccPerThread], float (&acc1)[kAccPerThread], FoldAcc& fold,
                                 uint8_t* smem, uint32_t a_offset, uint64_t* full, uint64_t* empty, uint32_t it,
                                 int num_k_blocks, uint32_t lane, UnderMma under_mma) {
  static_assert(!kFold || !kMajorMNA, "the fold's tail rows are K-major A rows");
  uint32_t prev_stage = 0;
  const auto k_block = [&](int kb, auto&& under) {
    const uint32_t stage = it % kStages, phase = (it / kStages) & 1;
    ptx::mbarrier_wait_parity(&full[stage], phase);  // A and B have landed
    // A gathered by cp.async (generic proxy) is read by wgmma through the async proxy.
    if constexpr (kGather) ptx::fence_proxy_async_shared();
    // A: K-major, or MN-major (this warpgroup's 64 rows are one 64-column box: its LBO is never used).
    constexpr uint32_t kAStep = kMajorMNA ? 16 * 128 : 32;
    const uint64_t desc_a = kMajorMNA ? ptx::smem_desc_sw128_mn(stage_a(smem, stage) + a_offset, kATileBytes / 2)
                                      : ptx::smem_desc_sw128(stage_a(smem, stage) + a_offset);
    // K-major B: k16 slice kk starts 32·kk bytes into each row. MN-major B: 16 k-rows of 128 bytes further,
    // and the second 64 columns sit one box (8 KiB) on (the descriptor's leading byte offset).
    // NOTE: one m64n256k16 over B0|B1 (MOK_GEMM_N256) measured no faster than two m64n128k16 in two processes at
    // 86c2bfb, before the sustained method; at the power cap, in one process, 0.98-0.99 of their time (91c1861).
    constexpr uint32_t kBStep = kMajorMN ? 16 * 128 : 32;
    const auto desc_b = [&](int which) {
      return kMajorMN ? ptx::smem_desc_sw128_mn(stage_b(smem, stage, which), kBTileBytes / 2)
                      : ptx::smem_desc_sw128(stage_b(smem, stage, which));
    };
    const uint64_t desc_b0 = desc_b(0), desc_b1 = desc_b(1);
    fence_accumulators(acc0, acc1);
    if constexpr (kFold) fence_accumulators(fold);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
      const uint64_t a = ptx::desc_advance(desc_a, kAStep * kk);
      if constexpr (kN256) {  // B1 follows B0 in the stage: one descriptor spans both (MN-major: 64-column boxes
                              // 8 KiB apart throughout)
        ptx::wgmma_m64n256k16_bf16<kMajorMNA, kMajorMN>(acc0, acc1, a, ptx::desc_advance(desc_b0, kBStep * kk));
      } else {
        ptx::wgmma_m64n128k16_bf16<kMajorMNA, kMajorMN>(acc0, a, ptx::desc_advance(desc_b0, kBStep * kk));
        ptx::wgmma_m64n128k16_bf16<kMajorMNA, kMajorMN>(acc1, a, ptx::desc_advance(desc_b1, kBStep * kk));
      }
      if constexpr (kFold) {  // this warpgroup's 64 columns of B0 and B1 as A, the tail rows as B (K-major)
        // K-major B: rows a_offset / 128.. of each tile; MN-major B: the tile's 64-column box number `group`, which
        // sits a_offset bytes in too (a box of 64 k-rows × 128 bytes is a warpgroup's 64 rows of A: 8 KiB)
        static_assert(kMajorMN ? WG_M * kRowBytes == kBTileBytes / 2 : true, "a warpgroup's columns are one box");
        const auto weights = [&](int which) {
          uint8_t* tile = stage_b(smem, stage, which) + a_offset;
          const uint64_t desc = kMajorMN ? ptx::smem_desc_sw128_mn(tile, kBTileBytes / 2) : ptx::smem_desc_sw128(tile);
          return ptx::desc_advance(desc, kBStep * kk);
        };
        const uint64_t tail = ptx::desc_advance(ptx::smem_desc_sw128(stage_fold(smem, stage)), 32 * kk);
        ptx::wgmma_m64n32k16_bf16<kMajorMN>(fold.w0, weights(0), tail);
        ptx::wgmma_m64n32k16_bf16<kMajorMN>(fold.w1, weights(1), tail);
      }
    }
    ptx::wgmma_commit_group();
    under();
    ptx::wgmma_wait_group<1>();  // k-block kb - 1's MMAs are done: its stage can be refilled
    fence_accumulators(acc0, acc1);
    if constexpr (kFold) fence_accumulators(fold);
    if (kb > 0 && lane == 0) release_stage<kCluster>(&empty[prev_stage]);
    prev_stage = stage;
    ++it;
  };
#pragma unroll
  for (int kb = 0; kb < kUnderMma; ++kb)
    if (kb < num_k_blocks) k_block(kb, under_mma);
  for (int kb = kUnderMma; kb < num_k_blocks; ++kb) k_block(kb, [] {});
  ptx::wgmma_wait_group<0>();
  fence_accumulators(acc0, acc1);
  if constexpr (kFold) fence_accumulators(fold);
  if (num_k_blocks > 0 && lane == 0) release_stage<kCluster>(&empty[prev_stage]);
  return it;
}

template <Gemm kGemm>
MOK_DEVICE void consume(const Params& p, const Outputs& outputs, uint8_t* smem, uint64_t* full, uint64_t* empty,
                        const UnitRing& ring, int num_tasks, int num_k_blocks) {
  using T = Tile<kGemm>;
  const uint32_t group = threadIdx.x / kWarpgroup - 1;  // 0 or 1: which 64 rows of the tile
  const uint32_t warp = (threadIdx.x % kWarpgroup) / kWarpSize;
  const uint32_t lane = lane_id();
  const uint32_t a_offset = group * WG_M * kRowBytes;  // this warpgroup's rows of the A tile
  Staging staging{smem + T::kStagingOffset +
                      (threadIdx.x / kWarpSize - kNumProducerThreads / kWarpSize) * T::kStagingBytesPerWarp,
                  0};
  // Only the weight gradients hold a tile (and only on the TMA path, where it fits in registers): their tasks
  // are short (K = one expert's rows), and they ran 2-10% faster holding it at three of the four shapes in three
  // runs, where the row-wise kinds moved within the runs' spread and the shared expert's GEMM1 at kimi-k2 ran 13-17%
  // slower (H200, parts against MOK_GEMM_DEFER_EPILOGUE=0 at 30c30b5, d9d7179, 24523e5; docs/l2_fused.md).
  constexpr bool kDefer = kDeferEpilogue && kTmaStore && kGemm == Gemm::kWeightGrad;
  using Epi = Epilogue<kGemm, kDefer>;
  Epi epilogue;
  uint32_t it = 0;
  for_each_unit<kGemm>(p, num_tasks, ring, false, [&](int unit) {
    Work w = decode_work<kGemm>(p, unit, num_k_blocks, num_tasks);
    // The weight gradients' K comes from memory (expert_rows): loaded per thread, it made their mainloop's wgmma
    // descriptors vector values moved to uniform registers by R2UR, 62-72 instructions per k-block's 8 wgmmas
    // against 34-39 broadcast (the row-wise kinds': 38-42); measured 0.98-1.05x, docs/l2_fused.md.
    if constexpr (kGemm == Gemm::kWeightGrad) w.t.num_k_blocks = warp_uniform(w.t.num_k_blocks);
    const Task& t = w.t;
    if (skips_tail<kGemm>(p, t)) return;
    const auto release_as_landed = [&] {  // keeps the ring's pace without reading it
      for (int kb = 0; kb < t.num_k_blocks; ++kb, ++it) {
        ptx::mbarrier_wait_parity(&full[it % T::kStages], (it / T::kStages) & 1);
        if (lane == 0) release_stage<T::kMulticast>(&empty[it % T::kStages]);
      }
    };
    if (!w.active) {  // multicast, no task for this CTA: release each stage once it has landed, nothing else
      epilogue.store_rest(p, outputs, staging, lane);
      release_as_landed();
      return;
    }
    float acc0[kAccPerThread], acc1[kAccPerThread];  // kGateUp: gate, up; else columns n0.., n0+128..
#pragma unroll
    for (int i = 0; i < kAccPerThread; ++i) acc0[i] = 0.0f, acc1[i] = 0.0f;

    // A row-wise tile lies in one expert's segment, real rows first: if this warpgroup's first row is padding,
    // all 64 are, and the epilogue stores zeros there whatever the accumulators hold.
    const bool padding_half = kSkipPaddingHalf && kGemm != Gemm::kWeightGrad &&
                              warp_uniform(p.row_to_token[t.m_tile * BLOCK_M + group * WG_M] < 0);
#if MOK_GEMM_TRACE
    const long long clock_start = clock64();
#endif
    const bool fold = folds_tail<kGemm>(p, t, num_tasks);
    FoldAcc fold_acc;  // the tail's outputs, transposed (MOK_GEMM_FOLD=3; the probes drop them)
    const auto mainloop = [&](auto folding) {
      if constexpr (decltype(folding)::value) {
#pragma unroll
        for (int i = 0; i < kFoldAccPerThread; ++i) fold_acc.w0[i] = 0.0f, fold_acc.w1[i] = 0.0f;
      }
      return mma_k_blocks<T::kStages, T::kGather, T::kMajorMNA, T::kMajorMN, T::kMulticast, decltype(folding)::value,
                          kDefer ? Epi::kPieces : 0>(acc0, acc1, fold_acc, smem, a_offset, full, empty, it,
                                                     t.num_k_blocks, lane,
                                                     [&] { epilogue.store_next(p, outputs, staging, lane); });
    };
    if (padding_half) {
      release_as_landed();
    } else if (T::kFold && fold) {
      it = mainloop(std::integral_constant<bool, T::kFold>{});
    } else {
      it = mainloop(std::false_type{});
    }
    if constexpr (kDefer) epilogue.store_rest(p, outputs, staging, lane);  // a task of fewer k-blocks than pieces
#if MOK_GEMM_TRACE
    const long long clock_mma = clock64();
#endif
    const int row0 = t.m_tile * BLOCK_M + group * WG_M + 16 * warp;  // this warp's 16 rows
    epilogue.finish(acc0, acc1, p, outputs, staging, row0, t.n_tile * T::kTaskN, t.expert, lane);
#if MOK_GEMM_TRACE
    if (warp == 0 && lane == 0) {
      const int slot = atomicAdd(&g_trace_count, 1);
      if (slot < kTraceRecords) {
        const bool half_padding = kGemm != Gemm::kWeightGrad && p.row_to_token[t.m_tile * BLOCK_M + WG_M] < 0;
        const long long record[kTraceWords] = {static_cast<int>(kGemm), blockIdx.x, group, unit,
                                               half_padding + 2 * fold,
                                               clock_start, clock_mma, clock64()};
        for (int i = 0; i < kTraceWords; ++i) g_trace[static_cast<int64_t>(slot) * kTraceWords + i] = record[i];
      }
    }
#endif
    if constexpr (!kDefer) epilogue.store_rest(p, outputs, staging, lane);
    if constexpr (T::kFold && kFoldWritesTails) {
      if (fold) store_folded_tail<kGemm>(fold_acc, p, staging, (t.m_tile + 1) * BLOCK_M, t.n_tile * T::kTaskN, group,
                                         warp, lane);
    }
  });
  epilogue.store_rest(p, outputs, staging, lane);
  drain_stores(lane);
}

// ---- the kernel ----------------------------------------------------------------------------------------

template <Gemm kGemm>
__global__ void __launch_bounds__(kNumThreads, 1)
    grouped_gemm_bf16_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_a2,
                             const __grid_constant__ CUtensorMap tmap_b0, const __grid_constant__ CUtensorMap tmap_b1,
                             const __grid_constant__ CUtensorMap tmap_s0,  // MXFP8 kinds: B0's scales
                             const __grid_constant__ CUtensorMap tmap_s1,  // MXFP8 kinds: B1's scales
                             const __grid_constant__ CUtensorMap tmap_out,
                             const __grid_constant__ CUtensorMap tmap_gate,  // kGateUp's TMA stores; FoldMaps
                             const __grid_constant__ CUtensorMap tmap_up,    // kGateUp's TMA stores; FoldMaps
                             const Params p) {
  using T = Tile<kGemm>;
  extern __shared__ uint8_t smem_raw[];
  // Dynamic shared memory is only 16-byte aligned for sure; the swizzle atoms need 1024 (kSmemBytes has
  // the slack).
  uint8_t* smem = smem_raw + (ptx::kSw128AtomBytes - ptx::smem_addr(smem_raw) % ptx::kSw128AtomBytes) %
                                 ptx::kSw128AtomBytes;
  // Layout: [ring][staging of the 8 consumer warps][landing scales][barriers]. NOTE: the barriers sat at the
  // staging's first bytes before, where consumer warp 0's stmatrix wrote row 0 of every tile.
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kMainBytes + kStagingBytes + kLandScalesBytes);
  uint64_t* empty = full + kNumStages;                                              // [T::kStages]
  const Landing land{&tmap_b0, &tmap_b1, &tmap_s0, &tmap_s1, empty + kNumStages,
                     empty + kNumStages + kNumLanding};  // full, empty [kNumLanding] each
  uint64_t* unit_bars = empty + kNumStages + 2 * kNumLanding;  // kDynamic: full, empty [kUnitSlots] each
  const UnitRing ring{unit_bars, unit_bars + kUnitSlots, reinterpret_cast<int*>(unit_bars + 2 * kUnitSlots)};

  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      ptx::mbarrier_init(&full[s], T::kFullArrivals);
      // multicast kinds: both CTAs' consumer warps release each stage (its producers write both CTAs)
      ptx::mbarrier_init(&empty[s], kNumConsumerWarps * (T::kMulticast ? kClusterSize : 1));
    }
    if constexpr (T::kMx) {
      for (int s = 0; s < kNumLanding; ++s) {
        ptx::mbarrier_init(&land.full[s], 1);
        ptx::mbarrier_init(&land.empty[s], kNumProducerThreads);
      }
    }
    if constexpr (T::kDynamic) {
      for (int s = 0; s < kUnitSlots; ++s) {
        ptx::mbarrier_init(&ring.full[s], 1);
        ptx::mbarrier_init(&ring.empty[s], UnitFeed<kGemm>::kReaderWarps);
      }
    }
    ptx::fence_mbarrier_init();
    if constexpr (!T::kGather) ptx::prefetch_tensor_map(&tmap_a);
    if constexpr (kGemm == Gemm::kGateUpDgrad) ptx::prefetch_tensor_map(&tmap_a2);
    if constexpr (T::kFold && !T::kGather) ptx::prefetch_tensor_map(&tmap_gate);
    if constexpr (T::kFold && kGemm == Gemm::kGateUpDgrad) ptx::prefetch_tensor_map(&tmap_up);
    ptx::prefetch_tensor_map(&tmap_b0);
    ptx::prefetch_tensor_map(&tmap_b1);
    if constexpr (T::kMx) ptx::prefetch_tensor_map(&tmap_s0), ptx::prefetch_tensor_map(&tmap_s1);
    if constexpr (kTmaStore) ptx::prefetch_tensor_map(&tmap_out);
    if constexpr (kTmaStore && T::kSwiGLU)
      ptx::prefetch_tensor_map(&tmap_gate), ptx::prefetch_tensor_map(&tmap_up);
  }
  // NOTE: the last block-wide barrier: roles split below and may exit independently. Multicast kinds sync the
  // cluster instead: no CTA arrives on, or copies into, its peer before the peer's barriers are initialized.
  if constexpr (T::kMulticast) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }

  const int num_tasks = num_tasks_of<kGemm>(p);  // every thread reads the same 4 bytes: one load per warp
  const int num_k_blocks = num_k_blocks_of<kGemm>(p.k);  // kWeightGrad: per task (decode_task)
  if (threadIdx.x < kNumProducerThreads) {
    ptx::setmaxnreg_dec<T::kProducerRegs>();
    produce<kGemm>(&tmap_a, &tmap_a2, &tmap_b0, &tmap_b1, {&tmap_gate, &tmap_up}, land, p, smem, full, empty, ring,
                   num_tasks, num_k_blocks);
  } else {
    ptx::setmaxnreg_inc<T::kConsumerRegs>();
    consume<kGemm>(p, {&tmap_out, &tmap_gate, &tmap_up}, smem, full, empty, ring, num_tasks, num_k_blocks);
  }
  // Multicast kinds: no CTA exits while its peer may still arrive on its barriers (the last stages' releases).
  if constexpr (T::kMulticast) ptx::cluster_sync();
}

// ---- host launcher -------------------------------------------------------------------------------------
// Encodes the tensor maps, sizes the persistent grid (min(num_sms or the device's SM count, tasks)) and
// launches on `stream`. w_b0/w_b1: the weights, bf16 [num_experts, ·, ·] in their stored (nn.Linear)
// layout: [E, n, k] for K-major kinds (kDown passes one matrix twice), [E, k, n] for the MN-major ones
// (kDownDgrad: W_down twice; kGateUpDgrad: W_gate, W_up). A rows (p.a, p.a2: [num_rows, k]) get a map each.
// kWeightGrad: w_b0 = w_b1 = the B rows [num_rows, n], p.a = the A rows [num_rows, m], num_experts = E.
// MXFP8 kinds: w_b0/w_b1 are the E4M3 data [E, n, k] and `mx` their scales in the k-block layout
// [E, ceil(k / 64), n, 2] (mok.ops.gemm.mx_scales_by_k_block: one TMA box of 256 bytes per tile and k-block).

struct MxScales {
  const void *s0, *s1;  // of w_b0, w_b1
};

template <Gemm kGemm>
cudaError_t launch_grouped_gemm_bf16(const void* w_b0, const void* w_b1, int64_t num_experts, Params p,
                                     int num_sms, cudaStream_t stream, MxScales mx = {nullptr, nullptr}) {
  using T = Tile<kGemm>;
  constexpr bool kWeightGrad = kGemm == Gemm::kWeightGrad;
  p.num_m_tiles = static_cast<int>(ceil_div(kWeightGrad ? p.m : p.num_rows, BLOCK_M));
  p.num_n_tiles = static_cast<int>(ceil_div(p.n, T::kTaskN));
  const int64_t num_tasks = (kWeightGrad ? num_experts : 1) * static_cast<int64_t>(p.num_m_tiles) * p.num_n_tiles;
  if (num_tasks == 0) return cudaSuccess;
  if (num_tasks > INT32_MAX || p.num_rows % BLOCK_M != 0) return cudaErrorInvalidValue;
  if (T::kMxOut && p.n % mxfp8::kBlockSize != 0) return cudaErrorInvalidValue;
  p.num_tasks = static_cast<int>(num_tasks);
  CUtensorMap tmap_a{}, tmap_a2{}, tmap_b0, tmap_b1;
  cudaError_t err = cudaSuccess;
  if (kWeightGrad) {  // A rows [num_rows, m] read MN-major: dims (m, rows, 1), box (64, 64)
    if ((err = encode_rows_map(&tmap_a, p.a, 1, p.num_rows, p.m, 64, BLOCK_K))) return err;
  } else if (!T::kGather && (err = encode_rows_map(&tmap_a, p.a, 1, p.num_rows, p.k, BLOCK_K, BLOCK_M))) {
    return err;
  }
  if (kGemm == Gemm::kGateUpDgrad && (err = encode_rows_map(&tmap_a2, p.a2, 1, p.num_rows, p.k, BLOCK_K, BLOCK_M)))
    return err;
  CUtensorMap tmap_out{}, tmap_gate{}, tmap_up{};
  if constexpr (T::kFold && !T::kGather) {  // FoldMaps: A's rows (and a2's) in boxes of a tail's kFoldRows
    if ((err = encode_rows_map(&tmap_gate, p.a, 1, p.num_rows, p.k, BLOCK_K, kFoldRows))) return err;
    if (kGemm == Gemm::kGateUpDgrad && (err = encode_rows_map(&tmap_up, p.a2, 1, p.num_rows, p.k, BLOCK_K, kFoldRows)))
      return err;
  }
  // K-major: dims (k, n, E), box (64 k, 128 n). MN-major: dims (n, k, E), box (64 n, 64 k); kWeightGrad's B
  // rows: dims (n, rows, 1).
  const auto encode_b = [&](CUtensorMap* map, const void* w) {
    if (T::kMx)  // E4M3 rows of 64 bytes per box: dims (k, n, E), box (64, 128, 1), 64-byte swizzle
      return encode_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w, num_experts, p.n, p.k, BLOCK_K, BLOCK_N_B,
                        CU_TENSOR_MAP_SWIZZLE_64B);
    if (kWeightGrad) return encode_rows_map(map, w, 1, p.num_rows, p.n, 64, BLOCK_K);
    return T::kMajorMN ? encode_rows_map(map, w, num_experts, p.k, p.n, 64, BLOCK_K)
                       : encode_rows_map(map, w, num_experts, p.n, p.k, BLOCK_K, BLOCK_N_B);
  };
  if ((err = encode_b(&tmap_b0, w_b0)) || (err = encode_b(&tmap_b1, w_b1))) return err;
  CUtensorMap tmap_s0{}, tmap_s1{};
  if constexpr (T::kMx) {  // scales: dims (2n, k-blocks, E), box (256, 1, 1): a tile's 128 rows × 2 bytes
    const auto encode_s = [&](CUtensorMap* map, const void* scales) {
      return encode_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, scales, num_experts, ceil_div(p.k, BLOCK_K),
                        2 * p.n, 2 * BLOCK_N_B, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
    };
    if ((err = encode_s(&tmap_s0, mx.s0)) || (err = encode_s(&tmap_s1, mx.s1))) return err;
  }
  // TMA stores: boxes of one warp's 16 rows × 64 columns; the map's dims clip N tails and kWeightGrad's rows
  // past m (dims (n, m, E): never into the next expert's dW).
  if constexpr (kTmaStore) {
    const auto encode_out = [&](CUtensorMap* map, const void* out) {
      return kWeightGrad ? encode_rows_map(map, out, num_experts, p.m, p.n, kStoreBoxCols, kStoreBoxRows)
                         : encode_rows_map(map, out, 1, p.num_rows, p.n, kStoreBoxCols, kStoreBoxRows);
    };
    if ((err = encode_out(&tmap_out, p.out))) return err;
    // kGateUpMxOut: gate and up as E4M3, boxes of 16 rows × 128 bytes (one staging box, the same swizzle)
    const auto encode_e4m3 = [&](CUtensorMap* map, const void* data) {
      return encode_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, data, 1, p.num_rows, p.n, BLOCK_N_B, kStoreBoxRows,
                        CU_TENSOR_MAP_SWIZZLE_128B);
    };
    if (T::kMxOut && ((err = encode_e4m3(&tmap_gate, p.gate)) || (err = encode_e4m3(&tmap_up, p.up))))
      return err;
    if (T::kSwiGLU && !T::kMxOut &&
        ((err = encode_out(&tmap_gate, p.gate)) || (err = encode_out(&tmap_up, p.up))))
      return err;
  }
  const auto kernel = grouped_gemm_bf16_kernel<kGemm>;
  if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes))) return err;
  if (num_sms <= 0) {
    int device = 0;
    if ((err = cudaGetDevice(&device)) ||
        (err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device)))
      return err;
  }
  if constexpr (!T::kMulticast) {
    const int grid = static_cast<int>(num_tasks < num_sms ? num_tasks : num_sms);
    kernel<<<grid, kNumThreads, kSmemBytes, stream>>>(tmap_a, tmap_a2, tmap_b0, tmap_b1, tmap_s0, tmap_s1, tmap_out,
                                                      tmap_gate, tmap_up, p);
    return cudaGetLastError();
  } else {  // whole clusters: one per pair unit at most, no more than fit at once, at least one
    cudaLaunchConfig_t config{};
    config.blockDim = dim3(kNumThreads);
    config.dynamicSmemBytes = kSmemBytes;
    config.stream = stream;
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = kClusterSize;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    // NOTE: pairs of SMs come per GPC, so fewer than num_sms / 2 clusters may be resident; a persistent grid
    // larger than that would leave units to clusters that start only when others have finished.
    // Asked once per kind and process (one device: the level runs on the first Hopper GPU it is given).
    static int resident = 0;
    if (resident == 0) {
      config.gridDim = dim3(kClusterSize);  // the query wants a whole number of clusters; their count is the answer
      if ((err = cudaOccupancyMaxActiveClusters(&resident, kernel, &config))) return err;
    }
    const int64_t num_units = ceil_div(p.num_m_tiles, kClusterSize) * static_cast<int64_t>(p.num_n_tiles);
    const int64_t clusters = std::max<int64_t>(1, std::min<int64_t>({num_units, num_sms / kClusterSize, resident}));
    config.gridDim = dim3(static_cast<unsigned>(clusters * kClusterSize));
    return cudaLaunchKernelEx(&config, kernel, tmap_a, tmap_a2, tmap_b0, tmap_b1, tmap_s0, tmap_s1, tmap_out,
                              tmap_gate, tmap_up, p);
  }
}

}  // namespace mok::gemm
