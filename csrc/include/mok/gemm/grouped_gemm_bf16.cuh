// Grouped BF16 GEMMs over the route schedule (mok/schedule.py), sm_90a: persistent, warp-specialized,
// wgmma with fp32 accumulators in registers, weights by TMA, activation rows by TMA or gathered with
// 16-byte cp.async.
//
//   GEMM1 (kSwiGLU):  for every row r of the schedule, e = the tile's expert, t = row_to_token[r]:
//                     gate[r] = bf16(x[t]·Wg[e]ᵀ), up[r] = bf16(x[t]·Wu[e]ᵀ),
//                     h[r] = bf16(swiglu(gate[r], up[r]))  (fp32 SwiGLU of the rounded gate/up, as L0)
//                     padding rows (t = -1): zeros in h, gate and up.
//   GEMM2 (kStore):   out[r] = bf16(a[r]·W[e]ᵀ) (a plain grouped GEMM; A rows by TMA); padding rows: zeros.
//
// Task = one output tile: BLOCK_M = 128 rows (one expert) × kTaskN columns, over the full K in one CTA (no
// split-K: every output is one fp32 sum in a fixed order, bitwise identical for any grid size). CTA b
// takes tasks b, b + grid, b + 2·grid, ... in increasing order (m-major: neighbouring CTAs share A rows,
// and a wave covers few experts, so their weight tiles are read from HBM about once per wave).
//
// Roles (384 threads = 3 warpgroups): warpgroup 0 = producer (gives registers back), warpgroups 1 and 2 =
// consumers, each owning 64 of the tile's 128 rows (wgmma m64n128k16, two accumulators of 64 floats).
// Both roles walk the same (task, k-block) sequence through a ring of kNumStages shared-memory stages;
// stage s is handed over with two mbarriers:
//   full[s]:  gathered A: 128 arrivals (cp.async.mbarrier.arrive.noinc of every producer thread: fires when
//             that thread's copies have landed) + 1 arrive.expect_tx (B bytes);
//             A by TMA: 1 arrive.expect_tx (A + B bytes).
//   empty[s]: 8 arrivals = lane 0 of each consumer warp, once its wgmmas reading s have completed.
// The consumers keep one wgmma group in flight: k-block kb's MMAs run while kb - 1's stage is released.
//
// Stage layout (bytes; every tile 1024-aligned): [A 128×128][B0 128×128][B1 128×128], 48 KiB.
//   GEMM1: B0 = Wg[e] rows n0..n0+127, B1 = Wu[e] rows n0..n0+127 (gate and up of the same columns, so the
//          epilogue holds both in registers);  GEMM2: B0/B1 = W[e] rows n0..n0+127 / n0+128..n0+255.
#pragma once

#include <cuda_bf16.h>

#include "mok/gemm/ptx.cuh"
#include "mok/gemm/tensor_map.cuh"

