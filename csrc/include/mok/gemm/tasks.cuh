// The grouped GEMMs' kinds and parameters, and the tasks a CTA runs: their decoding, the static stride, and the
// stages' addresses.
#pragma once

#include "mok/api.h"
#include "mok/gemm/config.cuh"

namespace mok::gemm {

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
// the row-wise E8M0 scales [num_rows, n / 32]. NOTE: one pointer, not two: a field more in Params changes the
// PTX of every kind (nvcc 13.0).
struct MxOut {
  uint8_t *data, *scales;
};
MOK_HOST_DEVICE MxOut mx_of(uint16_t* buffer, const Params& p) {
  uint8_t* data = reinterpret_cast<uint8_t*>(buffer);
  return {data, data + static_cast<int64_t>(p.num_rows) * p.n};
}

// The Params every kind over the schedule's rows (all but kWeightGrad) starts from: the schedule's arrays, field by
// field; the entry points (csrc/gemm_*.cu) add A, the output, n, k and what their kind needs.
inline Params rows_params(const RowSchedule& sched) {
  Params p{};
  p.row_to_token = sched.row_to_token;  // padding rows (-1) are written as zeros
  p.tile_to_expert = sched.tile_to_expert;
  p.real_num_rows = sched.real_num_rows;
  p.num_rows = static_cast<int>(sched.num_rows);
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
  // full[s]: the cp.async arrivals of a gathered A, the dequantizing threads' arrivals, and one
  // arrive.expect_tx when TMA writes into the stage (A unless gathered, B unless dequantized).
  static constexpr bool kTmaIntoStage = !kGather || !kMx;
  static constexpr uint32_t kFullArrivals =
      (kGather ? kNumProducerThreads : 0) + (kMx ? kNumProducerThreads : 0) + (kTmaIntoStage ? 1 : 0);
  static constexpr uint32_t kTmaBytes = (kGather ? 0 : kATileBytes) + (kMx ? 0 : 2 * kBTileBytes);
  // setmaxnreg budgets (128 · producer + 256 · consumer <= 384 · kLaunchRegs; ptxas allocates each role's
  // code within its budget): the dequantizing producer needs more than 88 in kGateUpMx, whose producer also
  // gathers A (4 bytes spilled); 120 / 192 is the split that spills nowhere. A producer that only issues TMA
  // (one thread) needs few: 40 leaves the consumers 232 for the held tile.
  static constexpr int kProducerRegs = kMx ? 120 : kGather ? 56 : 40;
  static constexpr int kConsumerRegs = kMx ? 192 : kGather ? 224 : 232;
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
// n-tiles, in groups of kGroupM m-tiles (the last group may be smaller), m fastest inside a group. kWeightGrad
// numbers (expert, m_tile, n_tile) and runs K over the expert's segment of rows [k_row0, k_row0 + 64·num_k_blocks):
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
// decode_task groups only the real m-tiles, so the first real_tiles · num_n_tiles tasks are exactly theirs).
// kWeightGrad: static, experts × m tiles × n tiles (each task's K comes from expert_offsets).
template <Gemm kGemm>
MOK_DEVICE int num_tasks_of(const Params& p) {
  if (kGemm == Gemm::kWeightGrad || p.real_num_rows == nullptr) return p.num_tasks;
  const int real_tasks = (*p.real_num_rows / BLOCK_M) * p.num_n_tiles;
  return real_tasks < p.num_tasks ? real_tasks : p.num_tasks;  // never past the buffers, whatever it holds
}

// body(task) for each of the CTA's tasks: blockIdx.x, blockIdx.x + gridDim.x, ... < num_tasks (a static stride;
// docs/gemm.md, decisions, says why not a device counter).
template <typename Body>
MOK_DEVICE void for_each_task(int num_tasks, Body body) {
  const int first = static_cast<int>(blockIdx.x), step = static_cast<int>(gridDim.x);
  for (int task = first; task < num_tasks; task += step) body(task);
}

MOK_DEVICE uint8_t* stage_a(uint8_t* smem, uint32_t stage) { return smem + stage * kStageBytes; }
MOK_DEVICE uint8_t* stage_b(uint8_t* smem, uint32_t stage, int which) {  // which: 0 = B0, 1 = B1
  return smem + stage * kStageBytes + kATileBytes + which * kBTileBytes;
}
// MXFP8 landing slot `slot`: the E4M3 tile of B0 or B1, and its scales (row r's two bytes at 2r).
MOK_DEVICE uint8_t* land_tile(uint8_t* smem, uint32_t slot, int which) {
  return smem + kMxStages * kStageBytes + (2 * slot + which) * kLandTileBytes;
}
MOK_DEVICE uint8_t* land_scales(uint8_t* smem, uint32_t slot, int which) {  // after the staging: 128-aligned
  return smem + kMainBytes + kStagingBytes + (2 * slot + which) * kLandScaleBytes;
}

}  // namespace mok::gemm
