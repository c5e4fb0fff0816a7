// Route placement on the GPU (DESIGN §5), bit for bit mok.schedule.make_schedule: expert-major segments,
// routes in ascending route id r = t·K + k inside a segment, each segment padded to block_m rows.
// Integer-only and order-free: counts come from shared-memory histograms (integer atomics: the count
// does not depend on the order of the adds) and every rank is computed, never taken from a counter that
// routes race for, so the output bits are the same run to run and for any grid.
//
// Three launches over chunks of kChunkRoutes consecutive routes (one CTA each):
//   1. count  chunk_counts[c][e] = routes of chunk c with expert e; column E counts ids outside [0, E).
//   2. scan   one CTA per expert column: chunk_counts[c][e] := routes of expert e in chunks < c
//             (exclusive prefix over c, in place); tokens_per_expert / padded_per_expert; CTA E the bad ids.
//   3. place  every CTA scans the E padded counts (segment starts, num_rows) in shared memory, then either
//             places one chunk (row = segment start + chunk base + rank among the chunk's earlier routes of
//             the same expert) or fills a range of rows (row_to_expert, -1 in padding rows, tile fields),
//             spare rows past num_rows included (up to max_num_rows: -1 everywhere, tile_num_rows 0).
// num_rows and the bad-id count land in counts (int32, device memory): nothing here needs a host read, and
// the kernels that run over schedule rows read num_rows from there (the row buffers have max_num_rows rows).
// Bytes: topk_idx read twice (8·T·K each), route_to_row + 4 row arrays written once (8 bytes per entry),
// a [num_chunks, E + 1] int32 scratch: a few microseconds at the standard shapes.
#pragma once

#include <cstdint>

#include "mok/api.h"
#include "mok/common.cuh"

