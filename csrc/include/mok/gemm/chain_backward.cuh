// The layer's backward at EP = 1 in one persistent launch, BF16: the megakernel level's backward
// (docs/megakernel.md). Per expert group (the shared expert, then the routed experts; chain.cuh's groups), the fused
// level's backward kernels as tasks of one kernel, numbered phase by phase, each waiting on counters its producers
// raise:
//   1 kDownDgrad (m, n)     g = bf16(dy[r]·Wd[e]) into d_gate's buffer                     waits on nothing
//   2 rows (m)              the SwiGLU backward of the m-tile's rows, each consumer warp 16 of them, with
//                           moe/swiglu_backward_rows.cuh's row body: d_gate, d_up, h; the routed group with the route
//                           gradients (g unweighted, h written as w·h, d_topk_weights)   waits on g_ready[m]
//   3 round trips (m)       MXFP8 groups only: the m-tile's rows of d_gate and d_up both ways (row-wise in place,
//                           column-wise into d_gate_cols, d_up_cols) and h column-wise in place, in the fused
//                           level's 32-row warp tiles (quant/mxfp8_quantize.cuh's tile body)   waits on rows_ready[m]
//   4 kGateUpDgrad (m, n)   dx[r] = bf16(d_gate[r]·Wg[e] + d_up[r]·Wu[e]), and the combine of d_x behind its tiles
//                           (chain.cuh's combine, weights 1, the shared group's rows counted)   waits on rows_ready[m]
//                           (MXFP8: round_ready[m])
//   5 kWeightGrad (e, m, n) d_w_down[e], then d_w_gate[e], d_w_up[e], over e's rows          waits on expert_ready[e]
// Same tiles, same fp32 sums, same row body as the fused level's launches: their bits. The dy rows (the unweighted
// d_out rows) and the x rows are gathered before the launch: the weight gradients read them by TMA, MN-major.
// An MXFP8 group (its gate/up the forward's row-wise MXFP8, read by the row body as the fused level's SwiGLU kernel
// reads them) takes its operands' other round trips before the launch, as the fused level does: dy's both ways (dy
// rows row-wise, dy_cols column-wise; dy = bf16(w·d_out), no route gradients in the launch), the x rows column-wise,
// the weights along their K. Only the routed group can be MXFP8 (the shared expert is BF16 in every precision).
//
// Counters, per group, zero at launch: g_ready[m] (each consumer warp of a kDownDgrad task adds 1 once its stores
// have finished: target kNumConsumerWarps · its n-tiles), rows_ready[m] and expert_ready[e] (each warp of a row
// task adds 1 to both: targets kNumConsumerWarps and kNumConsumerWarps · e's m-tiles; in an MXFP8 group the row
// task adds to rows_ready only, and each warp of the round-trip task to round_ready[m] and expert_ready[e]). The row
// and round-trip tasks' stores are st.global (generic proxy): the warp syncs, then lane 0 fences the async proxy and
// releases; the waiting producer acquires and fences again before its TMA loads read them.
//
// No deadlock, with every CTA resident (grid at most the SM count, one CTA per SM): a CTA takes its tasks in
// increasing number, and every producer task has a smaller number than its consumers (phases in order). Phase 1
// waits on nothing. A consumer warp sends its last kDownDgrad signal before it waits (a row or round-trip task) and
// before the mainloop of any task whose producer waits, so every count a waiter needs comes from a task that is
// running, or is done with its signals sent. The producer waits only in phases 4 and 5, after it has loaded every
// earlier task.
#pragma once

#include "mok/gemm/chain.cuh"
#include "mok/moe/swiglu_backward_rows.cuh"
#include "mok/quant/mxfp8_quantize.cuh"

