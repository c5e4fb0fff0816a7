// GEMM1 and GEMM2 of the experts in one persistent launch, the megakernel's first step at EP = 1
// (docs/megakernel.md): the tasks of kGateUp (h, gate, up from x gathered) and then those of kDown (y = h·W_downᵀ),
// numbered one after the other and taken by each CTA in the static stride of for_each_task, so GEMM2's first tiles
// run in GEMM1's last wave instead of after it. Same tiles, same fp32 sums: the bits of the launches one by one.
// Measured on an H100: GEMM1 + GEMM2 no faster than the two launches (docs/gemm.md), so the fused level keeps those;
// this is the pattern the megakernel's other kinds follow.
//
// Two expert groups may share the launch: the routed experts and the shared expert (a group of one expert whose
// rows are the tokens in order, fused.shared_schedule), each with its own weights, schedule and outputs. Tasks in
// this order: the shared GEMM1's, the routed GEMM1's, the shared GEMM2's, the routed GEMM2's.
//
// A kDown task of m-tile m reads h's rows of m, which its group's kGateUp tasks of m write. Each consumer warp of a
// kGateUp task increments its group's h_ready[m] once that task's stores have finished (bulk_wait_group<0>, then a
// release); the kDown task's producer waits until h_ready[m] = kNumConsumerWarps · (GEMM1's n-tiles), then its TMA
// loads read h. The warp sends a task's signal late, after its next task's mainloop (by then its stores are long
// done, so the wait costs nothing), but always before a kDown mainloop and at its end.
//
// No deadlock, with every CTA resident (one per SM, the grid at most the SM count): a CTA runs its tasks in
// increasing number and every kGateUp task precedes every kDown task, so kGateUp tasks never wait; a CTA's
// consumers send their last kGateUp signal before their first kDown mainloop, so every signal a waiting producer
// needs comes from a CTA that is still running kGateUp tasks or has sent all of its signals.
// NOTE: the premise is residency. Two such launches on two streams whose grids together exceed the SMs could each
// hold SMs while waiting for CTAs of their own that cannot start (the wait then faults after kWaitTimeoutNs); a
// ticket taken from a device counter instead of the static stride (docs/megakernel.md) removes the premise.
//
// Roles and stages as grouped_gemm_bf16.cuh. The producer runs both kinds' code and needs 64 registers (56, kGateUp's
// split, spilled: ptxas -v), which leaves the consumers 216 (no spills in either epilogue). full[s] counts
// kGateUp's arrivals (one cp.async arrival per producer thread and thread 0's expect_tx); in kDown tasks every
// producer thread arrives plainly and thread 0 also with expect_tx, the same 129.
//
// Over ranks (EP > 1, docs/megakernel.md): a row id names a row of any rank's buffer as (rank << kRankShift | local
// id); at EP = 1 every id is rank 0's, so the ids are the local ones. The routed GEMM1 gathers x's rows from the
// token's rank (group.a[rank]), and the combine of a token runs on whichever rank completes it, reading the owners'
// rows and writing its home rank's out through the same tables. No task waits on another rank: only the completion
// counters cross ranks (.sys scope), so the ranks' launches need not run at the same time.
//
// With a combine (ChainCombine::out set), GEMM2's tiles also finish the layer's combine, and no CTA waits for it:
// after a consumer warp's 16 rows of a GEMM2 tile are stored, each row counts once for its token's 256-column slice
// (token_done[token, n-tile], acquire-release), and the warp whose count completes the slice (the token's routes
// with a row, plus one for the shared expert's row when it is computed in this launch) sums that slice of
// out = bf16(Σ_k w·y[row(t, k)] + shared[t]) in increasing k, as combine_rows does (moe/combine.cuh: the same
// bits). A token's slice is complete with the last of its tiles, so the combines run inside GEMM2's tasks instead
// of in a launch after them.
#pragma once

