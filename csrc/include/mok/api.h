// The host API of mok's CUDA kernels: plain C++ (no torch, no CUDA kernel code), so that
// csrc/bindings.cpp, compiled by the host compiler, can call what csrc/*.cu define.
// Every pointer is a device pointer; every call is asynchronous on `stream` and returns the launch
// status. Shapes are checked (with clear messages) in mok/ops/ before these are reached.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace mok {

// The most ranks a kernel reaches through its tables of peers' addresses (expert parallelism, docs/megakernel.md).
constexpr int kMaxRanks = 8;

// ---- MXFP8 (csrc/quant_mxfp8.cu) --------------------------------------------------------------------
// x: bf16, data: E4M3 bytes with x's shape; rows = numel / cols. Row-wise scales: [rows, cols / 32];
// column-wise scales: [rows / 32, cols] (a leading experts dim folds into rows).

cudaError_t mxfp8_quantize_rowwise(const void* x, void* data, void* scales, int64_t numel, cudaStream_t stream);
cudaError_t mxfp8_quantize_colwise(const void* x, void* data, void* scales, int64_t rows, int64_t cols,
                                   cudaStream_t stream);
cudaError_t mxfp8_quantize_dual(const void* x, void* data_row, void* scales_row, void* data_col, void* scales_col,
                                int64_t rows, int64_t cols, cudaStream_t stream);
cudaError_t mxfp8_dequantize_rowwise(const void* data, const void* scales, void* out, int64_t numel,
                                     cudaStream_t stream);
cudaError_t mxfp8_dequantize_colwise(const void* data, const void* scales, void* out, int64_t rows,
                                     int64_t cols, cudaStream_t stream);

// BF16 -> MXFP8 -> BF16 in one pass (the dequantized values, no bytes or scales written): row-wise over numel
// elements; column-wise (out_row null) or dual (both directions from one read) over [rows, cols]. The tiled
// ones leave the 32-row blocks from *real_num_rows on (int32 on the device; null: none) unread and unwritten.
cudaError_t mxfp8_fake_quantize_rowwise(const void* x, void* out, int64_t numel, cudaStream_t stream);
cudaError_t mxfp8_fake_quantize_tiled(const void* x, void* out_col, void* out_row, int64_t rows, int64_t cols,
                                      const int32_t* real_num_rows, cudaStream_t stream);
// Column-wise over [rows, cols] of x's rows gathered by row_to_token (int32 [rows]; negative: a zero row).
cudaError_t mxfp8_fake_quantize_gathered_colwise(const void* x, const int32_t* row_to_token, void* out, int64_t rows,
                                                 int64_t num_src_rows, int64_t cols, const int32_t* real_num_rows,
                                                 cudaStream_t stream);

// ---- grouped BF16 GEMMs over the route schedule (csrc/gemm_bf16.cu, csrc/gemm_mxfp8.cu) ----------------------
// Every entry point takes its operands in a struct filled by field name (csrc/bindings.cpp), the schedule in a
// RowSchedule, then num_sms (<= 0: the device's SM count; the persistent grid's size, the results bitwise the same
// for any value) and the stream. Weights bf16 [num_experts, n, k] (nn.Linear layout), 16-byte aligned; k % 8 == 0
// and n % 8 == 0.

// The route schedule as the row-wise kernels read it (mok/schedule.py with tiles of 128 rows).
struct RowSchedule {
  const int32_t* row_to_token;    // [num_rows], -1 = padding (written as zeros in every output)
  const int32_t* tile_to_expert;  // [num_rows / 128]
  const int32_t* real_num_rows;   // [1] on the device (a multiple of 128, written by the schedule), or null:
                                  // num_rows. The kernels run its tiles only: rows past it are never touched.
  int64_t num_rows;               // rows of the row buffers, a multiple of 128
};

// SwiGLU's clamp (mok.reference.swiglu): limit is used only when has_limit.
struct SwiGLULimit {
  float limit;
  bool has_limit;
};

