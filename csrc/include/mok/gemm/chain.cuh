// GEMM1 and GEMM2 of the routed experts in one persistent launch, the megakernel's first step at EP = 1
// (docs/megakernel.md): the tasks of kGateUp (h, gate, up from x gathered) and then those of kDown (y = h·W_downᵀ),
// numbered one after the other and taken by each CTA in the static stride of for_each_task, so GEMM2's first tiles
// run in GEMM1's last wave instead of after it. Same tiles, same fp32 sums: the bits of the two launches.
// Measured on an H100: no faster than the two launches (docs/gemm.md), so the fused level keeps those; this is the
// pattern the megakernel's other kinds follow.
//
// A kDown task of m-tile m reads h's rows of m, which the kGateUp tasks of m write. Each consumer warp of a kGateUp
// task increments h_ready[m] once that task's stores have finished (bulk_wait_group<0>, then a release); the kDown
// task's producer waits until h_ready[m] = kNumConsumerWarps · (GEMM1's n-tiles), then its TMA loads read h. The
// warp sends a task's signal late, after its next task's mainloop (by then its stores are long done, so the wait
// costs nothing), but always before a kDown mainloop and at its end.
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
// With a combine (ChainCombine::out set), GEMM2's tiles also finish the layer's routed combine, and no CTA waits
// for it: after a consumer warp's 16 rows of a GEMM2 tile are stored, each row counts once for its token's
// 256-column slice (token_done[token, n-tile], acquire-release), and the warp whose count reaches the token's
// number of routes sums that slice of out = bf16(Σ_k w·y[row(t, k)] + shared[t]) in increasing k, as combine_rows
// does (moe/combine.cuh: the same bits). A token's slice is complete with the last of its K routes' tiles, so the
// combines run inside GEMM2's tasks instead of in a launch after them.
#pragma once

#include "mok/gemm/grouped_gemm_bf16.cuh"
#include "mok/moe/combine.cuh"

