// Grouped BF16 GEMMs over the route schedule (mok/schedule.py), sm_90a: persistent, warp-specialized,
// wgmma with fp32 accumulators in registers, weights by TMA, activation rows by 16-byte cp.async.
//
//   GEMM1 (kSwiGLU):  for every row r of the schedule, e = the tile's expert, t = row_to_token[r]:
//                     gate[r] = bf16(x[t]·Wg[e]ᵀ), up[r] = bf16(x[t]·Wu[e]ᵀ),
//                     h[r] = bf16(swiglu(gate[r], up[r]))  (fp32 SwiGLU of the rounded gate/up, as L0)
//                     padding rows (t = -1): zeros in h, gate and up.
//   GEMM2 (kStore):   out[r] = bf16(a[r]·W[e]ᵀ) for every row (a plain grouped GEMM, no gather).
//
// Task = one output tile: BLOCK_M rows (one expert) × kTaskN columns, over the full K in one CTA (no
// split-K: every output is one fp32 sum in a fixed order, bitwise identical for any grid size). CTA b
// takes tasks b, b + grid, b + 2·grid, ... in increasing order (m-major: neighbouring CTAs share A rows).
//
// Roles (256 threads): warpgroup 0 = producer (warp 0 issues every load; warps 1-3 exit at once),
// warpgroup 1 = consumer (the wgmmas and the epilogue). Both walk the same (task, k-block) sequence
// through a ring of kNumStages shared-memory stages; stage s is handed over with two mbarriers:
//   full[s]:  33 arrivals = 32 producer lanes (cp.async.mbarrier.arrive.noinc: fires when that lane's
//             copies have landed) + 1 arrive.expect_tx (lane 0), plus the two TMA tiles' bytes.
//   empty[s]: 4 arrivals = lane 0 of each consumer warp, after its wgmmas reading s have completed.
//
// Stage layout (bytes; every tile 1024-aligned): [A 64×128][B0 64×128][B1 64×128], 24 KiB.
//   GEMM1: B0 = Wg[e] rows n0..n0+63, B1 = Wu[e] rows n0..n0+63 (gate and up of the same columns, so the
//          epilogue holds both in registers);  GEMM2: B0/B1 = W[e] rows n0..n0+63 / n0+64..n0+127.
#pragma once

#include <cuda_bf16.h>

#include "mok/gemm/ptx.cuh"
#include "mok/gemm/tensor_map.cuh"

namespace mok::gemm {

// ---- tiling -------------------------------------------------------------------------------------------

constexpr int BLOCK_M = 64;             // rows per task: one m64 wgmma
constexpr int BLOCK_K = 64;             // k per stage: 64 bf16 = 128 bytes = one swizzled row
constexpr int BLOCK_N_B = 64;           // rows of each B tile = n of each wgmma
constexpr int kNumStages = 4;           // shared-memory ring depth
constexpr int kNumProducerThreads = 128;
constexpr int kNumConsumerThreads = 128;
constexpr int kNumThreads = kNumProducerThreads + kNumConsumerThreads;
constexpr int kNumConsumerWarps = kNumConsumerThreads / kWarpSize;
constexpr int kRowBytes = BLOCK_K * 2;
constexpr uint32_t kTileBytes = BLOCK_M * kRowBytes;  // 8 KiB
constexpr uint32_t kStageBytes = 3 * kTileBytes;       // A, B0, B1
constexpr uint32_t kFullArrivals = kWarpSize + 1;      // 32 cp.async lanes + the expect_tx arrival
constexpr uint32_t kSmemBytes = kNumStages * kStageBytes + 2 * kNumStages * 8 + ptx::kSw128AtomBytes;

// The producer warp copies an A tile as 64 rows × 8 chunks of 16 bytes: lane l copies chunk l % 8 of
// rows l / 8 + 4j, j in [0, 16) (8 lanes read one row's 128 contiguous bytes).
constexpr int kChunksPerRow = kRowBytes / 16;
constexpr int kRowsPerLane = BLOCK_M * kChunksPerRow / kWarpSize;
constexpr int kRowStride = kWarpSize / kChunksPerRow;

static_assert(kRowBytes == 128, "one tile row is one 128-byte swizzle row: BLOCK_K = 64 bf16");
static_assert(BLOCK_M == 64 && BLOCK_N_B == 64, "one m64n64k16 wgmma per B tile and k16 step");
static_assert(BLOCK_M == BLOCK_N_B, "A and B tiles share one shape, so one tile size and one descriptor kind");
static_assert(BLOCK_M % 8 == 0 && kTileBytes % ptx::kSw128AtomBytes == 0, "tiles are whole 8-row atoms");
static_assert(kStageBytes % ptx::kSw128AtomBytes == 0, "every stage and tile starts 1024-byte aligned");
static_assert(kRowsPerLane * kRowStride == BLOCK_M && kRowStride * kChunksPerRow == kWarpSize,
              "the producer warp covers every (row, chunk) of an A tile exactly once");
static_assert(kNumProducerThreads % 128 == 0 && kNumConsumerThreads == 128,
              "the consumer is one whole warpgroup starting at a warp index divisible by 4");
static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KiB of shared memory an sm_90 block may use");

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
  const uint16_t* a;               // GEMM1: x [num_tokens, k]; GEMM2: a_rows [num_rows, k] (bf16 bits)
  const int32_t* row_to_token;     // [num_rows], -1 = padding; nullptr: row r reads a[r] (GEMM2)
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
  static constexpr int kTaskN = kEpilogue == Epilogue::kSwiGLU ? BLOCK_N_B : 2 * BLOCK_N_B;  // columns
  static constexpr int kB1RowOffset = kEpilogue == Epilogue::kSwiGLU ? 0 : BLOCK_N_B;  // B1 rows vs B0
};

