// The grouped GEMMs' consumer warpgroups: the wgmma mainloop over the stage ring, and the task loop around the
// epilogue.
#pragma once

#include "mok/gemm/epilogue.cuh"

namespace mok::gemm {

// ---- consumers: warpgroups 1 and 2 ---------------------------------------------------------------------

MOK_DEVICE void fence_accumulators(float (&acc0)[kAccPerThread], float (&acc1)[kAccPerThread]) {
#pragma unroll
  for (int i = 0; i < kAccPerThread; ++i) ptx::fence_operand(acc0[i]), ptx::fence_operand(acc1[i]);
}

// The mainloop of one task: k-block by k-block, wait for the stage, 4 k16 steps of one n256 wgmma, keep one
// group in flight and release the previous stage. `under_mma()` runs after each of the first kUnderMma k-blocks'
// wgmmas are issued, before their wait (a held tile's pieces); those k-blocks are peeled off the loop, so the loop
// is the code it is without a held tile and the held words are dead in it. Returns the position in the stage
// sequence after the task.
template <int kStages, bool kGather, bool kMajorMNA, bool kMajorMN, int kUnderMma, typename UnderMma>
MOK_DEVICE uint32_t mma_k_blocks(float (&acc0)[kAccPerThread], float (&acc1)[kAccPerThread], uint8_t* smem,
                                 uint32_t a_offset, uint64_t* full, uint64_t* empty, uint32_t it, int num_k_blocks,
                                 uint32_t lane, UnderMma under_mma) {
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
    // NOTE: one m64n256k16 over B0|B1 reads each A slice from shared memory once, where two m64n128k16 (one per B
    // tile) would read it twice: same fragments and bits, a little faster at the power cap (docs/gemm.md).
    constexpr uint32_t kBStep = kMajorMN ? 16 * 128 : 32;
    // B1 follows B0 in the stage: one descriptor spans both (MN-major: 64-column boxes 8 KiB apart throughout).
    const uint64_t desc_b = kMajorMN ? ptx::smem_desc_sw128_mn(stage_b(smem, stage, 0), kBTileBytes / 2)
                                     : ptx::smem_desc_sw128(stage_b(smem, stage, 0));
    fence_accumulators(acc0, acc1);
    ptx::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
      const uint64_t a = ptx::desc_advance(desc_a, kAStep * kk);
      ptx::wgmma_m64n256k16_bf16<kMajorMNA, kMajorMN>(acc0, acc1, a, ptx::desc_advance(desc_b, kBStep * kk));
    }
    ptx::wgmma_commit_group();
    under();
    ptx::wgmma_wait_group<1>();  // k-block kb - 1's MMAs are done: its stage can be refilled
    fence_accumulators(acc0, acc1);
    if (kb > 0 && lane == 0) ptx::mbarrier_arrive(&empty[prev_stage]);
    prev_stage = stage;
    ++it;
  };
#pragma unroll
  for (int kb = 0; kb < kUnderMma; ++kb)
    if (kb < num_k_blocks) k_block(kb, under_mma);
  for (int kb = kUnderMma; kb < num_k_blocks; ++kb) k_block(kb, [] {});
  ptx::wgmma_wait_group<0>();
  fence_accumulators(acc0, acc1);
  if (num_k_blocks > 0 && lane == 0) ptx::mbarrier_arrive(&empty[prev_stage]);
  return it;
}

template <Gemm kGemm>
MOK_DEVICE void consume(const Params& p, const Outputs& outputs, uint8_t* smem, uint64_t* full, uint64_t* empty,
                        int num_tasks, int num_k_blocks) {
  using T = Tile<kGemm>;
  const uint32_t group = threadIdx.x / kWarpgroup - 1;  // 0 or 1: which 64 rows of the tile
  const uint32_t warp = (threadIdx.x % kWarpgroup) / kWarpSize;
  const uint32_t lane = lane_id();
  const uint32_t a_offset = group * WG_M * kRowBytes;  // this warpgroup's rows of the A tile
  Staging staging{smem + kMainBytes +
                      (threadIdx.x / kWarpSize - kNumProducerThreads / kWarpSize) * kStagingBytesPerWarp,
                  0};
  // Only the weight gradients hold a tile into the next task's mainloop: their tasks are short (K = one expert's
  // rows), so storing under the next wgmmas pays off there; the row-wise kinds gain nothing (docs/gemm.md).
  constexpr bool kDefer = kGemm == Gemm::kWeightGrad;
  using Epi = Epilogue<kGemm, kDefer>;
  Epi epilogue;
  uint32_t it = 0;
  for_each_task(num_tasks, [&](int task) {
    Task t = decode_task<kGemm>(p, task, num_k_blocks, num_tasks);
    // The weight gradients' K comes from memory (expert_rows): broadcast from one lane, it stays warp-uniform, so
    // the mainloop's wgmma descriptors live in uniform registers (no R2UR moves per k-block; docs/gemm.md).
    if constexpr (kGemm == Gemm::kWeightGrad) t.num_k_blocks = warp_uniform(t.num_k_blocks);
    float acc0[kAccPerThread], acc1[kAccPerThread];  // kGateUp: gate, up; else columns n0.., n0+128..
#pragma unroll
    for (int i = 0; i < kAccPerThread; ++i) acc0[i] = 0.0f, acc1[i] = 0.0f;
    // Padding rows are multiplied too (the epilogue stores zeros there): skipping a tile's all-padding half ends
    // its tasks early and lets the CTAs fall out of step, which costs more than it saves (docs/gemm.md).
    it = mma_k_blocks<T::kStages, T::kGather, T::kMajorMNA, T::kMajorMN, kDefer ? Epi::kPieces : 0>(
        acc0, acc1, smem, a_offset, full, empty, it, t.num_k_blocks, lane,
        [&] { epilogue.store_next(p, outputs, staging, lane); });
    if constexpr (kDefer) epilogue.store_rest(p, outputs, staging, lane);  // a task of fewer k-blocks than pieces
    const int row0 = t.m_tile * BLOCK_M + group * WG_M + 16 * warp;  // this warp's 16 rows
    epilogue.finish(acc0, acc1, p, outputs, staging, row0, t.n_tile * T::kTaskN, t.expert, lane);
    if constexpr (!kDefer) epilogue.store_rest(p, outputs, staging, lane);
  });
  epilogue.store_rest(p, outputs, staging, lane);
  drain_stores(lane);
}

}  // namespace mok::gemm
