// The one file that sees both torch and mok's kernels: tensors in, raw pointers to the torch-free host
// API (mok/api.h) out, on the current stream. Outputs are allocated and every argument is checked with
// a clear message in mok/ops/; the TORCH_CHECKs here only guard against misuse of the raw bindings.
// NOTE: their messages are strings only: with torch 2.11.0+cu130 a TORCH_CHECK whose message formats a number
// can segfault the process instead of raising (not understood); string-only messages raise RuntimeError.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <map>
#include <vector>
#include <string>

#include "mok/api.h"

namespace {

// The device guard of every launch. It also clears an error that an earlier CUDA runtime call on this host thread
// left unread: mok's launchers return cudaGetLastError(), which would blame their launch for it (torch's autograd
// device thread can carry one: mok.moe's backward then failed with "invalid argument" on valid operands).
struct LaunchGuard {
  c10::cuda::CUDAGuard device;
  explicit LaunchGuard(c10::Device d) : device(d) { (void)cudaGetLastError(); }
};

void check_cuda(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, "mok.", op, ": kernel launch failed: ", cudaGetErrorString(status));
}

void check_arg(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.is_contiguous(), name, ": expected a contiguous CUDA tensor");
}

// A schedule's device counts (int32, entry 0 = the real padded row count, mok.schedule.Schedule.counts) or
// null: the row-wise kernels then run every row of the buffers.
const int32_t* real_num_rows_ptr(const std::optional<at::Tensor>& counts) {
  if (!counts) return nullptr;
  check_arg(*counts, "counts");
  TORCH_CHECK(counts->scalar_type() == at::kInt && counts->numel() >= 1, "counts: expected int32 [2]");
  return counts->data_ptr<int32_t>();
}

void quantize_rowwise(const at::Tensor& x, at::Tensor& data, at::Tensor& scales) {
  check_arg(x, "x"), check_arg(data, "data"), check_arg(scales, "scales");
  const LaunchGuard guard(x.device());
  check_cuda(mok::mxfp8_quantize_rowwise(x.data_ptr(), data.data_ptr(), scales.data_ptr(), x.numel(),
                                         c10::cuda::getCurrentCUDAStream()),
             "mxfp8_quantize_rowwise");
}

void quantize_colwise(const at::Tensor& x, at::Tensor& data, at::Tensor& scales) {
  check_arg(x, "x"), check_arg(data, "data"), check_arg(scales, "scales");
  const LaunchGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  check_cuda(mok::mxfp8_quantize_colwise(x.data_ptr(), data.data_ptr(), scales.data_ptr(), rows, cols,
                                         c10::cuda::getCurrentCUDAStream()),
             "mxfp8_quantize_colwise");
}

void quantize_dual(const at::Tensor& x, at::Tensor& data_row, at::Tensor& scales_row, at::Tensor& data_col,
                   at::Tensor& scales_col) {
  check_arg(x, "x"), check_arg(data_row, "data_row"), check_arg(scales_row, "scales_row");
  check_arg(data_col, "data_col"), check_arg(scales_col, "scales_col");
  const LaunchGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  check_cuda(mok::mxfp8_quantize_dual(x.data_ptr(), data_row.data_ptr(), scales_row.data_ptr(),
                                      data_col.data_ptr(), scales_col.data_ptr(), rows, cols,
                                      c10::cuda::getCurrentCUDAStream()),
             "mxfp8_quantize_dual");
}

void dequantize(const at::Tensor& data, const at::Tensor& scales, at::Tensor& out, bool rowwise) {
  check_arg(data, "data"), check_arg(scales, "scales"), check_arg(out, "out");
  const LaunchGuard guard(data.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t cols = data.size(-1), rows = cols == 0 ? 0 : data.numel() / cols;
  check_cuda(rowwise ? mok::mxfp8_dequantize_rowwise(data.data_ptr(), scales.data_ptr(), out.data_ptr(),
                                                     data.numel(), stream)
                     : mok::mxfp8_dequantize_colwise(data.data_ptr(), scales.data_ptr(), out.data_ptr(),
                                                     rows, cols, stream),
             "mxfp8_dequantize");
}

void fake_quantize(const at::Tensor& x, at::Tensor& out_col_or_row, const std::optional<at::Tensor>& out_row,
                   bool rowwise, const std::optional<at::Tensor>& counts) {
  check_arg(x, "x"), check_arg(out_col_or_row, "out");
  if (out_row) check_arg(*out_row, "out_row");
  TORCH_CHECK(!(rowwise && counts), "counts: expected None for the row-wise round trip");
  const LaunchGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  check_cuda(rowwise ? mok::mxfp8_fake_quantize_rowwise(x.data_ptr(), out_col_or_row.data_ptr(), x.numel(), stream)
                     : mok::mxfp8_fake_quantize_tiled(x.data_ptr(), out_col_or_row.data_ptr(),
                                                      out_row ? out_row->data_ptr() : nullptr, rows, cols,
                                                      real_num_rows_ptr(counts), stream),
             "mxfp8_fake_quantize");
}

void fake_quantize_gathered(const at::Tensor& x, const at::Tensor& row_to_token, at::Tensor& out,
                            const std::optional<at::Tensor>& counts) {
  check_arg(x, "x"), check_arg(row_to_token, "row_to_token"), check_arg(out, "out");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt, "row_to_token: expected int32");
  const LaunchGuard guard(x.device());
  check_cuda(mok::mxfp8_fake_quantize_gathered_colwise(x.data_ptr(), row_to_token.data_ptr<int32_t>(),
                                                       out.data_ptr(), out.size(0), x.size(0), x.size(1),
                                                       real_num_rows_ptr(counts), c10::cuda::getCurrentCUDAStream()),
             "mxfp8_fake_quantize_gathered");
}

// ---- grouped GEMMs (mok.ops.gemm, mok.ops.gemm_mx): operands and schedule by field name ------------------------

// The schedule as the row-wise GEMMs read it (mok.ops.gemm.gemm_schedule_kwargs: row_to_token, tile_to_expert,
// counts).
mok::RowSchedule row_schedule(const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                              const std::optional<at::Tensor>& counts) {
  check_arg(row_to_token, "row_to_token"), check_arg(tile_to_expert, "tile_to_expert");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt && tile_to_expert.scalar_type() == at::kInt,
              "row_to_token, tile_to_expert: expected int32");
  mok::RowSchedule sched{};
  sched.row_to_token = row_to_token.data_ptr<int32_t>();
  sched.tile_to_expert = tile_to_expert.data_ptr<int32_t>();
  sched.real_num_rows = real_num_rows_ptr(counts);
  sched.num_rows = row_to_token.numel();
  return sched;
}

mok::SwiGLULimit swiglu_limit_of(double swiglu_limit, bool has_limit) {
  mok::SwiGLULimit limit{};
  limit.limit = static_cast<float>(swiglu_limit);
  limit.has_limit = has_limit;
  return limit;
}

// A row-wise GEMM of the host API (mok/api.h) on `on`'s device and its current stream; raises naming `name`.
template <class Args>
void launch_rows(cudaError_t (*launch)(const Args&, const mok::RowSchedule&, int, cudaStream_t), const char* name,
                 const Args& args, const mok::RowSchedule& sched, int64_t num_sms, const at::Tensor& on) {
  const LaunchGuard guard(on.device());
  check_cuda(launch(args, sched, static_cast<int>(num_sms), c10::cuda::getCurrentCUDAStream()), name);
}