MOK_DEVICE uint8_t* stage_tile(uint8_t* smem, uint32_t stage, int which) {
  return smem + stage * kStageBytes + which * kTileBytes;  // which: 0 = A, 1 = B0, 2 = B1
}

// ---- producer: warp 0 ----------------------------------------------------------------------------------

template <Epilogue kEpilogue>
MOK_DEVICE void produce(const CUtensorMap* tmap_b0, const CUtensorMap* tmap_b1, const Params& p,
                        uint8_t* smem, uint64_t* full, uint64_t* empty, int num_tasks, int num_k_blocks) {
  const uint32_t lane = lane_id();
  const uint32_t chunk = lane % kChunksPerRow;
  const uint32_t row_lane = lane / kChunksPerRow;
  uint32_t it = 0;  // position in the (task, k-block) sequence, shared with the consumer
  for (int task = blockIdx.x; task < num_tasks; task += gridDim.x) {
    const int m_tile = task / p.num_n_tiles, n_tile = task % p.num_n_tiles;
    const int expert = p.tile_to_expert[m_tile];
    const int n0 = n_tile * Tile<kEpilogue>::kTaskN;
    int32_t token[kRowsPerLane];  // source row of each of this lane's A rows, -1 = zero row
#pragma unroll
    for (int j = 0; j < kRowsPerLane; ++j) {
      const int row = m_tile * BLOCK_M + row_lane + kRowStride * j;
      token[j] = p.row_to_token != nullptr ? p.row_to_token[row] : row;
    }
    for (int kb = 0; kb < num_k_blocks; ++kb, ++it) {
      const uint32_t stage = it % kNumStages, phase = (it / kNumStages) & 1;
      ptx::mbarrier_wait_parity(&empty[stage], phase ^ 1);  // the slot is free
      if (lane == 0) {
        ptx::mbarrier_arrive_expect_tx(&full[stage], 2 * kTileBytes);
        ptx::tma_load_3d(stage_tile(smem, stage, 1), tmap_b0, kb * BLOCK_K, n0, expert, &full[stage]);
        ptx::tma_load_3d(stage_tile(smem, stage, 2), tmap_b1, kb * BLOCK_K,
                         n0 + Tile<kEpilogue>::kB1RowOffset, expert, &full[stage]);
      }
      uint8_t* a_tile = stage_tile(smem, stage, 0);
      const int col = kb * BLOCK_K + static_cast<int>(chunk) * 8;  // first element of this lane's chunk
#pragma unroll
      for (int j = 0; j < kRowsPerLane; ++j) {
        const bool real = token[j] >= 0 && col < p.k;  // k % 8 == 0: a chunk is all in or all out
        const uint16_t* src = real ? p.a + static_cast<int64_t>(token[j]) * p.k + col : p.a;
        ptx::cp_async_16_zfill(a_tile + sw128_offset(row_lane + kRowStride * j, chunk), src, real ? 16 : 0);
      }
      ptx::cp_async_mbarrier_arrive_noinc(&full[stage]);
    }
  }
  ptx::cp_async_wait_all();  // NOTE: do not leave copies in flight behind an exited thread
}

// ---- epilogues: registers -> global, bf16 pairs --------------------------------------------------------

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

