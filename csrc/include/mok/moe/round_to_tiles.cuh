// The two one-block kernels of round_to_tiles (mok/rounding.py; the map steps around them: round_steps.cuh),
// each one launch, each giving its PyTorch twin's result bit for bit, so that the rounding reads nothing on the host.
//
// route_fill_rounds_kernel: the rounds (twin fill_rounds). A pool of P movable routes, in ascending route id (a
// token's entries side by side), R receivers each lacking need[r] routes. Per round:
//   1. a warp per receiver counts its candidates: entries not yet assigned, first of their token's unassigned
//      ones, whose token may take the receiver;
//   2. the receivers are ranked by slack (candidates minus need; none needed: last), ties by index: first_pick;
//   3. a warp per receiver walks its entries by descending score (`order`) and proposes its first need[r]
//      candidates: each proposal is an atomicMin of the receiver's rank into the entry's pick (an integer
//      minimum: the same for any order of the atomics);
//   4. every proposed entry goes to its best-ranked proposer; that receiver's need falls, the token may not take it
//      again, and the token's next entry becomes its first unassigned one.
// Rounds end when none assigns an entry (then no receiver with need has a candidate, as in the twin); the twin
// costs ~20 ops and a host read a round. One block keeps it simple: at the standard shapes P is 300-2,100 real
// entries. The caller may pad the pool (it allocates it at a bound, to read nothing from the device); the walks
// stop at the real count, read here. `may` is receiver-major, [R, U]: step 1's lanes read one receiver's bytes of
// consecutive tokens, a cache line or two per warp load, where token-major rows cost a line per lane.
//
// route_swap_leftovers_kernel: the end game (twin swap_leftovers), for the receivers the rounds left short: returns
// at once when none is (the common case); else, receivers in ascending id and leftovers in ascending id, one at a
// time, each either moves or swaps with the first fitting route of the moved list, searched by the whole block.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "mok/common.cuh"