namespace mok::gemm {

static_assert(Tile<Gemm::kDownDgrad>::kFullArrivals == 1 && Tile<Gemm::kGateUpDgrad>::kFullArrivals == 1 &&
                  Tile<Gemm::kWeightGrad>::kFullArrivals == 1,
              "every kind of the backward chain loads by TMA alone: one arrival per stage");
static_assert(Tile<Gemm::kDownDgrad>::kStages == kNumStages && Tile<Gemm::kGateUpDgrad>::kStages == kNumStages &&
                  Tile<Gemm::kWeightGrad>::kStages == kNumStages,
              "one stage ring for every kind");
static_assert(Tile<Gemm::kGateUpDgrad>::kTaskN == Gemm2::kTaskN, "chain.cuh's combine slices: 256 columns");
constexpr int kBackwardProducerRegs = 40, kBackwardConsumerRegs = 232;  // a TMA-only producer (grouped_gemm_bf16)
static_assert(kNumProducerThreads * kBackwardProducerRegs + kNumConsumerGroups * kWarpgroup * kBackwardConsumerRegs <=
                  kNumThreads * kLaunchRegs,
              "the register budgets fit the CTA's launch registers");

// The kinds in task order; the weight gradients last.
enum BackwardKind {
  kBwdDgrad, kBwdRows, kBwdRound, kBwdGateUpDgrad, kBwdWgradDown, kBwdWgradGate, kBwdWgradUp, kBwdKinds
};

struct BackwardMaps {  // nothing but tensor maps (the kernel prefetches them as an array)
  CUtensorMap dy, w_down, g;                   // kDownDgrad: A, B (both halves), out (d_gate's buffer)
  CUtensorMap d_gate, d_up, w_gate, w_up, dx;  // kGateUpDgrad: A, A2, B0, B1, out
  CUtensorMap wd_a, wd_b, wd_out;              // d_w_down: A = dy rows (MN-major), B = h rows
  CUtensorMap wg_a, wg_b, wg_out;              // d_w_gate: A = d_gate rows, B = x rows
  CUtensorMap wu_a, wu_out;                    // d_w_up: A = d_up rows, B = x rows (wg_b)
};

// One expert group's backward.
struct BackwardGroup {
  BackwardMaps maps;
  Params dgrad, gate_up_dgrad, wgrad[3];  // wgrad: down, gate, up
  moe::SwiGLUBackwardRows rows;           // d_h = d_gate's buffer; gate_scales set: an MXFP8 group
  uint16_t *d_gate_cols, *d_up_cols;      // MXFP8: d_gate's and d_up's column-wise round trips
  int32_t *g_ready, *rows_ready, *round_ready, *expert_ready;
  int g_target;                           // kNumConsumerWarps · kDownDgrad's n-tiles
  int k_blocks_dgrad, k_blocks_gate_up_dgrad;
  int runs;                               // 0: no tasks (no shared expert)
  MOK_DEVICE bool mx() const { return rows.gate_scales != nullptr; }
  // What kGateUpDgrad waits on: the row tasks' counts, or in MXFP8 the round-trip tasks'.
  MOK_DEVICE const int32_t* gate_up_ready() const { return mx() ? round_ready : rows_ready; }
};

struct BackwardLaunch {
  BackwardGroup group[2];  // kSharedGroup, kRoutedGroup
  ChainCombine combine;    // d_x: out = d_x, weights null, shared = the shared group's dx rows or null
  TaskTrace trace;         // kinds: kind · 2 + group
};

struct BackwardCounts {
  int num[kBwdKinds][2];
  MOK_DEVICE int total() const {
    int sum = 0;
    for (int k = 0; k < kBwdKinds; ++k) sum += num[k][0] + num[k][1];
    return sum;
  }
};

// A task's kind, group, index among that group's tasks of the kind, and their number (the loop unrolls: the counts
// stay in registers).
struct BackwardTask {
  int kind, group, index, num;
};
MOK_DEVICE BackwardTask backward_task(const BackwardCounts& n, int task) {
#pragma unroll
  for (int k = 0; k < kBwdKinds; ++k)
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      if (task < n.num[k][g]) return {k, g, task, n.num[k][g]};
      task -= n.num[k][g];
    }
  return {kBwdKinds, 0, 0, 0};  // never: task < total()
}

