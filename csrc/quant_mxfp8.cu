// Instantiates the MXFP8 kernels behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/quant/mxfp8_dequantize.cuh"
#include "mok/quant/mxfp8_fake_quantize.cuh"
#include "mok/quant/mxfp8_quantize.cuh"
#include "mok/quant/mxfp8_quantize_split.cuh"

namespace mok {

cudaError_t mxfp8_quantize_rowwise(const void* x, void* data, void* scales, int64_t numel, cudaStream_t stream) {
  return mxfp8::launch_quantize_rowwise(x, data, scales, numel, stream);
}

cudaError_t mxfp8_quantize_colwise(const void* x, void* data, void* scales, int64_t rows, int64_t cols,
                                   cudaStream_t stream) {
  return mxfp8::launch_quantize_colwise(x, data, scales, rows, cols, stream);
}

cudaError_t mxfp8_quantize_dual(const void* x, void* data_row, void* scales_row, void* data_col, void* scales_col,
                                int64_t rows, int64_t cols, cudaStream_t stream) {
  return mxfp8::launch_quantize_dual_split(x, data_row, scales_row, data_col, scales_col, rows, cols, stream);
}

cudaError_t mxfp8_dequantize_rowwise(const void* data, const void* scales, void* out, int64_t numel,
                                     cudaStream_t stream) {
  return mxfp8::launch_dequantize_rowwise(data, scales, out, numel, stream);
}

cudaError_t mxfp8_dequantize_colwise(const void* data, const void* scales, void* out, int64_t rows,
                                     int64_t cols, cudaStream_t stream) {
  return mxfp8::launch_dequantize_colwise(data, scales, out, rows, cols, stream);
}

cudaError_t mxfp8_fake_quantize_rowwise(const void* x, void* out, int64_t numel, cudaStream_t stream) {
  return mxfp8::launch_fake_quantize_rowwise(x, out, numel, stream);
}

cudaError_t mxfp8_fake_quantize_tiled(const void* x, void* out_col, void* out_row, int64_t rows, int64_t cols,
                                      const int32_t* real_num_rows, cudaStream_t stream) {
  return mxfp8::launch_fake_quantize_tiled(x, out_col, out_row, rows, cols, real_num_rows, stream);
}

cudaError_t mxfp8_fake_quantize_gathered_colwise(const void* x, const int32_t* row_to_token, void* out, int64_t rows,
                                                 int64_t num_src_rows, int64_t cols, const int32_t* real_num_rows,
                                                 cudaStream_t stream) {
  return mxfp8::launch_fake_quantize_gathered_colwise(x, row_to_token, out, rows, num_src_rows, cols, real_num_rows,
                                                      stream);
}

}  // namespace mok
