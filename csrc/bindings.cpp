// The one file that sees both torch and mok's kernels: tensors in, raw pointers to the torch-free host
// API (mok/api.h) out, on the current stream. Outputs are allocated and every argument is checked with
// a clear message in mok/ops/; the TORCH_CHECKs here only guard against misuse of the raw bindings.
// NOTE: their messages are strings only: with torch 2.11.0+cu130 a TORCH_CHECK whose message formats a number
// can segfault the process instead of raising (not understood); string-only messages raise RuntimeError.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "mok/api.h"

namespace {

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
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda(mok::mxfp8_quantize_rowwise(x.data_ptr(), data.data_ptr(), scales.data_ptr(), x.numel(),
                                         c10::cuda::getCurrentCUDAStream()),
             "mxfp8_quantize_rowwise");
}

void quantize_colwise(const at::Tensor& x, at::Tensor& data, at::Tensor& scales) {
  check_arg(x, "x"), check_arg(data, "data"), check_arg(scales, "scales");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  check_cuda(mok::mxfp8_quantize_colwise(x.data_ptr(), data.data_ptr(), scales.data_ptr(), rows, cols,
                                         c10::cuda::getCurrentCUDAStream()),
             "mxfp8_quantize_colwise");
}

void quantize_dual(const at::Tensor& x, at::Tensor& data_row, at::Tensor& scales_row, at::Tensor& data_col,
                   at::Tensor& scales_col) {
  check_arg(x, "x"), check_arg(data_row, "data_row"), check_arg(scales_row, "scales_row");
  check_arg(data_col, "data_col"), check_arg(scales_col, "scales_col");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  check_cuda(mok::mxfp8_quantize_dual(x.data_ptr(), data_row.data_ptr(), scales_row.data_ptr(),
                                      data_col.data_ptr(), scales_col.data_ptr(), rows, cols,
                                      c10::cuda::getCurrentCUDAStream()),
             "mxfp8_quantize_dual");
}

void dequantize(const at::Tensor& data, const at::Tensor& scales, at::Tensor& out, bool rowwise) {
  check_arg(data, "data"), check_arg(scales, "scales"), check_arg(out, "out");
  const c10::cuda::CUDAGuard guard(data.device());
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
  const c10::cuda::CUDAGuard guard(x.device());
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
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda(mok::mxfp8_fake_quantize_gathered_colwise(x.data_ptr(), row_to_token.data_ptr<int32_t>(),
                                                       out.data_ptr(), out.size(0), x.size(0), x.size(1),
                                                       real_num_rows_ptr(counts), c10::cuda::getCurrentCUDAStream()),
             "mxfp8_fake_quantize_gathered");
}