// GEMM1 with fused dispatch and SwiGLU: h, gate, up [num_rows, intermediate] from x [num_tokens, hidden] gathered
// through row_to_token and w_gate, w_up [num_experts, intermediate, hidden].
struct GateUpGemm {
  const void* x;
  const void* w_gate;
  const void* w_up;
  const void* w_gate_scales;  // MXFP8 weights only (grouped_gemm_mxfp8_swiglu_gather), else null
  const void* w_up_scales;    // idem
  void* h;
  void* gate;  // bf16, or (grouped_gemm_bf16_swiglu_gather_mxfp8_out) the row-wise MXFP8 buffer, see there
  void* up;    // idem
  int64_t hidden, intermediate, num_experts;
  SwiGLULimit swiglu;
};

// GEMM2, a plain grouped GEMM: out[r] = a_rows[r] · w[e]ᵀ; a_rows [num_rows, k], w [num_experts, n, k],
// out [num_rows, n]; padding rows of out are zeros.
struct DownGemm {
  const void* a_rows;
  const void* w;
  const void* w_scales;  // MXFP8 weights only (grouped_gemm_mxfp8_nt_contiguous), else null
  void* out;
  int64_t n, k, num_experts;
};

// GEMM1 (bf16 weights, zeros in padding rows).
cudaError_t grouped_gemm_bf16_swiglu_gather(const GateUpGemm& args, const RowSchedule& sched, int num_sms,
                                            cudaStream_t stream);

// GEMM1 for the MXFP8 forward: gate and up written as MXFP8 row-wise, each in one 16-byte aligned buffer of E4M3
// data [num_rows, intermediate] then E8M0 scales [num_rows, intermediate / 32] (mxfp8_quantize_rowwise's bits),
// and h as its row-wise round trip (mxfp8_fake_quantize's bits). intermediate % 32 == 0.
cudaError_t grouped_gemm_bf16_swiglu_gather_mxfp8_out(const GateUpGemm& args, const RowSchedule& sched, int num_sms,
                                                      cudaStream_t stream);

// GEMM2 (bf16 weights).
cudaError_t grouped_gemm_bf16_nt_contiguous(const DownGemm& args, const RowSchedule& sched, int num_sms,
                                            cudaStream_t stream);

// GEMM1 and GEMM2 in one persistent launch (csrc/include/mok/gemm/chain.cuh): gate_up as for GEMM1, down as for
// GEMM2 with a_rows = gate_up.h; h_ready: int32 [num_rows / 128] on the device, zero at the call (GEMM2's tiles wait
// on it). The bits of the two launches. With shared_gate_up.w_gate set, the shared expert's GEMM1 and GEMM2 too
// (shared_gate_up, shared_down over shared_sched: the tokens in order; shared_h_ready as h_ready). With out set,
// also the combine behind GEMM2's tiles: out bf16 [num_tokens, hidden] = combine_rows(y, route_to_row, topk_weights,
// shared) bit for bit, route_to_row int32 and topk_weights fp32 [num_tokens, num_topk], shared = the shared
// expert's y when it runs here, else bf16 [num_tokens, hidden] or null; token_done int32 [num_tokens,
// ceil(hidden / 256)] zero at the call.
// The chain over ranks (EP > 1, docs/megakernel.md): the routed rows' tokens (gate_up's row_to_token) and
// route_to_row's rows are row ids (rank << 24 | local id); route_to_row holds every rank's tokens, rank-major (rank
// s's from token_offset[s]). Entry s of each list is rank s's tensor as this process reaches it: x (routed GEMM1's
// gathered A), y (the routed rows, [y_capacity, hidden]; entry `rank` is down.out), and per home rank topk_weights,
// shared, out and token_done (entry `rank`: the ChainGemm's own). The combine of a token runs on the rank that
// completes it, so a rank's out is whole only once every rank's launch has ended.
struct ChainRanks {
  int num_ranks, rank;
  const void* x[kMaxRanks];
  const void* y[kMaxRanks];
  const float* topk_weights[kMaxRanks];
  const void* shared[kMaxRanks];
  void* out[kMaxRanks];
  int32_t* token_done[kMaxRanks];
  int32_t token_offset[kMaxRanks];
  int64_t y_capacity;
};

