// Instantiates the forward GEMMs with MXFP8 weights (kGateUpMx, kDownMx of mok/gemm/tasks.cuh)
// behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/gemm/grouped_gemm_bf16.cuh"

namespace mok {

cudaError_t grouped_gemm_mxfp8_swiglu_gather(const GateUpGemm& args, const RowSchedule& sched, int num_sms,
                                             cudaStream_t stream) {
  gemm::Params p = gemm::rows_params(sched);
  p.a = static_cast<const uint16_t*>(args.x);
  p.out = static_cast<uint16_t*>(args.h);
  p.n = static_cast<int>(args.intermediate);
  p.k = static_cast<int>(args.hidden);
  p.gate = static_cast<uint16_t*>(args.gate);
  p.up = static_cast<uint16_t*>(args.up);
  p.swiglu_limit = args.swiglu.limit;
  p.has_limit = args.swiglu.has_limit ? 1 : 0;
  gemm::MxScales scales{};
  scales.s0 = args.w_gate_scales;
  scales.s1 = args.w_up_scales;
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kGateUpMx>(args.w_gate, args.w_up, args.num_experts, p, num_sms,
                                                               stream, scales);
}

cudaError_t grouped_gemm_mxfp8_nt_contiguous(const DownGemm& args, const RowSchedule& sched, int num_sms,
                                             cudaStream_t stream) {
  gemm::Params p = gemm::rows_params(sched);
  p.a = static_cast<const uint16_t*>(args.a_rows);
  p.out = static_cast<uint16_t*>(args.out);
  p.n = static_cast<int>(args.n);
  p.k = static_cast<int>(args.k);
  gemm::MxScales scales{};
  scales.s0 = args.w_scales;
  scales.s1 = args.w_scales;
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kDownMx>(args.w, args.w, args.num_experts, p, num_sms, stream,
                                                             scales);
}

}  // namespace mok