// Expert e's count of finished row-task warps once all of its m-tiles are done.
MOK_DEVICE int expert_target(const Params& wgrad, int e) {
  return (wgrad.expert_offsets[e + 1] - wgrad.expert_offsets[e]) / BLOCK_M * kNumConsumerWarps;
}

// Thread 0 issues every load (the kinds are TMA-only); the other producer threads leave at once.
template <Gemm kGemm>
MOK_DEVICE uint32_t load_task(const Task& t, int k, const CUtensorMap* a, const CUtensorMap* a2, const CUtensorMap* b0,
                              const CUtensorMap* b1, uint8_t* smem, uint64_t* full, uint64_t* empty, uint32_t it) {
  for (int kb = 0; kb < t.num_k_blocks; ++kb, ++it) {
    const uint32_t stage = it % kNumStages, phase = (it / kNumStages) & 1;
    ptx::mbarrier_wait_parity(&empty[stage], phase ^ 1);
    issue_tma<kGemm>(a, a2, b0, b1, smem, &full[stage], stage, t, kb, k);
  }
  return it;
}

MOK_DEVICE void produce_backward(const BackwardLaunch& L, const BackwardCounts& n, uint8_t* smem, uint64_t* full,
                                 uint64_t* empty) {
  if (threadIdx.x != 0) return;
  uint32_t it = 0;  // position in the (task, k-block) sequence, shared with the consumers
  const auto task_of = [&](int task, const BackwardTask& bt, auto group) {
    constexpr int kGroup = decltype(group)::value;
    const BackwardGroup& g = L.group[kGroup];
    const BackwardMaps& m = g.maps;
    const int num = bt.num;
    if (bt.kind == kBwdDgrad) {
      const Task t = decode_task<Gemm::kDownDgrad>(g.dgrad, bt.index, g.k_blocks_dgrad, num);
      it = load_task<Gemm::kDownDgrad>(t, g.dgrad.k, &m.dy, nullptr, &m.w_down, &m.w_down, smem, full, empty, it);
    } else if (bt.kind == kBwdGateUpDgrad) {
      const Task t = decode_task<Gemm::kGateUpDgrad>(g.gate_up_dgrad, bt.index, g.k_blocks_gate_up_dgrad, num);
      L.trace.mark(task, kTraceWaitBegin);
      ptx::wait_counter(&g.gate_up_ready()[t.m_tile], kNumConsumerWarps);
      L.trace.mark(task, kTraceWaitEnd);
      ptx::fence_proxy_async_global();  // d_gate's and d_up's rows, announced by the counter, before TMA reads them
      it = load_task<Gemm::kGateUpDgrad>(t, g.gate_up_dgrad.k, &m.d_gate, &m.d_up, &m.w_gate, &m.w_up, smem, full,
                                         empty, it);
    } else if (bt.kind >= kBwdWgradDown) {
      const int which = bt.kind - kBwdWgradDown;
      const Params& p = g.wgrad[which];
      const Task t = decode_task<Gemm::kWeightGrad>(p, bt.index, 0, num);
      L.trace.mark(task, kTraceWaitBegin);
      ptx::wait_counter(&g.expert_ready[t.expert], expert_target(p, t.expert));
      L.trace.mark(task, kTraceWaitEnd);
      ptx::fence_proxy_async_global();
      const CUtensorMap* a = which == 0 ? &m.wd_a : which == 1 ? &m.wg_a : &m.wu_a;
      const CUtensorMap* b = which == 0 ? &m.wd_b : &m.wg_b;
      it = load_task<Gemm::kWeightGrad>(t, p.k, a, nullptr, b, b, smem, full, empty, it);
    }  // kBwdRows, kBwdRound: the consumers alone
  };
  for_each_group_task(n.total(), [&](int task) { return backward_task(n, task); }, task_of);
}