// Thread (warp w, lane l) of the consumer warpgroup holds rows 16w + l/4 (+8) and, per i in [0, 8),
// columns 8i + 2(l%4) + {0, 1} of each 64-column accumulator (see ptx::wgmma_m64n64k16_bf16).
MOK_DEVICE void store_swiglu(const float (&acc_gate)[32], const float (&acc_up)[32], const Params& p,
                             int m_tile, int n0, uint32_t warp, uint32_t lane) {
  const bool has_limit = p.has_limit != 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m_tile * BLOCK_M + 16 * warp + lane / 4 + 8 * h;
    const bool real = p.row_to_token[row] >= 0;
    const int64_t base = static_cast<int64_t>(row) * p.n;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int col = n0 + 8 * i + 2 * static_cast<int>(lane % 4);
      if (col >= p.n) continue;  // n % 8 == 0: a pair is all in or all out
      const float g0 = round_bf16(acc_gate[4 * i + 2 * h]), g1 = round_bf16(acc_gate[4 * i + 2 * h + 1]);
      const float u0 = round_bf16(acc_up[4 * i + 2 * h]), u1 = round_bf16(acc_up[4 * i + 2 * h + 1]);
      const float h0 = swiglu(g0, u0, p.swiglu_limit, has_limit), h1 = swiglu(g1, u1, p.swiglu_limit, has_limit);
      // Padding rows: zeros whatever the weights hold (0·Inf would be NaN).
      *reinterpret_cast<uint32_t*>(p.gate + base + col) = real ? pack_bf16x2(g0, g1) : 0u;
      *reinterpret_cast<uint32_t*>(p.up + base + col) = real ? pack_bf16x2(u0, u1) : 0u;
      *reinterpret_cast<uint32_t*>(p.out + base + col) = real ? pack_bf16x2(h0, h1) : 0u;
    }
  }
}

MOK_DEVICE void store_pair(const float (&acc0)[32], const float (&acc1)[32], const Params& p, int m_tile, int n0,
                           uint32_t warp, uint32_t lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m_tile * BLOCK_M + 16 * warp + lane / 4 + 8 * h;
    const int64_t base = static_cast<int64_t>(row) * p.n;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int col = n0 + 8 * i + 2 * static_cast<int>(lane % 4);
      if (col < p.n)
        *reinterpret_cast<uint32_t*>(p.out + base + col) = pack_bf16x2(acc0[4 * i + 2 * h], acc0[4 * i + 2 * h + 1]);
      if (col + BLOCK_N_B < p.n)
        *reinterpret_cast<uint32_t*>(p.out + base + col + BLOCK_N_B) =
            pack_bf16x2(acc1[4 * i + 2 * h], acc1[4 * i + 2 * h + 1]);
    }
  }
}

// ---- consumer: warpgroup 1 -----------------------------------------------------------------------------

MOK_DEVICE void fence_accumulators(float (&acc0)[32], float (&acc1)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) ptx::fence_operand(acc0[i]), ptx::fence_operand(acc1[i]);
}

template <Epilogue kEpilogue>
MOK_DEVICE void consume(const Params& p, uint8_t* smem, uint64_t* full, uint64_t* empty, int num_tasks,
                        int num_k_blocks) {
  const uint32_t warp = (threadIdx.x - kNumProducerThreads) / kWarpSize;
  const uint32_t lane = lane_id();
  uint32_t it = 0;
  for (int task = blockIdx.x; task < num_tasks; task += gridDim.x) {
    const int m_tile = task / p.num_n_tiles, n_tile = task % p.num_n_tiles;
    float acc0[32], acc1[32];  // GEMM1: gate, up; GEMM2: columns n0.., n0+64..
#pragma unroll
    for (int i = 0; i < 32; ++i) acc0[i] = 0.0f, acc1[i] = 0.0f;

    for (int kb = 0; kb < num_k_blocks; ++kb, ++it) {
      const uint32_t stage = it % kNumStages, phase = (it / kNumStages) & 1;
      ptx::mbarrier_wait_parity(&full[stage], phase);  // A and B have landed
      // The A tile was written by cp.async (generic proxy); wgmma reads it through the async proxy.
      ptx::fence_proxy_async_shared();
      const uint64_t desc_a = ptx::smem_desc_sw128(stage_tile(smem, stage, 0));
      const uint64_t desc_b0 = ptx::smem_desc_sw128(stage_tile(smem, stage, 1));
      const uint64_t desc_b1 = ptx::smem_desc_sw128(stage_tile(smem, stage, 2));
      fence_accumulators(acc0, acc1);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_K / 16; ++kk) {  // k16 slice kk starts 32·kk bytes into each row
        ptx::wgmma_m64n64k16_bf16(acc0, ptx::desc_advance(desc_a, 32 * kk), ptx::desc_advance(desc_b0, 32 * kk));
        ptx::wgmma_m64n64k16_bf16(acc1, ptx::desc_advance(desc_a, 32 * kk), ptx::desc_advance(desc_b1, 32 * kk));
      }
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<0>();  // TODO: keep one group in flight and release the previous stage
      fence_accumulators(acc0, acc1);
      if (lane == 0) ptx::mbarrier_arrive(&empty[stage]);  // this warp's reads of the stage are done
    }

    const int n0 = n_tile * Tile<kEpilogue>::kTaskN;
    if constexpr (kEpilogue == Epilogue::kSwiGLU) {
      store_swiglu(acc0, acc1, p, m_tile, n0, warp, lane);
    } else {
      store_pair(acc0, acc1, p, m_tile, n0, warp, lane);
    }
  }
}

