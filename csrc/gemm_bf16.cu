// Instantiates the grouped BF16 GEMMs (mok/gemm/grouped_gemm_bf16.cuh) behind the host API of mok/api.h.
// Torch-free.
#include "mok/api.h"
#include "mok/gemm/api_params.cuh"
#include "mok/gemm/chain.cuh"
#include "mok/gemm/chain_backward.cuh"
#include "mok/gemm/grouped_gemm_bf16.cuh"
#include "mok/moe/swiglu_backward_rows.cuh"

namespace mok {

cudaError_t grouped_gemm_bf16_swiglu_gather(const GateUpGemm& args, const RowSchedule& sched, int num_sms,
                                            cudaStream_t stream) {
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kGateUp>(args.w_gate, args.w_up, args.num_experts,
                                                             gemm::gate_up_params(args, sched), num_sms, stream);
}

cudaError_t grouped_gemm_bf16_swiglu_gather_mxfp8_out(const GateUpGemm& args, const RowSchedule& sched, int num_sms,
                                                      cudaStream_t stream) {
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kGateUpMxOut>(args.w_gate, args.w_up, args.num_experts,
                                                                  gemm::gate_up_params(args, sched), num_sms, stream);
}

cudaError_t grouped_gemm_bf16_nt_contiguous(const DownGemm& args, const RowSchedule& sched, int num_sms,
                                            cudaStream_t stream) {
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kDown>(args.w, args.w, args.num_experts,
                                                           gemm::down_params(args, sched), num_sms, stream);
}

cudaError_t grouped_gemm_bf16_chain(const ChainGemm& args, const RowSchedule& sched, int num_sms, cudaStream_t stream) {
  const bool with_shared = args.shared_gate_up.w_gate != nullptr;
  if (args.down.a_rows != args.gate_up.h || args.down.k != args.gate_up.intermediate ||
      args.down.num_experts != args.gate_up.num_experts || (args.h_ready == nullptr && sched.num_rows > 0))
    return cudaErrorInvalidValue;
  if (with_shared && (args.shared_down.a_rows != args.shared_gate_up.h ||
                      args.shared_down.k != args.shared_gate_up.intermediate ||
                      (args.shared_h_ready == nullptr && args.shared_sched.num_rows > 0) ||
                      args.shared_gate_up.num_experts != 1 || args.shared_down.num_experts != 1))
    return cudaErrorInvalidValue;
  if (args.out != nullptr && (args.route_to_row == nullptr || args.topk_weights == nullptr ||
                              args.token_done == nullptr || args.num_topk < 1 ||
                              (with_shared && args.shared != args.shared_down.out)))
    return cudaErrorInvalidValue;
  gemm::ChainGroupArgs routed{args.gate_up.w_gate, args.gate_up.w_up, args.down.w, args.gate_up.num_experts,
                              gemm::gate_up_params(args.gate_up, sched), gemm::down_params(args.down, sched),
                              args.h_ready};
  gemm::ChainGroupArgs shared{};
  if (with_shared)
    shared = {args.shared_gate_up.w_gate, args.shared_gate_up.w_up, args.shared_down.w, 1,
              gemm::gate_up_params(args.shared_gate_up, args.shared_sched),
              gemm::down_params(args.shared_down, args.shared_sched), args.shared_h_ready};
  gemm::ChainCombine combine = gemm::local_combine(args.route_to_row, args.topk_weights, args.shared, args.out,
                                                   args.token_done, static_cast<int>(args.num_topk),
                                                   with_shared ? 1 : 0, routed.p2);
  if (const ChainRanks& r = args.ranks; r.num_ranks > 0) {  // over ranks: every table from the lists
    if (args.out == nullptr || r.shared[r.rank] != args.shared || r.topk_weights[r.rank] != args.topk_weights ||
        !gemm::combine_over_ranks(r, sched.num_rows, &combine))
      return cudaErrorInvalidValue;
    for (int s = 0; s < r.num_ranks; ++s) {
      if (r.x[s] == nullptr || r.topk_weights[s] == nullptr) return cudaErrorInvalidValue;
      routed.a[s] = r.x[s];
    }
  }
  const gemm::TaskTrace trace{args.trace.at, static_cast<int>(std::min<int64_t>(args.trace.capacity, INT32_MAX))};
  const auto launch = args.mx_out ? gemm::launch_grouped_gemm_bf16_chain<gemm::Gemm::kGateUpMxOut>
                                  : gemm::launch_grouped_gemm_bf16_chain<gemm::Gemm::kGateUp>;
  return launch(routed, shared, combine, trace, num_sms, stream);
}

namespace {

// One group of the backward chain from the host API's structs (the fields the separate launches take).
cudaError_t backward_group(const ChainBackwardGroup& a, gemm::BackwardGroupArgs* out) {
  const DownDgradSwiGLU& d = a.dgrad;
  const GateUpDgrad& gu = a.gate_up_dgrad;
  const bool mx = d.gate_scales != nullptr;  // the chain checks the rest of an MXFP8 group's fields
  if (mx != (d.up_scales != nullptr) || gu.d_gate != d.d_gate || gu.d_up != d.d_up || gu.hidden != d.hidden ||
      gu.intermediate != d.intermediate || gu.num_experts != d.num_experts || a.counters == nullptr)
    return cudaErrorInvalidValue;
  const void* want_a[3] = {mx ? a.wgrad[0].a_rows : d.dy_rows, mx ? a.d_gate_cols : d.d_gate,
                           mx ? a.d_up_cols : d.d_up};  // and B: h, then the x rows twice
  if (mx && want_a[0] == nullptr) return cudaErrorInvalidValue;
  if (a.wgrad[0].b_rows != d.h || a.wgrad[2].b_rows != a.wgrad[1].b_rows) return cudaErrorInvalidValue;
  gemm::BackwardGroupArgs& g = *out;
  g = {};
  g.w_down = d.w_down, g.w_gate = gu.w_gate, g.w_up = gu.w_up, g.num_experts = d.num_experts;
  g.dgrad = gemm::down_dgrad_params(d, a.sched);
  g.gate_up_dgrad = gemm::gate_up_dgrad_params(gu, a.sched);
  for (int w = 0; w < 3; ++w) {
    const WeightGrad& wg = a.wgrad[w];
    if (wg.a_rows != want_a[w] || wg.num_rows != a.sched.num_rows || wg.num_experts != d.num_experts)
      return cudaErrorInvalidValue;
    g.wgrad[w] = gemm::weight_grad_params(wg);
    g.b_rows[w] = wg.b_rows;
  }
  g.rows = {static_cast<const uint16_t*>(d.d_gate), d.gate, d.up, static_cast<const uint8_t*>(d.gate_scales),
            static_cast<const uint8_t*>(d.up_scales), a.sched.row_to_token, d.route_weights, d.row_to_route,
            d.d_topk_weights, static_cast<uint16_t*>(d.d_gate), static_cast<uint16_t*>(d.d_up),
            static_cast<uint16_t*>(d.h), d.intermediate, d.swiglu.limit, d.swiglu.has_limit};
  g.d_gate_cols = static_cast<uint16_t*>(a.d_gate_cols), g.d_up_cols = static_cast<uint16_t*>(a.d_up_cols);
  g.counters = a.counters;
  return cudaSuccess;
}

}  // namespace

cudaError_t grouped_gemm_bf16_chain_backward(const ChainBackward& args, int num_sms, cudaStream_t stream) {
  const bool with_shared = args.shared.dgrad.w_down != nullptr;
  gemm::BackwardGroupArgs routed, shared{};
  cudaError_t err = backward_group(args.routed, &routed);
  if (err || (with_shared && (err = backward_group(args.shared, &shared)))) return err;
  const bool mx = args.routed.dgrad.gate_scales != nullptr;  // the MXFP8 backward: its route gradients come before
  if ((args.routed.dgrad.route_weights == nullptr) != mx ||
      (with_shared && (args.shared.dgrad.route_weights != nullptr || args.shared.dgrad.gate_scales != nullptr)) ||
      args.route_to_row == nullptr || args.d_x == nullptr || args.token_done == nullptr || args.num_topk < 1)
    return cudaErrorInvalidValue;
  gemm::ChainCombine combine =
      gemm::local_combine(args.route_to_row, nullptr, with_shared ? args.shared.gate_up_dgrad.dx_rows : nullptr,
                          args.d_x, args.token_done, static_cast<int>(args.num_topk), with_shared ? 1 : 0,
                          routed.gate_up_dgrad);
  if (args.ranks.num_ranks > 0 &&  // over ranks: the shared expert's dx rows come from before the launch
      (with_shared || !gemm::combine_over_ranks(args.ranks, routed.gate_up_dgrad.num_rows, &combine)))
    return cudaErrorInvalidValue;
  const gemm::TaskTrace trace{args.trace.at, static_cast<int>(std::min<int64_t>(args.trace.capacity, INT32_MAX))};
  return gemm::launch_grouped_gemm_bf16_chain_backward(routed, shared, combine, trace, num_sms, stream);
}

namespace {

// The down dgrad writes d_h into d_gate's buffer; the SwiGLU backward overwrites it in place with d_gate and
// writes d_up and h. gate/up: bf16, or row-wise MXFP8 data with args' scales (null: bf16).
cudaError_t dgrad_then_swiglu(const DownDgradSwiGLU& args, const RowSchedule& sched, int num_sms,
                              cudaStream_t stream) {
  cudaError_t err = gemm::launch_grouped_gemm_bf16<gemm::Gemm::kDownDgrad>(
      args.w_down, args.w_down, args.num_experts, gemm::down_dgrad_params(args, sched), num_sms, stream);
  if (err) return err;
  return moe::launch_swiglu_backward_rows(args.d_gate, args.gate, args.up, sched.row_to_token, sched.real_num_rows,
                                          args.d_gate, args.d_up, args.h, sched.num_rows, args.intermediate,
                                          args.swiglu.limit, args.swiglu.has_limit, stream, args.gate_scales,
                                          args.up_scales, args.route_weights, args.row_to_route,
                                          args.d_topk_weights);
}

}  // namespace

cudaError_t grouped_gemm_bf16_dgrad_swiglu(const DownDgradSwiGLU& args, const RowSchedule& sched, int num_sms,
                                           cudaStream_t stream) {
  if (args.gate_scales != nullptr || args.up_scales != nullptr) return cudaErrorInvalidValue;  // bf16 gate/up
  if (args.route_weights != nullptr) return cudaErrorInvalidValue;  // ..._route_grads
  return dgrad_then_swiglu(args, sched, num_sms, stream);
}

cudaError_t grouped_gemm_bf16_dgrad_swiglu_route_grads(const DownDgradSwiGLU& args, const RowSchedule& sched,
                                                       int num_sms, cudaStream_t stream) {
  if (args.gate_scales != nullptr || args.up_scales != nullptr) return cudaErrorInvalidValue;  // bf16 gate/up
  if (args.route_weights == nullptr) return cudaErrorInvalidValue;
  return dgrad_then_swiglu(args, sched, num_sms, stream);
}

cudaError_t grouped_gemm_bf16_dgrad_swiglu_mxfp8(const DownDgradSwiGLU& args, const RowSchedule& sched, int num_sms,
                                                 cudaStream_t stream) {
  if (args.gate_scales == nullptr || args.up_scales == nullptr) return cudaErrorInvalidValue;  // MXFP8 gate/up
  if (args.route_weights != nullptr) return cudaErrorInvalidValue;
  return dgrad_then_swiglu(args, sched, num_sms, stream);
}

cudaError_t grouped_gemm_bf16_dgrad_gate_up(const GateUpDgrad& args, const RowSchedule& sched, int num_sms,
                                            cudaStream_t stream) {
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kGateUpDgrad>(
      args.w_gate, args.w_up, args.num_experts, gemm::gate_up_dgrad_params(args, sched), num_sms, stream);
}

cudaError_t grouped_gemm_bf16_weight_grad(const WeightGrad& args, int num_sms, cudaStream_t stream) {
  return gemm::launch_grouped_gemm_bf16<gemm::Gemm::kWeightGrad>(args.b_rows, args.b_rows, args.num_experts,
                                                                 gemm::weight_grad_params(args), num_sms, stream);
}

}  // namespace mok