namespace mok::gemm {

// ---- tiling -------------------------------------------------------------------------------------------

constexpr int kNumConsumerGroups = 2;              // consumer warpgroups
constexpr int WG_M = 64;                           // rows per consumer warpgroup: one m64 wgmma
constexpr int BLOCK_M = kNumConsumerGroups * WG_M;  // rows per task
constexpr int BLOCK_K = 64;                        // k per stage: 64 bf16 = 128 bytes = one swizzled row
constexpr int BLOCK_N_B = 128;                     // rows of each B tile = n of each wgmma
constexpr int kNumStages = 4;                      // shared-memory ring depth
constexpr int kWarpgroup = 128;
constexpr int kNumProducerThreads = kWarpgroup;
constexpr int kNumThreads = kWarpgroup * (1 + kNumConsumerGroups);
constexpr int kNumConsumerWarps = kNumConsumerGroups * kWarpgroup / kWarpSize;
constexpr int kProducerRegs = 56, kConsumerRegs = 224;  // setmaxnreg budgets: 128·56 + 256·224 <= 64 Ki
constexpr int kRowBytes = BLOCK_K * 2;
constexpr uint32_t kATileBytes = BLOCK_M * kRowBytes;    // 16 KiB
constexpr uint32_t kBTileBytes = BLOCK_N_B * kRowBytes;  // 16 KiB
constexpr uint32_t kStageBytes = kATileBytes + 2 * kBTileBytes;
// Epilogue staging: each consumer warp owns 16 rows × 128 bf16 columns (4 KiB), 16-byte chunks swizzled.
constexpr uint32_t kStagingBytesPerWarp = 16 * BLOCK_N_B * 2;
constexpr uint32_t kStagingBytes = kNumConsumerWarps * kStagingBytesPerWarp;
constexpr uint32_t kSmemBytes =
    kNumStages * kStageBytes + kStagingBytes + 2 * kNumStages * 8 + ptx::kSw128AtomBytes;

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
static_assert(kNumProducerThreads * kProducerRegs + kNumConsumerGroups * kWarpgroup * kConsumerRegs <= 65536 &&
                  kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0,
              "the register budgets fit the register file (setmaxnreg takes multiples of 8)");
static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KiB of shared memory an sm_90 block may use");
static_assert(BLOCK_N_B * 2 == 16 * 16, "a staging row is 16 chunks of 16 bytes; 16 lanes store one row");

// ---- the 128-byte swizzle ------------------------------------------------------------------------------
// Shared-memory byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a tile of 128-byte rows:
// rows are contiguous, and inside each 1024-byte atom of 8 rows the chunk index is XORed with the row
// index mod 8. This is what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and what a wgmma descriptor of
// layout "128B swizzle" reads: on the byte offset o, bits [4:6] ^= bits [7:9].

MOK_HOST_DEVICE constexpr uint32_t sw128_offset(uint32_t row, uint32_t chunk) {
  return row * 128 + ((chunk ^ (row % 8)) << 4);
}

constexpr bool sw128_is_the_address_xor() {
  for (uint32_t row = 0; row < BLOCK_M; ++row)
    for (uint32_t chunk = 0; chunk < 8; ++chunk) {
      const uint32_t o = row * 128 + chunk * 16;
      if (sw128_offset(row, chunk) != (o ^ (((o >> 7) & 7) << 4))) return false;
    }
  return true;
}
static_assert(sw128_is_the_address_xor(), "sw128_offset is the 128B swizzle: bits [4:6] ^= bits [7:9]");
static_assert(sw128_offset(9, 3) == 9 * 128 + 2 * 16, "row 9 is row 1 of its atom: chunk 3 lands in slot 2");

// ---- parameters ----------------------------------------------------------------------------------------

enum class Epilogue { kSwiGLU, kStore };

struct Params {
  const uint16_t* a;               // GEMM1: x [num_tokens, k], gathered; GEMM2: a_rows [num_rows, k], by TMA
  const int32_t* row_to_token;     // [num_rows], -1 = padding (GEMM1 gathers through it)
  const int32_t* tile_to_expert;   // [num_rows / BLOCK_M]
  uint16_t* out;                   // GEMM1: h; GEMM2: out. [num_rows, n] bf16
  uint16_t* gate;                  // GEMM1 only: [num_rows, n]
  uint16_t* up;                    // GEMM1 only: [num_rows, n]
  int num_rows;                    // a multiple of BLOCK_M
  int n;                           // output columns (intermediate for GEMM1, hidden for GEMM2), % 8 == 0
  int k;                           // reduction length, % 8 == 0
  int num_n_tiles;                 // ceil(n / kTaskN)
  float swiglu_limit;              // used when has_limit
  int has_limit;
};

template <Epilogue kEpilogue>
struct Tile {
  static constexpr bool kGather = kEpilogue == Epilogue::kSwiGLU;  // A gathered by cp.async, else by TMA
  static constexpr int kTaskN = kEpilogue == Epilogue::kSwiGLU ? BLOCK_N_B : 2 * BLOCK_N_B;  // columns
  static constexpr int kB1RowOffset = kEpilogue == Epilogue::kSwiGLU ? 0 : BLOCK_N_B;  // B1 rows vs B0
  static constexpr uint32_t kFullArrivals = kGather ? kNumProducerThreads + 1 : 1;
  static constexpr uint32_t kTmaBytes = (kGather ? 0 : kATileBytes) + 2 * kBTileBytes;
};

MOK_DEVICE uint8_t* stage_a(uint8_t* smem, uint32_t stage) { return smem + stage * kStageBytes; }
MOK_DEVICE uint8_t* stage_b(uint8_t* smem, uint32_t stage, int which) {  // which: 0 = B0, 1 = B1
  return smem + stage * kStageBytes + kATileBytes + which * kBTileBytes;
}

// ---- producer: warpgroup 0 -----------------------------------------------------------------------------

// Lane 0 of warp 0: the tensor-map loads of one stage (B0, B1, and A unless it is gathered).
template <Epilogue kEpilogue>
MOK_DEVICE void issue_tma(const CUtensorMap* tmap_a, const CUtensorMap* tmap_b0, const CUtensorMap* tmap_b1,
                          uint8_t* smem, uint64_t* bar, uint32_t stage, int m_tile, int n0, int expert, int kb) {
  using T = Tile<kEpilogue>;
  ptx::mbarrier_arrive_expect_tx(bar, T::kTmaBytes);
  if constexpr (!T::kGather) ptx::tma_load_3d(stage_a(smem, stage), tmap_a, kb * BLOCK_K, m_tile * BLOCK_M, 0, bar);
  ptx::tma_load_3d(stage_b(smem, stage, 0), tmap_b0, kb * BLOCK_K, n0, expert, bar);
  ptx::tma_load_3d(stage_b(smem, stage, 1), tmap_b1, kb * BLOCK_K, n0 + T::kB1RowOffset, expert, bar);
}

template <Epilogue kEpilogue>
MOK_DEVICE void produce(const CUtensorMap* tmap_a, const CUtensorMap* tmap_b0, const CUtensorMap* tmap_b1,
                        const Params& p, uint8_t* smem, uint64_t* full, uint64_t* empty, int num_tasks,
                        int num_k_blocks) {
  using T = Tile<kEpilogue>;
  const uint32_t thread = threadIdx.x;  // 0..127
  if (!T::kGather && thread != 0) return;  // TMA only: one thread issues everything
  const uint32_t chunk = thread % kChunksPerRow;
  const uint32_t row_in_tile = thread / kChunksPerRow;
  uint32_t it = 0;  // position in the (task, k-block) sequence, shared with the consumers
  for (int task = blockIdx.x; task < num_tasks; task += gridDim.x) {
    const int m_tile = task / p.num_n_tiles, n_tile = task % p.num_n_tiles;
    const int expert = p.tile_to_expert[m_tile];
    const int n0 = n_tile * T::kTaskN;
    int32_t token[kRowsPerThread];  // source row of each of this thread's A rows, -1 = zero row
    if constexpr (T::kGather) {
#pragma unroll
      for (int j = 0; j < kRowsPerThread; ++j)
        token[j] = p.row_to_token[m_tile * BLOCK_M + row_in_tile + kRowStride * j];
    }
    for (int kb = 0; kb < num_k_blocks; ++kb, ++it) {
      const uint32_t stage = it % kNumStages, phase = (it / kNumStages) & 1;
      ptx::mbarrier_wait_parity(&empty[stage], phase ^ 1);  // the slot is free
      if (thread == 0)
        issue_tma<kEpilogue>(tmap_a, tmap_b0, tmap_b1, smem, &full[stage], stage, m_tile, n0, expert, kb);
      if constexpr (T::kGather) {
        uint8_t* a_tile = stage_a(smem, stage);
        const int col = kb * BLOCK_K + static_cast<int>(chunk) * 8;  // first element of this thread's chunk
#pragma unroll
        for (int j = 0; j < kRowsPerThread; ++j) {
          const bool real = token[j] >= 0 && col < p.k;  // k % 8 == 0: a chunk is all in or all out
          const uint16_t* src = real ? p.a + static_cast<int64_t>(token[j]) * p.k + col : p.a;
          ptx::cp_async_16_zfill(a_tile + sw128_offset(row_in_tile + kRowStride * j, chunk), src, real ? 16 : 0);
        }
        ptx::cp_async_mbarrier_arrive_noinc(&full[stage]);
      }
    }
  }
  if constexpr (T::kGather) ptx::cp_async_wait_all();  // NOTE: no copies in flight behind an exited thread
}

// ---- epilogues: registers -> shared memory -> global --------------------------------------------------

constexpr int kAccPerThread = WG_M * BLOCK_N_B / kWarpgroup;  // 64 fp32 per accumulator

// Epilogue through shared memory: a warp's fragment of one 128-column accumulator (16 rows × 128 columns,
// thread (lane l) holding rows l/4 and l/4 + 8, columns 8i + 2(l%4) + {0, 1}, i in [0, 16)) goes to its
// staging area with stmatrix, then back out as 16-byte chunks, 16 lanes per 256-byte row: full-line global
// stores instead of 4-byte ones scattered over 8 rows. Chunk c of staging row r sits at slot c ^ (r % 8)
// (bank-conflict free both ways).
MOK_DEVICE uint32_t staging_offset(uint32_t row, uint32_t chunk) { return row * 256 + ((chunk ^ (row % 8)) << 4); }

// values(i, h) -> the bf16x2 word of column pair i, row half h (h = 0: row l/4, h = 1: row l/4 + 8).
// Writes columns [col0, col0 + 128) of rows row0 .. row0 + 15 of `out` (row stride n); columns >= n skipped.
template <typename Values>
MOK_DEVICE void store_tile(uint8_t* staging, uint16_t* out, int row0, int col0, int n, uint32_t lane, Values values) {
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
    if (col < n) st_v4(out + static_cast<int64_t>(row0 + row) * n + col, v);  // n % 8 == 0: all in or out
  }
  __syncwarp();  // the staging area is reused by the next call
}