// ---- the kernel ----------------------------------------------------------------------------------------

template <Epilogue kEpilogue>
__global__ void __launch_bounds__(kNumThreads, 1)
    grouped_gemm_bf16_kernel(const __grid_constant__ CUtensorMap tmap_b0,
                             const __grid_constant__ CUtensorMap tmap_b1, const Params p) {
  extern __shared__ uint8_t smem_raw[];
  // Dynamic shared memory is only 16-byte aligned for sure; the swizzle atoms need 1024 (kSmemBytes has
  // the slack).
  uint8_t* smem = smem_raw + (ptx::kSw128AtomBytes - ptx::smem_addr(smem_raw) % ptx::kSw128AtomBytes) %
                                 ptx::kSw128AtomBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kNumStages * kStageBytes);  // [kNumStages]
  uint64_t* empty = full + kNumStages;                                             // [kNumStages]

  if (threadIdx.x == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      ptx::mbarrier_init(&full[s], kFullArrivals);
      ptx::mbarrier_init(&empty[s], kNumConsumerWarps);
    }
    ptx::fence_mbarrier_init();
    ptx::prefetch_tensor_map(&tmap_b0);
    ptx::prefetch_tensor_map(&tmap_b1);
  }
  __syncthreads();  // NOTE: the last block-wide barrier: roles split below and may exit independently

  const int num_tasks = (p.num_rows / BLOCK_M) * p.num_n_tiles;
  const int num_k_blocks = static_cast<int>(ceil_div(p.k, BLOCK_K));
  if (threadIdx.x < kNumProducerThreads) {
    if (threadIdx.x < kWarpSize) produce<kEpilogue>(&tmap_b0, &tmap_b1, p, smem, full, empty, num_tasks, num_k_blocks);
  } else {
    consume<kEpilogue>(p, smem, full, empty, num_tasks, num_k_blocks);
  }
}

// ---- host launcher -------------------------------------------------------------------------------------
// Encodes the two weight maps, sizes the persistent grid (min(num_sms or the device's SM count, tasks))
// and launches on `stream`. w_b0/w_b1: bf16 [num_experts, n, k] (GEMM2 passes the same matrix twice).

template <Epilogue kEpilogue>
cudaError_t launch_grouped_gemm_bf16(const void* w_b0, const void* w_b1, int64_t num_experts, Params p,
                                     int num_sms, cudaStream_t stream) {
  p.num_n_tiles = static_cast<int>(ceil_div(p.n, Tile<kEpilogue>::kTaskN));
  const int64_t num_tasks = static_cast<int64_t>(p.num_rows / BLOCK_M) * p.num_n_tiles;
  if (num_tasks == 0) return cudaSuccess;
  if (num_tasks > INT32_MAX || p.num_rows % BLOCK_M != 0) return cudaErrorInvalidValue;
  CUtensorMap tmap_b0, tmap_b1;
  cudaError_t err;
  if ((err = encode_weight_map(&tmap_b0, w_b0, num_experts, p.n, p.k, BLOCK_K, BLOCK_N_B)) ||
      (err = encode_weight_map(&tmap_b1, w_b1, num_experts, p.n, p.k, BLOCK_K, BLOCK_N_B)))
    return err;
  const auto kernel = grouped_gemm_bf16_kernel<kEpilogue>;
  if ((err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes))) return err;
  if (num_sms <= 0) {
    int device = 0;
    if ((err = cudaGetDevice(&device)) || (err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device)))
      return err;
  }
  const int grid = static_cast<int>(num_tasks < num_sms ? num_tasks : num_sms);
  kernel<<<grid, kNumThreads, kSmemBytes, stream>>>(tmap_b0, tmap_b1, p);
  return cudaGetLastError();
}

}  // namespace mok::gemm