// Per-task times of a chain launch (gemm/trace.cuh): at null (off), or uint64 [capacity, 5] zeros.
struct ChainTrace {
  uint64_t* at;
  int64_t capacity;
};

struct ChainGemm {
  GateUpGemm gate_up;  // mx_out: gate and up are row-wise MXFP8 buffers, h the round trip (as ..._mxfp8_out)
  DownGemm down;
  int32_t* h_ready;
  bool mx_out;
  GateUpGemm shared_gate_up;  // the shared expert: w_gate null, or all of these set
  DownGemm shared_down;
  RowSchedule shared_sched;
  int32_t* shared_h_ready;
  const int32_t* route_to_row;  // the combine: null, or all of these set
  const float* topk_weights;
  const void* shared;
  void* out;
  int32_t* token_done;
  int64_t num_topk;
  ChainRanks ranks;  // num_ranks 0: EP = 1
  ChainTrace trace;
};
cudaError_t grouped_gemm_bf16_chain(const ChainGemm& args, const RowSchedule& sched, int num_sms, cudaStream_t stream);

// GEMM1 and GEMM2 with MXFP8 weights, dequantized in the mainloop (csrc/gemm_mxfp8.cu): each weight is its E4M3
// data [num_experts, n, k] (uint8) with its E8M0 scales (the *_scales fields) in the k-block layout
// [num_experts, ceil(k / 64), n, 2] (uint8). Same bits as the BF16 kernels on the dequantized weights.
// k % 32 == 0, n % 8 == 0.
cudaError_t grouped_gemm_mxfp8_swiglu_gather(const GateUpGemm& args, const RowSchedule& sched, int num_sms,
                                             cudaStream_t stream);
cudaError_t grouped_gemm_mxfp8_nt_contiguous(const DownGemm& args, const RowSchedule& sched, int num_sms,
                                             cudaStream_t stream);

// Backward, dgrad of the down projection, then the SwiGLU backward kernel: d_h = bf16(dy_rows[r] · w_down[e])
// (w_down [num_experts, hidden, intermediate] read transposed), then (d_gate, d_up) [num_rows, intermediate] =
// bf16(swiglu_backward(gate, up, d_h)) from the saved gate, up [num_rows, intermediate], and h =
// bf16(swiglu(gate, up)) [num_rows, intermediate] for the weight gradient of the down projection.
struct DownDgradSwiGLU {
  const void* dy_rows;
  const void* w_down;
  const void* gate;         // bf16, or the row-wise MXFP8 E4M3 data (grouped_gemm_bf16_dgrad_swiglu_mxfp8)
  const void* up;           // idem
  const void* gate_scales;  // MXFP8 gate/up only: E8M0 [num_rows, intermediate / 32]; else null
  const void* up_scales;    // idem
  void* d_gate;
  void* d_up;
  void* h;
  int64_t hidden, intermediate, num_experts;
  SwiGLULimit swiglu;
  // The route gradients (grouped_gemm_bf16_dgrad_swiglu_route_grads; else all null): dy_rows holds the unweighted
  // d_out rows, the SwiGLU backward weights d_h by route_weights[row_to_route[r]], writes h weighted likewise and
  // d_topk_weights[row_to_route[r]] = Σ_i d_h[r, i]·h[r, i] (unweighted d_h, fixed order).
  const float* route_weights;    // fp32 [num_tokens · num_topk]
  const int64_t* row_to_route;   // int64 [num_rows], -1 for padding rows
  float* d_topk_weights;         // fp32 [num_tokens · num_topk]; routes without a row are not written
};

cudaError_t grouped_gemm_bf16_dgrad_swiglu(const DownDgradSwiGLU& args, const RowSchedule& sched, int num_sms,
                                           cudaStream_t stream);

// The same from unweighted rows, weighted by route in the SwiGLU backward, with the route gradients (the fields
// above): no saved y. bf16 gate/up.
cudaError_t grouped_gemm_bf16_dgrad_swiglu_route_grads(const DownDgradSwiGLU& args, const RowSchedule& sched,
                                                       int num_sms, cudaStream_t stream);