// A consumer warp's wait for `counter` to reach `target`, traced (trace: the task's marks, the tracing thread's, or
// null); every lane's loads after the acquire.
MOK_DEVICE void warp_wait(const int32_t* counter, int target, uint32_t lane, const TaskTrace* trace, int task) {
  if (trace != nullptr) trace->mark(task, kTraceWaitBegin);
  if (lane == 0) ptx::wait_counter(counter, target);
  if (trace != nullptr) trace->mark(task, kTraceWaitEnd);
  __syncwarp();
}

// A consumer warp's release of its st.global rows to TMA loads: to `counter` and, unless null, `counter2`.
MOK_DEVICE void warp_release(int32_t* counter, int32_t* counter2, uint32_t lane) {
  __syncwarp();  // every lane's stores before lane 0's release
  if (lane == 0) {
    ptx::fence_proxy_async_global();  // st.global rows that TMA loads will read
    ptx::red_release_gpu_add(counter, 1);
    if (counter2 != nullptr) ptx::red_release_gpu_add(counter2, 1);
  }
}

// One consumer warp's 16 rows of a row task (m-tile m): wait for the tile's g, the SwiGLU backward row by row (kMx:
// gate/up the row-wise MXFP8 the forward saved), then this warp's count (an MXFP8 group's weight gradients wait
// for the round trips instead).
template <bool kMx>
MOK_DEVICE void backward_rows(const BackwardGroup& g, int m, int warp_rows, uint32_t lane, const TaskTrace* trace,
                              int task) {
  warp_wait(&g.g_ready[m], g.g_target, lane, trace, task);
  const int64_t row0 = static_cast<int64_t>(m) * BLOCK_M + kStoreBoxRows * warp_rows;
  const uint16_t* d_h = g.rows.d_h;
  for (int i = 0; i < kStoreBoxRows; ++i)
    moe::swiglu_backward_row<kMx>(g.rows, row0 + i, static_cast<int>(lane),
                                  [d_h](int64_t at) { return ptx::ld_cg_v4(d_h + at); });
  warp_release(&g.rows_ready[m], kMx ? nullptr : &g.expert_ready[g.dgrad.tile_to_expert[m]], lane);
}

// One consumer warp's share of an MXFP8 group's round-trip task (m-tile m): the 32-row warp tiles of the m-tile's
// d_gate and d_up (dual: row-wise in place, column-wise into d_gate_cols, d_up_cols) and h (column-wise in place),
// tiles warp, warp + kNumConsumerWarps, ..., each loaded whole before it is stored (so in place is safe), by
// quantize_and_store_tile: the fused level's round-trip kernels' bits. Then this warp's counts.
MOK_DEVICE void backward_round_trips(const BackwardGroup& g, int m, int warp, uint32_t lane, const TaskTrace* trace,
                                     int task) {
  using Tile = mxfp8::ColTile<4>;
  warp_wait(&g.rows_ready[m], kNumConsumerWarps, lane, trace, task);
  const int64_t cols = g.rows.n, col_tiles = (cols + Tile::kCols - 1) / Tile::kCols;
  constexpr int kBlocks = BLOCK_M / mxfp8::kBlockSize;  // 32-row blocks of the m-tile
  const int row_lane = static_cast<int>(lane) / Tile::kColLanes, col_lane = static_cast<int>(lane) % Tile::kColLanes;
  for (int64_t i = warp; i < 3 * kBlocks * col_tiles; i += kNumConsumerWarps) {
    const int which = static_cast<int>(i / (kBlocks * col_tiles));  // 0 d_gate, 1 d_up, 2 h: warp-uniform
    const int64_t in = i % (kBlocks * col_tiles);
    const int64_t row0 = static_cast<int64_t>(m) * BLOCK_M + (in / col_tiles) * mxfp8::kBlockSize;
    const int64_t col = (in % col_tiles) * Tile::kCols + col_lane * mxfp8::kChunkElems;
    const bool valid = col < cols;
    uint16_t* x = which == 0 ? g.rows.d_gate : which == 1 ? g.rows.d_up : g.rows.h;
    uint4 v[Tile::kRowsPerThread];
#pragma unroll
    for (int r = 0; r < Tile::kRowsPerThread; ++r)
      v[r] = valid ? ptx::ld_cg_v4(x + (row0 + row_lane + 4 * r) * cols + col) : make_uint4(0u, 0u, 0u, 0u);
    mxfp8::TiledOut out{nullptr, nullptr, nullptr, nullptr};
    out.round_trip_col = reinterpret_cast<uint8_t*>(which == 0 ? g.d_gate_cols : which == 1 ? g.d_up_cols : x);
    out.round_trip_row = reinterpret_cast<uint8_t*>(x);
    if (which < 2)
      mxfp8::quantize_and_store_tile<4, true, true>(v, row0, col, cols, valid, row_lane, col_lane, out);
    else
      mxfp8::quantize_and_store_tile<4, false, true>(v, row0, col, cols, valid, row_lane, col_lane, out);
  }
  warp_release(&g.round_ready[m], &g.expert_ready[g.dgrad.tile_to_expert[m]], lane);
}