namespace mok::moe {

constexpr int kFillThreads = 1024;

struct FillArgs {
  const int64_t* order;  // [R, P]: receiver r's entries by descending score, ties ascending
  uint8_t* may;          // [R, U]: whether the token may take the receiver (cleared as it takes it)
  const int64_t* inv;    // [P]: each entry's token, nondecreasing
  int64_t* need;         // [R]: in, what each receiver lacks; out, what it still lacks
  int64_t* assign;       // [P]: out, the receiver an entry goes to, or -1
  int32_t* first;        // [U] scratch: each token's first unassigned entry
  int32_t* pick;         // [P] scratch: the best rank proposing the entry this round (R: none)
  const int64_t* num_real;  // [1] or null: the entries from it on are padding, last in every row of `order`
  int num_pool, num_tokens, num_receivers;
};

__global__ void __launch_bounds__(kFillThreads) route_fill_rounds_kernel(FillArgs a) {
  extern __shared__ long long fill_smem[];
  const int P = a.num_pool, R = a.num_receivers;
  long long* need = fill_smem;    // [R]: int64, as the twin's (any int64 need gives its result)
  int* count = reinterpret_cast<int*>(need + R);  // [R]: this round's candidates
  int* first_pick = count + R;    // [R]: the receiver's rank (0 wins a conflict)
  int* by_pick = first_pick + R;  // [R]: the receiver of each rank
  __shared__ int assigned_any;
  const int walk = a.num_real != nullptr && *a.num_real < P ? static_cast<int>(*a.num_real) : P;  // what rows hold
  const int lane = static_cast<int>(lane_id()), warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  for (int r = threadIdx.x; r < R; r += blockDim.x) need[r] = a.need[r];
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    a.assign[p] = -1;
    a.pick[p] = R;
    if (p == 0 || a.inv[p - 1] != a.inv[p]) a.first[a.inv[p]] = p;
  }
  __syncthreads();
  // Each of the three loads is in range whatever the others read, so the test takes all three (`&`, not `&&`): with
  // short-circuits the walks' SASS chained inv -> first -> may in each entry and the entries one after another, three
  // dependent loads an entry (nvcc 13.0); now an unrolled walk issues its entries' loads together.
  const auto is_candidate = [&](int p, int r) {
    const int64_t u = a.inv[p];
    return (a.assign[p] < 0) & (a.first[u] == p) & (a.may[int64_t{r} * a.num_tokens + u] != 0);
  };
  const auto slack = [&](int r) {  // int64 like the twin's, whose receivers needing nothing sort last
    return need[r] > 0 ? count[r] - need[r] : INT64_MAX;
  };
  for (;;) {
    for (int r = warp; r < R; r += warps) {  // 1. candidates
      // A count needs no order: the walk's first `walk` entries of every row of `order` are the real ones, so the
      // lanes take them in pool order (coalesced, and one dependent load fewer than through `order`).
      int c = 0;
      if (need[r] > 0) {
        for (int p = lane; p < walk; p += kWarpSize) c += is_candidate(p, r);
      }
      c = __reduce_add_sync(0xffffffffu, c);
      if (lane == 0) count[r] = c;
    }
    if (threadIdx.x == 0) assigned_any = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < R; r += blockDim.x) {  // 2. ranks by (slack, index)
      const int64_t s = slack(r);
      int rank = 0;
      for (int q = 0; q < R; ++q) {
        const int64_t sq = slack(q);
        rank += sq < s || (sq == s && q < r);
      }
      first_pick[r] = rank;
      by_pick[rank] = r;
    }
    __syncthreads();
    for (int r = warp; r < R; r += warps) {  // 3. proposals: each receiver's first need[r] candidates
      if (need[r] <= 0 || count[r] == 0) continue;  // warp-uniform
      long long seen = 0;
      for (int base = 0; base < walk && seen < need[r]; base += kWarpSize) {
        const int i = base + lane;
        const int p = i < walk ? static_cast<int>(a.order[int64_t{r} * P + i]) : 0;
        const bool c = i < walk && is_candidate(p, r);
        const unsigned ballot = __ballot_sync(0xffffffffu, c);
        if (c && seen + __popc(ballot & ((1u << lane) - 1u)) < need[r]) atomicMin(&a.pick[p], first_pick[r]);
        seen += __popc(ballot);
      }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {  // 4. each proposed entry to its best-ranked proposer
      const int k = a.pick[p];
      if (k < R) {
        const int r = by_pick[k];
        const int64_t u = a.inv[p];
        a.assign[p] = r;
        atomicAdd(reinterpret_cast<unsigned long long*>(&need[r]), ~0ull);  // need[r] -= 1
        a.may[int64_t{r} * a.num_tokens + u] = 0;
        a.first[u] = p + 1;  // the token's next entry, if it has one (entries are assigned in order)
        a.pick[p] = R;
        assigned_any = 1;
      }
    }
    __syncthreads();
    if (!assigned_any) break;  // block-uniform
    __syncthreads();           // every thread read assigned_any before thread 0 clears it
  }
  for (int r = threadIdx.x; r < R; r += blockDim.x) a.need[r] = need[r];
}