// The same with the forward's saved row-wise MXFP8 gate and up, dequantized in the SwiGLU kernel to
// mxfp8_dequantize's bits: the outputs are the BF16 op's on the dequantized gate/up. intermediate % 32 == 0.
cudaError_t grouped_gemm_bf16_dgrad_swiglu_mxfp8(const DownDgradSwiGLU& args, const RowSchedule& sched, int num_sms,
                                                 cudaStream_t stream);

// Backward, dgrad of gate/up: dx_rows [num_rows, hidden] = bf16(d_gate[r] · w_gate[e] + d_up[r] · w_up[e]), one
// fp32 sum over K = 2·intermediate (w_gate, w_up [num_experts, intermediate, hidden] read transposed).
struct GateUpDgrad {
  const void* d_gate;
  const void* d_up;
  const void* w_gate;
  const void* w_up;
  void* dx_rows;
  int64_t hidden, intermediate, num_experts;
};

cudaError_t grouped_gemm_bf16_dgrad_gate_up(const GateUpDgrad& args, const RowSchedule& sched, int num_sms,
                                            cudaStream_t stream);

// Weight gradients, a k-grouped GEMM: d_w[e] [m, n] = bf16(Σ_r a_rows[r]ᵀ · b_rows[r]) over the real rows r of
// expert e's segment, [expert_offsets[e], expert_offsets[e] + expert_rows[e]) (segment starts are multiples of
// 128, padding rows zero, the first 63 of them may be read); a_rows [num_rows, m], b_rows [num_rows, n] (both read
// transposed); an expert without rows gets zeros.
struct WeightGrad {
  const void* a_rows;
  const void* b_rows;
  const int32_t* expert_offsets;  // [num_experts + 1]
  const int32_t* expert_rows;     // [num_experts]
  void* d_w;                      // [num_experts, m, n]
  int64_t num_rows, m, n, num_experts;
};

cudaError_t grouped_gemm_bf16_weight_grad(const WeightGrad& args, int num_sms, cudaStream_t stream);

// The backward at EP = 1 in one persistent launch (csrc/include/mok/gemm/chain_backward.cuh), BF16, per expert group:
// grouped_gemm_bf16_dgrad_swiglu (dgrad; the routed group with its route fields, as ..._route_grads), then
// grouped_gemm_bf16_dgrad_gate_up (gate_up_dgrad, from dgrad's d_gate and d_up), then the weight gradients
// (grouped_gemm_bf16_weight_grad: wgrad[0] = d_w_down from dgrad's dy_rows and h, wgrad[1] = d_w_gate from d_gate and
// the x rows, wgrad[2] = d_w_up from d_up and the x rows), and the combine of d_x behind the gate/up dgrad's tiles:
// d_x bf16 [num_tokens, hidden] = combine_rows(routed dx_rows, route_to_row, no weights, the shared group's dx rows)
// bit for bit. The bits of those launches one by one. counters: int32 zeros [3 · num_rows / 128 + num_experts] per
// group; route_to_row int32 [num_tokens, num_topk]; token_done int32 zeros [num_tokens, ceil(hidden / 256)].
// The MXFP8 backward (the routed group only; dgrad with gate/up scales, as grouped_gemm_bf16_dgrad_swiglu_mxfp8, and
// no route fields): every operand as that precision's launches read it, the round trips of d_gate, d_up and h done
// in the launch: d_gate and d_up row-wise in place (gate_up_dgrad's operands), column-wise into d_gate_cols and
// d_up_cols (wgrad[1], wgrad[2]'s a_rows), h column-wise in place; wgrad[0]'s a_rows the dy rows' column-wise round
// trip, wgrad[1..2]'s b_rows the x rows' (launches: mxfp8_fake_quantize and its dual, the gathered kind for x).
struct ChainBackwardGroup {
  DownDgradSwiGLU dgrad;
  GateUpDgrad gate_up_dgrad;
  WeightGrad wgrad[3];
  RowSchedule sched;
  int32_t* counters;
  void *d_gate_cols, *d_up_cols;  // MXFP8: [num_rows, intermediate] bf16 each; null in BF16
};
// Over ranks (ranks.num_ranks > 0, no shared group in the launch): the combine of d_x as the forward chain's, with
// y the ranks' routed dx rows, out their d_x, and shared the shared expert's dx rows of each home rank's tokens,
// written before any rank's launch (they are not counted); x and topk_weights unused.
struct ChainBackward {
  ChainBackwardGroup routed, shared;  // shared.dgrad.w_down null: no shared expert
  const int32_t* route_to_row;
  void* d_x;
  int32_t* token_done;
  int64_t num_topk;
  ChainRanks ranks;
  ChainTrace trace;
};
cudaError_t grouped_gemm_bf16_chain_backward(const ChainBackward& args, int num_sms, cudaStream_t stream);

