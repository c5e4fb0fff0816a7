// Grouped BF16 GEMMs over the route schedule (mok/schedule.py), sm_90a: persistent, warp-specialized,
// wgmma with fp32 accumulators in registers, weights by TMA, activation rows by TMA or gathered with
// 16-byte cp.async.
//
// For every row r of the schedule (e = the tile's expert, t = row_to_token[r]; padding rows t = -1 are
// written as zeros in every output), in L0's rounding points (mok.reference.expert_forward/_backward):
//   kGateUp       gate[r] = bf16(x[t]·Wg[e]ᵀ), up[r] = bf16(x[t]·Wu[e]ᵀ), h[r] = bf16(swiglu_n(gate[r], up[r]))
//                 (x rows gathered through row_to_token: the dispatch is fused)
//   kDown         out[r] = bf16(a[r]·W[e]ᵀ)                          (the down projection, or any NT GEMM)
//   kDownDgrad    d_h[r] = bf16(dy[r]·Wd[e])  (Wd [E, H, I] read MN-major; the SwiGLU backward runs after it
//                 as an elementwise kernel, mok/moe/swiglu_backward_rows.cuh: see the note there)
//   kGateUpDgrad  dx[r] = bf16(d_gate[r]·Wg[e] + d_up[r]·Wu[e])      (one fp32 sum over K = 2·I, MN-major B)
//   kWeightGrad   dW[e] = bf16(Σ_{r in e's segment} a[r]ᵀ·b[r])  [M, N] (a k-grouped GEMM: K = e's real rows,
//                 rounded up to 64 within the segment's zero padding rows; both operands MN-major; d_w_down
//                 from dy/h rows, d_w_gate/d_w_up from d_gate/d_up and x rows)
//   kGateUpMxOut  kGateUp for the MXFP8 forward (DESIGN §4): gate and up leave as MXFP8, row-wise (E4M3 data
//                 and E8M0 scales, mxfp8_quantize_rowwise's bits) and h as its row-wise round trip (bf16,
//                 mxfp8_fake_quantize's bits): GEMM2's operand and the backward's saved gate/up, with no kernel
//                 between (a warp's 16 × 128 tile holds whole 32-column blocks: `rowwise_blocks`)
//   kGateUpMx, kDownMx   kGateUp and kDown with MXFP8 weights (E4M3 data [E, n, k] and E8M0 scales along k):
//                 the producer dequantizes each weight tile in shared memory to exactly the bf16 that
//                 mxfp8_dequantize writes (mok/quant/mxfp8.cuh), so the outputs are the BF16 kinds' bits on
//                 dequantized weights, with a weight read of 1 + 1/32 bytes per element instead of 2.
//
// Task = one output tile: BLOCK_M = 128 rows (one expert) × kTaskN columns, over the full K in one CTA (no
// split-K: every output is one fp32 sum in a fixed order, bitwise identical for any grid size). CTA b
// takes tasks b, b + grid, b + 2·grid, ... in increasing order. Row-wise tasks are numbered in groups of
// kGroupM = 8 m-tiles, m fastest inside a group (decode_task): neighbouring CTAs run the m-tiles that share a
// weight tile at the same time, so each weight tile is read from HBM about once per group (docs/gemm.md,
// decisions).
//
// Roles (384 threads = 3 warpgroups): warpgroup 0 = producer (gives registers back), warpgroups 1 and 2 =
// consumers, each owning 64 of the tile's 128 rows (one wgmma m64n256k16 per k16 slice into two accumulators of
// 64 floats, B0's columns and B1's).
// Both roles walk the same (task, k-block) sequence through a ring of kNumStages shared-memory stages;
// stage s is handed over with two mbarriers:
//   full[s]:  gathered A: 128 arrivals (cp.async.mbarrier.arrive.noinc of every producer thread: fires when
//             that thread's copies have landed) + 1 arrive.expect_tx (B bytes);
//             A by TMA: 1 arrive.expect_tx (A + B bytes).
//   empty[s]: 8 arrivals = lane 0 of each consumer warp, once its wgmmas reading s have completed.
// The consumers keep one wgmma group in flight: k-block kb's MMAs run while kb - 1's stage is released.
//
// MXFP8 weights (kGateUpMx, kDownMx) take one more hop: thread 0 loads the E4M3 tiles of B0 and B1 (128 rows
// × 64 bytes each, 64-byte swizzle) and their scales by TMA into a ring of kNumLanding landing slots, up to
// kNumLanding - 1 k-blocks ahead; producer thread r then dequantizes row r of both into the stage's bf16 B
// tiles (the layout TMA writes for the BF16 kinds), fences, and arrives on full[s]. These kinds run
// kNumStages - 1 bf16 stages: the landing ring takes the fourth one's shared memory.
//
// Stage layout (bytes; every tile 1024-aligned): [A 128 rows × 128 B][B0 16 KiB][B1 16 KiB], 48 KiB.
//   kGateUp: B0 = Wg[e] rows n0..n0+127, B1 = Wu[e] rows n0..n0+127 (gate and up of the same columns, so the
//            epilogue holds both in registers); the others: B0/B1 = columns n0..n0+127 / n0+128..n0+255.
//   K-major B (nn.Linear rows, the forward): 128 rows of 128 bytes. MN-major B (the backward reads the
//   weights transposed): two boxes of 64 k-rows × 64 n (128 bytes), n0.. then n0+64.. (8 KiB apart).
#pragma once

