// Instantiates the forward GEMMs with MXFP8 weights (kGateUpMx, kDownMx of mok/gemm/tasks.cuh)
// behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/gemm/api_params.cuh"
#include "mok/gemm/grouped_gemm_bf16.cuh"

namespace mok {

cudaError_t grouped_gemm_mxfp8_swiglu_gather(const GateUpGemm& args, const RowSchedule& sched, int num_sms,
                                             cudaStream_t stream) {
  const gemm::Params p = gemm::gate_up_params(args, sched);
  gemm::MxScales scales{};
  scales.s0 = args.w_gate_scales;
  scales.s1 = args.w_up_scales;
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kGateUpMx>(args.w_gate, args.w_up, args.num_experts, p, num_sms,
                                                               stream, scales);
}

cudaError_t grouped_gemm_mxfp8_nt_contiguous(const DownGemm& args, const RowSchedule& sched, int num_sms,
                                             cudaStream_t stream) {
  const gemm::Params p = gemm::down_params(args, sched);
  gemm::MxScales scales{};
  scales.s0 = args.w_scales;
  scales.s1 = args.w_scales;
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kDownMx>(args.w, args.w, args.num_experts, p, num_sms, stream,
                                                             scales);
}

}  // namespace mok