namespace mok::moe {

constexpr int kScheduleThreads = 256;
constexpr int kScheduleWarps = kScheduleThreads / kWarpSize;
constexpr int kRoutesPerLane = 4;                                     // per warp: 4 rounds of 32 routes
constexpr int kRoutesPerWarp = kRoutesPerLane * kWarpSize;            // 128 consecutive routes
constexpr int kScanItems = 4;                                         // values per thread per scan round
constexpr int kFillRowsPerThread = 4;
constexpr int kFillRows = kFillRowsPerThread * kScheduleThreads;      // rows per fill CTA
constexpr int kGemmTileRows = 128;                                    // the GEMMs' kernel tile (ops.GEMM_BLOCK_M)
constexpr int kBadRoute = -2;  // place: a route whose expert id is outside [0, E) (-1: past the last route)
static_assert(kScheduleThreads % kWarpSize == 0, "whole warps: a warp places 128 consecutive routes");
static_assert(kRoutesPerWarp * kScheduleWarps == kScheduleChunkRoutes,
              "a placement CTA's warps cover exactly one chunk of the count kernel");
static_assert(kScheduleMaxExperts * (kScheduleWarps + 2) * 4 <= 227 * 1024,
              "the place kernel's per-warp expert cursors fit in shared memory");

// ---- block-wide exclusive scan (integers: any order gives the same sums) -----------------------------------
// data[i * stride] for i in [0, n) := sum of data[j * stride] for j < i; returns the total to every thread.
// Every thread of the CTA calls it. s_warp_sums: kScheduleWarps ints of shared memory.

MOK_DEVICE int32_t block_exclusive_scan(int32_t* data, int64_t n, int64_t stride, int32_t* s_warp_sums) {
  const int lane = static_cast<int>(lane_id()), warp = static_cast<int>(threadIdx.x) / kWarpSize;
  int32_t carry = 0;
  for (int64_t base = 0; base < n; base += kScheduleThreads * kScanItems) {
    const int64_t first = base + static_cast<int64_t>(threadIdx.x) * kScanItems;
    int32_t v[kScanItems];
    int32_t thread_sum = 0;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      v[j] = first + j < n ? data[(first + j) * stride] : 0;
      thread_sum += v[j];
    }
    int32_t inclusive = thread_sum;  // warp inclusive scan of the thread sums
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset <<= 1) {
      const int32_t up = __shfl_up_sync(kFullMask, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    if (lane == kWarpSize - 1) s_warp_sums[warp] = inclusive;
    __syncthreads();
    int32_t warp_base = 0, round_total = 0;
#pragma unroll
    for (int w = 0; w < kScheduleWarps; ++w) {
      warp_base += w < warp ? s_warp_sums[w] : 0;
      round_total += s_warp_sums[w];
    }
    int32_t running = carry + warp_base + inclusive - thread_sum;
#pragma unroll
    for (int j = 0; j < kScanItems; ++j) {
      if (first + j < n) data[(first + j) * stride] = running;
      running += v[j];
    }
    carry += round_total;
    __syncthreads();  // s_warp_sums is reused by the next round (and by the caller)
  }
  return carry;
}

// ---- 1. count: per-chunk expert histogram ---------------------------------------------------------------------

__global__ void __launch_bounds__(kScheduleThreads)
    schedule_count_kernel(const int64_t* __restrict__ topk_idx, int64_t num_routes, int num_experts,
                          int32_t* __restrict__ chunk_counts) {
  extern __shared__ int32_t s_hist[];  // [E + 1]: entry E counts ids outside [0, E)
  for (int e = threadIdx.x; e <= num_experts; e += kScheduleThreads) s_hist[e] = 0;
  __syncthreads();
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kScheduleChunkRoutes;
#pragma unroll
  for (int j = 0; j < kScheduleChunkRoutes / kScheduleThreads; ++j) {
    const int64_t route = first + j * kScheduleThreads + threadIdx.x;  // coalesced 8-byte loads
    if (route >= num_routes) break;
    const int64_t id = topk_idx[route];
    atomicAdd(&s_hist[id >= 0 && id < num_experts ? static_cast<int>(id) : num_experts], 1);
  }
  __syncthreads();
  int32_t* counts = chunk_counts + static_cast<int64_t>(blockIdx.x) * (num_experts + 1);  // [E + 1]
  for (int e = threadIdx.x; e <= num_experts; e += kScheduleThreads) counts[e] = s_hist[e];
}

// ---- 2. scan: chunk bases per expert, expert totals ------------------------------------------------------------

__global__ void __launch_bounds__(kScheduleThreads)
    schedule_scan_kernel(int32_t* __restrict__ chunk_counts, int64_t num_chunks, int num_experts,
                         int64_t block_m, ScheduleOutputs out) {
  __shared__ int32_t s_warp_sums[kScheduleWarps];
  const int e = blockIdx.x;  // column e of [num_chunks, E + 1]; column E holds the bad ids
  const int32_t total = block_exclusive_scan(chunk_counts + e, num_chunks, num_experts + 1, s_warp_sums);
  if (threadIdx.x != 0) return;
  if (e < num_experts) {
    out.tokens_per_expert[e] = total;
    out.padded_per_expert[e] = ceil_div(total, block_m) * block_m;  // 0 stays 0
  } else {
    out.counts[1] = total;
  }
}

// ---- 3. place: one chunk's routes, or a range of rows ----------------------------------------------------------

// Rows of the chunk's routes. Warp w owns routes [chunk·1024 + w·128, +128) in 4 rounds of 32 lanes, so
// route order = (round, lane) order inside a warp and warp order across warps. s_cursor[w][e] is the row of
// warp w's next route of expert e: segment start + chunk base + routes of e in warps < w (a prefix over the
// per-warp histogram), then + the round's rank among equal experts (`match.any` peers in lower lanes).
MOK_DEVICE void place_chunk(const int64_t* __restrict__ topk_idx, const int32_t* __restrict__ chunk_bases,
                            int64_t num_routes, int num_topk, int num_experts, const int32_t* s_offsets,
                            int32_t* s_cursor, ScheduleOutputs out) {
  const int lane = static_cast<int>(lane_id()), warp = static_cast<int>(threadIdx.x) / kWarpSize;
  for (int i = threadIdx.x; i < kScheduleWarps * num_experts; i += kScheduleThreads) s_cursor[i] = 0;
  __syncthreads();

  // ---- this warp's histogram (ids outside [0, E) were counted as bad and are skipped: kBadRoute) ----
  int32_t* cursor = s_cursor + warp * num_experts;  // [E]
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kScheduleChunkRoutes + warp * kRoutesPerWarp;
  int expert[kRoutesPerLane];
#pragma unroll
  for (int j = 0; j < kRoutesPerLane; ++j) {
    const int64_t route = first + j * kWarpSize + lane;
    const int64_t id = route < num_routes ? topk_idx[route] : -1;
    expert[j] = id >= 0 && id < num_experts ? static_cast<int>(id) : (route < num_routes ? kBadRoute : -1);
    if (expert[j] >= 0) atomicAdd(&cursor[expert[j]], 1);
  }
  __syncthreads();

  // ---- histograms -> first row of each warp's routes of each expert ----
  const int32_t* bases = chunk_bases + static_cast<int64_t>(blockIdx.x) * (num_experts + 1);  // [E + 1]
  for (int e = threadIdx.x; e < num_experts; e += kScheduleThreads) {
    int32_t row = s_offsets[e] + bases[e];
    for (int w = 0; w < kScheduleWarps; ++w) {
      const int32_t n = s_cursor[w * num_experts + e];
      s_cursor[w * num_experts + e] = row;
      row += n;
    }
  }
  __syncthreads();

  // ---- rank in route order, write the route's row and the row's route ----
  const uint32_t lanes_below = (1u << lane) - 1u;
#pragma unroll
  for (int j = 0; j < kRoutesPerLane; ++j) {
    const int e = expert[j];
    const uint32_t peers = __match_any_sync(kFullMask, e);  // lanes of this round with the same expert
    const int rank = __popc(peers & lanes_below);
    const int32_t row = e >= 0 ? cursor[e] + rank : 0;
    __syncwarp();
    if (e >= 0 && rank == 0) cursor[e] += __popc(peers);  // the group's lowest lane advances the cursor
    __syncwarp();
    // 32-bit division: route < T·K < 2^31 (the launcher checks), and no 64-bit division subroutine
    const uint32_t route = static_cast<uint32_t>(first + j * kWarpSize + lane);
    if (e < 0) {  // a bad id has no row: -1, so that combine_rows makes its token NaN (never another row)
      if (e == kBadRoute) out.route_to_row[route] = -1;
      continue;
    }
    const uint32_t token = route / static_cast<uint32_t>(num_topk);
    out.route_to_row[route] = row;
    out.row_to_route[row] = route;
    out.row_to_token[row] = token;
    out.row_to_k[row] = route - token * static_cast<uint32_t>(num_topk);
    out.row_to_token_i32[row] = static_cast<int32_t>(token);
  }
}

// Spare row (num_rows <= row < max_num_rows): no route and no expert; its tile, if it starts one, runs no rows.
MOK_DEVICE void fill_spare_row(int row, int block_m, ScheduleOutputs out) {
  out.row_to_token[row] = -1;
  out.row_to_k[row] = -1;
  out.row_to_route[row] = -1;
  out.row_to_expert[row] = -1;
  out.row_to_token_i32[row] = -1;
  if (row % block_m == 0) {
    out.tile_to_expert[row / block_m] = -1;
    out.tile_num_rows[row / block_m] = 0;
  }
  if (out.gemm_tile_to_expert != nullptr && row % kGemmTileRows == 0) out.gemm_tile_to_expert[row / kGemmTileRows] = -1;
}

// Rows [fill·kFillRows, +kFillRows) ∩ [0, max_num_rows): the expert of each row (its segment: the last e with
// start ≤ row), -1 in padding rows, and the tile fields at each tile's first row; spare rows past num_rows.
// Rows and block_m are below 2^31 (the launcher checks): 32-bit divisions.
MOK_DEVICE void fill_rows(int fill, int num_experts, int block_m, int max_num_rows, const int32_t* s_offsets,
                          const int32_t* s_tokens, ScheduleOutputs out) {
  const int num_rows = s_offsets[num_experts];
#pragma unroll
  for (int j = 0; j < kFillRowsPerThread; ++j) {
    const int row = fill * kFillRows + j * kScheduleThreads + static_cast<int>(threadIdx.x);
    if (row >= max_num_rows) break;
    if (row >= num_rows) {
      fill_spare_row(row, block_m, out);
      continue;
    }
    int lo = 0, hi = num_experts - 1;  // binary search; invariant: s_offsets[lo] <= row
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_offsets[mid] <= row) lo = mid; else hi = mid - 1;
    }
    const int e = lo;
    const int local = row - s_offsets[e];  // row's place in its segment: real rows come first
    out.row_to_expert[row] = e;
    if (local >= s_tokens[e]) {  // padding
      out.row_to_token[row] = -1;
      out.row_to_k[row] = -1;
      out.row_to_route[row] = -1;
      out.row_to_token_i32[row] = -1;
    }
    if (row % block_m == 0) {
      const int real = s_tokens[e] - local;
      out.tile_to_expert[row / block_m] = e;
      out.tile_num_rows[row / block_m] = real < 0 ? 0 : (real > block_m ? block_m : real);
    }
    if (out.gemm_tile_to_expert != nullptr && row % kGemmTileRows == 0) out.gemm_tile_to_expert[row / kGemmTileRows] = e;
  }
}