// GEMM1's operands: w_gate_scales, w_up_scales only with MXFP8 weights (`mx`).
mok::GateUpGemm gate_up_gemm(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                             const std::optional<at::Tensor>& w_gate_scales,
                             const std::optional<at::Tensor>& w_up_scales, at::Tensor& h, at::Tensor& gate,
                             at::Tensor& up, double swiglu_limit, bool has_limit) {
  check_arg(x, "x"), check_arg(w_gate, "w_gate"), check_arg(w_up, "w_up"), check_arg(h, "h");
  check_arg(gate, "gate"), check_arg(up, "up");
  if (w_gate_scales) check_arg(*w_gate_scales, "w_gate_scales");
  if (w_up_scales) check_arg(*w_up_scales, "w_up_scales");
  mok::GateUpGemm args{};
  args.x = x.data_ptr();
  args.w_gate = w_gate.data_ptr();
  args.w_up = w_up.data_ptr();
  args.w_gate_scales = w_gate_scales ? w_gate_scales->data_ptr() : nullptr;
  args.w_up_scales = w_up_scales ? w_up_scales->data_ptr() : nullptr;
  args.h = h.data_ptr();
  args.gate = gate.data_ptr();
  args.up = up.data_ptr();
  args.hidden = x.size(1);
  args.intermediate = w_gate.size(1);
  args.num_experts = w_gate.size(0);
  args.swiglu = swiglu_limit_of(swiglu_limit, has_limit);
  return args;
}

void gemm_swiglu_gather(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                        const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                        const std::optional<at::Tensor>& counts, at::Tensor& h, at::Tensor& gate, at::Tensor& up,
                        double swiglu_limit, bool has_limit, int64_t num_sms) {
  const mok::RowSchedule sched = row_schedule(row_to_token, tile_to_expert, counts);
  const mok::GateUpGemm args = gate_up_gemm(x, w_gate, w_up, {}, {}, h, gate, up, swiglu_limit, has_limit);
  launch_rows(mok::grouped_gemm_bf16_swiglu_gather, "grouped_gemm_bf16_swiglu_gather", args, sched, num_sms, x);
}

void gemm_swiglu_gather_mxfp8_out(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                                  const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                                  const std::optional<at::Tensor>& counts, at::Tensor& h, at::Tensor& gate_mx,
                                  at::Tensor& up_mx, double swiglu_limit, bool has_limit, int64_t num_sms) {
  const mok::RowSchedule sched = row_schedule(row_to_token, tile_to_expert, counts);
  const mok::GateUpGemm args = gate_up_gemm(x, w_gate, w_up, {}, {}, h, gate_mx, up_mx, swiglu_limit, has_limit);
  const int64_t mx_bytes = h.numel() + h.numel() / 32;  // E4M3 data, then one scale byte per 32
  TORCH_CHECK(gate_mx.nbytes() == mx_bytes && up_mx.nbytes() == mx_bytes,
              "gate_mx, up_mx: expected the data and scales of h's shape in one buffer");
  launch_rows(mok::grouped_gemm_bf16_swiglu_gather_mxfp8_out, "grouped_gemm_bf16_swiglu_gather_mxfp8_out",
              args, sched, num_sms, x);
}

void gemm_mx_swiglu_gather(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_gate_scales,
                           const at::Tensor& w_up, const at::Tensor& w_up_scales, const at::Tensor& row_to_token,
                           const at::Tensor& tile_to_expert, const std::optional<at::Tensor>& counts, at::Tensor& h,
                           at::Tensor& gate, at::Tensor& up, double swiglu_limit, bool has_limit, int64_t num_sms) {
  const mok::RowSchedule sched = row_schedule(row_to_token, tile_to_expert, counts);
  const mok::GateUpGemm args =
      gate_up_gemm(x, w_gate, w_up, w_gate_scales, w_up_scales, h, gate, up, swiglu_limit, has_limit);
  launch_rows(mok::grouped_gemm_mxfp8_swiglu_gather, "grouped_gemm_mxfp8_swiglu_gather", args, sched, num_sms, x);
}

// GEMM2's operands: w_scales only with MXFP8 weights.
mok::DownGemm down_gemm(const at::Tensor& a_rows, const at::Tensor& w, const std::optional<at::Tensor>& w_scales,
                        at::Tensor& out) {
  check_arg(a_rows, "a_rows"), check_arg(w, "w"), check_arg(out, "out");
  if (w_scales) check_arg(*w_scales, "w_scales");
  mok::DownGemm args{};
  args.a_rows = a_rows.data_ptr();
  args.w = w.data_ptr();
  args.w_scales = w_scales ? w_scales->data_ptr() : nullptr;
  args.out = out.data_ptr();
  args.n = w.size(1);
  args.k = w.size(2);
  args.num_experts = w.size(0);
  return args;
}

void gemm_nt_contiguous(const at::Tensor& a_rows, const at::Tensor& w, const at::Tensor& row_to_token,
                        const at::Tensor& tile_to_expert, const std::optional<at::Tensor>& counts, at::Tensor& out,
                        int64_t num_sms) {
  const mok::RowSchedule sched = row_schedule(row_to_token, tile_to_expert, counts);
  const mok::DownGemm args = down_gemm(a_rows, w, {}, out);
  launch_rows(mok::grouped_gemm_bf16_nt_contiguous, "grouped_gemm_bf16_nt_contiguous", args, sched, num_sms, a_rows);
}

// The chain over ranks from its lists (x, y, topk_weights, shared, out, token_done; entry s: rank s's tensor, as
// mok.ops.chain.ChainRanks holds them; a list may be empty). Entry `rank` of y, out, token_done (and shared) must be
// the launch's own tensors: the launcher checks it.
mok::ChainRanks chain_ranks(const std::vector<std::vector<at::Tensor>>& lists, int64_t rank,
                            const std::vector<int64_t>& token_offsets) {
  TORCH_CHECK(lists.size() == 6, "ranks: expected 6 lists (x, y, topk_weights, shared, out, token_done)");
  const int64_t R = static_cast<int64_t>(lists[1].size());  // y: every pass has it
  TORCH_CHECK(R >= 1 && R <= mok::kMaxRanks, "ranks: expected 1 to ", mok::kMaxRanks, " ranks, got ", R);
  TORCH_CHECK(rank >= 0 && rank < R, "rank: expected in [0, ", R, "), got ", rank);
  TORCH_CHECK(static_cast<int64_t>(token_offsets.size()) == R, "token_offsets: expected one per rank");
  for (const auto& list : lists)
    TORCH_CHECK(static_cast<int64_t>(list.size()) == R || list.empty(), "ranks: expected one tensor per rank");
  mok::ChainRanks r{};
  r.num_ranks = static_cast<int>(R), r.rank = static_cast<int>(rank);
  const auto ptr = [&](int list, int64_t s) -> void* {
    return lists[list].empty() ? nullptr : lists[list][s].data_ptr();
  };
  for (int64_t s = 0; s < R; ++s) {
    TORCH_CHECK(token_offsets[s] >= 0 && token_offsets[s] <= INT32_MAX, "token_offsets: expected int32 offsets");
    r.x[s] = ptr(0, s), r.y[s] = ptr(1, s), r.topk_weights[s] = static_cast<const float*>(ptr(2, s));
    r.shared[s] = ptr(3, s), r.out[s] = ptr(4, s), r.token_done[s] = static_cast<int32_t*>(ptr(5, s));
    r.token_offset[s] = static_cast<int32_t>(token_offsets[s]);
  }
  TORCH_CHECK(!lists[1].empty() && !lists[4].empty() && !lists[5].empty(), "ranks: expected y, out and token_done");
  r.y_capacity = lists[1][rank].size(0);
  return r;
}

// A chain launch's trace (gemm/trace.cuh): None (off), or int64 zeros [capacity, 5].
mok::ChainTrace chain_trace(const std::optional<at::Tensor>& trace) {
  if (!trace) return {};
  check_arg(*trace, "trace");
  TORCH_CHECK(trace->scalar_type() == at::kLong && trace->dim() == 2 && trace->size(1) == 5,
              "trace: expected int64 zeros [capacity, 5]");  // its device: the launch's (mok.ops checks it)
  return {reinterpret_cast<uint64_t*>(trace->data_ptr<int64_t>()), trace->size(0)};
}