MOK_DEVICE float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

MOK_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

// L0's swiglu (mok.reference.swiglu) on bf16-exact inputs, in fp32: g = min(g, L), u = clamp(u, -L, L)
// (NaN passes through, as torch.clamp), then silu(g)·u = (g·sigmoid(g))·u with IEEE expf and division.
MOK_DEVICE float swiglu(float g, float u, float limit, bool has_limit) {
  if (has_limit) {
    g = g > limit ? limit : g;
    u = u < -limit ? -limit : u;
    u = u > limit ? limit : u;
  }
  const float sigmoid = 1.0f / (1.0f + expf(-g));
  return g * sigmoid * u;
}

// GEMM1: gate, up (rounded) and h = swiglu(gate, up); padding rows are zeros whatever the weights hold
// (0·Inf would be NaN). `real[h]`: whether row half h is a real route.
MOK_DEVICE void store_swiglu(float (&acc_gate)[kAccPerThread], float (&acc_up)[kAccPerThread], const Params& p,
                             uint8_t* staging, int row0, int n0, uint32_t lane) {
  const bool real[2] = {p.row_to_token[row0 + lane / 4] >= 0, p.row_to_token[row0 + lane / 4 + 8] >= 0};
  store_tile(staging, p.gate, row0, n0, p.n, lane, [&](int i, int h) {
    return real[h] ? pack_bf16x2(acc_gate[4 * i + 2 * h], acc_gate[4 * i + 2 * h + 1]) : 0u;
  });
  store_tile(staging, p.up, row0, n0, p.n, lane, [&](int i, int h) {
    return real[h] ? pack_bf16x2(acc_up[4 * i + 2 * h], acc_up[4 * i + 2 * h + 1]) : 0u;
  });
  const bool has_limit = p.has_limit != 0;
  store_tile(staging, p.out, row0, n0, p.n, lane, [&](int i, int h) {
    const int a = 4 * i + 2 * h;
    const float h0 = swiglu(round_bf16(acc_gate[a]), round_bf16(acc_up[a]), p.swiglu_limit, has_limit);
    const float h1 = swiglu(round_bf16(acc_gate[a + 1]), round_bf16(acc_up[a + 1]), p.swiglu_limit, has_limit);
    return real[h] ? pack_bf16x2(h0, h1) : 0u;
  });
}