MOK_DEVICE void consume_backward(const BackwardLaunch& L, const BackwardCounts& n, uint8_t* smem, uint64_t* full,
                                 uint64_t* empty) {
  const uint32_t half = threadIdx.x / kWarpgroup - 1;  // 0 or 1: which 64 rows of the tile
  const uint32_t warp = (threadIdx.x % kWarpgroup) / kWarpSize;
  const int warp_rows = static_cast<int>(half * (kWarpgroup / kWarpSize) + warp);  // 0..7: its 16 rows of a tile
  const uint32_t lane = lane_id();
  const uint32_t a_offset = half * WG_M * kRowBytes;
  Staging staging{smem + kMainBytes +
                      (threadIdx.x / kWarpSize - kNumProducerThreads / kWarpSize) * kStagingBytesPerWarp,
                  0};
  Epilogue<Gemm::kDownDgrad, false> epilogue_dgrad;
  Epilogue<Gemm::kGateUpDgrad, false> epilogue_gate_up_dgrad;
  Epilogue<Gemm::kWeightGrad, false> epilogue_wgrad;
  int32_t* pending = nullptr;  // this warp's last kDownDgrad count, not yet sent
  const auto signal = [&] {
    if (pending == nullptr) return;
    if (lane == 0) {
      ptx::bulk_wait_group<0>();  // this warp's stores of that task have finished (and any before them)
      ptx::fence_proxy_async_global();
      ptx::red_release_gpu_add(pending, 1);
    }
    pending = nullptr;
  };
  uint32_t it = 0;
  const bool traces = threadIdx.x == kNumProducerThreads;  // the first consumer thread marks its CTA's tasks
  const auto task_of = [&](int task, const BackwardTask& bt, auto group) {
    constexpr int kGroup = decltype(group)::value;
    const BackwardGroup& g = L.group[kGroup];
    const BackwardMaps& m = g.maps;
    const int num = bt.num;
    if (traces) L.trace.begin(task, bt.kind * 2 + kGroup);
    if (bt.kind == kBwdRows || bt.kind == kBwdRound) {
      signal();  // before waiting: the count it waits for may be this warp's
      const TaskTrace* trace = traces ? &L.trace : nullptr;
      if constexpr (kGroup == kRoutedGroup) {  // the shared expert is BF16 in every precision
        if (g.mx()) {
          if (bt.kind == kBwdRows)
            backward_rows<true>(g, bt.index, warp_rows, lane, trace, task);
          else
            backward_round_trips(g, bt.index, warp_rows, lane, trace, task);
          if (traces) L.trace.mark(task, kTraceEnd);
          return;
        }
      }
      backward_rows<false>(g, bt.index, warp_rows, lane, trace, task);  // kBwdRound has no tasks in a BF16 group
      if (traces) L.trace.mark(task, kTraceEnd);
      return;
    }
    float acc0[kAccPerThread], acc1[kAccPerThread];
#pragma unroll
    for (int i = 0; i < kAccPerThread; ++i) acc0[i] = 0.0f, acc1[i] = 0.0f;
    if (bt.kind == kBwdDgrad) {
      const Task t = decode_task<Gemm::kDownDgrad>(g.dgrad, bt.index, g.k_blocks_dgrad, num);
      it = mma_k_blocks<kNumStages, false, false, true, 0>(acc0, acc1, smem, a_offset, full, empty, it,
                                                           t.num_k_blocks, lane, [] {});
      signal();  // the previous task's: its stores are long done
      const int row0 = t.m_tile * BLOCK_M + kStoreBoxRows * warp_rows;
      const Outputs out{&m.g, nullptr, nullptr};
      epilogue_dgrad.finish(acc0, acc1, g.dgrad, out, staging, row0, t.n_tile * Tile<Gemm::kDownDgrad>::kTaskN,
                            t.expert, lane);
      epilogue_dgrad.store_rest(g.dgrad, out, staging, lane);
      pending = &g.g_ready[t.m_tile];
    } else if (bt.kind == kBwdGateUpDgrad) {
      signal();  // before a mainloop whose producer waits
      const Task t = decode_task<Gemm::kGateUpDgrad>(g.gate_up_dgrad, bt.index, g.k_blocks_gate_up_dgrad, num);
      it = mma_k_blocks<kNumStages, false, false, true, 0>(acc0, acc1, smem, a_offset, full, empty, it,
                                                           t.num_k_blocks, lane, [] {});
      const int row0 = t.m_tile * BLOCK_M + kStoreBoxRows * warp_rows;
      const Outputs out{&m.dx, nullptr, nullptr};
      epilogue_gate_up_dgrad.finish(acc0, acc1, g.gate_up_dgrad, out, staging, row0,
                                    t.n_tile * Tile<Gemm::kGateUpDgrad>::kTaskN, t.expert, lane);
      epilogue_gate_up_dgrad.store_rest(g.gate_up_dgrad, out, staging, lane);
      combine_rows_done(L.combine, g.gate_up_dgrad, L.group[kRoutedGroup].gate_up_dgrad.n, row0, t.n_tile,
                        kGroup == kSharedGroup, lane);
    } else {
      signal();
      const int which = bt.kind - kBwdWgradDown;
      const Params& p = g.wgrad[which];
      Task t = decode_task<Gemm::kWeightGrad>(p, bt.index, 0, num);
      t.num_k_blocks = warp_uniform(t.num_k_blocks);  // as consume<kWeightGrad>: uniform descriptors
      it = mma_k_blocks<kNumStages, false, true, true, 0>(acc0, acc1, smem, a_offset, full, empty, it,
                                                          t.num_k_blocks, lane, [] {});
      const int row0 = t.m_tile * BLOCK_M + kStoreBoxRows * warp_rows;
      const Outputs out{which == 0 ? &m.wd_out : which == 1 ? &m.wg_out : &m.wu_out, nullptr, nullptr};
      epilogue_wgrad.finish(acc0, acc1, p, out, staging, row0, t.n_tile * Tile<Gemm::kWeightGrad>::kTaskN, t.expert,
                            lane);
      epilogue_wgrad.store_rest(p, out, staging, lane);
    }
    if (traces) L.trace.mark(task, kTraceEnd);
  };
  for_each_group_task(n.total(), [&](int task) { return backward_task(n, task); }, task_of);
  signal();
  drain_stores(lane);
}