void gemm_swiglu_gather(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                        const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                        const std::optional<at::Tensor>& counts, at::Tensor& h, at::Tensor& gate, at::Tensor& up,
                        double swiglu_limit, bool has_limit, int64_t num_sms) {
  check_arg(x, "x"), check_arg(w_gate, "w_gate"), check_arg(w_up, "w_up"), check_arg(h, "h");
  check_arg(row_to_token, "row_to_token"), check_arg(tile_to_expert, "tile_to_expert");
  check_arg(gate, "gate"), check_arg(up, "up");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt && tile_to_expert.scalar_type() == at::kInt,
              "row_to_token, tile_to_expert: expected int32");
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda(mok::grouped_gemm_bf16_swiglu_gather(
                 x.data_ptr(), w_gate.data_ptr(), w_up.data_ptr(), row_to_token.data_ptr<int32_t>(),
                 tile_to_expert.data_ptr<int32_t>(), real_num_rows_ptr(counts), h.data_ptr(), gate.data_ptr(),
                 up.data_ptr(),
                 row_to_token.numel(), x.size(1), w_gate.size(1), w_gate.size(0), static_cast<float>(swiglu_limit),
                 has_limit, static_cast<int>(num_sms), c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_bf16_swiglu_gather");
}

void gemm_swiglu_gather_mxfp8_out(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                                  const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                                  const std::optional<at::Tensor>& counts, at::Tensor& h, at::Tensor& gate_mx,
                                  at::Tensor& up_mx, double swiglu_limit, bool has_limit, int64_t num_sms) {
  check_arg(x, "x"), check_arg(w_gate, "w_gate"), check_arg(w_up, "w_up"), check_arg(h, "h");
  check_arg(row_to_token, "row_to_token"), check_arg(tile_to_expert, "tile_to_expert");
  check_arg(gate_mx, "gate_mx"), check_arg(up_mx, "up_mx");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt && tile_to_expert.scalar_type() == at::kInt,
              "row_to_token, tile_to_expert: expected int32");
  const int64_t mx_bytes = h.numel() + h.numel() / 32;  // E4M3 data, then one scale byte per 32
  TORCH_CHECK(gate_mx.nbytes() == mx_bytes && up_mx.nbytes() == mx_bytes,
              "gate_mx, up_mx: expected the data and scales of h's shape in one buffer");
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda(mok::grouped_gemm_bf16_swiglu_gather_mxfp8_out(
                 x.data_ptr(), w_gate.data_ptr(), w_up.data_ptr(), row_to_token.data_ptr<int32_t>(),
                 tile_to_expert.data_ptr<int32_t>(), real_num_rows_ptr(counts), h.data_ptr(), gate_mx.data_ptr(),
                 up_mx.data_ptr(), row_to_token.numel(), x.size(1), w_gate.size(1), w_gate.size(0),
                 static_cast<float>(swiglu_limit), has_limit, static_cast<int>(num_sms),
                 c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_bf16_swiglu_gather_mxfp8_out");
}

void gemm_nt_contiguous(const at::Tensor& a_rows, const at::Tensor& w, const at::Tensor& row_to_token,
                        const at::Tensor& tile_to_expert, const std::optional<at::Tensor>& counts, at::Tensor& out,
                        int64_t num_sms) {
  check_arg(a_rows, "a_rows"), check_arg(w, "w"), check_arg(tile_to_expert, "tile_to_expert"), check_arg(out, "out");
  check_arg(row_to_token, "row_to_token");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt && tile_to_expert.scalar_type() == at::kInt,
              "row_to_token, tile_to_expert: expected int32");
  const c10::cuda::CUDAGuard guard(a_rows.device());
  check_cuda(mok::grouped_gemm_bf16_nt_contiguous(a_rows.data_ptr(), w.data_ptr(), row_to_token.data_ptr<int32_t>(),
                                                  tile_to_expert.data_ptr<int32_t>(), real_num_rows_ptr(counts),
                                                  out.data_ptr(), a_rows.size(0), w.size(1), w.size(2), w.size(0),
                                                  static_cast<int>(num_sms), c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_bf16_nt_contiguous");
}

void gemm_mx_swiglu_gather(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_gate_scales,
                           const at::Tensor& w_up, const at::Tensor& w_up_scales, const at::Tensor& row_to_token,
                           const at::Tensor& tile_to_expert, const std::optional<at::Tensor>& counts, at::Tensor& h,
                           at::Tensor& gate, at::Tensor& up, double swiglu_limit, bool has_limit, int64_t num_sms) {
  check_arg(x, "x"), check_arg(w_gate, "w_gate"), check_arg(w_up, "w_up"), check_arg(h, "h");
  check_arg(w_gate_scales, "w_gate_scales"), check_arg(w_up_scales, "w_up_scales");
  check_arg(row_to_token, "row_to_token"), check_arg(tile_to_expert, "tile_to_expert");
  check_arg(gate, "gate"), check_arg(up, "up");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt && tile_to_expert.scalar_type() == at::kInt,
              "row_to_token, tile_to_expert: expected int32");
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda(mok::grouped_gemm_mxfp8_swiglu_gather(
                 x.data_ptr(), w_gate.data_ptr(), w_gate_scales.data_ptr(), w_up.data_ptr(), w_up_scales.data_ptr(),
                 row_to_token.data_ptr<int32_t>(), tile_to_expert.data_ptr<int32_t>(), real_num_rows_ptr(counts),
                 h.data_ptr(), gate.data_ptr(), up.data_ptr(), row_to_token.numel(), x.size(1), w_gate.size(1),
                 w_gate.size(0), static_cast<float>(swiglu_limit), has_limit, static_cast<int>(num_sms),
                 c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_mxfp8_swiglu_gather");
}

void gemm_mx_nt_contiguous(const at::Tensor& a_rows, const at::Tensor& w, const at::Tensor& w_scales,
                           const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                           const std::optional<at::Tensor>& counts, at::Tensor& out, int64_t num_sms) {
  check_arg(a_rows, "a_rows"), check_arg(w, "w"), check_arg(w_scales, "w_scales"), check_arg(out, "out");
  check_arg(row_to_token, "row_to_token"), check_arg(tile_to_expert, "tile_to_expert");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt && tile_to_expert.scalar_type() == at::kInt,
              "row_to_token, tile_to_expert: expected int32");
  const c10::cuda::CUDAGuard guard(a_rows.device());
  check_cuda(mok::grouped_gemm_mxfp8_nt_contiguous(a_rows.data_ptr(), w.data_ptr(), w_scales.data_ptr(),
                                                   row_to_token.data_ptr<int32_t>(), tile_to_expert.data_ptr<int32_t>(),
                                                   real_num_rows_ptr(counts), out.data_ptr(), a_rows.size(0), w.size(1),
                                                   w.size(2), w.size(0), static_cast<int>(num_sms),
                                                   c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_mxfp8_nt_contiguous");
}

void gemm_dgrad_swiglu(const at::Tensor& dy_rows, const at::Tensor& w_down, const at::Tensor& gate,
                       const at::Tensor& up, const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                       const std::optional<at::Tensor>& counts, at::Tensor& d_gate, at::Tensor& d_up, at::Tensor& h,
                       double swiglu_limit, bool has_limit, int64_t num_sms) {
  check_arg(dy_rows, "dy_rows"), check_arg(w_down, "w_down"), check_arg(gate, "gate"), check_arg(up, "up");
  check_arg(row_to_token, "row_to_token"), check_arg(tile_to_expert, "tile_to_expert");
  check_arg(d_gate, "d_gate"), check_arg(d_up, "d_up"), check_arg(h, "h");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt && tile_to_expert.scalar_type() == at::kInt,
              "row_to_token, tile_to_expert: expected int32");
  const c10::cuda::CUDAGuard guard(dy_rows.device());
  check_cuda(mok::grouped_gemm_bf16_dgrad_swiglu(
                 dy_rows.data_ptr(), w_down.data_ptr(), gate.data_ptr(), up.data_ptr(),
                 row_to_token.data_ptr<int32_t>(), tile_to_expert.data_ptr<int32_t>(), real_num_rows_ptr(counts),
                 d_gate.data_ptr(), d_up.data_ptr(), h.data_ptr(), dy_rows.size(0), w_down.size(1), w_down.size(2), w_down.size(0),
                 static_cast<float>(swiglu_limit), has_limit, static_cast<int>(num_sms),
                 c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_bf16_dgrad_swiglu");
}

void gemm_dgrad_swiglu_mxfp8(const at::Tensor& dy_rows, const at::Tensor& w_down, const at::Tensor& gate_data,
                             const at::Tensor& gate_scales, const at::Tensor& up_data, const at::Tensor& up_scales,
                             const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                             const std::optional<at::Tensor>& counts, at::Tensor& d_gate, at::Tensor& d_up,
                             at::Tensor& h, double swiglu_limit, bool has_limit, int64_t num_sms) {
  check_arg(dy_rows, "dy_rows"), check_arg(w_down, "w_down"), check_arg(gate_data, "gate_data");
  check_arg(gate_scales, "gate_scales"), check_arg(up_data, "up_data"), check_arg(up_scales, "up_scales");
  check_arg(row_to_token, "row_to_token"), check_arg(tile_to_expert, "tile_to_expert");
  check_arg(d_gate, "d_gate"), check_arg(d_up, "d_up"), check_arg(h, "h");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt && tile_to_expert.scalar_type() == at::kInt,
              "row_to_token, tile_to_expert: expected int32");
  const c10::cuda::CUDAGuard guard(dy_rows.device());
  check_cuda(mok::grouped_gemm_bf16_dgrad_swiglu_mxfp8(
                 dy_rows.data_ptr(), w_down.data_ptr(), gate_data.data_ptr(), gate_scales.data_ptr(),
                 up_data.data_ptr(), up_scales.data_ptr(), row_to_token.data_ptr<int32_t>(),
                 tile_to_expert.data_ptr<int32_t>(), real_num_rows_ptr(counts), d_gate.data_ptr(), d_up.data_ptr(),
                 h.data_ptr(), dy_rows.size(0), w_down.size(1), w_down.size(2), w_down.size(0),
                 static_cast<float>(swiglu_limit), has_limit, static_cast<int>(num_sms),
                 c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_bf16_dgrad_swiglu_mxfp8");
}

void gemm_dgrad_gate_up(const at::Tensor& d_gate, const at::Tensor& d_up, const at::Tensor& w_gate,
                        const at::Tensor& w_up, const at::Tensor& row_to_token, const at::Tensor& tile_to_expert,
                        const std::optional<at::Tensor>& counts, at::Tensor& dx_rows, int64_t num_sms) {
  check_arg(d_gate, "d_gate"), check_arg(d_up, "d_up"), check_arg(w_gate, "w_gate"), check_arg(w_up, "w_up");
  check_arg(row_to_token, "row_to_token"), check_arg(tile_to_expert, "tile_to_expert"), check_arg(dx_rows, "dx_rows");
  TORCH_CHECK(row_to_token.scalar_type() == at::kInt && tile_to_expert.scalar_type() == at::kInt,
              "row_to_token, tile_to_expert: expected int32");
  const c10::cuda::CUDAGuard guard(d_gate.device());
  check_cuda(mok::grouped_gemm_bf16_dgrad_gate_up(
                 d_gate.data_ptr(), d_up.data_ptr(), w_gate.data_ptr(), w_up.data_ptr(),
                 row_to_token.data_ptr<int32_t>(), tile_to_expert.data_ptr<int32_t>(), real_num_rows_ptr(counts),
                 dx_rows.data_ptr(),
                 d_gate.size(0), w_gate.size(2), w_gate.size(1), w_gate.size(0), static_cast<int>(num_sms),
                 c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_bf16_dgrad_gate_up");
}

void gemm_weight_grad(const at::Tensor& a_rows, const at::Tensor& b_rows, const at::Tensor& expert_offsets,
                      const at::Tensor& expert_rows, at::Tensor& d_w, int64_t num_sms) {
  check_arg(a_rows, "a_rows"), check_arg(b_rows, "b_rows"), check_arg(expert_offsets, "expert_offsets");
  check_arg(expert_rows, "expert_rows"), check_arg(d_w, "d_w");
  TORCH_CHECK(expert_offsets.scalar_type() == at::kInt, "expert_offsets: expected int32");
  TORCH_CHECK(expert_rows.scalar_type() == at::kInt, "expert_rows: expected int32");
  const c10::cuda::CUDAGuard guard(a_rows.device());
  check_cuda(mok::grouped_gemm_bf16_weight_grad(a_rows.data_ptr(), b_rows.data_ptr(), expert_offsets.data_ptr<int32_t>(),
                                                expert_rows.data_ptr<int32_t>(), d_w.data_ptr(), a_rows.size(0),
                                                a_rows.size(1), b_rows.size(1), d_w.size(0), static_cast<int>(num_sms),
                                                c10::cuda::getCurrentCUDAStream()),
             "grouped_gemm_bf16_weight_grad");
}

void combine(const at::Tensor& y_rows, const at::Tensor& route_to_row, const std::optional<at::Tensor>& topk_weights,
             const std::optional<at::Tensor>& shared, at::Tensor& out) {
  check_arg(y_rows, "y_rows"), check_arg(route_to_row, "route_to_row"), check_arg(out, "out");
  if (topk_weights) check_arg(*topk_weights, "topk_weights");
  if (shared) check_arg(*shared, "shared");
  TORCH_CHECK(route_to_row.scalar_type() == at::kLong || route_to_row.scalar_type() == at::kInt,
              "route_to_row: expected int64 or int32");
  const c10::cuda::CUDAGuard guard(y_rows.device());
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
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda(mok::gather_rows(x.data_ptr(), row_to_token.data_ptr<int32_t>(), row_to_k.data_ptr<int64_t>(),
                              route_to_row.data_ptr<int64_t>(), real_num_rows_ptr(counts), out.data_ptr(),
                              x.size(0), route_to_row.size(1), out.size(0), x.size(1),
                              c10::cuda::getCurrentCUDAStream()),
             "gather_rows_cuda");
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
// 14 views cost ~40 us of Python per forward, on the path to GEMM1's launch (tools/host_time.py). Returned in
// the order of mok.ops.moe._SCHEDULE_ARRAYS: the 11 int64 arrays (route_to_row as [num_tokens, num_topk]),
// then the int32 counts [2], row_to_token [max_num_rows] and, with `gemm`, the per-128-row tile_to_expert
// (else an empty tensor). Every array starts 256-byte aligned. The chunk-count scratch comes from the same
// caching allocator, on the current stream.
std::vector<at::Tensor> make_schedule(const at::Tensor& topk_idx, int64_t num_experts, int64_t block_m,
                                      int64_t max_num_rows, bool gemm) {
  TORCH_CHECK(topk_idx.dim() == 2, "topk_idx: expected [num_tokens, num_topk]");
  const int64_t num_routes = topk_idx.numel(), tiles = max_num_rows / block_m, rows = max_num_rows;
  const auto carve = [&](at::ScalarType type, std::initializer_list<int64_t> sizes, std::vector<at::Tensor>& out) {
    const int64_t step = 256 / static_cast<int64_t>(c10::elementSize(type));
    int64_t total = 0;
    for (const int64_t n : sizes) total += (n + step - 1) / step * step;
    const at::Tensor buf = at::empty({total}, topk_idx.options().dtype(type));
    int64_t start = 0;
    for (const int64_t n : sizes) {
      out.push_back(buf.narrow(0, start, n));
      start += (n + step - 1) / step * step;
    }
  };
  std::vector<at::Tensor> v;
  carve(at::kLong, {num_experts, num_experts, num_experts + 1, num_experts + 1, num_routes, rows, rows, rows, rows,
                    tiles, tiles}, v);
  carve(at::kInt, {2, rows, gemm ? max_num_rows / 128 : 0}, v);
  const mok::ScheduleOutputs out{
      v[0].data_ptr<int64_t>(), v[1].data_ptr<int64_t>(), v[2].data_ptr<int64_t>(),  v[3].data_ptr<int64_t>(),
      v[4].data_ptr<int64_t>(), v[5].data_ptr<int64_t>(), v[6].data_ptr<int64_t>(),  v[7].data_ptr<int64_t>(),
      v[8].data_ptr<int64_t>(), v[9].data_ptr<int64_t>(), v[10].data_ptr<int64_t>(), v[11].data_ptr<int32_t>(),
      v[12].data_ptr<int32_t>(), gemm ? v[13].data_ptr<int32_t>() : nullptr};
  v[4] = v[4].view({topk_idx.size(0), topk_idx.size(1)});  // route_to_row
  const c10::cuda::CUDAGuard guard(topk_idx.device());
  const int64_t num_chunks = (num_routes + mok::kScheduleChunkRoutes - 1) / mok::kScheduleChunkRoutes;
  at::Tensor chunk_counts = at::empty({num_chunks * (num_experts + 1)}, topk_idx.options().dtype(at::kInt));
  check_cuda(mok::make_schedule(int64_ptr(topk_idx, "topk_idx"), topk_idx.size(0), topk_idx.size(1), num_experts,
                                block_m, max_num_rows, out, chunk_counts.data_ptr<int32_t>(),
                                c10::cuda::getCurrentCUDAStream()),
             "make_schedule_cuda");
  return v;
}

void route_grads(const at::Tensor& d_out, const at::Tensor& topk_weights, const at::Tensor& y_rows,
                 const at::Tensor& route_to_row, const at::Tensor& tile_num_rows,
                 const std::optional<at::Tensor>& counts, at::Tensor& dy_rows, at::Tensor& d_topk_weights,
                 int64_t block_m) {
  check_arg(d_out, "d_out"), check_arg(topk_weights, "topk_weights"), check_arg(y_rows, "y_rows");
  check_arg(dy_rows, "dy_rows"), check_arg(d_topk_weights, "d_topk_weights");
  const c10::cuda::CUDAGuard guard(d_out.device());
  check_cuda(mok::route_grads_prep(d_out.data_ptr(), topk_weights.data_ptr<float>(), y_rows.data_ptr(),
                                   int64_ptr(route_to_row, "route_to_row"), int64_ptr(tile_num_rows, "tile_num_rows"),
                                   real_num_rows_ptr(counts), dy_rows.data_ptr(), d_topk_weights.data_ptr<float>(), route_to_row.size(0),
                                   route_to_row.size(1), y_rows.size(0), y_rows.size(1), block_m,
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
  const c10::cuda::CUDAGuard guard(idx.device());
  const mok::RouteRound args{int64_ptr(idx, "idx"), scores.data_ptr<float>(), counts.data_ptr<int32_t>(),
                             int64_ptr(plan, "plan"),
                             int64_ptr(keys, "keys"), int64_ptr(by_expert, "by_expert"), chosen.data_ptr<int32_t>(),
                             slots.data_ptr<int32_t>(), int64_ptr(pool, "pool"), int64_ptr(num_real, "num_real"),
                             int64_ptr(inv, "inv"), may.data_ptr<uint8_t>(), pool_scores.data_ptr<float>(),
                             int64_ptr(assign, "assign"), int64_ptr(routes, "routes"), int64_ptr(left, "left"),
                             int64_ptr(out, "out"), idx.size(0), idx.size(1), scores.size(1), pool.size(0), tile};
  check_cuda(mok::route_round_step(args, static_cast<int>(step), c10::cuda::getCurrentCUDAStream()),
             "route_round_step");
}

void fill_rounds(const at::Tensor& order, at::Tensor& may, const at::Tensor& inv, at::Tensor& need,
                 at::Tensor& assign, at::Tensor& first, at::Tensor& pick, const std::optional<at::Tensor>& num_real) {
  check_arg(may, "may"), check_arg(first, "first"), check_arg(pick, "pick");
  TORCH_CHECK(may.scalar_type() == at::kByte, "may: expected uint8");
  TORCH_CHECK(first.scalar_type() == at::kInt && pick.scalar_type() == at::kInt, "first, pick: expected int32");
  const c10::cuda::CUDAGuard guard(order.device());
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
  const c10::cuda::CUDAGuard guard(idx.device());
  check_cuda(mok::route_swap_leftovers(int64_ptr(idx, "idx"), int64_ptr(before, "before"), allowed.data_ptr<uint8_t>(),
                                       int64_ptr(left, "left"), int64_ptr(need, "need"), waiting.data_ptr<int32_t>(),
                                       moved.data_ptr<int32_t>(), idx.size(0), idx.size(1), allowed.size(1),
                                       left.size(0), c10::cuda::getCurrentCUDAStream()),
             "route_swap_leftovers");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mxfp8_quantize_rowwise", &quantize_rowwise, "x, data, scales");
  m.def("mxfp8_quantize_colwise", &quantize_colwise, "x, data, scales");
  m.def("mxfp8_quantize_dual", &quantize_dual, "x, data_row, scales_row, data_col, scales_col");
  m.def("mxfp8_dequantize", &dequantize, "data, scales, out, rowwise");
  m.def("mxfp8_fake_quantize", &fake_quantize,
        "x, out (row-wise, or column-wise), out_row (None, or dual's row-wise output), rowwise, counts (None, or a "
        "schedule's int32 counts: the 32-row blocks from counts[0] on are left alone; tiled only)");
  m.def("mxfp8_fake_quantize_gathered", &fake_quantize_gathered,
        "x [T, H], row_to_token (int32 [R]), out [R, H], counts (None or as mxfp8_fake_quantize's): the column-wise "
        "round trip of x's rows in schedule order");
  m.def("grouped_gemm_bf16_swiglu_gather", &gemm_swiglu_gather,
        "x, w_gate, w_up, row_to_token, tile_to_expert, counts (or None), h, gate, up, swiglu_limit, has_limit, "
        "num_sms");
  m.def("grouped_gemm_bf16_swiglu_gather_mxfp8_out", &gemm_swiglu_gather_mxfp8_out,
        "x, w_gate, w_up, row_to_token, tile_to_expert, counts (or None), h, gate_mx, up_mx (uint8: E4M3 data "
        "then scales), swiglu_limit, has_limit, num_sms");
  m.def("grouped_gemm_bf16_nt_contiguous", &gemm_nt_contiguous,
        "a_rows, w, row_to_token, tile_to_expert, counts (or None), out, num_sms");
  m.def("grouped_gemm_mxfp8_swiglu_gather", &gemm_mx_swiglu_gather,
        "x, w_gate, w_gate_scales, w_up, w_up_scales, row_to_token, tile_to_expert, counts (or None), h, gate, up, "
        "swiglu_limit, has_limit, num_sms");
  m.def("grouped_gemm_mxfp8_nt_contiguous", &gemm_mx_nt_contiguous,
        "a_rows, w, w_scales, row_to_token, tile_to_expert, counts (or None), out, num_sms");
  m.def("grouped_gemm_bf16_dgrad_swiglu", &gemm_dgrad_swiglu,
        "dy_rows, w_down, gate, up, row_to_token, tile_to_expert, counts (or None), d_gate, d_up, h, swiglu_limit, "
        "has_limit, num_sms");
  m.def("grouped_gemm_bf16_dgrad_swiglu_mxfp8", &gemm_dgrad_swiglu_mxfp8,
        "dy_rows, w_down, gate_data, gate_scales, up_data, up_scales, row_to_token, tile_to_expert, counts (or None), "
        "d_gate, d_up, h, swiglu_limit, has_limit, num_sms");
  m.def("grouped_gemm_bf16_dgrad_gate_up", &gemm_dgrad_gate_up,
        "d_gate, d_up, w_gate, w_up, row_to_token, tile_to_expert, counts (or None), dx_rows, num_sms");
  m.def("grouped_gemm_bf16_weight_grad", &gemm_weight_grad,
        "a_rows, b_rows, expert_offsets, expert_rows, d_w, num_sms");
  m.def("combine_rows", &combine, "y_rows, route_to_row, topk_weights (or None), shared (or None), out");
  m.def("gather_rows", &gather,
        "x, row_to_token (int32), row_to_k (int64), route_to_row (int64 [T, K]), out, counts (None, or a schedule's "
        "int32 counts: rows from counts[0] on are left alone)");
  m.def("make_schedule", &make_schedule,
        "topk_idx, num_experts, block_m, max_num_rows, gemm -> the schedule's arrays (mok.ops.moe._SCHEDULE_ARRAYS)");
  m.def("route_grads_prep", &route_grads,
        "d_out, topk_weights, y_rows, route_to_row, tile_num_rows, counts (or None), dy_rows, d_topk_weights, block_m");
  m.def("route_round_step", &round_step,
        "step (RouteRoundStep), idx, scores, counts, plan, keys, by_expert, chosen, slots, pool, num_real, inv, may, "
        "pool_scores, assign, routes, left, out, tile: one map step of round_to_tiles (struct RouteRound, mok/api.h)");
  m.def("route_fill_rounds", &fill_rounds,
        "order (int64 [R, P]), may (uint8 [U, R], changed), inv (int64 [P]), need (int64 [R], in/out), assign (int64 "
        "[P], out), first (int32 [U]), pick (int32 [P]), num_real (int64 [1] or None): round_to_tiles' rounds");
  m.def("route_swap_leftovers", &swap_leftovers,
        "idx (int64 [T, K], changed), before (int64 [T, K]), allowed (uint8 [T, E]), left (int64 [P]), need (int64 "
        "[E], in/out), waiting (int32 [P]), moved (int32 [T·K + P]): round_to_tiles' end game");
}
