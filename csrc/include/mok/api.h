// The host API of mok's CUDA kernels: plain C++ (no torch, no CUDA kernel code), so that
// csrc/bindings.cpp, compiled by the host compiler, can call what csrc/*.cu define.
// Every pointer is a device pointer; every call is asynchronous on `stream` and returns the launch
// status. Shapes are checked (with clear messages) in mok/ops.py before these are reached.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace mok {

// ---- MXFP8 (csrc/quant_mxfp8.cu) --------------------------------------------------------------------
// x: bf16, data: E4M3 bytes with x's shape; rows = numel / cols. Row-wise scales: [rows, cols / 32];
// column-wise scales: [rows / 32, cols] (a leading experts dim folds into rows).

cudaError_t mxfp8_quantize_rowwise(const void* x, void* data, void* scales, int64_t numel, int variant,
                                   cudaStream_t stream);
cudaError_t mxfp8_quantize_colwise(const void* x, void* data, void* scales, int64_t rows, int64_t cols,
                                   int variant, cudaStream_t stream);
cudaError_t mxfp8_quantize_dual(const void* x, void* data_row, void* scales_row, void* data_col,
                                void* scales_col, int64_t rows, int64_t cols, int variant,
                                cudaStream_t stream);
cudaError_t mxfp8_dequantize_rowwise(const void* data, const void* scales, void* out, int64_t numel,
                                     cudaStream_t stream);
cudaError_t mxfp8_dequantize_colwise(const void* data, const void* scales, void* out, int64_t rows,
                                     int64_t cols, cudaStream_t stream);

}  // namespace mok