__global__ void __launch_bounds__(kNumThreads, 1)
    grouped_gemm_bf16_chain_backward_kernel(const __grid_constant__ BackwardLaunch launch) {
  extern __shared__ uint8_t smem_raw[];
  const CtaSmem c = cta_smem(smem_raw);
  uint8_t* smem = c.smem;
  uint64_t *full = c.full, *empty = c.empty;
  if (threadIdx.x == 0) {
    init_stage_barriers(c, kNumStages, 1);
    ptx::fence_mbarrier_init();
    for (const BackwardGroup& g : launch.group) {
      if (!g.runs) continue;
      const CUtensorMap* maps = &g.maps.dy;  // BackwardMaps: tensor maps only, back to back
      for (size_t i = 0; i < sizeof(BackwardMaps) / sizeof(CUtensorMap); ++i) ptx::prefetch_tensor_map(maps + i);
    }
  }
  __syncthreads();  // NOTE: the last block-wide barrier: roles split below and may exit independently
  BackwardCounts n{};
  for (int i = 0; i < 2; ++i) {
    const BackwardGroup& g = launch.group[i];
    if (!g.runs) continue;
    n.num[kBwdDgrad][i] = num_tasks_of<Gemm::kDownDgrad>(g.dgrad);
    n.num[kBwdRows][i] = n.num[kBwdDgrad][i] / (g.dgrad.num_n_tiles > 0 ? g.dgrad.num_n_tiles : 1);  // real m-tiles
    n.num[kBwdRound][i] = g.mx() ? n.num[kBwdRows][i] : 0;
    n.num[kBwdGateUpDgrad][i] = num_tasks_of<Gemm::kGateUpDgrad>(g.gate_up_dgrad);
    for (int w = 0; w < 3; ++w) n.num[kBwdWgradDown + w][i] = num_tasks_of<Gemm::kWeightGrad>(g.wgrad[w]);
  }
  if (threadIdx.x < kNumProducerThreads) {
    ptx::setmaxnreg_dec<kBackwardProducerRegs>();
    produce_backward(launch, n, smem, full, empty);
  } else {
    ptx::setmaxnreg_inc<kBackwardConsumerRegs>();
    consume_backward(launch, n, smem, full, empty);
  }
}