void gemm_chain(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up, const at::Tensor& w_down,
                const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                const std::optional<at::Tensor>& counts, at::Tensor& h, at::Tensor& gate, at::Tensor& up,
                at::Tensor& y, at::Tensor& h_ready, const std::optional<std::vector<at::Tensor>>& shared_expert,
                const std::optional<at::Tensor>& route_to_row, const std::optional<at::Tensor>& topk_weights,
                const std::optional<at::Tensor>& shared, const std::optional<at::Tensor>& out,
                const std::optional<at::Tensor>& token_done, bool mx_out, double swiglu_limit, bool has_limit,
                int64_t num_sms, const std::optional<std::vector<std::vector<at::Tensor>>>& ranks, int64_t rank,
                const std::vector<int64_t>& token_offsets, const std::optional<at::Tensor>& trace) {
  const mok::RowSchedule sched = row_schedule(row_to_token, tile_to_expert, counts);
  check_arg(h_ready, "h_ready");
  if (mx_out) {
    const int64_t mx_bytes = h.numel() + h.numel() / 32;  // E4M3 data, then one scale byte per 32
    TORCH_CHECK(gate.nbytes() == mx_bytes && up.nbytes() == mx_bytes,
                "gate, up: expected with mx_out the data and scales of h's shape in one buffer");
  }
  TORCH_CHECK(h_ready.scalar_type() == at::kInt && h_ready.numel() == row_to_token.numel() / 128,
              "h_ready: expected int32 zeros, one per 128 rows");
  mok::ChainGemm args{};
  args.gate_up = gate_up_gemm(x, w_gate, w_up, {}, {}, h, gate, up, swiglu_limit, has_limit);
  args.down = down_gemm(h, w_down, {}, y);
  args.h_ready = h_ready.data_ptr<int32_t>();
  args.mx_out = mx_out;
  if (shared_expert) {  // x, w_gate, w_up, w_down [1, ...], row_to_token, tile_to_expert, h, gate, up, y, h_ready
    const std::vector<at::Tensor>& e = *shared_expert;
    TORCH_CHECK(e.size() == 11, "shared_expert: expected 11 tensors");
    at::Tensor sh_h = e[6], sh_gate = e[7], sh_up = e[8], sh_y = e[9];
    check_arg(e[10], "shared_expert h_ready");
    TORCH_CHECK(e[10].scalar_type() == at::kInt && e[10].numel() == e[4].numel() / 128,
                "shared_expert h_ready: expected int32 zeros, one per 128 rows");
    args.shared_gate_up = gate_up_gemm(e[0], e[1], e[2], {}, {}, sh_h, sh_gate, sh_up, swiglu_limit, has_limit);
    args.shared_down = down_gemm(sh_h, e[3], {}, sh_y);
    args.shared_sched = row_schedule(e[4], e[5], std::nullopt);
    args.shared_h_ready = e[10].data_ptr<int32_t>();
  }
  if (out) {  // the combine behind GEMM2
    TORCH_CHECK(route_to_row && topk_weights && token_done,
                "route_to_row, topk_weights, token_done: expected with out");
    check_arg(*route_to_row, "route_to_row"), check_arg(*topk_weights, "topk_weights"), check_arg(*out, "out");
    check_arg(*token_done, "token_done");
    if (shared) check_arg(*shared, "shared");
    TORCH_CHECK(route_to_row->scalar_type() == at::kInt && token_done->scalar_type() == at::kInt,
                "route_to_row, token_done: expected int32");
    args.route_to_row = route_to_row->data_ptr<int32_t>();
    args.topk_weights = topk_weights->data_ptr<float>();
    args.shared = shared ? shared->data_ptr() : nullptr;
    args.out = out->data_ptr();
    args.token_done = token_done->data_ptr<int32_t>();
    args.num_topk = route_to_row->size(1);
  }
  if (ranks) args.ranks = chain_ranks(*ranks, rank, token_offsets);
  args.trace = chain_trace(trace);
  launch_rows(mok::grouped_gemm_bf16_chain, "grouped_gemm_bf16_chain", args, sched, num_sms, x);
}

void gemm_mx_nt_contiguous(const at::Tensor& a_rows, const at::Tensor& w, const at::Tensor& w_scales,
                           const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                           const std::optional<at::Tensor>& counts, at::Tensor& out, int64_t num_sms) {
  const mok::RowSchedule sched = row_schedule(row_to_token, tile_to_expert, counts);
  const mok::DownGemm args = down_gemm(a_rows, w, w_scales, out);
  launch_rows(mok::grouped_gemm_mxfp8_nt_contiguous, "grouped_gemm_mxfp8_nt_contiguous", args, sched, num_sms, a_rows);
}

// The down dgrad's operands: gate_scales, up_scales only with MXFP8 gate/up.
mok::DownDgradSwiGLU down_dgrad(const at::Tensor& dy_rows, const at::Tensor& w_down, const at::Tensor& gate,
                                const at::Tensor& up, const std::optional<at::Tensor>& gate_scales,
                                const std::optional<at::Tensor>& up_scales, at::Tensor& d_gate, at::Tensor& d_up,
                                at::Tensor& h, double swiglu_limit, bool has_limit) {
  check_arg(dy_rows, "dy_rows"), check_arg(w_down, "w_down"), check_arg(gate, "gate"), check_arg(up, "up");
  check_arg(d_gate, "d_gate"), check_arg(d_up, "d_up"), check_arg(h, "h");
  if (gate_scales) check_arg(*gate_scales, "gate_scales");
  if (up_scales) check_arg(*up_scales, "up_scales");
  mok::DownDgradSwiGLU args{};
  args.dy_rows = dy_rows.data_ptr();
  args.w_down = w_down.data_ptr();
  args.gate = gate.data_ptr();
  args.up = up.data_ptr();
  args.gate_scales = gate_scales ? gate_scales->data_ptr() : nullptr;
  args.up_scales = up_scales ? up_scales->data_ptr() : nullptr;
  args.d_gate = d_gate.data_ptr();
  args.d_up = d_up.data_ptr();
  args.h = h.data_ptr();
  args.hidden = w_down.size(1);
  args.intermediate = w_down.size(2);
  args.num_experts = w_down.size(0);
  args.swiglu = swiglu_limit_of(swiglu_limit, has_limit);
  return args;
}

void gemm_dgrad_swiglu(const at::Tensor& dy_rows, const at::Tensor& w_down, const at::Tensor& gate,
                       const at::Tensor& up, const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                       const std::optional<at::Tensor>& counts, at::Tensor& d_gate, at::Tensor& d_up, at::Tensor& h,
                       double swiglu_limit, bool has_limit, int64_t num_sms) {
  const mok::RowSchedule sched = row_schedule(row_to_token, tile_to_expert, counts);
  const mok::DownDgradSwiGLU args =
      down_dgrad(dy_rows, w_down, gate, up, {}, {}, d_gate, d_up, h, swiglu_limit, has_limit);
  launch_rows(mok::grouped_gemm_bf16_dgrad_swiglu, "grouped_gemm_bf16_dgrad_swiglu", args, sched, num_sms, dy_rows);
}

void gemm_dgrad_swiglu_route_grads(const at::Tensor& d_out_rows, const at::Tensor& w_down, const at::Tensor& gate,
                                   const at::Tensor& up, const at::Tensor& topk_weights,
                                   const at::Tensor& row_to_route, const at::Tensor& row_to_token,
                                   const at::Tensor& tile_to_expert, const std::optional<at::Tensor>& counts,
                                   at::Tensor& d_gate, at::Tensor& d_up, at::Tensor& h, at::Tensor& d_topk_weights,
                                   double swiglu_limit, bool has_limit, int64_t num_sms) {
  const mok::RowSchedule sched = row_schedule(row_to_token, tile_to_expert, counts);
  mok::DownDgradSwiGLU args =
      down_dgrad(d_out_rows, w_down, gate, up, {}, {}, d_gate, d_up, h, swiglu_limit, has_limit);
  check_arg(topk_weights, "topk_weights"), check_arg(row_to_route, "row_to_route");
  check_arg(d_topk_weights, "d_topk_weights");
  args.route_weights = topk_weights.data_ptr<float>();
  args.row_to_route = row_to_route.data_ptr<int64_t>();
  args.d_topk_weights = d_topk_weights.data_ptr<float>();
  launch_rows(mok::grouped_gemm_bf16_dgrad_swiglu_route_grads, "grouped_gemm_bf16_dgrad_swiglu_route_grads",
              args, sched, num_sms, d_out_rows);
}