// ---- fixed-order combine (csrc/combine.cu) -----------------------------------------------------------
// out[t] = bf16(sum over k of w[t,k] * y_rows[route_to_row[t,k]] (fp32, increasing k) + shared[t]):
// y_rows bf16 [num_rows, hidden]; route_to_row [num_tokens, num_topk], int64 or int32; topk_weights fp32
// [num_tokens, num_topk] or null (weights 1: the d_x sum of the backward); shared bf16 [num_tokens, hidden]
// or null; out bf16 [num_tokens, hidden]. hidden % 8 == 0, 16-byte aligned rows. A route_to_row entry
// outside [0, num_rows) is not read; its token's output is NaN.

cudaError_t combine_rows(const void* y_rows, const void* route_to_row, bool route_to_row_is_int64,
                         const float* topk_weights, const void* shared, void* out, int64_t num_tokens,
                         int64_t num_topk, int64_t num_rows, int64_t hidden, cudaStream_t stream);

// ---- rows of other ranks (csrc/peer_rows.cu) -----------------------------------------------------------
// Through device arrays of num_ranks base addresses (each rank's buffer of `capacity` rows, the same on every rank:
// moe/peer_rows.cuh says whose memory they may be). pull_rows: out[r] = src[pull_rank[r]] row pull_token[r]
// (zeros where pull_rank[r] < 0), times weights[pull_rank[r]][pull_token[r] · num_topk + pull_k[r]] rounded to bf16
// when weights is not null. combine_peers: combine_rows with route (t, k)'s row at rows[combine_rank[t, k]] row
// combine_row[t, k]. int32 tables; bf16 rows, hidden % 8 == 0, 16-byte aligned. Out-of-bounds entries read nothing
// and give NaN rows (pull) or tokens (combine).

cudaError_t pull_rows(const void* const* src, const float* const* weights, const int32_t* pull_rank,
                      const int32_t* pull_token, const int32_t* pull_k, void* out, int64_t num_rows, int64_t hidden,
                      int64_t capacity, int num_ranks, int num_topk, cudaStream_t stream);

cudaError_t combine_peers(const void* const* rows, const int32_t* combine_rank, const int32_t* combine_row,
                          const float* topk_weights, const void* shared, void* out, int64_t num_tokens,
                          int64_t num_topk, int64_t capacity, int64_t hidden, int num_ranks, cudaStream_t stream);

// ---- row gather (csrc/gather_rows.cu) ---------------------------------------------------------------
// out[r] = x[row_to_token[r]] (a copy), zeros where row_to_token[r] < 0 (padding rows), NaN where it is >=
// num_tokens or the schedule's views of the row disagree (route_to_row[t, row_to_k[r]] != r): x bf16
// [num_tokens, hidden]; row_to_token int32 [num_rows]; row_to_k int64 [num_rows]; route_to_row int64
// [num_tokens, num_topk]; real_num_rows int32 [1] on the device (rows from it on are spare: left unwritten) or
// null (every row); out bf16 [num_rows, hidden]; hidden % 8 == 0, 16-byte aligned rows.

cudaError_t gather_rows(const void* x, const int32_t* row_to_token, const int64_t* row_to_k,
                        const int64_t* route_to_row, const int32_t* real_num_rows, void* out, int64_t num_tokens,
                        int64_t num_topk, int64_t num_rows, int64_t hidden, cudaStream_t stream);