// One group's operands. dgrad: a = the dy rows, out = d_gate's buffer (g, then d_gate), n = intermediate, k = hidden;
// gate_up_dgrad: a = d_gate, a2 = d_up, out = the dx rows, n = hidden, k = intermediate; wgrad[0..2]: d_w_down (a = dy
// rows, b = h rows), d_w_gate (a = d_gate, b = x rows), d_w_up (a = d_up, b = x rows), each with the schedule's
// expert_offsets and expert_rows, m and n of its output; rows: the SwiGLU backward's pointers (d_h = d_gate's buffer);
// counters: int32 zeros [3 · num_rows / 128 + num_experts] (g_ready, rows_ready, round_ready, expert_ready).
// MXFP8 (rows.gate_scales set): d_gate_cols, d_up_cols [num_rows, intermediate] the round trips' outputs, and the
// weight gradients' A rows dy_cols (the dy rows' column-wise round trip), d_gate_cols, d_up_cols.
struct BackwardGroupArgs {
  const void *w_down, *w_gate, *w_up;
  const void* b_rows[3];  // the weight gradients' B rows: h, x rows, x rows
  int64_t num_experts;
  Params dgrad, gate_up_dgrad, wgrad[3];
  moe::SwiGLUBackwardRows rows;
  uint16_t *d_gate_cols, *d_up_cols;
  int32_t* counters;
};