void gemm_dgrad_swiglu_mxfp8(const at::Tensor& dy_rows, const at::Tensor& w_down, const at::Tensor& gate_data,
                             const at::Tensor& gate_scales, const at::Tensor& up_data, const at::Tensor& up_scales,
                             const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                             const std::optional<at::Tensor>& counts, at::Tensor& d_gate, at::Tensor& d_up,
                             at::Tensor& h, double swiglu_limit, bool has_limit, int64_t num_sms) {
  const mok::RowSchedule sched = row_schedule(row_to_token, tile_to_expert, counts);
  const mok::DownDgradSwiGLU args = down_dgrad(dy_rows, w_down, gate_data, up_data, gate_scales, up_scales, d_gate,
                                               d_up, h, swiglu_limit, has_limit);
  launch_rows(mok::grouped_gemm_bf16_dgrad_swiglu_mxfp8, "grouped_gemm_bf16_dgrad_swiglu_mxfp8",
              args, sched, num_sms, dy_rows);
}

void gemm_dgrad_gate_up(const at::Tensor& d_gate, const at::Tensor& d_up, const at::Tensor& w_gate,
                        const at::Tensor& w_up, const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                        const std::optional<at::Tensor>& counts, at::Tensor& dx_rows, int64_t num_sms) {
  const mok::RowSchedule sched = row_schedule(row_to_token, tile_to_expert, counts);
  check_arg(d_gate, "d_gate"), check_arg(d_up, "d_up"), check_arg(w_gate, "w_gate"), check_arg(w_up, "w_up");
  check_arg(dx_rows, "dx_rows");
  mok::GateUpDgrad args{};
  args.d_gate = d_gate.data_ptr();
  args.d_up = d_up.data_ptr();
  args.w_gate = w_gate.data_ptr();
  args.w_up = w_up.data_ptr();
  args.dx_rows = dx_rows.data_ptr();
  args.hidden = w_gate.size(2);
  args.intermediate = w_gate.size(1);
  args.num_experts = w_gate.size(0);
  launch_rows(mok::grouped_gemm_bf16_dgrad_gate_up, "grouped_gemm_bf16_dgrad_gate_up", args, sched, num_sms, d_gate);
}

mok::WeightGrad weight_grad(const at::Tensor& a_rows, const at::Tensor& b_rows, const at::Tensor& expert_offsets,
                            const at::Tensor& expert_rows, at::Tensor& d_w) {
  check_arg(a_rows, "a_rows"), check_arg(b_rows, "b_rows"), check_arg(expert_offsets, "expert_offsets");
  check_arg(expert_rows, "expert_rows"), check_arg(d_w, "d_w");
  TORCH_CHECK(expert_offsets.scalar_type() == at::kInt, "expert_offsets: expected int32");
  TORCH_CHECK(expert_rows.scalar_type() == at::kInt, "expert_rows: expected int32");
  mok::WeightGrad args{};
  args.a_rows = a_rows.data_ptr();
  args.b_rows = b_rows.data_ptr();
  args.expert_offsets = expert_offsets.data_ptr<int32_t>();
  args.expert_rows = expert_rows.data_ptr<int32_t>();
  args.d_w = d_w.data_ptr();
  args.num_rows = a_rows.size(0);
  args.m = a_rows.size(1);
  args.n = b_rows.size(1);
  args.num_experts = d_w.size(0);
  return args;
}