#include "mok/gemm/consumer.cuh"
#include "mok/gemm/producer.cuh"

namespace mok::gemm {

// ---- the kernel ----------------------------------------------------------------------------------------

// A CTA's shared memory: [ring][staging of the 8 consumer warps][landing scales][barriers]. Dynamic shared memory is
// only 16-byte aligned for sure; the swizzle atoms need 1024 (kSmemBytes has the slack). NOTE: the barriers lie past
// the staging, where no stmatrix of a consumer warp can overwrite them.
struct CtaSmem {
  uint8_t* smem;          // the ring, 1024-aligned
  uint64_t *full, *empty;  // [kNumStages] each, then the landing barriers (MXFP8 kinds)
};
MOK_DEVICE CtaSmem cta_smem(uint8_t* smem_raw) {
  uint8_t* smem = smem_raw + (ptx::kSw128AtomBytes - ptx::smem_addr(smem_raw) % ptx::kSw128AtomBytes) %
                                 ptx::kSw128AtomBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kMainBytes + kStagingBytes + kLandScalesBytes);
  return {smem, full, full + kNumStages};
}

// Thread 0: the stage ring's barriers (full: full_arrivals per stage, empty: one per consumer warp).
MOK_DEVICE void init_stage_barriers(const CtaSmem& c, int stages, uint32_t full_arrivals) {
  for (int s = 0; s < stages; ++s) {
    ptx::mbarrier_init(&c.full[s], full_arrivals);
    ptx::mbarrier_init(&c.empty[s], kNumConsumerWarps);
  }
}

template <Gemm kGemm>
__global__ void __launch_bounds__(kNumThreads, 1)
    grouped_gemm_bf16_kernel(const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_a2,
                             const __grid_constant__ CUtensorMap tmap_b0, const __grid_constant__ CUtensorMap tmap_b1,
                             const __grid_constant__ CUtensorMap tmap_s0,  // MXFP8 kinds: B0's scales
                             const __grid_constant__ CUtensorMap tmap_s1,  // MXFP8 kinds: B1's scales
                             const __grid_constant__ CUtensorMap tmap_out,
                             const __grid_constant__ CUtensorMap tmap_gate,  // the SwiGLU kinds
                             const __grid_constant__ CUtensorMap tmap_up,    // the SwiGLU kinds
                             const Params p) {
  using T = Tile<kGemm>;
  extern __shared__ uint8_t smem_raw[];
  const CtaSmem c = cta_smem(smem_raw);
  uint8_t* smem = c.smem;
  uint64_t *full = c.full, *empty = c.empty;
  const Landing land{&tmap_b0, &tmap_b1, &tmap_s0, &tmap_s1, empty + kNumStages,
                     empty + kNumStages + kNumLanding};  // full, empty [kNumLanding] each

  if (threadIdx.x == 0) {
    init_stage_barriers(c, T::kStages, T::kFullArrivals);
    if constexpr (T::kMx) {
      for (int s = 0; s < kNumLanding; ++s) {
        ptx::mbarrier_init(&land.full[s], 1);
        ptx::mbarrier_init(&land.empty[s], kNumProducerThreads);
      }
    }
    ptx::fence_mbarrier_init();
    if constexpr (!T::kGather) ptx::prefetch_tensor_map(&tmap_a);
    if constexpr (kGemm == Gemm::kGateUpDgrad) ptx::prefetch_tensor_map(&tmap_a2);
    ptx::prefetch_tensor_map(&tmap_b0);
    ptx::prefetch_tensor_map(&tmap_b1);
    if constexpr (T::kMx) ptx::prefetch_tensor_map(&tmap_s0), ptx::prefetch_tensor_map(&tmap_s1);
    ptx::prefetch_tensor_map(&tmap_out);
    if constexpr (T::kSwiGLU) ptx::prefetch_tensor_map(&tmap_gate), ptx::prefetch_tensor_map(&tmap_up);
  }
  __syncthreads();  // NOTE: the last block-wide barrier: roles split below and may exit independently

  const int num_tasks = num_tasks_of<kGemm>(p);  // every thread reads the same 4 bytes: one load per warp
  const int num_k_blocks = num_k_blocks_of<kGemm>(p.k);  // kWeightGrad: per task (decode_task)
  if (threadIdx.x < kNumProducerThreads) {
    ptx::setmaxnreg_dec<T::kProducerRegs>();
    produce<kGemm>(&tmap_a, &tmap_a2, &tmap_b0, &tmap_b1, land, p, smem, full, empty, num_tasks, num_k_blocks);
  } else {
    ptx::setmaxnreg_inc<T::kConsumerRegs>();
    consume<kGemm>(p, {&tmap_out, &tmap_gate, &tmap_up}, smem, full, empty, num_tasks, num_k_blocks);
  }
}