inline cudaError_t launch_route_fill_rounds(const FillArgs& args, cudaStream_t stream) {
  if (args.num_pool == 0 || args.num_receivers == 0) return cudaSuccess;
  const size_t smem = (sizeof(long long) + 3 * sizeof(int)) * static_cast<size_t>(args.num_receivers);
  route_fill_rounds_kernel<<<1, kFillThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

// ---- the end game -----------------------------------------------------------------------------------------

struct SwapArgs {
  int64_t* idx;            // [T·K]: the routing so far, changed in place
  const int64_t* before;   // [T·K]: the routing before rounding
  const uint8_t* allowed;  // [T, E]: the experts a token may go to at all
  const int64_t* left;     // [P]: the leftover route ids, ascending where >= 0
  int64_t* need;           // [E]: in, what each expert lacks; out, what it still lacks
  int32_t* waiting;        // [P] scratch: the leftovers not yet placed (-1: placed)
  int32_t* moved;          // [T·K + P] scratch: the moved routes, ascending, then in the order they move here
  int num_tokens, num_topk, num_experts, num_left;
};

// out[k] = value(i) for the k-th i in [0, n) with keep(i), in order; returns the count. Every thread of the block
// calls it; s_warp: one int per warp of shared memory.
template <typename Keep, typename Value>
MOK_DEVICE int block_compact(int n, Keep keep, Value value, int32_t* out, int* s_warp) {
  const int lane = static_cast<int>(lane_id()), warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  int base = 0;
  for (int start = 0; start < n; start += blockDim.x) {
    const int i = start + static_cast<int>(threadIdx.x);
    const bool k = i < n && keep(i);
    const unsigned ballot = __ballot_sync(0xffffffffu, k);
    if (lane == 0) s_warp[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < warps; ++w) {
      before += w < warp ? s_warp[w] : 0;
      total += s_warp[w];
    }
    if (k) out[base + before + __popc(ballot & ((1u << lane) - 1u))] = value(i);
    base += total;
    __syncthreads();  // s_warp is written again for the next chunk
  }
  return base;
}

__global__ void __launch_bounds__(kFillThreads) route_swap_leftovers_kernel(SwapArgs a) {
  __shared__ int s_warp[kFillThreads / kWarpSize];
  __shared__ int s_any, s_best, s_moved;
  const int E = a.num_experts, K = a.num_topk;
  if (threadIdx.x == 0) s_any = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    if (a.need[e] > 0) s_any = 1;
  }
  __syncthreads();
  if (!s_any) return;  // block-uniform: no receiver lacks routes
  const int num_waiting = block_compact(
      a.num_left, [&](int i) { return a.left[i] >= 0; }, [&](int i) { return static_cast<int32_t>(a.left[i]); },
      a.waiting, s_warp);
  const int num_moved = block_compact(
      a.num_tokens * K, [&](int r) { return a.idx[r] != a.before[r]; }, [](int r) { return r; }, a.moved, s_warp);
  if (threadIdx.x == 0) s_moved = num_moved;
  __syncthreads();
  const auto lacks = [&](int t, int64_t e) {  // token t is allowed e and not routed to it
    if (!a.allowed[int64_t{t} * E + e]) return false;
    for (int k = 0; k < K; ++k) {
      if (a.idx[int64_t{t} * K + k] == e) return false;
    }
    return true;
  };
  // Every branch below is block-uniform: each thread reads the same values, written by thread 0 before a barrier.
  for (int e = 0; e < E; ++e) {
    for (int i = 0; i < num_waiting; ++i) {
      if (a.need[e] <= 0) break;
      const int p = a.waiting[i];
      if (p < 0) continue;  // placed already
      const int t = p / K;
      const bool direct = lacks(t, e);
      int q = -1;
      if (!direct) {  // the first moved route q (token t2, at e2) with t2 lacking e and t lacking e2
        if (threadIdx.x == 0) s_best = INT_MAX;
        __syncthreads();
        const int m = s_moved;
        for (int j = threadIdx.x; j < m; j += blockDim.x) {
          const int r = a.moved[j];
          const int64_t e2 = a.idx[r];
          if (e2 != e && lacks(r / K, e) && lacks(t, e2)) atomicMin(&s_best, j);
        }
        __syncthreads();
        const int best = s_best;
        __syncthreads();  // every thread has read s_best before thread 0 resets it
        if (best == INT_MAX) continue;
        q = a.moved[best];
      }
      __syncthreads();  // every thread has read need, waiting and idx for this leftover before thread 0 writes them
      if (threadIdx.x == 0) {
        if (direct) {
          a.idx[p] = e;
        } else {
          a.idx[p] = a.idx[q];
          a.idx[q] = e;
        }
        a.waiting[i] = -1;
        a.moved[s_moved++] = p;
        a.need[e] -= 1;
      }
      __syncthreads();
    }
  }
}

inline cudaError_t launch_route_swap_leftovers(const SwapArgs& args, cudaStream_t stream) {
  if (args.num_experts == 0) return cudaSuccess;
  route_swap_leftovers_kernel<<<1, kFillThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace mok::moe
