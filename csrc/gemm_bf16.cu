// Instantiates the grouped BF16 GEMMs (mok/gemm/grouped_gemm_bf16.cuh) behind the host API of mok/api.h.
// Torch-free.
#include "mok/api.h"
#include "mok/gemm/grouped_gemm_bf16.cuh"
#include "mok/moe/swiglu_backward_rows.cuh"

namespace mok {

cudaError_t grouped_gemm_bf16_swiglu_gather(const void* x, const void* w_gate, const void* w_up,
                                            const int32_t* row_to_token, const int32_t* tile_to_expert,
                                            const int32_t* real_num_rows, void* h, void* gate, void* up,
                                            int64_t num_rows, int64_t hidden, int64_t intermediate,
                                            int64_t num_experts, float swiglu_limit, bool has_limit, int num_sms,
                                            cudaStream_t stream) {
  gemm::Params p = gemm::rows_params(x, row_to_token, tile_to_expert, real_num_rows, h, num_rows, intermediate, hidden);
  p.gate = static_cast<uint16_t*>(gate);
  p.up = static_cast<uint16_t*>(up);
  p.swiglu_limit = swiglu_limit;
  p.has_limit = has_limit ? 1 : 0;
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kGateUp>(w_gate, w_up, num_experts, p, num_sms, stream);
}

cudaError_t grouped_gemm_bf16_swiglu_gather_mxfp8_out(
    const void* x, const void* w_gate, const void* w_up, const int32_t* row_to_token, const int32_t* tile_to_expert,
    const int32_t* real_num_rows, void* h, void* gate_mx, void* up_mx,
    int64_t num_rows, int64_t hidden, int64_t intermediate, int64_t num_experts, float swiglu_limit, bool has_limit,
    int num_sms, cudaStream_t stream) {
  gemm::Params p = gemm::rows_params(x, row_to_token, tile_to_expert, real_num_rows, h, num_rows, intermediate, hidden);
  p.gate = static_cast<uint16_t*>(gate_mx);  // mx_of: data, then scales
  p.up = static_cast<uint16_t*>(up_mx);
  p.swiglu_limit = swiglu_limit;
  p.has_limit = has_limit ? 1 : 0;
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kGateUpMxOut>(w_gate, w_up, num_experts, p, num_sms, stream);
}

cudaError_t grouped_gemm_bf16_nt_contiguous(const void* a_rows, const void* w, const int32_t* row_to_token,
                                            const int32_t* tile_to_expert, const int32_t* real_num_rows, void* out,
                                            int64_t num_rows, int64_t n, int64_t k, int64_t num_experts, int num_sms,
                                            cudaStream_t stream) {
  const gemm::Params p = gemm::rows_params(a_rows, row_to_token, tile_to_expert, real_num_rows, out, num_rows, n, k);
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kDown>(w, w, num_experts, p, num_sms, stream);
}

namespace {

// The down dgrad writes d_h into d_gate's buffer; the SwiGLU backward overwrites it in place with d_gate and
// writes d_up and h. gate/up: bf16, or row-wise MXFP8 data with these scales (null: bf16).
cudaError_t dgrad_then_swiglu(const void* dy_rows, const void* w_down, const void* gate, const void* up,
                              const void* gate_scales, const void* up_scales, const int32_t* row_to_token,
                              const int32_t* tile_to_expert, const int32_t* real_num_rows, void* d_gate, void* d_up,
                              void* h, int64_t num_rows, int64_t hidden, int64_t intermediate, int64_t num_experts,
                              float swiglu_limit, bool has_limit, int num_sms, cudaStream_t stream) {
  const gemm::Params p =
      gemm::rows_params(dy_rows, row_to_token, tile_to_expert, real_num_rows, d_gate, num_rows, intermediate, hidden);
  cudaError_t err = gemm::launch_grouped_gemm_bf16<gemm::Gemm::kDownDgrad>(w_down, w_down, num_experts, p, num_sms,
                                                                            stream);
  if (err) return err;
  return moe::launch_swiglu_backward_rows(d_gate, gate, up, row_to_token, real_num_rows, d_gate, d_up, h, num_rows,
                                          intermediate, swiglu_limit, has_limit, stream, gate_scales, up_scales);
}

}  // namespace

cudaError_t grouped_gemm_bf16_dgrad_swiglu(const void* dy_rows, const void* w_down, const void* gate, const void* up,
                                           const int32_t* row_to_token, const int32_t* tile_to_expert,
                                           const int32_t* real_num_rows, void* d_gate, void* d_up, void* h,
                                           int64_t num_rows, int64_t hidden, int64_t intermediate,
                                           int64_t num_experts, float swiglu_limit, bool has_limit, int num_sms,
                                           cudaStream_t stream) {
  return dgrad_then_swiglu(dy_rows, w_down, gate, up, nullptr, nullptr, row_to_token, tile_to_expert, real_num_rows,
                           d_gate, d_up, h, num_rows, hidden, intermediate, num_experts, swiglu_limit, has_limit,
                           num_sms, stream);
}

cudaError_t grouped_gemm_bf16_dgrad_swiglu_mxfp8(const void* dy_rows, const void* w_down, const void* gate_data,
                                                 const void* gate_scales, const void* up_data, const void* up_scales,
                                                 const int32_t* row_to_token, const int32_t* tile_to_expert,
                                                 const int32_t* real_num_rows, void* d_gate, void* d_up, void* h,
                                                 int64_t num_rows, int64_t hidden, int64_t intermediate,
                                                 int64_t num_experts, float swiglu_limit, bool has_limit, int num_sms,
                                                 cudaStream_t stream) {
  return dgrad_then_swiglu(dy_rows, w_down, gate_data, up_data, gate_scales, up_scales, row_to_token, tile_to_expert,
                           real_num_rows, d_gate, d_up, h, num_rows, hidden, intermediate, num_experts, swiglu_limit,
                           has_limit, num_sms, stream);
}

cudaError_t grouped_gemm_bf16_dgrad_gate_up(const void* d_gate, const void* d_up, const void* w_gate, const void* w_up,
                                            const int32_t* row_to_token, const int32_t* tile_to_expert,
                                            const int32_t* real_num_rows, void* dx_rows, int64_t num_rows,
                                            int64_t hidden, int64_t intermediate, int64_t num_experts, int num_sms,
                                            cudaStream_t stream) {
  gemm::Params p =
      gemm::rows_params(d_gate, row_to_token, tile_to_expert, real_num_rows, dx_rows, num_rows, hidden, intermediate);
  p.a2 = static_cast<const uint16_t*>(d_up);
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kGateUpDgrad>(w_gate, w_up, num_experts, p, num_sms, stream);
}

cudaError_t grouped_gemm_bf16_weight_grad(const void* a_rows, const void* b_rows, const int32_t* expert_offsets,
                                          const int32_t* expert_rows, void* d_w, int64_t num_rows, int64_t m,
                                          int64_t n, int64_t num_experts, int num_sms, cudaStream_t stream) {
  gemm::Params p{};
  p.a = static_cast<const uint16_t*>(a_rows);
  p.expert_offsets = expert_offsets;
  p.expert_rows = expert_rows;
  p.out = static_cast<uint16_t*>(d_w);
  p.num_rows = static_cast<int>(num_rows);
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kWeightGrad>(b_rows, b_rows, num_experts, p, num_sms, stream);
}

}  // namespace mok