// ---- route schedule on the device (csrc/schedule.cu) ----------------------------------------------------
// mok/schedule.py's make_schedule as three launches (csrc/include/mok/moe/schedule.cuh), no host sync: the
// row arrays are sized for max_num_rows (a multiple of block_m, at least schedule_max_num_rows); the first
// num_rows entries hold the schedule, the rest are spare rows (-1 everywhere, tile_num_rows 0).
// counts[0] = num_rows, counts[1] = number of topk_idx entries outside [0, num_experts): those routes are
// skipped, their route_to_row is -1 (combine_rows then gives their token NaN), and the caller raises.
// Every field int64 as in mok.schedule.Schedule, plus int32 copies for the GEMMs.

constexpr int64_t kScheduleChunkRoutes = 1024;  // routes per chunk (scratch: [ceil(T·K / 1024), E + 1] int32)
constexpr int64_t kScheduleMaxExperts = 4096;   // E counters per warp in shared memory (mok.ops falls back above)

// The most rows any routing of num_routes routes over num_experts experts needs (mok.schedule.max_num_rows):
// a segment of c > 0 routes takes ceil(c / block_m) <= (c + block_m − 1) / block_m tiles and at most
// min(E, routes) segments are non-empty, so the tiles number at most floor((routes + min(E, routes)·(block_m − 1))
// / block_m); attained by min(E, routes) − 1 experts with one route each and the rest on one more expert.
constexpr int64_t schedule_max_num_rows(int64_t num_routes, int64_t num_experts, int64_t block_m) {
  const int64_t busy = num_experts < num_routes ? num_experts : num_routes;
  return (num_routes + busy * (block_m - 1)) / block_m * block_m;
}

struct ScheduleOutputs {
  int64_t* tokens_per_expert;    // [E]
  int64_t* padded_per_expert;    // [E]
  int64_t* expert_offsets;       // [E + 1]
  int64_t* tile_offsets;         // [E + 1]
  int64_t* route_to_row;         // [T · K]
  int64_t* row_to_token;         // [max_num_rows], -1 in padding and spare rows
  int64_t* row_to_k;             // [max_num_rows], -1 in padding and spare rows
  int64_t* row_to_route;         // [max_num_rows], -1 in padding and spare rows
  int64_t* row_to_expert;        // [max_num_rows], -1 in spare rows
  int64_t* tile_to_expert;       // [max_num_rows / block_m], -1 for spare tiles
  int64_t* tile_num_rows;        // [max_num_rows / block_m], 0 for spare tiles
  int32_t* counts;               // [2]: num_rows (the real padded row count), ids outside [0, E)
  int32_t* row_to_token_i32;     // [max_num_rows], the GEMMs' row_to_token
  int32_t* gemm_tile_to_expert;  // [max_num_rows / 128], the GEMMs' per-128-row tiles; null: not written
};

cudaError_t make_schedule(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                          int64_t block_m, int64_t max_num_rows, const ScheduleOutputs& out, int32_t* chunk_counts,
                          cudaStream_t stream);

// ---- round_to_tiles on the device (csrc/round_to_tiles.cu) ---------------------------------------------------
// The rounding but for its rounds and swaps, in eight map steps (mok/moe/round_steps.cuh says what each writes, and
// what the caller runs between them). idx int64 [T·K] (topk_idx); scores float32 [T, E]; counts int32 [E] (zeroed
// by the caller); plan int64 [3, E] (delta,
// first position in expert order, need); keys int64 [T·K]; by_expert int64 [T·K] (the keys' stable argsort); chosen
// int32 [T·K]; slots int32 [T·K] (chosen's inclusive running count); pool int64 [P] (preset to T·K); num_real int64
// [1]; inv int64 [P]; may uint8 [E, P]; pool_scores float32 [E, P]; assign int64 [P] (the rounds'); routes int64
// [T·K] (preset to idx); left int64 [P]; out int64 [T·K]. A step reads only what the steps before it wrote.

enum RouteRoundStep : int {
  kRouteRoundCount,
  kRouteRoundPlan,
  kRouteRoundKeys,
  kRouteRoundChoose,
  kRouteRoundPool,
  kRouteRoundCells,
  kRouteRoundApply,
  kRouteRoundOrder
};