void gemm_weight_grad(const at::Tensor& a_rows, const at::Tensor& b_rows, const at::Tensor& expert_offsets,
                      const at::Tensor& expert_rows, at::Tensor& d_w, int64_t num_sms) {
  const mok::WeightGrad args = weight_grad(a_rows, b_rows, expert_offsets, expert_rows, d_w);
  const LaunchGuard guard(a_rows.device());
  check_cuda(mok::grouped_gemm_bf16_weight_grad(args, static_cast<int>(num_sms), c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_bf16_weight_grad");
}

// One expert group of the backward chain, its tensors in mok.ops.gemm.grouped_gemm_bf16_chain_backward's order:
// dy_rows, x_rows, w_gate, w_up, w_down, gate, up, d_gate, d_up, h, dx_rows, d_w_gate, d_w_up, d_w_down,
// row_to_token, tile_to_expert, expert_offsets, expert_rows, counters. mx (the MXFP8 backward): gate_scales,
// up_scales (gate, up: their E4M3 data), dy_cols, d_gate_cols, d_up_cols (mok::ChainBackwardGroup's).
mok::ChainBackwardGroup chain_backward_group(std::vector<at::Tensor> t, const std::optional<at::Tensor>& counts,
                                             double swiglu_limit, bool has_limit,
                                             const std::optional<std::vector<at::Tensor>>& mx = std::nullopt) {
  TORCH_CHECK(t.size() == 19, "a group of the backward chain: expected 19 tensors");
  TORCH_CHECK(!mx || mx->size() == 5, "mx: expected 5 tensors");
  at::Tensor &dy_rows = t[0], &x_rows = t[1], &w_gate = t[2], &w_up = t[3], &w_down = t[4], &gate = t[5], &up = t[6];
  at::Tensor &d_gate = t[7], &d_up = t[8], &h = t[9], &dx_rows = t[10], &counters = t[18];
  check_arg(x_rows, "x_rows"), check_arg(dx_rows, "dx_rows"), check_arg(counters, "counters");
  TORCH_CHECK(counters.scalar_type() == at::kInt, "counters: expected int32 zeros");
  mok::ChainBackwardGroup g{};
  g.dgrad = mx ? down_dgrad(dy_rows, w_down, gate, up, (*mx)[0], (*mx)[1], d_gate, d_up, h, swiglu_limit, has_limit)
               : down_dgrad(dy_rows, w_down, gate, up, {}, {}, d_gate, d_up, h, swiglu_limit, has_limit);
  g.gate_up_dgrad.d_gate = d_gate.data_ptr();
  g.gate_up_dgrad.d_up = d_up.data_ptr();
  g.gate_up_dgrad.w_gate = w_gate.data_ptr();
  g.gate_up_dgrad.w_up = w_up.data_ptr();
  g.gate_up_dgrad.dx_rows = dx_rows.data_ptr();
  g.gate_up_dgrad.hidden = w_gate.size(2);
  g.gate_up_dgrad.intermediate = w_gate.size(1);
  g.gate_up_dgrad.num_experts = w_gate.size(0);
  g.wgrad[0] = weight_grad(mx ? (*mx)[2] : dy_rows, h, t[16], t[17], t[13]);
  g.wgrad[1] = weight_grad(mx ? (*mx)[3] : d_gate, x_rows, t[16], t[17], t[11]);
  g.wgrad[2] = weight_grad(mx ? (*mx)[4] : d_up, x_rows, t[16], t[17], t[12]);
  if (mx) g.d_gate_cols = (*mx)[3].data_ptr(), g.d_up_cols = (*mx)[4].data_ptr();
  g.sched = row_schedule(t[14], t[15], counts);
  g.counters = counters.data_ptr<int32_t>();
  return g;
}

void gemm_chain_backward(const std::vector<at::Tensor>& routed, const std::optional<at::Tensor>& counts,
                         const std::optional<at::Tensor>& topk_weights, const std::optional<at::Tensor>& row_to_route,
                         const std::optional<at::Tensor>& d_topk_weights,
                         const std::optional<std::vector<at::Tensor>>& shared, const at::Tensor& route_to_row,
                         at::Tensor& d_x, at::Tensor& token_done, double swiglu_limit, bool has_limit,
                         int64_t num_sms, const std::optional<std::vector<std::vector<at::Tensor>>>& ranks,
                         int64_t rank, const std::vector<int64_t>& token_offsets,
                         const std::optional<at::Tensor>& trace, const std::optional<std::vector<at::Tensor>>& mx) {
  check_arg(route_to_row, "route_to_row"), check_arg(d_x, "d_x"), check_arg(token_done, "token_done");
  TORCH_CHECK(route_to_row.scalar_type() == at::kInt && token_done.scalar_type() == at::kInt,
              "route_to_row, token_done: expected int32");
  TORCH_CHECK(mx.has_value() != (topk_weights && row_to_route && d_topk_weights),
              "topk_weights, row_to_route, d_topk_weights: all set in BF16, all None with mx");
  mok::ChainBackward args{};
  args.routed = chain_backward_group(routed, counts, swiglu_limit, has_limit, mx);
  if (!mx) {
    check_arg(*topk_weights, "topk_weights"), check_arg(*row_to_route, "row_to_route");
    check_arg(*d_topk_weights, "d_topk_weights");
    TORCH_CHECK(row_to_route->scalar_type() == at::kLong, "row_to_route: expected int64");
    args.routed.dgrad.route_weights = topk_weights->data_ptr<float>();
    args.routed.dgrad.row_to_route = row_to_route->data_ptr<int64_t>();
    args.routed.dgrad.d_topk_weights = d_topk_weights->data_ptr<float>();
  }
  if (shared) args.shared = chain_backward_group(*shared, std::nullopt, swiglu_limit, has_limit);
  args.route_to_row = route_to_row.data_ptr<int32_t>();
  args.d_x = d_x.data_ptr();
  args.token_done = token_done.data_ptr<int32_t>();
  args.num_topk = route_to_row.size(1);
  if (ranks) args.ranks = chain_ranks(*ranks, rank, token_offsets);
  args.trace = chain_trace(trace);
  const LaunchGuard guard(d_x.device());
  check_cuda(mok::grouped_gemm_bf16_chain_backward(args, static_cast<int>(num_sms), c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_bf16_chain_backward");
}

void combine(const at::Tensor& y_rows, const at::Tensor& route_to_row, const std::optional<at::Tensor>& topk_weights,
             const std::optional<at::Tensor>& shared, at::Tensor& out) {
  check_arg(y_rows, "y_rows"), check_arg(route_to_row, "route_to_row"), check_arg(out, "out");
  if (topk_weights) check_arg(*topk_weights, "topk_weights");
  if (shared) check_arg(*shared, "shared");
  TORCH_CHECK(route_to_row.scalar_type() == at::kLong || route_to_row.scalar_type() == at::kInt,
              "route_to_row: expected int64 or int32");
  const LaunchGuard guard(y_rows.device());
  check_cuda(mok::combine_rows(y_rows.data_ptr(), route_to_row.data_ptr(), route_to_row.scalar_type() == at::kLong,
                               topk_weights ? topk_weights->data_ptr<float>() : nullptr,
                               shared ? shared->data_ptr() : nullptr, out.data_ptr(), route_to_row.size(0),
                               route_to_row.size(1), y_rows.size(0), y_rows.size(1),
                               c10::cuda::getCurrentCUDAStream()),
             "combine_rows");
}

void gather(const at::Tensor& x, const at::Tensor& row_to_token, const at::Tensor& row_to_k,
            const at::Tensor& route_to_row, at::Tensor& out, const std::optional<at::Tensor>& counts) {
  check_arg(x, "x"), check_arg(row_to_token, "row_to_token"), check_arg(row_to_k, "row_to_k");
  check_arg(route_to_row, "route_to_row"), check_arg(out, "out");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt, "row_to_token: expected int32");
  TORCH_CHECK(row_to_k.scalar_type() == at::kLong && route_to_row.scalar_type() == at::kLong,
              "row_to_k, route_to_row: expected int64");
  TORCH_CHECK(route_to_row.dim() == 2, "route_to_row: expected [num_tokens, num_topk]");
  const LaunchGuard guard(x.device());
  check_cuda(mok::gather_rows(x.data_ptr(), row_to_token.data_ptr<int32_t>(), row_to_k.data_ptr<int64_t>(),
                              route_to_row.data_ptr<int64_t>(), real_num_rows_ptr(counts), out.data_ptr(),
                              x.size(0), route_to_row.size(1), out.size(0), x.size(1),
                              c10::cuda::getCurrentCUDAStream()),
             "gather_rows_cuda");
}

// A table of base addresses: int64 [num_ranks] on the device, read by the kernel as pointers.
const void* const* pointer_table(const at::Tensor& table, const char* name) {
  check_arg(table, name);
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1, name, ": expected int64 [num_ranks]");
  return reinterpret_cast<const void* const*>(table.data_ptr<int64_t>());
}

void pull(const at::Tensor& src, const std::optional<at::Tensor>& weights, const at::Tensor& pull_rank,
          const at::Tensor& pull_token, const at::Tensor& pull_k, at::Tensor& out, int64_t capacity,
          int64_t num_topk) {
  check_arg(pull_rank, "pull_rank"), check_arg(pull_token, "pull_token"), check_arg(pull_k, "pull_k");
  check_arg(out, "out");
  TORCH_CHECK(pull_rank.scalar_type() == at::kInt && pull_token.scalar_type() == at::kInt &&
                  pull_k.scalar_type() == at::kInt,
              "pull_rank, pull_token, pull_k: expected int32");
  const LaunchGuard guard(out.device());
  check_cuda(mok::pull_rows(pointer_table(src, "src"),
                            weights ? reinterpret_cast<const float* const*>(pointer_table(*weights, "weights"))
                                    : nullptr,
                            pull_rank.data_ptr<int32_t>(), pull_token.data_ptr<int32_t>(), pull_k.data_ptr<int32_t>(),
                            out.data_ptr(), out.size(0), out.size(1), capacity, static_cast<int>(src.numel()),
                            static_cast<int>(num_topk), c10::cuda::getCurrentCUDAStream()),
             "pull_rows");
}

void combine_from_peers(const at::Tensor& rows, const at::Tensor& combine_rank, const at::Tensor& combine_row,
                        const std::optional<at::Tensor>& topk_weights, const std::optional<at::Tensor>& shared,
                        at::Tensor& out, int64_t capacity) {
  check_arg(combine_rank, "combine_rank"), check_arg(combine_row, "combine_row"), check_arg(out, "out");
  if (topk_weights) check_arg(*topk_weights, "topk_weights");
  if (shared) check_arg(*shared, "shared");
  TORCH_CHECK(combine_rank.scalar_type() == at::kInt && combine_row.scalar_type() == at::kInt &&
                  combine_rank.dim() == 2,
              "combine_rank, combine_row: expected int32 [num_tokens, num_topk]");
  const LaunchGuard guard(out.device());
  check_cuda(mok::combine_peers(pointer_table(rows, "rows"), combine_rank.data_ptr<int32_t>(),
                                combine_row.data_ptr<int32_t>(),
                                topk_weights ? topk_weights->data_ptr<float>() : nullptr,
                                shared ? shared->data_ptr() : nullptr, out.data_ptr(), combine_rank.size(0),
                                combine_rank.size(1), capacity, out.size(1), static_cast<int>(rows.numel()),
                                c10::cuda::getCurrentCUDAStream()),
             "combine_peers");
}

}  // namespace

// ---- route schedule and routed-gradient prep (mok.ops.make_schedule_cuda, mok.ops.route_grads_prep) ----------

namespace {

int64_t* int64_ptr(const at::Tensor& t, const char* name) {
  check_arg(t, name);
  TORCH_CHECK(t.scalar_type() == at::kLong, name, ": expected int64");
  return t.data_ptr<int64_t>();
}

// The schedule's arrays are allocated here, not in mok.ops: carving one int64 and one int32 allocation into
// 14 views saves ~40 us of Python per forward, on the path to GEMM1's launch. Returned by
// name (struct ScheduleOutputs' fields, mok/api.h): the 11 int64 arrays (route_to_row as [num_tokens, num_topk]),
// then the int32 counts [2], row_to_token_i32 [max_num_rows] and, with `gemm`, the per-128-row
// gemm_tile_to_expert (else an empty tensor). Every array starts 256-byte aligned. The chunk-count scratch comes
// from the same caching allocator, on the current stream.
pybind11::dict make_schedule(const at::Tensor& topk_idx, int64_t num_experts, int64_t block_m, int64_t max_num_rows,
                             bool gemm) {
  TORCH_CHECK(topk_idx.dim() == 2, "topk_idx: expected [num_tokens, num_topk]");
  const int64_t num_routes = topk_idx.numel(), tiles = max_num_rows / block_m, rows = max_num_rows;
  // name -> view of one allocation per dtype, each view 256-byte aligned
  const auto carve = [&](at::ScalarType type, std::initializer_list<std::pair<const char*, int64_t>> sizes,
                         std::map<std::string, at::Tensor>& out) {
    const int64_t step = 256 / static_cast<int64_t>(c10::elementSize(type));
    int64_t total = 0;
    for (const auto& [name, n] : sizes) total += (n + step - 1) / step * step;
    const at::Tensor buf = at::empty({total}, topk_idx.options().dtype(type));
    int64_t start = 0;
    for (const auto& [name, n] : sizes) {
      out[name] = buf.narrow(0, start, n);
      start += (n + step - 1) / step * step;
    }
  };
  std::map<std::string, at::Tensor> v;
  carve(at::kLong, {{"tokens_per_expert", num_experts}, {"padded_per_expert", num_experts},
                    {"expert_offsets", num_experts + 1}, {"tile_offsets", num_experts + 1},
                    {"route_to_row", num_routes}, {"row_to_token", rows}, {"row_to_k", rows},
                    {"row_to_route", rows}, {"row_to_expert", rows}, {"tile_to_expert", tiles},
                    {"tile_num_rows", tiles}}, v);
  carve(at::kInt, {{"counts", 2}, {"row_to_token_i32", rows}, {"gemm_tile_to_expert", gemm ? max_num_rows / 128 : 0}},
        v);
  mok::ScheduleOutputs out{};
  out.tokens_per_expert = v["tokens_per_expert"].data_ptr<int64_t>();
  out.padded_per_expert = v["padded_per_expert"].data_ptr<int64_t>();
  out.expert_offsets = v["expert_offsets"].data_ptr<int64_t>();
  out.tile_offsets = v["tile_offsets"].data_ptr<int64_t>();
  out.route_to_row = v["route_to_row"].data_ptr<int64_t>();
  out.row_to_token = v["row_to_token"].data_ptr<int64_t>();
  out.row_to_k = v["row_to_k"].data_ptr<int64_t>();
  out.row_to_route = v["row_to_route"].data_ptr<int64_t>();
  out.row_to_expert = v["row_to_expert"].data_ptr<int64_t>();
  out.tile_to_expert = v["tile_to_expert"].data_ptr<int64_t>();
  out.tile_num_rows = v["tile_num_rows"].data_ptr<int64_t>();
  out.counts = v["counts"].data_ptr<int32_t>();
  out.row_to_token_i32 = v["row_to_token_i32"].data_ptr<int32_t>();
  out.gemm_tile_to_expert = gemm ? v["gemm_tile_to_expert"].data_ptr<int32_t>() : nullptr;
  v["route_to_row"] = v["route_to_row"].view({topk_idx.size(0), topk_idx.size(1)});
  const LaunchGuard guard(topk_idx.device());
  const int64_t num_chunks = (num_routes + mok::kScheduleChunkRoutes - 1) / mok::kScheduleChunkRoutes;
  at::Tensor chunk_counts = at::empty({num_chunks * (num_experts + 1)}, topk_idx.options().dtype(at::kInt));
  check_cuda(mok::make_schedule(int64_ptr(topk_idx, "topk_idx"), topk_idx.size(0), topk_idx.size(1), num_experts,
                                block_m, max_num_rows, out, chunk_counts.data_ptr<int32_t>(),
                                c10::cuda::getCurrentCUDAStream()),
             "make_schedule_cuda");
  pybind11::dict arrays;
  for (const auto& [name, t] : v) arrays[pybind11::str(name)] = t;
  return arrays;
}

void route_grads(const at::Tensor& d_out, const at::Tensor& topk_weights, const at::Tensor& y_rows,
                 const at::Tensor& route_to_row, const at::Tensor& tile_num_rows,
                 const std::optional<at::Tensor>& counts, at::Tensor& dy_rows, at::Tensor& d_topk_weights,
                 int64_t block_m) {
  check_arg(d_out, "d_out"), check_arg(topk_weights, "topk_weights"), check_arg(y_rows, "y_rows");
  check_arg(dy_rows, "dy_rows"), check_arg(d_topk_weights, "d_topk_weights");
  const LaunchGuard guard(d_out.device());
  check_cuda(mok::route_grads_prep(d_out.data_ptr(), topk_weights.data_ptr<float>(), y_rows.data_ptr(),
                                   int64_ptr(route_to_row, "route_to_row"), int64_ptr(tile_num_rows, "tile_num_rows"),
                                   real_num_rows_ptr(counts), dy_rows.data_ptr(), d_topk_weights.data_ptr<float>(),
                                   route_to_row.size(0), route_to_row.size(1), y_rows.size(0), y_rows.size(1), block_m,
                                   c10::cuda::getCurrentCUDAStream()),
             "route_grads_prep");
}

// ---- round_to_tiles on the device (mok.ops.route_round_to_tiles, route_fill_rounds, route_swap_leftovers) -----

void round_step(int64_t step, const at::Tensor& idx, const at::Tensor& scores, at::Tensor& counts, at::Tensor& plan,
                at::Tensor& keys,
                const at::Tensor& by_expert, at::Tensor& chosen, const at::Tensor& slots, at::Tensor& pool,
                at::Tensor& num_real, at::Tensor& inv, at::Tensor& may, at::Tensor& pool_scores,
                const at::Tensor& assign, at::Tensor& routes, at::Tensor& left, at::Tensor& out, int64_t tile) {
  check_arg(scores, "scores"), check_arg(counts, "counts"), check_arg(chosen, "chosen"), check_arg(slots, "slots");
  check_arg(may, "may"), check_arg(pool_scores, "pool_scores");
  TORCH_CHECK(scores.scalar_type() == at::kFloat && pool_scores.scalar_type() == at::kFloat,
              "scores, pool_scores: expected float32");
  TORCH_CHECK(counts.scalar_type() == at::kInt && chosen.scalar_type() == at::kInt && slots.scalar_type() == at::kInt,
              "counts, chosen, slots: expected int32");
  TORCH_CHECK(may.scalar_type() == at::kByte, "may: expected uint8");
  const LaunchGuard guard(idx.device());
  mok::RouteRound args{};
  args.idx = int64_ptr(idx, "idx");
  args.scores = scores.data_ptr<float>();
  args.counts = counts.data_ptr<int32_t>();
  args.plan = int64_ptr(plan, "plan");
  args.keys = int64_ptr(keys, "keys");
  args.by_expert = int64_ptr(by_expert, "by_expert");
  args.chosen = chosen.data_ptr<int32_t>();
  args.slots = slots.data_ptr<int32_t>();
  args.pool = int64_ptr(pool, "pool");
  args.num_real = int64_ptr(num_real, "num_real");
  args.inv = int64_ptr(inv, "inv");
  args.may = may.data_ptr<uint8_t>();
  args.pool_scores = pool_scores.data_ptr<float>();
  args.assign = int64_ptr(assign, "assign");
  args.routes = int64_ptr(routes, "routes");
  args.left = int64_ptr(left, "left");
  args.out = int64_ptr(out, "out");
  args.num_tokens = idx.size(0);
  args.num_topk = idx.size(1);
  args.num_experts = scores.size(1);
  args.num_pool = pool.size(0);
  args.tile = tile;
  check_cuda(mok::route_round_step(args, static_cast<int>(step), c10::cuda::getCurrentCUDAStream()),
             "route_round_step");
}

void fill_rounds(const at::Tensor& order, at::Tensor& may, const at::Tensor& inv, at::Tensor& need,
                 at::Tensor& assign, at::Tensor& first, at::Tensor& pick, const std::optional<at::Tensor>& num_real) {
  check_arg(may, "may"), check_arg(first, "first"), check_arg(pick, "pick");
  TORCH_CHECK(may.scalar_type() == at::kByte, "may: expected uint8");
  TORCH_CHECK(first.scalar_type() == at::kInt && pick.scalar_type() == at::kInt, "first, pick: expected int32");
  const LaunchGuard guard(order.device());
  check_cuda(mok::route_fill_rounds(int64_ptr(order, "order"), may.data_ptr<uint8_t>(), int64_ptr(inv, "inv"),
                                    int64_ptr(need, "need"), int64_ptr(assign, "assign"), first.data_ptr<int32_t>(),
                                    pick.data_ptr<int32_t>(), num_real ? int64_ptr(*num_real, "num_real") : nullptr,
                                    order.size(1), first.size(0), order.size(0),
                                    c10::cuda::getCurrentCUDAStream()),
             "route_fill_rounds");
}

void swap_leftovers(at::Tensor& idx, const at::Tensor& before, const at::Tensor& allowed, const at::Tensor& left,
                    at::Tensor& need, at::Tensor& waiting, at::Tensor& moved) {
  check_arg(allowed, "allowed"), check_arg(waiting, "waiting"), check_arg(moved, "moved");
  TORCH_CHECK(allowed.scalar_type() == at::kByte, "allowed: expected uint8");
  TORCH_CHECK(waiting.scalar_type() == at::kInt && moved.scalar_type() == at::kInt, "waiting, moved: expected int32");
  const LaunchGuard guard(idx.device());
  check_cuda(mok::route_swap_leftovers(int64_ptr(idx, "idx"), int64_ptr(before, "before"), allowed.data_ptr<uint8_t>(),
                                       int64_ptr(left, "left"), int64_ptr(need, "need"), waiting.data_ptr<int32_t>(),
                                       moved.data_ptr<int32_t>(), idx.size(0), idx.size(1), allowed.size(1),
                                       left.size(0), c10::cuda::getCurrentCUDAStream()),
             "route_swap_leftovers");
}

}  // namespace

// Every op takes keyword arguments only: the Python wrappers (mok/ops/) pass each tensor by its name, so that no
// reorder of a signature here can bind one pointer in another's place.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mxfp8_quantize_rowwise", &quantize_rowwise,
        "row-wise MXFP8 of x into data, scales",
        py::kw_only(), py::arg("x"), py::arg("data"), py::arg("scales"));
  m.def("mxfp8_quantize_colwise", &quantize_colwise,
        "column-wise MXFP8 of x into data, scales",
        py::kw_only(), py::arg("x"), py::arg("data"), py::arg("scales"));
  m.def("mxfp8_quantize_dual", &quantize_dual,
        "both directions from one read of x",
        py::kw_only(), py::arg("x"), py::arg("data_row"), py::arg("scales_row"), py::arg("data_col"),
        py::arg("scales_col"));
  m.def("mxfp8_dequantize", &dequantize,
        "data, scales (row-wise if rowwise, else column-wise) into bf16 out",
        py::kw_only(), py::arg("data"), py::arg("scales"), py::arg("out"), py::arg("rowwise"));
  m.def("mxfp8_fake_quantize", &fake_quantize,
        "the round trip of x into out (row-wise if rowwise, else column-wise), and into out_row too (None, or dual's "
        "row-wise output); counts: None, or a schedule's int32 counts (the 32-row blocks from counts[0] on are left "
        "alone; tiled only)",
        py::kw_only(), py::arg("x"), py::arg("out"), py::arg("out_row"), py::arg("rowwise"), py::arg("counts"));
  m.def("mxfp8_fake_quantize_gathered", &fake_quantize_gathered,
        "the column-wise round trip of x's rows [T, H] in schedule order (row_to_token int32 [R]) into out [R, H]; "
        "counts as mxfp8_fake_quantize's",
        py::kw_only(), py::arg("x"), py::arg("row_to_token"), py::arg("out"), py::arg("counts"));
  m.def("grouped_gemm_bf16_swiglu_gather", &gemm_swiglu_gather,
        "GEMM1: h, gate, up from x gathered by the schedule (row_to_token, tile_to_expert, counts or None)",
        py::kw_only(), py::arg("x"), py::arg("w_gate"), py::arg("w_up"), py::arg("row_to_token"),
        py::arg("tile_to_expert"), py::arg("counts"), py::arg("h"), py::arg("gate"), py::arg("up"),
        py::arg("swiglu_limit"), py::arg("has_limit"), py::arg("num_sms"));
  m.def("grouped_gemm_bf16_swiglu_gather_mxfp8_out", &gemm_swiglu_gather_mxfp8_out,
        "GEMM1 for the MXFP8 forward: gate_mx, up_mx uint8 buffers of E4M3 data then scales",
        py::kw_only(), py::arg("x"), py::arg("w_gate"), py::arg("w_up"), py::arg("row_to_token"),
        py::arg("tile_to_expert"), py::arg("counts"), py::arg("h"), py::arg("gate_mx"), py::arg("up_mx"),
        py::arg("swiglu_limit"), py::arg("has_limit"), py::arg("num_sms"));
  m.def("grouped_gemm_bf16_nt_contiguous", &gemm_nt_contiguous,
        "GEMM2: out = a_rows · w[e]ᵀ over the schedule",
        py::kw_only(), py::arg("a_rows"), py::arg("w"), py::arg("row_to_token"), py::arg("tile_to_expert"),
        py::arg("counts"), py::arg("out"), py::arg("num_sms"));
  m.def("grouped_gemm_bf16_chain", &gemm_chain,
        "GEMM1 then GEMM2 in one persistent launch: h, gate, up, y; h_ready int32 zeros [num_rows / 128]; "
        "shared_expert: None or its 11 tensors; with out, the combine behind GEMM2 (route_to_row int32, topk_weights, "
        "shared or None, token_done int32 zeros); mx_out: gate, up as row-wise MXFP8 buffers, h its round trip; "
        "ranks: None, or over ranks the lists (x, y, topk_weights, shared, out, token_done) with rank, token_offsets; "
        "trace: None, or int64 zeros [capacity, 5] (per-task times)",
        py::kw_only(), py::arg("x"), py::arg("w_gate"), py::arg("w_up"), py::arg("w_down"), py::arg("row_to_token"),
        py::arg("tile_to_expert"), py::arg("counts"), py::arg("h"), py::arg("gate"), py::arg("up"), py::arg("y"),
        py::arg("h_ready"), py::arg("shared_expert"), py::arg("route_to_row"), py::arg("topk_weights"),
        py::arg("shared"), py::arg("out"), py::arg("token_done"), py::arg("mx_out"), py::arg("swiglu_limit"),
        py::arg("has_limit"), py::arg("num_sms"), py::arg("ranks") = py::none(), py::arg("rank") = 0,
        py::arg("token_offsets") = std::vector<int64_t>{}, py::arg("trace") = py::none());
  m.def("grouped_gemm_mxfp8_swiglu_gather", &gemm_mx_swiglu_gather,
        "GEMM1 with MXFP8 weights",
        py::kw_only(), py::arg("x"), py::arg("w_gate"), py::arg("w_gate_scales"), py::arg("w_up"),
        py::arg("w_up_scales"), py::arg("row_to_token"), py::arg("tile_to_expert"), py::arg("counts"), py::arg("h"),
        py::arg("gate"), py::arg("up"), py::arg("swiglu_limit"), py::arg("has_limit"), py::arg("num_sms"));
  m.def("grouped_gemm_mxfp8_nt_contiguous", &gemm_mx_nt_contiguous,
        "GEMM2 with MXFP8 weights",
        py::kw_only(), py::arg("a_rows"), py::arg("w"), py::arg("w_scales"), py::arg("row_to_token"),
        py::arg("tile_to_expert"), py::arg("counts"), py::arg("out"), py::arg("num_sms"));
  m.def("grouped_gemm_bf16_dgrad_swiglu", &gemm_dgrad_swiglu,
        "the down dgrad, then the SwiGLU backward",
        py::kw_only(), py::arg("dy_rows"), py::arg("w_down"), py::arg("gate"), py::arg("up"), py::arg("row_to_token"),
        py::arg("tile_to_expert"), py::arg("counts"), py::arg("d_gate"), py::arg("d_up"), py::arg("h"),
        py::arg("swiglu_limit"), py::arg("has_limit"), py::arg("num_sms"));
  m.def("grouped_gemm_bf16_dgrad_swiglu_route_grads", &gemm_dgrad_swiglu_route_grads,
        "the down dgrad of unweighted rows, then the SwiGLU backward weighted by route, with the route gradients",
        py::kw_only(), py::arg("d_out_rows"), py::arg("w_down"), py::arg("gate"), py::arg("up"),
        py::arg("topk_weights"), py::arg("row_to_route"), py::arg("row_to_token"), py::arg("tile_to_expert"),
        py::arg("counts"), py::arg("d_gate"), py::arg("d_up"), py::arg("h"), py::arg("d_topk_weights"),
        py::arg("swiglu_limit"), py::arg("has_limit"), py::arg("num_sms"));
  m.def("grouped_gemm_bf16_dgrad_swiglu_mxfp8", &gemm_dgrad_swiglu_mxfp8,
        "the same from row-wise MXFP8 gate and up",
        py::kw_only(), py::arg("dy_rows"), py::arg("w_down"), py::arg("gate_data"), py::arg("gate_scales"),
        py::arg("up_data"), py::arg("up_scales"), py::arg("row_to_token"), py::arg("tile_to_expert"),
        py::arg("counts"), py::arg("d_gate"), py::arg("d_up"), py::arg("h"), py::arg("swiglu_limit"),
        py::arg("has_limit"), py::arg("num_sms"));
  m.def("grouped_gemm_bf16_dgrad_gate_up", &gemm_dgrad_gate_up,
        "dx_rows = d_gate · w_gate[e] + d_up · w_up[e]",
        py::kw_only(), py::arg("d_gate"), py::arg("d_up"), py::arg("w_gate"), py::arg("w_up"), py::arg("row_to_token"),
        py::arg("tile_to_expert"), py::arg("counts"), py::arg("dx_rows"), py::arg("num_sms"));
  m.def("grouped_gemm_bf16_chain_backward", &gemm_chain_backward,
        "the backward at EP = 1 in one persistent launch, BF16: routed (19 tensors, chain_backward_group's order) with "
        "counts and the route gradients' tensors, shared: None or its 19, and the combine of d_x; ranks: as the "
        "forward chain's (y: the dx rows, out: d_x, shared: the shared expert's dx rows); mx: the routed group's "
        "MXFP8 tensors (chain_backward_group's; then no route gradients' tensors)",
        py::kw_only(), py::arg("routed"), py::arg("counts"), py::arg("topk_weights"), py::arg("row_to_route"),
        py::arg("d_topk_weights"), py::arg("shared"), py::arg("route_to_row"), py::arg("d_x"), py::arg("token_done"),
        py::arg("swiglu_limit"), py::arg("has_limit"), py::arg("num_sms"), py::arg("ranks") = py::none(),
        py::arg("rank") = 0, py::arg("token_offsets") = std::vector<int64_t>{}, py::arg("trace") = py::none(),
        py::arg("mx") = py::none());
  m.def("grouped_gemm_bf16_weight_grad", &gemm_weight_grad,
        "d_w[e] = Σ a_rowsᵀ · b_rows over expert e's segment",
        py::kw_only(), py::arg("a_rows"), py::arg("b_rows"), py::arg("expert_offsets"), py::arg("expert_rows"),
        py::arg("d_w"), py::arg("num_sms"));
  m.def("combine_rows", &combine,
        "out[t] = Σ_k topk_weights[t, k] · y_rows[route_to_row[t, k]] + shared[t] (topk_weights, shared: or None)",
        py::kw_only(), py::arg("y_rows"), py::arg("route_to_row"), py::arg("topk_weights"), py::arg("shared"),
        py::arg("out"));
  m.def("gather_rows", &gather,
        "out[r] = x[row_to_token[r]] (int32), checked against row_to_k (int64) and route_to_row (int64 [T, K]); "
        "counts: None, or a schedule's int32 counts (rows from counts[0] on are left alone)",
        py::kw_only(), py::arg("x"), py::arg("row_to_token"), py::arg("row_to_k"), py::arg("route_to_row"),
        py::arg("out"), py::arg("counts"));
  m.def("pull_rows", &pull,
        "out[r] = src[pull_rank[r]][pull_token[r]] (times weights[...][pull_token[r], pull_k[r]] when weights is "
        "not None); src, weights: int64 tables of each rank's base address",
        py::kw_only(), py::arg("src"), py::arg("weights"), py::arg("pull_rank"), py::arg("pull_token"),
        py::arg("pull_k"), py::arg("out"), py::arg("capacity"), py::arg("num_topk"));
  m.def("combine_peers", &combine_from_peers,
        "combine_rows with route (t, k)'s row at rows[combine_rank[t, k]][combine_row[t, k]]",
        py::kw_only(), py::arg("rows"), py::arg("combine_rank"), py::arg("combine_row"), py::arg("topk_weights"),
        py::arg("shared"), py::arg("out"), py::arg("capacity"));
  m.def("make_schedule", &make_schedule,
        "the schedule's arrays by name (struct ScheduleOutputs' fields; mok.ops.moe)",
        py::kw_only(), py::arg("topk_idx"), py::arg("num_experts"), py::arg("block_m"), py::arg("max_num_rows"),
        py::arg("gemm"));
  m.def("route_grads_prep", &route_grads,
        "dy_rows, d_topk_weights from d_out, topk_weights, y_rows over the schedule (route_to_row, tile_num_rows, "
        "counts or None)",
        py::kw_only(), py::arg("d_out"), py::arg("topk_weights"), py::arg("y_rows"), py::arg("route_to_row"),
        py::arg("tile_num_rows"), py::arg("counts"), py::arg("dy_rows"), py::arg("d_topk_weights"),
        py::arg("block_m"));
  m.def("route_round_step", &round_step,
        "one map step (RouteRoundStep) of round_to_tiles over its buffers (struct RouteRound, mok/api.h)",
        py::kw_only(), py::arg("step"), py::arg("idx"), py::arg("scores"), py::arg("counts"), py::arg("plan"),
        py::arg("keys"), py::arg("by_expert"), py::arg("chosen"), py::arg("slots"), py::arg("pool"),
        py::arg("num_real"), py::arg("inv"), py::arg("may"), py::arg("pool_scores"), py::arg("assign"),
        py::arg("routes"), py::arg("left"), py::arg("out"), py::arg("tile"));
  m.def("route_fill_rounds", &fill_rounds,
        "round_to_tiles' rounds: order (int64 [R, P]), may (uint8 [U, R], changed), inv (int64 [P]), need (int64 "
        "[R], in/out), assign (int64 [P], out), first (int32 [U]), pick (int32 [P]), num_real (int64 [1] or None)",
        py::kw_only(), py::arg("order"), py::arg("may"), py::arg("inv"), py::arg("need"), py::arg("assign"),
        py::arg("first"), py::arg("pick"), py::arg("num_real"));
  m.def("route_swap_leftovers", &swap_leftovers,
        "round_to_tiles' end game: idx (int64 [T, K], changed), before (int64 [T, K]), allowed (uint8 [T, E]), left "
        "(int64 [P]), need (int64 [E], in/out), waiting (int32 [P]), moved (int32 [T·K + P])",
        py::kw_only(), py::arg("idx"), py::arg("before"), py::arg("allowed"), py::arg("left"), py::arg("need"),
        py::arg("waiting"), py::arg("moved"));
}
