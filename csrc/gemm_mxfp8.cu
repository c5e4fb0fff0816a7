// Instantiates the forward GEMMs with MXFP8 weights (kGateUpMx, kDownMx of mok/gemm/tasks.cuh)
// behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/gemm/grouped_gemm_bf16.cuh"

namespace mok {

cudaError_t grouped_gemm_mxfp8_swiglu_gather(const void* x, const void* w_gate, const void* w_gate_scales,
                                             const void* w_up, const void* w_up_scales, const int32_t* row_to_token,
                                             const int32_t* tile_to_expert, const int32_t* real_num_rows, void* h,
                                             void* gate, void* up, int64_t num_rows, int64_t hidden,
                                             int64_t intermediate, int64_t num_experts, float swiglu_limit,
                                             bool has_limit, int num_sms, cudaStream_t stream) {
  gemm::Params p = gemm::rows_params(x, row_to_token, tile_to_expert, real_num_rows, h, num_rows, intermediate, hidden);
  p.gate = static_cast<uint16_t*>(gate);
  p.up = static_cast<uint16_t*>(up);
  p.swiglu_limit = swiglu_limit;
  p.has_limit = has_limit ? 1 : 0;
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kGateUpMx>(w_gate, w_up, num_experts, p, num_sms, stream,
                                                               {w_gate_scales, w_up_scales});
}

cudaError_t grouped_gemm_mxfp8_nt_contiguous(const void* a_rows, const void* w, const void* w_scales,
                                             const int32_t* row_to_token, const int32_t* tile_to_expert,
                                             const int32_t* real_num_rows, void* out, int64_t num_rows, int64_t n,
                                             int64_t k, int64_t num_experts, int num_sms, cudaStream_t stream) {
  const gemm::Params p = gemm::rows_params(a_rows, row_to_token, tile_to_expert, real_num_rows, out, num_rows, n, k);
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kDownMx>(w, w, num_experts, p, num_sms, stream,
                                                             {w_scales, w_scales});
}

}  // namespace mok
