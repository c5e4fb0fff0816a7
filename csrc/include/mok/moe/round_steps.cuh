// routing.round_to_tiles on a GPU but for its rounds and swaps (round_to_tiles.cuh): eight map steps, with the bits
// of their twins in mok/rounding.py (the PyTorch prep _prep, and the moves and final order of _round_to_tiles). The
// caller (mok/ops/moe.py route_round_to_tiles) runs them in this order, with torch between them where it says:
//   kCount  per route: count it for its expert (integer atomics: the same counts in any order; zeroed by the caller);
//   kPlan   per expert: its delta (what it lacks, > 0, or gives, < 0), first position in expert order and need;
//   kKeys   per token: whether no receiver may take it ("stuck"), then each route's sort key
//           (2·expert + stuck) << 32 | the score's ascending key;                    caller: sort the keys (stable)
//   kChoose per position in that order: the route is chosen if it is among its expert's `give` first;
//                                                                                   caller: running count of chosen
//   kPool   per route: a chosen route goes to its slot of the pool (ascending route id); the pool's real count;
//   kCells  per (receiver, entry), receiver-major: the entry's score for the receiver (-inf for padding) and
//           whether its token may take the receiver; per entry, its token's first entry.
//                          caller: sort each receiver's scores (descending, stable); the rounds (route_fill_rounds)
//   kApply  per pool entry: an assigned route moves to its receiver; an unassigned real one is a leftover;
//                                                                        caller: the swaps (route_swap_leftovers)
//   kOrder  per token: its experts by descending score, then ascending id (the routers' order).
// Each step's body is a host-device function of its index, so a CPU test runs the same bodies on the host
// (run_round_step_on_host; tests/test_round_steps.py). The scores come as float32: the twins' keys and orders are
// those of float32 for bf16 and fp16 scores too (the conversions are exact); float64 stays with the twins.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "mok/api.h"
#include "mok/common.cuh"

namespace mok::moe {

constexpr int kRoundThreads = 256;

MOK_HOST_DEVICE uint32_t float_bits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
#endif
}

// routing._ascending_key for a float32: its order as torch.sort has it in 32 bits, -0.0 as +0.0, NaN last.
MOK_HOST_DEVICE uint32_t ascending_key(float v) {
  if (v != v) return 0xFFFFFFFFu;
  const int64_t bits = static_cast<int32_t>(float_bits(v == 0.0f ? 0.0f : v));  // sign-extended, as the twin's
  return static_cast<uint32_t>((bits < 0 ? bits ^ 0x7FFFFFFF : bits) + (int64_t{1} << 31));
}

MOK_HOST_DEVICE bool holds(const RouteRound& a, int64_t t, int64_t e) {  // token t is routed to expert e
  for (int k = 0; k < a.num_topk; ++k) {
    if (a.idx[t * a.num_topk + k] == e) return true;
  }
  return false;
}

// kCount, route r.
MOK_HOST_DEVICE void count_route(const RouteRound& a, int64_t r) {
#ifdef __CUDA_ARCH__
  atomicAdd(&a.counts[a.idx[r]], 1);
#else
  ++a.counts[a.idx[r]];
#endif
}

// kPlan, expert e. plan rows: delta, first position in expert order, need.
MOK_HOST_DEVICE void plan_expert(const RouteRound& a, int64_t e) {
  const int32_t* counts = a.counts;
  const int64_t E = a.num_experts, tile = a.tile, rem = counts[e] % tile;
  int64_t total = 0, start = 0, rank = 0;  // rank: by remainder, largest first, ties lower id
  for (int64_t f = 0; f < E; ++f) {
    const int64_t rem_f = counts[f] % tile;
    total += rem_f;
    start += f < e ? counts[f] : 0;
    rank += rem_f > rem || (rem_f == rem && f < e);
  }
  const int64_t num_up = total / tile, extra = total % tile;  // the first num_up round up, the next keeps `extra`
  const int64_t delta = tile * (rank < num_up) + extra * (rank == num_up) - rem;
  a.plan[e] = delta;
  a.plan[E + e] = start;
  a.plan[2 * E + e] = delta > 0 ? delta : 0;
}

// kKeys, token t: stuck if no expert that lacks routes may take it (allowed: score > -inf; not routed there).
MOK_HOST_DEVICE void route_keys(const RouteRound& a, int64_t t) {
  const int64_t E = a.num_experts, K = a.num_topk;
  bool stuck = true;
  for (int64_t e = 0; e < E && stuck; ++e)
    stuck = !(a.plan[e] > 0 && a.scores[t * E + e] > -INFINITY && !holds(a, t, e));
  for (int64_t k = 0; k < K; ++k) {
    const int64_t e = a.idx[t * K + k];
    a.keys[t * K + k] = static_cast<int64_t>((static_cast<uint64_t>(2 * e + stuck) << 32) |
                                             ascending_key(a.scores[t * E + e]));
  }
}

// kChoose, position i of the routes in key order: its expert's positions start at plan[E + e].
MOK_HOST_DEVICE void choose_route(const RouteRound& a, int64_t i) {
  const int64_t r = a.by_expert[i], e = a.idx[r], delta = a.plan[e];
  a.chosen[r] = delta < 0 && i - a.plan[a.num_experts + e] < -delta;
}