// CTAs [0, num_chunks) place chunks, the rest fill rows. Every CTA first scans the padded counts into segment
// starts in shared memory (E values: cheaper than a fourth launch); CTA 0 writes them out.
__global__ void __launch_bounds__(kScheduleThreads)
    schedule_place_kernel(const int64_t* __restrict__ topk_idx, const int32_t* __restrict__ chunk_bases,
                          int64_t num_routes, int num_topk, int num_experts, int64_t block_m, int64_t num_chunks,
                          int max_num_rows, ScheduleOutputs out) {
  extern __shared__ int32_t smem[];
  int32_t* s_offsets = smem;                       // [E + 1] segment starts, then num_rows
  int32_t* s_tokens = s_offsets + num_experts + 1;  // [E] real routes per expert
  int32_t* s_warp_sums = s_tokens + num_experts;    // [kScheduleWarps]
  int32_t* s_cursor = s_warp_sums + kScheduleWarps;  // [kScheduleWarps][E] (placement CTAs)
  for (int e = threadIdx.x; e < num_experts; e += kScheduleThreads) {
    s_offsets[e] = static_cast<int32_t>(out.padded_per_expert[e]);
    s_tokens[e] = static_cast<int32_t>(out.tokens_per_expert[e]);
  }
  __syncthreads();
  const int32_t num_rows = block_exclusive_scan(s_offsets, num_experts, 1, s_warp_sums);
  if (threadIdx.x == 0) s_offsets[num_experts] = num_rows;
  __syncthreads();

  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e <= num_experts; e += kScheduleThreads) {
      out.expert_offsets[e] = s_offsets[e];
      out.tile_offsets[e] = s_offsets[e] / static_cast<int>(block_m);
    }
    if (threadIdx.x == 0) out.counts[0] = num_rows;
  }
  if (blockIdx.x < num_chunks) {
    place_chunk(topk_idx, chunk_bases, num_routes, num_topk, num_experts, s_offsets, s_cursor, out);
  } else {
    fill_rows(static_cast<int>(blockIdx.x - num_chunks), num_experts, static_cast<int>(block_m), max_num_rows,
              s_offsets, s_tokens, out);
  }
}