// routed: the routed experts; shared: the shared expert (w_down null: none); combine: the d_x combine (out = d_x,
// token_done zeros; with a shared expert, its shared is the shared group's dx rows and shared_counts 1).
inline cudaError_t launch_grouped_gemm_bf16_chain_backward(const BackwardGroupArgs& routed,
                                                           const BackwardGroupArgs& shared, ChainCombine combine,
                                                           TaskTrace trace, int num_sms, cudaStream_t stream) {
  BackwardLaunch launch{};
  int64_t total = 0;
  const BackwardGroupArgs* args[2] = {&shared, &routed};
  for (int i = 0; i < 2; ++i) {
    const BackwardGroupArgs& a = *args[i];
    if (a.w_down == nullptr) continue;  // no shared expert: its group runs no task
    BackwardGroup& g = launch.group[i];
    const bool mx = a.rows.gate_scales != nullptr;
    if (mx && (i == kSharedGroup || a.rows.up_scales == nullptr || a.d_gate_cols == nullptr ||
               a.d_up_cols == nullptr || a.rows.route_weights != nullptr || a.rows.n % mxfp8::kBlockSize != 0))
      return cudaErrorInvalidValue;
    g.dgrad = a.dgrad, g.gate_up_dgrad = a.gate_up_dgrad, g.rows = a.rows;
    g.d_gate_cols = a.d_gate_cols, g.d_up_cols = a.d_up_cols;
    for (int w = 0; w < 3; ++w) g.wgrad[w] = a.wgrad[w];
    TaskMaps md, mg, mw[3];
    int64_t num = 0, sum = 0;
    cudaError_t err = prepare_tasks<Gemm::kDownDgrad>(a.w_down, a.w_down, a.num_experts, g.dgrad, {}, &md, &num);
    sum += num;
    if (err || (err = prepare_tasks<Gemm::kGateUpDgrad>(a.w_gate, a.w_up, a.num_experts, g.gate_up_dgrad, {}, &mg,
                                                        &num)))
      return err;
    sum += num;
    for (int w = 0; w < 3; ++w) {
      if ((err = prepare_tasks<Gemm::kWeightGrad>(a.b_rows[w], a.b_rows[w], a.num_experts, g.wgrad[w], {}, &mw[w],
                                                  &num)))
        return err;
      sum += num;
    }
    if (g.dgrad.num_m_tiles != g.gate_up_dgrad.num_m_tiles || g.dgrad.n != g.gate_up_dgrad.k ||
        g.dgrad.k != g.gate_up_dgrad.n)
      return cudaErrorInvalidValue;
    g.maps = BackwardMaps{md.a,     md.b0,    md.out,    mg.a,  mg.a2, mg.b0,     mg.b1,    mg.out,
                          mw[0].a, mw[0].b0, mw[0].out, mw[1].a, mw[1].b0, mw[1].out, mw[2].a, mw[2].out};
    const int num_m_tiles = g.dgrad.num_rows / BLOCK_M;
    g.g_ready = a.counters, g.rows_ready = a.counters + num_m_tiles, g.round_ready = a.counters + 2 * num_m_tiles;
    g.expert_ready = a.counters + 3 * num_m_tiles;
    g.g_target = kNumConsumerWarps * g.dgrad.num_n_tiles;
    g.k_blocks_dgrad = num_k_blocks_of<Gemm::kDownDgrad>(g.dgrad.k);
    g.k_blocks_gate_up_dgrad = num_k_blocks_of<Gemm::kGateUpDgrad>(g.gate_up_dgrad.k);
    g.runs = sum > 0;
    total += sum + (mx ? 2 : 1) * num_m_tiles;
  }
  if (total == 0) return cudaSuccess;
  if (combine.out[combine.rank] == nullptr || combine.topk_weights[0] != nullptr ||
      !combine_fits(combine, launch.group[kRoutedGroup].gate_up_dgrad, launch.group[kSharedGroup].gate_up_dgrad,
                    shared.w_down != nullptr))
    return cudaErrorInvalidValue;
  launch.combine = combine, launch.trace = trace;
  return launch_chain_kernel(grouped_gemm_bf16_chain_backward_kernel, launch, total, num_sms, stream);
}

}  // namespace mok::gemm
