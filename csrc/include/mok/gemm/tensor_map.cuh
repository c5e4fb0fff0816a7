// Host side of TMA: a CUtensorMap for a stack of expert weight matrices, encoded through the driver entry
// point that the CUDA runtime hands out (no link against libcuda). Torch-free, host-only code.
#pragma once

#include <cstdint>
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000
#include <cuda_runtime_api.h>

namespace mok::gemm {

// The driver's cuTensorMapEncodeTiled (ABI of CUDA 12.0), looked up once per process.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  return encode;
}

// A 3D map over a stack of row-major matrices [batch, rows, cols] (cols contiguous), dims innermost first
// (cols, rows, batch); a box of (box_cols, box_rows, 1) lands in shared memory as box_rows rows of
// box_cols elements, with `swizzle`. Elements past cols or rows read as zeros (and rows past the last
// matrix too): a tile never reads a neighbouring expert. Needs `ptr` 16-byte aligned and a row stride that
// is a multiple of 16 bytes.
inline cudaError_t encode_map(CUtensorMap* map, CUtensorMapDataType dtype, uint32_t elem_bytes, const void* ptr,
                              int64_t batch, int64_t rows, int64_t cols, uint32_t box_cols, uint32_t box_rows,
                              CUtensorMapSwizzle swizzle) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorSymbolNotFound;
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 || (cols * elem_bytes) % 16 != 0) return cudaErrorInvalidValue;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * elem_bytes,
                                 static_cast<cuuint64_t>(rows * cols) * elem_bytes};  // bytes
  const cuuint32_t box[3] = {box_cols, box_rows, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult res = encode(map, dtype, 3, const_cast<void*>(ptr), dims, strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// w: bf16 [batch, rows, k], k contiguous: a stack of expert weights (nn.Linear layout: rows = output features)
// or, with batch = 1, a matrix of activation rows; boxes of box_k * 2 = 128 bytes per row, 128-byte swizzle.
inline cudaError_t encode_rows_map(CUtensorMap* map, const void* w, int64_t num_experts, int64_t rows,
                                     int64_t k, uint32_t box_k, uint32_t box_rows) {
  if (box_k * 2 != 128) return cudaErrorInvalidValue;
  return encode_map(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w, num_experts, rows, k, box_k, box_rows,
                    CU_TENSOR_MAP_SWIZZLE_128B);
}

}  // namespace mok::gemm