struct RouteRound {
  const int64_t* idx;
  const float* scores;
  int32_t* counts;
  int64_t* plan;
  int64_t* keys;
  const int64_t* by_expert;
  int32_t* chosen;
  const int32_t* slots;
  int64_t* pool;
  int64_t* num_real;
  int64_t* inv;
  uint8_t* may;
  float* pool_scores;
  const int64_t* assign;
  int64_t* routes;
  int64_t* left;
  int64_t* out;
  int64_t num_tokens, num_topk, num_experts, num_pool, tile;
};

cudaError_t route_round_step(const RouteRound& args, int step, cudaStream_t stream);

// The rounds: mok/rounding.py fill_rounds in one launch, with its result bit for bit (mok/moe/round_to_tiles.cuh): a
// pool of num_pool movable routes of num_tokens tokens, num_receivers experts that lack routes. order int64 [R, P]
// (receiver r's entries by descending score, ties ascending); may uint8 [R, U] (whether the token may take the
// receiver; cleared as it does); inv int64 [P] (each entry's token, nondecreasing); need int64 [R] (in: what each
// receiver lacks; out: what it still lacks); assign int64 [P] (out: the receiver's index, or -1); first int32 [U]
// and pick int32 [P]: scratch; num_real int64 [1] or null: the entries from it on are padding (never candidates,
// after the others in every row of order). num_receivers <= kFillMaxReceivers (20 bytes each in shared memory).

constexpr int64_t kFillMaxReceivers = 1024;

cudaError_t route_fill_rounds(const int64_t* order, uint8_t* may, const int64_t* inv, int64_t* need, int64_t* assign,
                              int32_t* first, int32_t* pick, const int64_t* num_real, int64_t num_pool,
                              int64_t num_tokens, int64_t num_receivers, cudaStream_t stream);

// mok/rounding.py swap_leftovers in one launch, with its result bit for bit: idx int64 [T, K] (the routing so far,
// changed in place), before int64 [T, K], allowed uint8 [T, E], left int64 [P] (the leftover route ids, ascending
// where >= 0), need int64 [E] (in: what each expert lacks; out: what it still lacks); waiting int32 [P] and moved
// int32 [T·K + P]: scratch. Returns at once when no expert lacks routes.
cudaError_t route_swap_leftovers(int64_t* idx, const int64_t* before, const uint8_t* allowed, const int64_t* left,
                                 int64_t* need, int32_t* waiting, int32_t* moved, int64_t num_tokens,
                                 int64_t num_topk, int64_t num_experts, int64_t num_left, cudaStream_t stream);

// ---- routed-gradient prep (csrc/route_grads.cu) -----------------------------------------------------------
// For each route (t, k) with row r = route_to_row[t, k]: dy_rows[r] = bf16(fp32(d_out[t]) · w[t, k]) and
// d_topk_weights[t, k] = Σ_h fp32(d_out[t, h]) · fp32(y_rows[r, h]) in a fixed order; padding rows of
// dy_rows (tile i: rows from tile_num_rows[i] on) are zeros. d_out bf16 [num_tokens, hidden]; topk_weights,
// d_topk_weights fp32 [num_tokens, num_topk]; route_to_row, tile_num_rows int64 (a Schedule's); y_rows,
// dy_rows bf16 [num_rows, hidden]. hidden % 8 == 0, 16-byte aligned rows; num_topk <= kRouteGradsMaxTopk.
// A row id outside [0, num_rows) is not touched; its d_topk_weights entry is NaN. real_num_rows: as for the
// GEMMs (int32 [1] or null): tiles from real_num_rows / block_m on are not touched.

constexpr int64_t kRouteGradsMaxTopk = 1024;

cudaError_t route_grads_prep(const void* d_out, const float* topk_weights, const void* y_rows,
                             const int64_t* route_to_row, const int64_t* tile_num_rows,
                             const int32_t* real_num_rows, void* dy_rows, float* d_topk_weights, int64_t num_tokens,
                             int64_t num_topk, int64_t num_rows, int64_t hidden, int64_t block_m,
                             cudaStream_t stream);

}  // namespace mok