// kPool, route r: slots is chosen's inclusive running count; the pool was preset to T·K (padding) by the caller.
MOK_HOST_DEVICE void place_route(const RouteRound& a, int64_t r) {
  const int64_t n = a.num_tokens * a.num_topk;
  if (r == n - 1) *a.num_real = a.slots[r] < a.num_pool ? a.slots[r] : a.num_pool;
  if (a.chosen[r] && a.slots[r] - 1 < a.num_pool) a.pool[a.slots[r] - 1] = r;
}

// kCells, receiver e and pool entry p (cell e·P + p). A padding entry's token is T: it scores -inf and may take
// nothing. Entry p's token's first entry: at most K - 1 entries back (a token's routes are adjacent ids).
MOK_HOST_DEVICE void pool_cell(const RouteRound& a, int64_t e, int64_t p) {
  const int64_t n = a.num_tokens * a.num_topk, K = a.num_topk, P = a.num_pool, route = a.pool[p];
  const int64_t t = route < n ? route / K : a.num_tokens;
  const float score = t < a.num_tokens ? a.scores[t * a.num_experts + e] : -INFINITY;
  a.pool_scores[e * P + p] = score;
  a.may[e * P + p] = score > -INFINITY && !holds(a, t, e);
  if (e == 0) {
    int64_t q = p;
    if (t == a.num_tokens) {
      q = *a.num_real;  // the first padding entry
    } else {
      while (q > 0 && a.pool[q - 1] / K == t) --q;
    }
    a.inv[p] = q;
  }
}

// kApply, pool entry p: routes was preset to idx by the caller; assign is the rounds' (an expert, or -1).
MOK_HOST_DEVICE void apply_entry(const RouteRound& a, int64_t p) {
  const int64_t route = a.pool[p], to = a.assign[p];
  const bool real = route < a.num_tokens * a.num_topk;
  if (real && to >= 0) a.routes[route] = to;
  a.left[p] = real && to < 0 ? route : -1;
}

// kOrder, token t: its experts (distinct) by descending score, then ascending id, each written at its rank among
// the token's (score, id) keys, as the twin's one sort of them.
MOK_HOST_DEVICE void order_token(const RouteRound& a, int64_t t) {
  const int64_t K = a.num_topk, E = a.num_experts;
  const auto key = [&](int64_t k) {  // ascending: the score's key flipped in the high half, the id in the low
    const int64_t e = a.routes[t * K + k];
    return (static_cast<uint64_t>(0xFFFFFFFFu - ascending_key(a.scores[t * E + e])) << 32) | static_cast<uint64_t>(e);
  };
  for (int64_t j = 0; j < K; ++j) {
    const uint64_t mine = key(j);
    int64_t rank = 0;
    for (int64_t k = 0; k < K; ++k) rank += key(k) < mine;
    a.out[t * K + rank] = a.routes[t * K + j];
  }
}

inline int64_t round_step_size(const RouteRound& a, int step) {  // the indices a map step runs over
  switch (step) {
    case kRouteRoundPlan: return a.num_experts;
    case kRouteRoundKeys:
    case kRouteRoundOrder: return a.num_tokens;
    case kRouteRoundCount:
    case kRouteRoundChoose:
    case kRouteRoundPool: return a.num_tokens * a.num_topk;
    case kRouteRoundCells: return a.num_experts * a.num_pool;
    case kRouteRoundApply: return a.num_pool;
    default: return 0;
  }
}

MOK_HOST_DEVICE void round_map(const RouteRound& a, int step, int64_t i) {
  switch (step) {
    case kRouteRoundCount: count_route(a, i); break;
    case kRouteRoundPlan: plan_expert(a, i); break;
    case kRouteRoundKeys: route_keys(a, i); break;
    case kRouteRoundChoose: choose_route(a, i); break;
    case kRouteRoundPool: place_route(a, i); break;
    case kRouteRoundCells: pool_cell(a, i / a.num_pool, i % a.num_pool); break;
    case kRouteRoundApply: apply_entry(a, i); break;
    case kRouteRoundOrder: order_token(a, i); break;
    default: break;
  }
}

__global__ void __launch_bounds__(kRoundThreads) route_round_map_kernel(RouteRound a, int step, int64_t size) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < size) round_map(a, step, i);
}

inline cudaError_t launch_route_round_step(const RouteRound& a, int step, cudaStream_t stream) {
  if (step < kRouteRoundCount || step > kRouteRoundOrder) return cudaErrorInvalidValue;
  const int64_t size = round_step_size(a, step);
  if (size == 0) return cudaSuccess;
  route_round_map_kernel<<<static_cast<unsigned>((size + kRoundThreads - 1) / kRoundThreads), kRoundThreads, 0,
                           stream>>>(a, step, size);
  return cudaGetLastError();
}

// The same steps on the host, one index at a time (the CPU test's; every pointer a host pointer).
inline void run_round_step_on_host(const RouteRound& a, int step) {
  for (int64_t i = 0, size = round_step_size(a, step); i < size; ++i) round_map(a, step, i);
}

}  // namespace mok::moe
