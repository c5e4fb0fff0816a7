// The grouped GEMMs' producer warpgroup: TMA loads, the gathered A rows, MXFP8 weights' landing and
// dequantization into the stage ring.
#pragma once

#include "mok/gemm/tasks.cuh"

namespace mok::gemm {

// ---- producer: warpgroup 0 -----------------------------------------------------------------------------

// Thread 0: the tensor-map loads of one stage (B0, B1, and A unless it is gathered). tmap_b1 is Wu for
// kGateUp and kGateUpDgrad (its second half of K), unused otherwise; tmap_a2 is d_up for kGateUpDgrad.
// MN-major operands come as boxes of 64 columns × 64 k-rows, two per 128 columns (8 KiB apart).
template <Gemm kGemm>
MOK_DEVICE void issue_tma(const CUtensorMap* tmap_a, const CUtensorMap* tmap_a2, const CUtensorMap* tmap_b0,
                          const CUtensorMap* tmap_b1, uint8_t* smem, uint64_t* bar, uint32_t stage, const Task& t,
                          int kb, int k) {
  using T = Tile<kGemm>;
  const int half_blocks = static_cast<int>(ceil_div(k, BLOCK_K));
  const bool second = kGemm == Gemm::kGateUpDgrad && kb >= half_blocks;
  const int k0 = t.k_row0 + (second ? kb - half_blocks : kb) * BLOCK_K;
  const int batch = kGemm == Gemm::kWeightGrad ? 0 : t.expert;  // kWeightGrad's operands are row matrices
  const int n0 = t.n_tile * T::kTaskN, m0 = t.m_tile * BLOCK_M;
  const CUtensorMap* b_first = second ? tmap_b1 : tmap_b0;
  const CUtensorMap* b_second = T::kSwiGLU ? tmap_b1 : b_first;
  ptx::mbarrier_arrive_expect_tx(bar, T::kTmaBytes);
  if constexpr (T::kMajorMNA) {  // map dims (m, rows, 1)
    ptx::tma_load_3d(stage_a(smem, stage), tmap_a, m0, k0, 0, bar);
    ptx::tma_load_3d(stage_a(smem, stage) + kATileBytes / 2, tmap_a, m0 + 64, k0, 0, bar);
  } else if constexpr (!T::kGather) {  // map dims (k, rows, 1)
    ptx::tma_load_3d(stage_a(smem, stage), second ? tmap_a2 : tmap_a, k0, m0, 0, bar);
  }
  for (int which = 0; which < (T::kMx ? 0 : 2); ++which) {  // MXFP8 B: issue_landing
    const CUtensorMap* map = which == 0 ? b_first : b_second;
    const int col = n0 + which * T::kB1Offset;
    if constexpr (T::kMajorMN) {  // map dims (n, k, experts), box (64, 64, 1)
      ptx::tma_load_3d(stage_b(smem, stage, which), map, col, k0, batch, bar);
      ptx::tma_load_3d(stage_b(smem, stage, which) + T::kBHalfBytes, map, col + 64, k0, batch, bar);
    } else {  // map dims (k, n, experts), box (64, 128, 1)
      ptx::tma_load_3d(stage_b(smem, stage, which), map, k0, col, batch, bar);
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
      // NOTE: fp32 scale multiplies, as mxfp8_dequantize: a cheaper-looking path (one cvt per two elements, then
      // integer ops and a bf16 multiply by 2^(112+e)) is slower in this producer (docs/gemm.md).
      const float s = mxfp8::scale_byte_to_f32((scale_bytes >> (8 * (c / 2))) & 0xFFu);
      const float scale[8] = {s, s, s, s, s, s, s, s};
      *reinterpret_cast<uint4*>(b_tile + sw128_offset(row, 2 * c)) =
          mxfp8::dequantize8(make_uint2(q[c].x, q[c].y), scale);
      *reinterpret_cast<uint4*>(b_tile + sw128_offset(row, 2 * c + 1)) =
          mxfp8::dequantize8(make_uint2(q[c].z, q[c].w), scale);
    }
  }
}

// Producer thread (row_in_tile, chunk) of a gathered A: the source rows of its kRowsPerThread rows of m-tile
// m_tile (row_to_token; -1 = a zero row).
MOK_DEVICE void gathered_tokens(const Params& p, int m_tile, uint32_t row_in_tile, int32_t (&token)[kRowsPerThread]) {
#pragma unroll
  for (int j = 0; j < kRowsPerThread; ++j) token[j] = p.row_to_token[m_tile * BLOCK_M + row_in_tile + kRowStride * j];
}

// Its 16-byte chunks of k-block kb of the gathered A into stage `stage` by cp.async, then its arrival on `full`
// once they have landed. row_of(token): that token's row of A (its first element).
template <typename RowOf>
MOK_DEVICE void gather_rows_stage(const Params& p, uint8_t* smem, uint32_t stage, uint64_t* full,
                                  const int32_t (&token)[kRowsPerThread], uint32_t row_in_tile, uint32_t chunk, int kb,
                                  RowOf row_of) {
  uint8_t* a_tile = stage_a(smem, stage);
  const int col = kb * BLOCK_K + static_cast<int>(chunk) * 8;  // first element of this thread's chunk
#pragma unroll
  for (int j = 0; j < kRowsPerThread; ++j) {
    const bool real = token[j] >= 0 && col < p.k;  // k % 8 == 0: a chunk is all in or all out
    const uint16_t* src = real ? row_of(token[j]) + col : p.a;
    ptx::cp_async_16_zfill(a_tile + sw128_offset(row_in_tile + kRowStride * j, chunk), src, real ? 16 : 0);
  }
  ptx::cp_async_mbarrier_arrive_noinc(full);
}

// gather_rows_stage from p.a's rows, token t at row t.
MOK_DEVICE void gather_a_stage(const Params& p, uint8_t* smem, uint32_t stage, uint64_t* full,
                               const int32_t (&token)[kRowsPerThread], uint32_t row_in_tile, uint32_t chunk, int kb) {
  gather_rows_stage(p, smem, stage, full, token, row_in_tile, chunk, kb,
                    [&](int32_t t) { return p.a + static_cast<int64_t>(t) * p.k; });
}

template <Gemm kGemm>
MOK_DEVICE void produce(const CUtensorMap* tmap_a, const CUtensorMap* tmap_a2, const CUtensorMap* tmap_b0,
                        const CUtensorMap* tmap_b1, const Landing& land, const Params& p,
                        uint8_t* smem, uint64_t* full, uint64_t* empty, int num_tasks, int num_k_blocks) {
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
  for_each_task(num_tasks, [&](int task) {
    const Task t = decode_task<kGemm>(p, task, num_k_blocks, num_tasks);
    int32_t token[kRowsPerThread];  // source row of each of this thread's A rows, -1 = zero row
    if constexpr (T::kGather) gathered_tokens(p, t.m_tile, row_in_tile, token);
    for (int kb = 0; kb < t.num_k_blocks; ++kb, ++it) {
      const uint32_t stage = it % T::kStages, phase = (it / T::kStages) & 1;
      if constexpr (T::kMx) {  // before waiting for the stage: the landing runs ahead of the consumers too
        const int ahead = static_cast<int>(it) + kNumLanding - 1;
        if (thread == 0 && ahead < num_landings) issue_landing<kGemm>(land, p, smem, ahead, num_k_blocks, num_tasks);
      }
      ptx::mbarrier_wait_parity(&empty[stage], phase ^ 1);  // the slot is free
      if constexpr (T::kTmaIntoStage) {
        if (thread == 0)
          issue_tma<kGemm>(tmap_a, tmap_a2, tmap_b0, tmap_b1, smem, &full[stage], stage, t, kb, p.k);
      }
      if constexpr (T::kGather) gather_a_stage(p, smem, stage, &full[stage], token, row_in_tile, chunk, kb);
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

}  // namespace mok::gemm