namespace mok::gemm {

using Gemm1 = Tile<Gemm::kGateUp>;
using Gemm2 = Tile<Gemm::kDown>;
constexpr int kChainProducerRegs = 64, kChainConsumerRegs = 216;
static_assert(Gemm1::kStages == Gemm2::kStages && Gemm1::kFullArrivals == kNumProducerThreads + 1,
              "one stage ring for both kinds; the arrivals produce_chain makes");
static_assert(kNumProducerThreads * kChainProducerRegs + kNumConsumerGroups * kWarpgroup * kChainConsumerRegs <=
                  kNumThreads * kLaunchRegs,
              "the register budgets fit the CTA's launch registers");

// The tensor maps of the two kinds (kernel parameters).
struct ChainMaps {
  CUtensorMap w_gate, w_up, h, gate, up;  // GEMM1: B0, B1, and its outputs
  CUtensorMap h_rows, w_down, y;          // GEMM2: A, B (both halves), its output
};

// The combine behind GEMM2 (out null: none). Tokens index route_to_row and topk_weights as [num_tokens, num_topk].
struct ChainCombine {
  const int32_t* route_to_row;  // a route's row (GEMM2's y row), -1: none (its token's slices are NaN)
  const float* topk_weights;
  const uint16_t* shared;       // [num_tokens, hidden] bf16, or null
  uint16_t* out;                // [num_tokens, hidden] bf16
  int32_t* token_done;          // [num_tokens, GEMM2's n-tiles], zero at launch
  int num_topk;
};

// The tasks of one launch: GEMM1's are [0, num1), GEMM2's [num1, num1 + num2).
struct ChainTasks {
  int num1, num2, k_blocks1, k_blocks2;
  int32_t* h_ready;  // [GEMM1's m-tiles], zero at launch
  int h_target;      // kNumConsumerWarps · GEMM1's n-tiles
  ChainCombine combine;
};

MOK_DEVICE void produce_chain(const ChainMaps& m, const Params& p1, const Params& p2, const ChainTasks& c,
                              uint8_t* smem, uint64_t* full, uint64_t* empty) {
  const uint32_t thread = threadIdx.x;  // 0..127
  const uint32_t chunk = thread % kChunksPerRow, row_in_tile = thread / kChunksPerRow;
  uint32_t it = 0;  // position in the (task, k-block) sequence, shared with the consumers
  for_each_task(c.num1 + c.num2, [&](int task) {
    if (task < c.num1) {
      const Task t = decode_task<Gemm::kGateUp>(p1, task, c.k_blocks1, c.num1);
      int32_t token[kRowsPerThread];
      gathered_tokens(p1, t.m_tile, row_in_tile, token);
      for (int kb = 0; kb < t.num_k_blocks; ++kb, ++it) {
        const uint32_t stage = it % kNumStages, phase = (it / kNumStages) & 1;
        ptx::mbarrier_wait_parity(&empty[stage], phase ^ 1);
        if (thread == 0)
          issue_tma<Gemm::kGateUp>(nullptr, nullptr, &m.w_gate, &m.w_up, smem, &full[stage], stage, t, kb, p1.k);
        gather_a_stage(p1, smem, stage, &full[stage], token, row_in_tile, chunk, kb);
      }
    } else {
      const Task t = decode_task<Gemm::kDown>(p2, task - c.num1, c.k_blocks2, c.num2);
      if (thread == 0) {
        ptx::wait_counter(&c.h_ready[t.m_tile], c.h_target);
        ptx::fence_proxy_async_global();  // h's rows, announced by the counter, before the TMA loads read them
      }
      for (int kb = 0; kb < t.num_k_blocks; ++kb, ++it) {
        const uint32_t stage = it % kNumStages, phase = (it / kNumStages) & 1;
        ptx::mbarrier_wait_parity(&empty[stage], phase ^ 1);
        if (thread == 0)
          issue_tma<Gemm::kDown>(&m.h_rows, nullptr, &m.w_down, &m.w_down, smem, &full[stage], stage, t, kb, p2.k);
        ptx::mbarrier_arrive(&full[stage]);
      }
    }
  });
  ptx::cp_async_wait_all();  // NOTE: no copies in flight behind an exited thread
}

// One token's 256-column slice n of out, by one warp (lane l: 8 columns): combine_rows' sum, from y rows that other
// CTAs of this launch may have stored (read from L2).
MOK_DEVICE void combine_slice(const ChainCombine& cb, const Params& p2, int token, int n_tile, uint32_t lane) {
  static_assert(Gemm2::kTaskN == kWarpSize * moe::kVecElems, "a lane's 8 columns of a GEMM2 tile");
  const int64_t vecs = p2.n / moe::kVecElems, vec = static_cast<int64_t>(n_tile) * kWarpSize + lane;
  if (vec >= vecs) return;
  const int64_t route0 = static_cast<int64_t>(token) * cb.num_topk, col = vec * moe::kVecElems;
  const int64_t token_col = static_cast<int64_t>(token) * p2.n + col;
  moe::Acc8 acc;
  moe::acc_zero(acc);
  bool bad = false;
  for (int k = 0; k < cb.num_topk; ++k) {  // increasing k: combine_rows' order
    const int64_t row = cb.route_to_row[route0 + k];
    if (row < 0 || row >= p2.num_rows) {
      bad = true;
      continue;
    }
    const uint4 y = ptx::ld_cg_v4(p2.out + row * p2.n + col);
    moe::acc_add(acc, y, cb.topk_weights[route0 + k], false);
  }
  if (cb.shared != nullptr) moe::acc_add(acc, ld_stream_v4(cb.shared + token_col), 1.0f, true);
  if (bad) {
#pragma unroll
    for (int i = 0; i < moe::kVecElems; ++i) acc.v[i] = __int_as_float(0x7FC00000);  // NaN: never silent
  }
  st_v4(cb.out + token_col, moe::acc_to_bf16(acc));
}

// After this warp stored rows [row0, row0 + 16) of GEMM2's tile n: each real row counts for its token's slice n,
// and the warp combines the slices it completed.
MOK_DEVICE void combine_rows_done(const ChainCombine& cb, const Params& p2, int row0, int n_tile, uint32_t lane) {
  if (lane == 0) {
    ptx::bulk_wait_group<0>();  // this warp's stores of the tile have finished
    ptx::fence_proxy_async_global();
  }
  __syncwarp();
  int token = -1;
  bool last = false;
  if (lane < 16) {
    token = p2.row_to_token[row0 + lane];  // -1: a padding row
    if (token >= 0) {
      int routes = 0;  // the token's routes with a row: the count its slices reach
      const int32_t* rows = cb.route_to_row + static_cast<int64_t>(token) * cb.num_topk;
      for (int k = 0; k < cb.num_topk; ++k) routes += rows[k] >= 0;
      int32_t* done = cb.token_done + static_cast<int64_t>(token) * p2.num_n_tiles + n_tile;
      last = ptx::atom_add_acq_rel_gpu(done, 1) == routes - 1;
    }
  }
  for (uint32_t left = __ballot_sync(kFullMask, last); left != 0; left &= left - 1) {
    const int t = __shfl_sync(kFullMask, token, __ffs(left) - 1);
    __syncwarp();  // the lane that counted last acquired the other rows' stores: ordered before every lane's loads
    combine_slice(cb, p2, t, n_tile, lane);
  }
}

MOK_DEVICE void consume_chain(const ChainMaps& m, const Params& p1, const Params& p2, const ChainTasks& c,
                              uint8_t* smem, uint64_t* full, uint64_t* empty) {
  const uint32_t group = threadIdx.x / kWarpgroup - 1;  // 0 or 1: which 64 rows of the tile
  const uint32_t warp = (threadIdx.x % kWarpgroup) / kWarpSize;
  const uint32_t lane = lane_id();
  const uint32_t a_offset = group * WG_M * kRowBytes;
  Staging staging{smem + kMainBytes +
                      (threadIdx.x / kWarpSize - kNumProducerThreads / kWarpSize) * kStagingBytesPerWarp,
                  0};
  Epilogue<Gemm::kGateUp, false> epilogue1;
  Epilogue<Gemm::kDown, false> epilogue2;
  int pending = -1;  // the m-tile of this warp's last kGateUp task, not yet signalled
  const auto signal = [&] {
    if (pending < 0) return;
    if (lane == 0) {
      ptx::bulk_wait_group<0>();  // this warp's stores of that task have finished (and any before them)
      ptx::fence_proxy_async_global();
      ptx::red_release_gpu_add(&c.h_ready[pending], 1);
    }
    pending = -1;
  };
  uint32_t it = 0;
  for_each_task(c.num1 + c.num2, [&](int task) {
    float acc0[kAccPerThread], acc1[kAccPerThread];
#pragma unroll
    for (int i = 0; i < kAccPerThread; ++i) acc0[i] = 0.0f, acc1[i] = 0.0f;
    if (task < c.num1) {
      const Task t = decode_task<Gemm::kGateUp>(p1, task, c.k_blocks1, c.num1);
      it = mma_k_blocks<kNumStages, true, false, false, 0>(acc0, acc1, smem, a_offset, full, empty, it,
                                                           t.num_k_blocks, lane, [] {});
      signal();
      const int row0 = t.m_tile * BLOCK_M + group * WG_M + 16 * warp;
      epilogue1.finish(acc0, acc1, p1, {&m.h, &m.gate, &m.up}, staging, row0, t.n_tile * Gemm1::kTaskN, t.expert,
                       lane);
      pending = t.m_tile;
    } else {
      const Task t = decode_task<Gemm::kDown>(p2, task - c.num1, c.k_blocks2, c.num2);
      signal();  // before any kDown mainloop: a producer may wait for it
      it = mma_k_blocks<kNumStages, false, false, false, 0>(acc0, acc1, smem, a_offset, full, empty, it,
                                                            t.num_k_blocks, lane, [] {});
      const int row0 = t.m_tile * BLOCK_M + group * WG_M + 16 * warp;
      const Outputs out2{&m.y, nullptr, nullptr};
      epilogue2.finish(acc0, acc1, p2, out2, staging, row0, t.n_tile * Gemm2::kTaskN, t.expert, lane);
      epilogue2.store_rest(p2, out2, staging, lane);
      if (c.combine.out != nullptr) combine_rows_done(c.combine, p2, row0, t.n_tile, lane);
    }
  });
  signal();
  drain_stores(lane);
}

__global__ void __launch_bounds__(kNumThreads, 1)
    grouped_gemm_bf16_chain_kernel(const __grid_constant__ ChainMaps maps, const Params p1, const Params p2,
                                   const ChainTasks tasks) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (ptx::kSw128AtomBytes - ptx::smem_addr(smem_raw) % ptx::kSw128AtomBytes) %
                                 ptx::kSw128AtomBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kMainBytes + kStagingBytes + kLandScalesBytes);
  uint64_t* empty = full + kNumStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      ptx::mbarrier_init(&full[s], Gemm1::kFullArrivals);
      ptx::mbarrier_init(&empty[s], kNumConsumerWarps);
    }
    ptx::fence_mbarrier_init();
    ptx::prefetch_tensor_map(&maps.w_gate), ptx::prefetch_tensor_map(&maps.w_up);
    ptx::prefetch_tensor_map(&maps.h), ptx::prefetch_tensor_map(&maps.gate), ptx::prefetch_tensor_map(&maps.up);
    ptx::prefetch_tensor_map(&maps.h_rows), ptx::prefetch_tensor_map(&maps.w_down), ptx::prefetch_tensor_map(&maps.y);
  }
  __syncthreads();  // NOTE: the last block-wide barrier: roles split below and may exit independently
  ChainTasks c = tasks;
  c.num1 = num_tasks_of<Gemm::kGateUp>(p1), c.num2 = num_tasks_of<Gemm::kDown>(p2);  // the real m-tiles' tasks
  if (threadIdx.x < kNumProducerThreads) {
    ptx::setmaxnreg_dec<kChainProducerRegs>();
    produce_chain(maps, p1, p2, c, smem, full, empty);
  } else {
    ptx::setmaxnreg_inc<kChainConsumerRegs>();
    consume_chain(maps, p1, p2, c, smem, full, empty);
  }
}