// GEMM2: columns n0.. from acc0, n0 + 128.. from acc1; padding rows are zeros.
MOK_DEVICE void store_pair(float (&acc0)[kAccPerThread], float (&acc1)[kAccPerThread], const Params& p,
                           uint8_t* staging, int row0, int n0, uint32_t lane) {
  const bool real[2] = {p.row_to_token[row0 + lane / 4] >= 0, p.row_to_token[row0 + lane / 4 + 8] >= 0};
  store_tile(staging, p.out, row0, n0, p.n, lane, [&](int i, int h) {
    return real[h] ? pack_bf16x2(acc0[4 * i + 2 * h], acc0[4 * i + 2 * h + 1]) : 0u;
  });
  if (n0 + BLOCK_N_B < p.n)
    store_tile(staging, p.out, row0, n0 + BLOCK_N_B, p.n, lane, [&](int i, int h) {
      return real[h] ? pack_bf16x2(acc1[4 * i + 2 * h], acc1[4 * i + 2 * h + 1]) : 0u;
    });
}

// ---- consumers: warpgroups 1 and 2 ---------------------------------------------------------------------

MOK_DEVICE void fence_accumulators(float (&acc0)[kAccPerThread], float (&acc1)[kAccPerThread]) {
#pragma unroll
  for (int i = 0; i < kAccPerThread; ++i) ptx::fence_operand(acc0[i]), ptx::fence_operand(acc1[i]);
}