// ---- host launcher -------------------------------------------------------------------------------------
// Encodes the tensor maps, sizes the persistent grid (min(num_sms or the device's SM count, tasks)) and
// launches on `stream`. w_b0/w_b1: the weights, bf16 [num_experts, ·, ·] in their stored (nn.Linear)
// layout: [E, n, k] for K-major kinds (kDown passes one matrix twice), [E, k, n] for the MN-major ones
// (kDownDgrad: W_down twice; kGateUpDgrad: W_gate, W_up). A rows (p.a, p.a2: [num_rows, k]) get a map each.
// kWeightGrad: w_b0 = w_b1 = the B rows [num_rows, n], p.a = the A rows [num_rows, m], num_experts = E.
// MXFP8 kinds: w_b0/w_b1 are the E4M3 data [E, n, k] and `mx` their scales in the k-block layout
// [E, ceil(k / 64), n, 2] (mok.ops.gemm.mx_scales_by_k_block: one TMA box of 256 bytes per tile and k-block).

struct MxScales {
  const void *s0, *s1;  // of w_b0, w_b1
};

// The tensor maps of one kind's kernel parameters (unused ones stay zero).
struct TaskMaps {
  CUtensorMap a, a2, b0, b1, s0, s1, out, gate, up;
};

// Sizes p's tiles (num_m_tiles, num_n_tiles, num_tasks) for kGemm and encodes its tensor maps; *num_tasks = 0: nothing
// to run.
template <Gemm kGemm>
cudaError_t prepare_tasks(const void* w_b0, const void* w_b1, int64_t num_experts, Params& p, MxScales mx,
                          TaskMaps* maps, int64_t* num_tasks) {
  using T = Tile<kGemm>;
  constexpr bool kWeightGrad = kGemm == Gemm::kWeightGrad;
  p.num_m_tiles = static_cast<int>(ceil_div(kWeightGrad ? p.m : p.num_rows, BLOCK_M));
  p.num_n_tiles = static_cast<int>(ceil_div(p.n, T::kTaskN));
  *num_tasks = (kWeightGrad ? num_experts : 1) * static_cast<int64_t>(p.num_m_tiles) * p.num_n_tiles;
  if (*num_tasks == 0) return cudaSuccess;
  if (*num_tasks > INT32_MAX || p.num_rows % BLOCK_M != 0) return cudaErrorInvalidValue;
  if (T::kMxOut && p.n % mxfp8::kBlockSize != 0) return cudaErrorInvalidValue;
  p.num_tasks = static_cast<int>(*num_tasks);
  *maps = TaskMaps{};
  cudaError_t err = cudaSuccess;
  if (kWeightGrad) {  // A rows [num_rows, m] read MN-major: dims (m, rows, 1), box (64, 64)
    if ((err = encode_rows_map(&maps->a, p.a, 1, p.num_rows, p.m, 64, BLOCK_K))) return err;
  } else if (!T::kGather && (err = encode_rows_map(&maps->a, p.a, 1, p.num_rows, p.k, BLOCK_K, BLOCK_M))) {
    return err;
  }
  if (kGemm == Gemm::kGateUpDgrad && (err = encode_rows_map(&maps->a2, p.a2, 1, p.num_rows, p.k, BLOCK_K, BLOCK_M)))
    return err;
  // K-major: dims (k, n, E), box (64 k, 128 n). MN-major: dims (n, k, E), box (64 n, 64 k); kWeightGrad's B
  // rows: dims (n, rows, 1).
  const auto encode_b = [&](CUtensorMap* map, const void* w) {
    if (T::kMx)  // E4M3 rows of 64 bytes per box: dims (k, n, E), box (64, 128, 1), 64-byte swizzle
      return encode_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w, num_experts, p.n, p.k, BLOCK_K, BLOCK_N_B,
                        CU_TENSOR_MAP_SWIZZLE_64B);
    if (kWeightGrad) return encode_rows_map(map, w, 1, p.num_rows, p.n, 64, BLOCK_K);
    return T::kMajorMN ? encode_rows_map(map, w, num_experts, p.k, p.n, 64, BLOCK_K)
                       : encode_rows_map(map, w, num_experts, p.n, p.k, BLOCK_K, BLOCK_N_B);
  };
  if ((err = encode_b(&maps->b0, w_b0)) || (err = encode_b(&maps->b1, w_b1))) return err;
  if constexpr (T::kMx) {  // scales: dims (2n, k-blocks, E), box (256, 1, 1): a tile's 128 rows × 2 bytes
    const auto encode_s = [&](CUtensorMap* map, const void* scales) {
      return encode_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, scales, num_experts, ceil_div(p.k, BLOCK_K),
                        2 * p.n, 2 * BLOCK_N_B, 1, CU_TENSOR_MAP_SWIZZLE_NONE);
    };
    if ((err = encode_s(&maps->s0, mx.s0)) || (err = encode_s(&maps->s1, mx.s1))) return err;
  }
  // TMA stores: boxes of one warp's 16 rows × 64 columns; the map's dims clip N tails and kWeightGrad's rows
  // past m (dims (n, m, E): never into the next expert's dW).
  const auto encode_out = [&](CUtensorMap* map, const void* out) {
    return kWeightGrad ? encode_rows_map(map, out, num_experts, p.m, p.n, kStoreBoxCols, kStoreBoxRows)
                       : encode_rows_map(map, out, 1, p.num_rows, p.n, kStoreBoxCols, kStoreBoxRows);
  };
  if ((err = encode_out(&maps->out, p.out))) return err;
  // kGateUpMxOut: gate and up as E4M3, boxes of 16 rows × 128 bytes (one staging box, the same swizzle)
  const auto encode_e4m3 = [&](CUtensorMap* map, const void* data) {
    return encode_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, data, 1, p.num_rows, p.n, BLOCK_N_B, kStoreBoxRows,
                      CU_TENSOR_MAP_SWIZZLE_128B);
  };
  if (T::kMxOut && ((err = encode_e4m3(&maps->gate, p.gate)) || (err = encode_e4m3(&maps->up, p.up)))) return err;
  if (T::kSwiGLU && !T::kMxOut && ((err = encode_out(&maps->gate, p.gate)) || (err = encode_out(&maps->up, p.up))))
    return err;
  return cudaSuccess;
}

