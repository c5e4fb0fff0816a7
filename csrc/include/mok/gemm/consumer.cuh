// The grouped GEMMs' consumer warpgroups: the wgmma mainloop over the stage ring, the folded tails'
// transposed MMAs and stores (MOK_GEMM_FOLD), and the task loop around the epilogue.
#pragma once

#include "mok/gemm/epilogue.cuh"

namespace mok::gemm {

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

// The probes (MOK_GEMM_FOLD 1 and 2) drop the fold's accumulators, and ptxas then deletes their wgmmas as dead code
// (there were no m64n32k16 in the probes' SASS until 2026-12-05: the probes timed the tail loads only). A store of
// their sum under a condition ptxas cannot prove false, and that never holds, keeps the MMAs.
__device__ float g_fold_sink;
MOK_DEVICE void keep_fold_mmas(const FoldAcc& f) {
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kFoldAccPerThread; ++i) sum += f.w0[i] + f.w1[i];
  if (__float_as_uint(sum) == 0xffc0ffeeu) g_fold_sink = sum;  // a NaN payload no sum of these MMAs produces
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
  if constexpr (!kFoldZeroesTails) return;
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
    if constexpr (!kDefer) epilogue.store_rest(p, outputs, staging, lane);
    if constexpr (T::kFold && !kFoldWritesTails) {
      if (fold) keep_fold_mmas(fold_acc);
    }
    if constexpr (T::kFold && kFoldWritesTails) {
      if (fold) store_folded_tail<kGemm>(fold_acc, p, staging, (t.m_tile + 1) * BLOCK_M, t.n_tile * T::kTaskN, group,
                                         warp, lane);
    }
#if MOK_GEMM_TRACE  // the epilogue's end: after every store this task issues (a folded tail's too)
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
  });
  epilogue.store_rest(p, outputs, staging, lane);
  drain_stores(lane);
}

}  // namespace mok::gemm