// The mainloop of one task: k-block by k-block, wait for the stage, 4 k16 steps × 2 wgmmas, keep one
// group in flight and release the previous stage. Returns the position in the stage sequence after it.
template <bool kGather>
MOK_DEVICE uint32_t mma_k_blocks(float (&acc0)[kAccPerThread], float (&acc1)[kAccPerThread], uint8_t* smem,
                                 uint32_t a_offset, uint64_t* full, uint64_t* empty, uint32_t it, int num_k_blocks,
                                 uint32_t lane) {
  uint32_t prev_stage = 0;
  for (int kb = 0; kb < num_k_blocks; ++kb, ++it) {
    const uint32_t stage = it % kNumStages, phase = (it / kNumStages) & 1;
    ptx::mbarrier_wait_parity(&full[stage], phase);  // A and B have landed
    // A gathered by cp.async (generic proxy) is read by wgmma through the async proxy.
    if constexpr (kGather) ptx::fence_proxy_async_shared();
    const uint64_t desc_a = ptx::smem_desc_sw128(stage_a(smem, stage) + a_offset);
    const uint64_t desc_b0 = ptx::smem_desc_sw128(stage_b(smem, stage, 0));
    const uint64_t desc_b1 = ptx::smem_desc_sw128(stage_b(smem, stage, 1));
    fence_accumulators(acc0, acc1);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_K / 16; ++kk) {  // k16 slice kk starts 32·kk bytes into each row
      ptx::wgmma_m64n128k16_bf16(acc0, ptx::desc_advance(desc_a, 32 * kk), ptx::desc_advance(desc_b0, 32 * kk));
      ptx::wgmma_m64n128k16_bf16(acc1, ptx::desc_advance(desc_a, 32 * kk), ptx::desc_advance(desc_b1, 32 * kk));
    }
    ptx::wgmma_commit_group();
    ptx::wgmma_wait_group<1>();  // k-block kb - 1's MMAs are done: its stage can be refilled
    fence_accumulators(acc0, acc1);
    if (kb > 0 && lane == 0) ptx::mbarrier_arrive(&empty[prev_stage]);
    prev_stage = stage;
  }
  ptx::wgmma_wait_group<0>();
  fence_accumulators(acc0, acc1);
  if (num_k_blocks > 0 && lane == 0) ptx::mbarrier_arrive(&empty[prev_stage]);
  return it;
}

template <Epilogue kEpilogue>
MOK_DEVICE void consume(const Params& p, uint8_t* smem, uint64_t* full, uint64_t* empty, int num_tasks,
                        int num_k_blocks) {
  using T = Tile<kEpilogue>;
  const uint32_t group = threadIdx.x / kWarpgroup - 1;  // 0 or 1: which 64 rows of the tile
  const uint32_t warp = (threadIdx.x % kWarpgroup) / kWarpSize;
  const uint32_t lane = lane_id();
  const uint32_t a_offset = group * WG_M * kRowBytes;  // this warpgroup's rows of the A tile
  uint8_t* staging = smem + kNumStages * kStageBytes + (threadIdx.x / kWarpSize - kNumProducerThreads / kWarpSize) *
                                                          kStagingBytesPerWarp;
  uint32_t it = 0;
  for (int task = blockIdx.x; task < num_tasks; task += gridDim.x) {
    const int m_tile = task / p.num_n_tiles, n_tile = task % p.num_n_tiles;
    float acc0[kAccPerThread], acc1[kAccPerThread];  // GEMM1: gate, up; GEMM2: columns n0.., n0+128..
#pragma unroll
    for (int i = 0; i < kAccPerThread; ++i) acc0[i] = 0.0f, acc1[i] = 0.0f;

    // NOTE: skipping the MMAs of a 64-row half that is all padding measured 5-10% slower for GEMM1 on
    // the H200 (and no better for GEMM2), so every warpgroup multiplies; padding rows are zeroed on store.
    it = mma_k_blocks<T::kGather>(acc0, acc1, smem, a_offset, full, empty, it, num_k_blocks, lane);
    const int group_row0 = m_tile * BLOCK_M + group * WG_M;

    const int row0 = group_row0 + 16 * warp;  // this warp's 16 rows
    const int n0 = n_tile * T::kTaskN;
    if constexpr (kEpilogue == Epilogue::kSwiGLU) {
      store_swiglu(acc0, acc1, p, staging, row0, n0, lane);
    } else {
      store_pair(acc0, acc1, p, staging, row0, n0, lane);
    }
  }
}