// The persistent grid of `kernel` for num_tasks tasks: min(num_sms or the device's SM count, num_tasks), with the
// kernel's shared memory opted into.
template <typename Kernel>
cudaError_t persistent_gemm_grid(Kernel kernel, int64_t num_tasks, int num_sms, int* grid) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err) return err;
  if (num_sms <= 0) {
    int device = 0;
    if ((err = cudaGetDevice(&device)) ||
        (err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device)))
      return err;
  }
  *grid = static_cast<int>(num_tasks < num_sms ? num_tasks : num_sms);
  return cudaSuccess;
}

template <Gemm kGemm>
cudaError_t launch_grouped_gemm_bf16(const void* w_b0, const void* w_b1, int64_t num_experts, Params p,
                                     int num_sms, cudaStream_t stream, MxScales mx = {nullptr, nullptr}) {
  TaskMaps m;
  int64_t num_tasks = 0;
  int grid = 0;
  cudaError_t err = prepare_tasks<kGemm>(w_b0, w_b1, num_experts, p, mx, &m, &num_tasks);
  if (err || num_tasks == 0) return err;
  const auto kernel = grouped_gemm_bf16_kernel<kGemm>;
  if ((err = persistent_gemm_grid(kernel, num_tasks, num_sms, &grid))) return err;
  kernel<<<grid, kNumThreads, kSmemBytes, stream>>>(m.a, m.a2, m.b0, m.b1, m.s0, m.s1, m.out, m.gate, m.up, p);
  return cudaGetLastError();
}

}  // namespace mok::gemm
