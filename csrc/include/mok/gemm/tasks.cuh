// The grouped GEMMs' kinds and parameters, and the tasks a CTA runs: their decoding, the static stride or the
// device counter (MOK_GEMM_DYNAMIC), and the stages' addresses.
#pragma once

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
#if MOK_GEMM_DYNAMIC
  int* unit_counter;  // the launch's own counter of units handed out, zero at the start (launch_grouped_gemm_bf16)
#endif
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
  static constexpr bool kDynamic = kDynamicBuild && !kMulticast && !kMx;  // MOK_GEMM_DYNAMIC
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
// launch's counter (p.unit_counter) and passes it through a ring of kUnitSlots in shared memory to the roles that
// read it (the consumer warps; the producer's gather warps).

struct UnitRing {
  uint64_t* full;   // [kUnitSlots] the writer's arrival: the slot holds the next unit
  uint64_t* empty;  // [kUnitSlots] each reader warp's arrival: the slot may be rewritten
  int* unit;        // [kUnitSlots] a unit, or -1: none left
};

template <Gemm kGemm>
struct UnitFeed {
  Units units;
  UnitRing ring;
  int* counter;  // the launch's (kDynamic builds; else null)

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
        const int unit = atomicAdd(counter, 1);
        ring.unit[slot] = unit < units.count ? unit : -1;
        ptx::mbarrier_arrive(&ring.full[slot]);  // release: the readers see the unit
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
#if MOK_GEMM_DYNAMIC
    const UnitFeed<kGemm> feed{units, ring, p.unit_counter};
#else
    const UnitFeed<kGemm> feed{units, ring, nullptr};
#endif
    for (int i = 0, unit; (unit = feed.next(i, writer)) >= 0; ++i) body(unit);
  } else {
    for (int unit = units.first; unit < units.count; unit += units.step) body(unit);
  }
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
