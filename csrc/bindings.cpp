// The one file that sees both torch and mok's kernels: tensors in, raw pointers to the torch-free host
// API (mok/api.h) out, on the current stream. Outputs are allocated and every argument is checked with
// a clear message in mok/ops.py; the TORCH_CHECKs here only guard against misuse of the raw bindings.
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

void quantize_rowwise(const at::Tensor& x, at::Tensor& data, at::Tensor& scales, int64_t variant) {
  check_arg(x, "x"), check_arg(data, "data"), check_arg(scales, "scales");
  const c10::cuda::CUDAGuard guard(x.device());
  check_cuda(mok::mxfp8_quantize_rowwise(x.data_ptr(), data.data_ptr(), scales.data_ptr(), x.numel(),
                                         static_cast<int>(variant), c10::cuda::getCurrentCUDAStream()),
             "mxfp8_quantize_rowwise");
}

void quantize_colwise(const at::Tensor& x, at::Tensor& data, at::Tensor& scales, int64_t variant) {
  check_arg(x, "x"), check_arg(data, "data"), check_arg(scales, "scales");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  check_cuda(mok::mxfp8_quantize_colwise(x.data_ptr(), data.data_ptr(), scales.data_ptr(), rows, cols,
                                         static_cast<int>(variant), c10::cuda::getCurrentCUDAStream()),
             "mxfp8_quantize_colwise");
}

void quantize_dual(const at::Tensor& x, at::Tensor& data_row, at::Tensor& scales_row, at::Tensor& data_col,
                   at::Tensor& scales_col, int64_t variant) {
  check_arg(x, "x"), check_arg(data_row, "data_row"), check_arg(scales_row, "scales_row");
  check_arg(data_col, "data_col"), check_arg(scales_col, "scales_col");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  check_cuda(mok::mxfp8_quantize_dual(x.data_ptr(), data_row.data_ptr(), scales_row.data_ptr(),
                                      data_col.data_ptr(), scales_col.data_ptr(), rows, cols,
                                      static_cast<int>(variant), c10::cuda::getCurrentCUDAStream()),
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mxfp8_quantize_rowwise", &quantize_rowwise, "x, data, scales, variant");
  m.def("mxfp8_quantize_colwise", &quantize_colwise, "x, data, scales, variant");
  m.def("mxfp8_quantize_dual", &quantize_dual, "x, data_row, scales_row, data_col, scales_col, variant");
  m.def("mxfp8_dequantize", &dequantize, "data, scales, out, rowwise");
}
