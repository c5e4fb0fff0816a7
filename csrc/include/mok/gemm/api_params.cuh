// The GEMM kernels' Params filled from the host API's structs (mok/api.h), by field name: shared by the units that
// launch them (csrc/gemm_bf16.cu, csrc/gemm_mxfp8.cu). Host code; torch-free.
#pragma once

#include "mok/api.h"
#include "mok/gemm/grouped_gemm_bf16.cuh"

namespace mok::gemm {

// A row-wise GEMM: out [num_rows, n] = a [num_rows, k] · B[e] over the schedule's rows.
inline Params row_gemm_params(const RowSchedule& sched, const void* a, void* out, int64_t n, int64_t k) {
  Params p = rows_params(sched);
  p.a = static_cast<const uint16_t*>(a);
  p.out = static_cast<uint16_t*>(out);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  return p;
}

// GEMM1: x gathered, h out, n = intermediate, k = hidden, gate and up (bf16, or MXFP8 buffers).
inline Params gate_up_params(const GateUpGemm& args, const RowSchedule& sched) {
  Params p = row_gemm_params(sched, args.x, args.h, args.intermediate, args.hidden);
  p.gate = static_cast<uint16_t*>(args.gate);
  p.up = static_cast<uint16_t*>(args.up);
  p.swiglu_limit = args.swiglu.limit;
  p.has_limit = args.swiglu.has_limit ? 1 : 0;
  return p;
}

// GEMM2: out [num_rows, n] = a_rows [num_rows, k] · w[e]ᵀ.
inline Params down_params(const DownGemm& args, const RowSchedule& sched) {
  return row_gemm_params(sched, args.a_rows, args.out, args.n, args.k);
}

// The down dgrad: out (d_gate's buffer) [num_rows, intermediate] = dy_rows [num_rows, hidden] · Wd[e].
inline Params down_dgrad_params(const DownDgradSwiGLU& args, const RowSchedule& sched) {
  return row_gemm_params(sched, args.dy_rows, args.d_gate, args.intermediate, args.hidden);
}

// The gate/up dgrad: dx_rows [num_rows, hidden] from d_gate, d_up [num_rows, intermediate].
inline Params gate_up_dgrad_params(const GateUpDgrad& args, const RowSchedule& sched) {
  Params p = row_gemm_params(sched, args.d_gate, args.dx_rows, args.hidden, args.intermediate);
  p.a2 = static_cast<const uint16_t*>(args.d_up);
  return p;
}

// A weight gradient: d_w [num_experts, m, n] over each expert's segment of a_rows and b_rows (B: the launch's
// w_b0 = w_b1 = args.b_rows).
inline Params weight_grad_params(const WeightGrad& args) {
  Params p{};
  p.a = static_cast<const uint16_t*>(args.a_rows);
  p.expert_offsets = args.expert_offsets;
  p.expert_rows = args.expert_rows;
  p.out = static_cast<uint16_t*>(args.d_w);
  p.num_rows = static_cast<int>(args.num_rows);
  p.m = static_cast<int>(args.m);
  p.n = static_cast<int>(args.n);
  return p;
}

}  // namespace mok::gemm