// p1: GEMM1's parameters (gate_up_params), p2: GEMM2's (down_params, a = p1's h); h_ready: int32 zeros, one per
// m-tile of the row buffers (num_rows / BLOCK_M); combine: out null, or its tensors (token_done zeros).
inline cudaError_t launch_grouped_gemm_bf16_chain(const void* w_gate, const void* w_up, const void* w_down,
                                                  int64_t num_experts, Params p1, Params p2, int32_t* h_ready,
                                                  ChainCombine combine, int num_sms, cudaStream_t stream) {
  TaskMaps m1, m2;
  int64_t num1 = 0, num2 = 0;
  cudaError_t err = prepare_tasks<Gemm::kGateUp>(w_gate, w_up, num_experts, p1, {}, &m1, &num1);
  if (err || (err = prepare_tasks<Gemm::kDown>(w_down, w_down, num_experts, p2, {}, &m2, &num2))) return err;
  if (num1 == 0 && num2 == 0) return cudaSuccess;
  if (p1.num_m_tiles != p2.num_m_tiles || num1 + num2 > INT32_MAX) return cudaErrorInvalidValue;
  const ChainMaps maps{m1.b0, m1.b1, m1.out, m1.gate, m1.up, m2.a, m2.b0, m2.out};
  if (combine.out != nullptr && (p2.n % moe::kVecElems != 0 || combine.num_topk < 1)) return cudaErrorInvalidValue;
  const ChainTasks tasks{static_cast<int>(num1), static_cast<int>(num2), num_k_blocks_of<Gemm::kGateUp>(p1.k),
                         num_k_blocks_of<Gemm::kDown>(p2.k), h_ready, kNumConsumerWarps * p1.num_n_tiles, combine};
  int grid = 0;
  if ((err = persistent_gemm_grid(grouped_gemm_bf16_chain_kernel, num1 + num2, num_sms, &grid))) return err;
  grouped_gemm_bf16_chain_kernel<<<grid, kNumThreads, kSmemBytes, stream>>>(maps, p1, p2, tasks);
  return cudaGetLastError();
}

}  // namespace mok::gemm