// ---- host launcher ------------------------------------------------------------------------------------------------
// topk_idx int64 [num_tokens, num_topk]; chunk_counts int32 scratch [ceil(T·K / kScheduleChunkRoutes), E + 1];
// the outputs as mok/api.h's ScheduleOutputs describes them, row arrays sized for max_num_rows (a multiple of
// block_m, at least schedule_max_num_rows: no routing overflows it).

inline cudaError_t launch_make_schedule(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                                        int64_t num_experts, int64_t block_m, int64_t max_num_rows,
                                        const ScheduleOutputs& out, int32_t* chunk_counts, cudaStream_t stream) {
  const int64_t num_routes = num_tokens * num_topk;
  if (num_topk < 1 || num_experts < 1 || num_experts > kScheduleMaxExperts || block_m < 1 || num_tokens < 0 ||
      max_num_rows >= (int64_t{1} << 31) || max_num_rows % block_m != 0 ||
      max_num_rows < schedule_max_num_rows(num_routes, num_experts, block_m))
    return cudaErrorInvalidValue;
  const int num_e = static_cast<int>(num_experts);
  const int64_t num_chunks = ceil_div(num_routes, kScheduleChunkRoutes);
  if (num_chunks > 0) {
    const size_t smem = (num_experts + 1) * sizeof(int32_t);
    schedule_count_kernel<<<static_cast<unsigned>(num_chunks), kScheduleThreads, smem, stream>>>(
        topk_idx, num_routes, num_e, chunk_counts);
  }
  schedule_scan_kernel<<<static_cast<unsigned>(num_experts + 1), kScheduleThreads, 0, stream>>>(
      chunk_counts, num_chunks, num_e, block_m, out);

  const int64_t fill_blocks = ceil_div(max_num_rows, kFillRows) > 0 ? ceil_div(max_num_rows, kFillRows) : 1;
  const size_t smem = ((2 + kScheduleWarps) * num_experts + 1 + kScheduleWarps) * sizeof(int32_t);
  if (smem > 48 * 1024) {
    const cudaError_t status = cudaFuncSetAttribute(schedule_place_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(smem));
    if (status != cudaSuccess) return status;
  }
  schedule_place_kernel<<<static_cast<unsigned>(num_chunks + fill_blocks), kScheduleThreads, smem, stream>>>(
      topk_idx, chunk_counts, num_routes, static_cast<int>(num_topk), num_e, block_m, num_chunks,
      static_cast<int>(max_num_rows), out);
  return cudaGetLastError();
}

}  // namespace mok::moe