// ---- the kernel ----------------------------------------------------------------------------------------

template <Epilogue kEpilogue>
__global__ void __launch_bounds__(kNumThreads, 1)
    grouped_gemm_bf16_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b0,
                             const __grid_constant__ CUtensorMap tmap_b1, const Params p) {
  using T = Tile<kEpilogue>;
  extern __shared__ uint8_t smem_raw[];
  // Dynamic shared memory is only 16-byte aligned for sure; the swizzle atoms need 1024 (kSmemBytes has
  // the slack).
  uint8_t* smem = smem_raw + (ptx::kSw128AtomBytes - ptx::smem_addr(smem_raw) % ptx::kSw128AtomBytes) %
                                 ptx::kSw128AtomBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kNumStages * kStageBytes);  // [kNumStages]
  uint64_t* empty = full + kNumStages;                                             // [kNumStages]

  if (threadIdx.x == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      ptx::mbarrier_init(&full[s], T::kFullArrivals);
      ptx::mbarrier_init(&empty[s], kNumConsumerWarps);
    }
    ptx::fence_mbarrier_init();
    if constexpr (!T::kGather) ptx::prefetch_tensor_map(&tmap_a);
    ptx::prefetch_tensor_map(&tmap_b0);
    ptx::prefetch_tensor_map(&tmap_b1);
  }
  __syncthreads();  // NOTE: the last block-wide barrier: roles split below and may exit independently

  const int num_tasks = (p.num_rows / BLOCK_M) * p.num_n_tiles;
  const int num_k_blocks = static_cast<int>(ceil_div(p.k, BLOCK_K));
  if (threadIdx.x < kNumProducerThreads) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    produce<kEpilogue>(&tmap_a, &tmap_b0, &tmap_b1, p, smem, full, empty, num_tasks, num_k_blocks);
  } else {
    ptx::setmaxnreg_inc<kConsumerRegs>();
    consume<kEpilogue>(p, smem, full, empty, num_tasks, num_k_blocks);
  }
}

// ---- host launcher -------------------------------------------------------------------------------------
// Encodes the tensor maps, sizes the persistent grid (min(num_sms or the device's SM count, tasks)) and
// launches on `stream`. w_b0/w_b1: bf16 [num_experts, n, k] (GEMM2 passes the same matrix twice); GEMM2's
// A rows (p.a, [num_rows, k]) get a 2D map.

template <Epilogue kEpilogue>
cudaError_t launch_grouped_gemm_bf16(const void* w_b0, const void* w_b1, int64_t num_experts, Params p,
                                     int num_sms, cudaStream_t stream) {
  p.num_n_tiles = static_cast<int>(ceil_div(p.n, Tile<kEpilogue>::kTaskN));
  const int64_t num_tasks = static_cast<int64_t>(p.num_rows / BLOCK_M) * p.num_n_tiles;
  if (num_tasks == 0) return cudaSuccess;
  if (num_tasks > INT32_MAX || p.num_rows % BLOCK_M != 0) return cudaErrorInvalidValue;
  CUtensorMap tmap_a{}, tmap_b0, tmap_b1;
  cudaError_t err;
  if (!Tile<kEpilogue>::kGather && (err = encode_rows_map(&tmap_a, p.a, 1, p.num_rows, p.k, BLOCK_K, BLOCK_M)))
    return err;
  if ((err = encode_rows_map(&tmap_b0, w_b0, num_experts, p.n, p.k, BLOCK_K, BLOCK_N_B)) ||
      (err = encode_rows_map(&tmap_b1, w_b1, num_experts, p.n, p.k, BLOCK_K, BLOCK_N_B)))
    return err;
  const auto kernel = grouped_gemm_bf16_kernel<kEpilogue>;
  if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes))) return err;
  if (num_sms <= 0) {
    int device = 0;
    if ((err = cudaGetDevice(&device)) || (err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device)))
      return err;
  }
  const int grid = static_cast<int>(num_tasks < num_sms ? num_tasks : num_sms);
  kernel<<<grid, kNumThreads, kSmemBytes, stream>>>(tmap_a, tmap_b0, tmap_b1, p);
  return cudaGetLastError();
}

}  // namespace mok::gemm