#include "mok/api.h"
#include "mok/gemm/grouped_gemm_bf16.cuh"
#include "mok/gemm/trace.cuh"
#include "mok/moe/combine.cuh"

namespace mok::gemm {

using Gemm1 = Tile<Gemm::kGateUp>;
using Gemm2 = Tile<Gemm::kDown>;
constexpr int kChainProducerRegs = 64, kChainConsumerRegs = 216;
static_assert(Gemm1::kStages == Gemm2::kStages && Gemm1::kFullArrivals == kNumProducerThreads + 1,
              "one stage ring for both kinds; the arrivals produce_chain makes");
static_assert(Tile<Gemm::kGateUpMxOut>::kFullArrivals == Gemm1::kFullArrivals && Tile<Gemm::kGateUpMxOut>::kGather,
              "the MXFP8-out GEMM1 loads as kGateUp does: produce_chain serves both");
static_assert(kNumProducerThreads * kChainProducerRegs + kNumConsumerGroups * kWarpgroup * kChainConsumerRegs <=
                  kNumThreads * kLaunchRegs,
              "the register budgets fit the CTA's launch registers");

// The tensor maps of the two kinds (kernel parameters).
struct ChainMaps {
  CUtensorMap w_gate, w_up, h, gate, up;  // GEMM1: B0, B1, and its outputs
  CUtensorMap h_rows, w_down, y;          // GEMM2: A, B (both halves), its output
};

// Row ids over ranks: (rank << kRankShift | local id), -1: none.
constexpr int kRankShift = 24;
constexpr int32_t kLocalIdMask = (1 << kRankShift) - 1;
static_assert(kMaxRanks <= (1 << (31 - kRankShift)), "a rank fits a row id's high bits");

// One expert group's GEMM1 and GEMM2.
struct ChainGroup {
  ChainMaps maps;
  Params p1, p2;     // gate_up_params, down_params (p2.a = p1's h)
  const uint16_t* a[kMaxRanks];  // over ranks: GEMM1's gathered A, row id (s, t) of p1.row_to_token reads a[s]'s row t
  int over_ranks;                // 0: p1.row_to_token holds local tokens of p1.a (EP = 1)
  int32_t* h_ready;  // [its m-tiles], zero at launch
  int h_target;      // kNumConsumerWarps · GEMM1's n-tiles
  int k_blocks1, k_blocks2;
  int runs;          // 0: no tasks (no shared expert)
};

// The combine behind GEMM2 (out null: none), over ranks: entry s of each table is rank s's tensor (EP = 1: entry 0).
// Home rank s's token t is route_to_row's token token_offset[s] + t.
struct ChainCombine {
  const int32_t* route_to_row;             // [every rank's tokens, num_topk]: a route's row id, -1: none (NaN slices)
  const float* topk_weights[kMaxRanks];    // [tokens, num_topk] of each home rank; entry 0 null: weights 1 (d_x)
  const uint16_t* shared[kMaxRanks];       // the shared expert's rows, row t = token t, [>= tokens, hidden], or null
  uint16_t* out[kMaxRanks];                // [tokens, hidden] bf16; entry `rank` null: no combine
  int32_t* token_done[kMaxRanks];          // [tokens, GEMM2's n-tiles], zero at launch
  const uint16_t* rows[kMaxRanks];         // the routed GEMM's rows of each owner, [rows_capacity, hidden]
  int32_t token_offset[kMaxRanks];
  int64_t rows_capacity;
  int num_topk;
  int shared_counts;  // 1: the shared rows are the shared group's, stored in this launch (they count)
  int rank;           // this launch's: the home of the shared group's rows, whose ids are local
  int num_ranks;      // the tables' entries: a row id of another rank is bad (NaN slices)
};

constexpr int kSharedGroup = 0, kRoutedGroup = 1;

// The kernel's one parameter: group[kSharedGroup] has no tasks without a shared expert.
struct ChainLaunch {
  ChainGroup group[2];
  ChainCombine combine;
  TaskTrace trace;  // kinds: (GEMM1 or 2 − 1) · 2 + group
};

// The tasks of each group and kind: the real m-tiles' (read on the device at kernel start).
struct ChainCounts {
  int num1[2], num2[2];
  MOK_DEVICE int total() const { return num1[0] + num1[1] + num2[0] + num2[1]; }
};

// Task `task` of the launch: its group, kind (1: GEMM1, 2: GEMM2), index among that group's tasks of the kind, and
// their number (picked here with constant indices: the counts stay in registers, no local memory).
struct ChainTask {
  int group, kind, index, num;
};
MOK_DEVICE ChainTask chain_task(const ChainCounts& n, int task) {
  if (task < n.num1[kSharedGroup]) return {kSharedGroup, 1, task, n.num1[kSharedGroup]};
  task -= n.num1[kSharedGroup];
  if (task < n.num1[kRoutedGroup]) return {kRoutedGroup, 1, task, n.num1[kRoutedGroup]};
  task -= n.num1[kRoutedGroup];
  if (task < n.num2[kSharedGroup]) return {kSharedGroup, 2, task, n.num2[kSharedGroup]};
  return {kRoutedGroup, 2, task - n.num2[kSharedGroup], n.num2[kRoutedGroup]};
}

// for_each_task with each task decoded once (decode(task): a struct with its .group) and its expert group a
// compile-time constant to fn(task, decoded, group): the group's fields at fixed kernel-parameter offsets in the hot
// loops, not at a runtime index.
template <typename Decode, typename Fn>
MOK_DEVICE void for_each_group_task(int total, Decode decode, Fn fn) {
  for_each_task(total, [&](int task) {
    const auto t = decode(task);
    if (t.group == kSharedGroup)
      fn(task, t, std::integral_constant<int, kSharedGroup>{});
    else
      fn(task, t, std::integral_constant<int, kRoutedGroup>{});
  });
}

MOK_DEVICE void produce_chain(const ChainLaunch& L, const ChainCounts& n, uint8_t* smem, uint64_t* full,
                              uint64_t* empty) {
  const uint32_t thread = threadIdx.x;  // 0..127
  const uint32_t chunk = thread % kChunksPerRow, row_in_tile = thread / kChunksPerRow;
  uint32_t it = 0;  // position in the (task, k-block) sequence, shared with the consumers
  const auto task_of = [&](int task, const ChainTask& ct, auto group) {
    constexpr int kGroup = decltype(group)::value;
    const ChainGroup& g = L.group[kGroup];
    if (ct.kind == 1) {
      const Task t = decode_task<Gemm::kGateUp>(g.p1, ct.index, g.k_blocks1, ct.num);
      int32_t token[kRowsPerThread];
      gathered_tokens(g.p1, t.m_tile, row_in_tile, token);
      for (int kb = 0; kb < t.num_k_blocks; ++kb, ++it) {
        const uint32_t stage = it % kNumStages, phase = (it / kNumStages) & 1;
        ptx::mbarrier_wait_parity(&empty[stage], phase ^ 1);
        if (thread == 0)
          issue_tma<Gemm::kGateUp>(nullptr, nullptr, &g.maps.w_gate, &g.maps.w_up, smem, &full[stage], stage, t, kb,
                                   g.p1.k);
        if (kGroup == kRoutedGroup && g.over_ranks)  // row ids over ranks: x from the token's rank
          gather_rows_stage(g.p1, smem, stage, &full[stage], token, row_in_tile, chunk, kb, [&](int32_t id) {
            return g.a[id >> kRankShift] + static_cast<int64_t>(id & kLocalIdMask) * g.p1.k;
          });
        else
          gather_a_stage(g.p1, smem, stage, &full[stage], token, row_in_tile, chunk, kb);
      }
    } else {
      const Task t = decode_task<Gemm::kDown>(g.p2, ct.index, g.k_blocks2, ct.num);
      if (thread == 0) {
        L.trace.mark(task, kTraceWaitBegin);
        ptx::wait_counter(&g.h_ready[t.m_tile], g.h_target);
        L.trace.mark(task, kTraceWaitEnd);
        ptx::fence_proxy_async_global();  // h's rows, announced by the counter, before the TMA loads read them
      }
      for (int kb = 0; kb < t.num_k_blocks; ++kb, ++it) {
        const uint32_t stage = it % kNumStages, phase = (it / kNumStages) & 1;
        ptx::mbarrier_wait_parity(&empty[stage], phase ^ 1);
        if (thread == 0)
          issue_tma<Gemm::kDown>(&g.maps.h_rows, nullptr, &g.maps.w_down, &g.maps.w_down, smem, &full[stage], stage,
                                 t, kb, g.p2.k);
        ptx::mbarrier_arrive(&full[stage]);
      }
    }
  };
  for_each_group_task(n.total(), [&](int task) { return chain_task(n, task); }, task_of);
  ptx::cp_async_wait_all();  // NOTE: no copies in flight behind an exited thread
}

// Home rank `home`'s token t, its 256-column slice n of out, by one warp (lane l: 8 columns): combine_rows' sum,
// from rows that other CTAs (of any rank's launch) may have stored (read from L2, or the peer's memory).
// width: the rows' (the routed GEMM's n).
MOK_DEVICE void combine_slice(const ChainCombine& cb, int width, int home, int token, int n_tile, uint32_t lane) {
  static_assert(Gemm2::kTaskN == kWarpSize * moe::kVecElems, "a lane's 8 columns of a GEMM2 tile");
  const int64_t vecs = width / moe::kVecElems, vec = static_cast<int64_t>(n_tile) * kWarpSize + lane;
  if (vec >= vecs) return;
  const int64_t route0 = static_cast<int64_t>(cb.token_offset[home] + token) * cb.num_topk;
  const int64_t col = vec * moe::kVecElems;
  const float* weights = cb.topk_weights[home];
  const bool weighted = cb.topk_weights[0] != nullptr;
  moe::Acc8 acc;
  moe::acc_zero(acc);
  bool bad = false;
  for (int k = 0; k < cb.num_topk; ++k) {  // increasing k: combine_rows' order
    const int32_t id = cb.route_to_row[route0 + k];
    const int64_t row = id & kLocalIdMask;
    if (id < 0 || (id >> kRankShift) >= cb.num_ranks || row >= cb.rows_capacity) {
      bad = true;
      continue;
    }
    const float w = weighted ? weights[static_cast<int64_t>(token) * cb.num_topk + k] : 1.0f;
    moe::acc_add(acc, ptx::ld_cg_v4(cb.rows[id >> kRankShift] + row * width + col), w, !weighted);
  }
  const int64_t token_col = static_cast<int64_t>(token) * width + col;
  if (cb.shared[home] != nullptr) moe::acc_add(acc, ptx::ld_cg_v4(cb.shared[home] + token_col), 1.0f, true);
  if (bad) moe::acc_nan(acc);
  st_v4(cb.out[home] + token_col, moe::acc_to_bf16(acc));
}

// After this warp stored rows [row0, row0 + 16) of tile n of a group's GEMM (p: the routed or the shared one): each
// real row counts for its token's slice n on the token's home rank, and the warp combines the slices it completed
// (width: the routed GEMM's n). local_ids: p's row ids are this rank's tokens (the shared group's).
MOK_DEVICE void combine_rows_done(const ChainCombine& cb, const Params& p, int width, int row0, int n_tile,
                                  bool local_ids, uint32_t lane) {
  const bool peers = cb.num_ranks > 1;  // counters and rows of other GPUs: system scope
  if (lane == 0) {
    ptx::bulk_wait_group<0>();  // this warp's stores of the tile have finished
    ptx::fence_proxy_async_global();
    if (peers) ptx::fence_acq_rel_sys();  // ... and are ordered at system scope before the lanes' releases below
  }
  __syncwarp();
  int32_t slice = -1;  // the row's token as a row id (home rank, token)
  bool last = false;
  if (lane < 16) {
    const int32_t id = p.row_to_token[row0 + lane];  // -1: a padding row (the shared group's rows: token = row)
    if (id >= 0) {
      const int home = local_ids ? cb.rank : id >> kRankShift, token = id & kLocalIdMask;
      slice = home << kRankShift | token;
      int count = cb.shared_counts;  // the rows a slice waits for: the token's routes with a row, and its shared row
      const int32_t* route_rows =
          cb.route_to_row + static_cast<int64_t>(cb.token_offset[home] + token) * cb.num_topk;
      for (int k = 0; k < cb.num_topk; ++k) count += route_rows[k] >= 0;
      int32_t* done = cb.token_done[home] + static_cast<int64_t>(token) * p.num_n_tiles + n_tile;
      last = (peers ? ptx::atom_add_acq_rel_sys(done, 1) : ptx::atom_add_acq_rel_gpu(done, 1)) == count - 1;
    }
  }
  for (uint32_t left = __ballot_sync(kFullMask, last); left != 0; left &= left - 1) {
    const int32_t s = __shfl_sync(kFullMask, slice, __ffs(left) - 1);
    __syncwarp();  // the lane that counted last acquired the other rows' stores: ordered before every lane's loads
    combine_slice(cb, width, s >> kRankShift, s & kLocalIdMask, n_tile, lane);
  }
}

// kRoutedGemm1: the routed GEMM1's kind, kGateUp or kGateUpMxOut (the MXFP8 forward: h's round trip and gate/up
// quantized row-wise from its epilogue; its producer side is kGateUp's). The shared expert's is kGateUp (BF16).
template <Gemm kRoutedGemm1>
MOK_DEVICE void consume_chain(const ChainLaunch& L, const ChainCounts& n, uint8_t* smem, uint64_t* full,
                              uint64_t* empty) {
  const uint32_t half = threadIdx.x / kWarpgroup - 1;  // 0 or 1: which 64 rows of the tile
  const uint32_t warp = (threadIdx.x % kWarpgroup) / kWarpSize;
  const uint32_t lane = lane_id();
  const uint32_t a_offset = half * WG_M * kRowBytes;
  Staging staging{smem + kMainBytes +
                      (threadIdx.x / kWarpSize - kNumProducerThreads / kWarpSize) * kStagingBytesPerWarp,
                  0};
  Epilogue<Gemm::kGateUp, false> epilogue1;
  Epilogue<kRoutedGemm1, false> epilogue1_routed;
  Epilogue<Gemm::kDown, false> epilogue2;
  int pending = -1, pending_group = 0;  // this warp's last kGateUp task (m-tile, group), not yet signalled
  const auto signal = [&] {
    if (pending < 0) return;
    if (lane == 0) {
      ptx::bulk_wait_group<0>();  // this warp's stores of that task have finished (and any before them)
      ptx::fence_proxy_async_global();
      ptx::red_release_gpu_add(&L.group[pending_group].h_ready[pending], 1);
    }
    pending = -1;
  };
  uint32_t it = 0;
  const bool traces = threadIdx.x == kNumProducerThreads;  // the first consumer thread marks its CTA's tasks
  const auto task_of = [&](int task, const ChainTask& ct, auto group) {
    constexpr int kGroup = decltype(group)::value;
    const ChainGroup& g = L.group[kGroup];
    if (traces) L.trace.begin(task, (ct.kind - 1) * 2 + kGroup);
    float acc0[kAccPerThread], acc1[kAccPerThread];
#pragma unroll
    for (int i = 0; i < kAccPerThread; ++i) acc0[i] = 0.0f, acc1[i] = 0.0f;
    if (ct.kind == 1) {
      const Task t = decode_task<Gemm::kGateUp>(g.p1, ct.index, g.k_blocks1, ct.num);
      it = mma_k_blocks<kNumStages, true, false, false, 0>(acc0, acc1, smem, a_offset, full, empty, it,
                                                           t.num_k_blocks, lane, [] {});
      signal();
      const int row0 = t.m_tile * BLOCK_M + half * WG_M + 16 * warp;
      const Outputs out1{&g.maps.h, &g.maps.gate, &g.maps.up};
      if (kRoutedGemm1 != Gemm::kGateUp && kGroup == kRoutedGroup)
        epilogue1_routed.finish(acc0, acc1, g.p1, out1, staging, row0, t.n_tile * Gemm1::kTaskN, t.expert, lane);
      else
        epilogue1.finish(acc0, acc1, g.p1, out1, staging, row0, t.n_tile * Gemm1::kTaskN, t.expert, lane);
      pending = t.m_tile, pending_group = kGroup;
    } else {
      const Task t = decode_task<Gemm::kDown>(g.p2, ct.index, g.k_blocks2, ct.num);
      signal();  // before any kDown mainloop: a producer may wait for it
      it = mma_k_blocks<kNumStages, false, false, false, 0>(acc0, acc1, smem, a_offset, full, empty, it,
                                                            t.num_k_blocks, lane, [] {});
      const int row0 = t.m_tile * BLOCK_M + half * WG_M + 16 * warp;
      const Outputs out2{&g.maps.y, nullptr, nullptr};
      epilogue2.finish(acc0, acc1, g.p2, out2, staging, row0, t.n_tile * Gemm2::kTaskN, t.expert, lane);
      epilogue2.store_rest(g.p2, out2, staging, lane);
      if (L.combine.out[L.combine.rank] != nullptr)
        combine_rows_done(L.combine, g.p2, L.group[kRoutedGroup].p2.n, row0, t.n_tile, kGroup == kSharedGroup, lane);
    }
    if (traces) L.trace.mark(task, kTraceEnd);
  };
  for_each_group_task(n.total(), [&](int task) { return chain_task(n, task); }, task_of);
  signal();
  drain_stores(lane);
}

template <Gemm kRoutedGemm1>
__global__ void __launch_bounds__(kNumThreads, 1)
    grouped_gemm_bf16_chain_kernel(const __grid_constant__ ChainLaunch launch) {
  extern __shared__ uint8_t smem_raw[];
  const CtaSmem c = cta_smem(smem_raw);
  uint8_t* smem = c.smem;
  uint64_t *full = c.full, *empty = c.empty;
  if (threadIdx.x == 0) {
    init_stage_barriers(c, kNumStages, Gemm1::kFullArrivals);
    ptx::fence_mbarrier_init();
    for (const ChainGroup& g : launch.group) {
      if (!g.runs) continue;
      ptx::prefetch_tensor_map(&g.maps.w_gate), ptx::prefetch_tensor_map(&g.maps.w_up);
      ptx::prefetch_tensor_map(&g.maps.h), ptx::prefetch_tensor_map(&g.maps.gate);
      ptx::prefetch_tensor_map(&g.maps.up);
      ptx::prefetch_tensor_map(&g.maps.h_rows), ptx::prefetch_tensor_map(&g.maps.w_down);
      ptx::prefetch_tensor_map(&g.maps.y);
    }
  }
  __syncthreads();  // NOTE: the last block-wide barrier: roles split below and may exit independently
  ChainCounts n{};
  for (int i = 0; i < 2; ++i) {
    if (!launch.group[i].runs) continue;
    n.num1[i] = num_tasks_of<Gemm::kGateUp>(launch.group[i].p1);
    n.num2[i] = num_tasks_of<Gemm::kDown>(launch.group[i].p2);
  }
  if (threadIdx.x < kNumProducerThreads) {
    ptx::setmaxnreg_dec<kChainProducerRegs>();
    produce_chain(launch, n, smem, full, empty);
  } else {
    ptx::setmaxnreg_inc<kChainConsumerRegs>();
    consume_chain<kRoutedGemm1>(launch, n, smem, full, empty);
  }
}

// Whether a combine behind a GEMM's tiles can run on these rows: whole 8-column vectors, a route or more per token,
// the shared group's rows (when it runs in the launch) as wide as the routed ones, and one table entry per rank.
inline bool combine_fits(const ChainCombine& combine, const Params& routed, const Params& shared, bool with_shared) {
  return routed.n % moe::kVecElems == 0 && combine.num_topk >= 1 && (!with_shared || shared.n == routed.n) &&
         combine.rank >= 0 && combine.rank < kMaxRanks && combine.rows[combine.rank] == routed.out &&
         combine.rows_capacity >= routed.num_rows && combine.rows_capacity <= kLocalIdMask + 1;
}

// The combine at EP = 1: every table's entry 0, the routed GEMM's rows (routed_rows) this launch's.
inline ChainCombine local_combine(const int32_t* route_to_row, const float* topk_weights, const void* shared,
                                  void* out, int32_t* token_done, int num_topk, int shared_counts,
                                  const Params& routed_rows) {
  ChainCombine c{};
  c.route_to_row = route_to_row, c.topk_weights[0] = topk_weights;
  c.shared[0] = static_cast<const uint16_t*>(shared), c.out[0] = static_cast<uint16_t*>(out);
  c.token_done[0] = token_done, c.rows[0] = routed_rows.out, c.rows_capacity = routed_rows.num_rows;
  c.num_topk = num_topk, c.shared_counts = shared_counts, c.num_ranks = 1;
  return c;
}

// A chain kernel's persistent launch for `total` tasks (none: nothing to launch).
template <typename Launch>
cudaError_t launch_chain_kernel(void (*kernel)(Launch), const Launch& launch, int64_t total, int num_sms,
                                cudaStream_t stream) {
  if (total == 0) return cudaSuccess;
  if (total > INT32_MAX) return cudaErrorInvalidValue;
  int grid = 0;
  cudaError_t err = persistent_gemm_grid(kernel, total, num_sms, &grid);
  if (err) return err;
  kernel<<<grid, kNumThreads, kSmemBytes, stream>>>(launch);
  return cudaGetLastError();
}

// The combine over ranks from the host API's lists (ranks.num_ranks > 0): false where they do not fit this
// launch's own tensors (combine's entry 0, from local_combine).
inline bool combine_over_ranks(const ChainRanks& r, int64_t num_rows, ChainCombine* combine) {
  const ChainCombine own = *combine;
  if (r.num_ranks > kMaxRanks || r.rank < 0 || r.rank >= r.num_ranks || r.y[r.rank] != own.rows[0] ||
      r.out[r.rank] != own.out[0] || r.token_done[r.rank] != own.token_done[0] || r.y_capacity < num_rows ||
      r.y_capacity > kLocalIdMask + 1)
    return false;
  for (int s = 0; s < r.num_ranks; ++s)
    if (r.y[s] == nullptr || r.out[s] == nullptr || r.token_done[s] == nullptr) return false;
  for (int s = 0; s < r.num_ranks; ++s) {
    combine->topk_weights[s] = r.topk_weights[s], combine->shared[s] = static_cast<const uint16_t*>(r.shared[s]);
    combine->out[s] = static_cast<uint16_t*>(r.out[s]), combine->token_done[s] = r.token_done[s];
    combine->rows[s] = static_cast<const uint16_t*>(r.y[s]), combine->token_offset[s] = r.token_offset[s];
  }
  for (int s = r.num_ranks; s < kMaxRanks; ++s) combine->out[s] = nullptr;
  combine->rows_capacity = r.y_capacity, combine->rank = r.rank, combine->num_ranks = r.num_ranks;
  return true;
}

// One group's operands: p1 = gate_up_params, p2 = down_params (a = p1's h); h_ready: int32 zeros, one per m-tile of
// its row buffers (num_rows / BLOCK_M).
struct ChainGroupArgs {
  const void *w_gate, *w_up, *w_down;
  int64_t num_experts;
  Params p1, p2;
  int32_t* h_ready;
  const void* a[kMaxRanks];  // GEMM1's gathered A by rank (row ids over ranks); entry 0 null: p1.a alone (EP = 1)
};

// routed: the routed experts; shared: the shared expert (w_gate null: none); combine: out[rank] null, or its tables
// (token_done zeros; with a shared expert, its shared is the shared group's y and shared_counts 1). kRoutedGemm1:
// kGateUp, or kGateUpMxOut (routed.p1's gate and up then the row-wise MXFP8 buffers, mx_of).
template <Gemm kRoutedGemm1>
inline cudaError_t launch_grouped_gemm_bf16_chain(const ChainGroupArgs& routed, const ChainGroupArgs& shared,
                                                  ChainCombine combine, TaskTrace trace, int num_sms,
                                                  cudaStream_t stream) {
  static_assert(kRoutedGemm1 == Gemm::kGateUp || kRoutedGemm1 == Gemm::kGateUpMxOut, "GEMM1 kinds of the chain");
  ChainLaunch launch{};
  int64_t total = 0;
  const ChainGroupArgs* args[2] = {&shared, &routed};
  for (int i = 0; i < 2; ++i) {
    const ChainGroupArgs& a = *args[i];
    if (a.w_gate == nullptr) continue;  // no shared expert: its group runs no task
    ChainGroup& g = launch.group[i];
    g.p1 = a.p1, g.p2 = a.p2, g.h_ready = a.h_ready;
    for (int s = 0; s < kMaxRanks; ++s) g.a[s] = static_cast<const uint16_t*>(a.a[s]);
    g.over_ranks = g.a[0] != nullptr;
    TaskMaps m1, m2;
    int64_t num1 = 0, num2 = 0;
    cudaError_t err = i == kRoutedGroup
                          ? prepare_tasks<kRoutedGemm1>(a.w_gate, a.w_up, a.num_experts, g.p1, {}, &m1, &num1)
                          : prepare_tasks<Gemm::kGateUp>(a.w_gate, a.w_up, a.num_experts, g.p1, {}, &m1, &num1);
    if (err || (err = prepare_tasks<Gemm::kDown>(a.w_down, a.w_down, a.num_experts, g.p2, {}, &m2, &num2)))
      return err;
    if (g.p1.num_m_tiles != g.p2.num_m_tiles) return cudaErrorInvalidValue;
    g.maps = ChainMaps{m1.b0, m1.b1, m1.out, m1.gate, m1.up, m2.a, m2.b0, m2.out};
    g.h_target = kNumConsumerWarps * g.p1.num_n_tiles;
    g.k_blocks1 = num_k_blocks_of<Gemm::kGateUp>(g.p1.k), g.k_blocks2 = num_k_blocks_of<Gemm::kDown>(g.p2.k);
    g.runs = num1 + num2 > 0;
    total += num1 + num2;
  }
  if (total == 0) return cudaSuccess;
  if (combine.out[combine.rank] != nullptr &&
      !combine_fits(combine, launch.group[kRoutedGroup].p2, launch.group[kSharedGroup].p2, shared.w_gate != nullptr))
    return cudaErrorInvalidValue;
  launch.combine = combine, launch.trace = trace;
  return launch_chain_kernel(grouped_gemm_bf16_chain_kernel<kRoutedGemm1>, launch, total, num_sms, stream);
}

}  // namespace mok::gemm
