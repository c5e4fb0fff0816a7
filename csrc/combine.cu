// Instantiates the fixed-order combine behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/moe/combine.cuh"

namespace mok {

cudaError_t combine_rows(const void* y_rows, const void* route_to_row, bool route_to_row_is_int64,
                         const float* topk_weights, const void* shared, void* out, int64_t num_tokens,
                         int64_t num_topk, int64_t num_rows, int64_t hidden, cudaStream_t stream) {
  if (route_to_row_is_int64)
    return moe::launch_combine_rows(y_rows, static_cast<const int64_t*>(route_to_row), topk_weights, shared, out,
                                    num_tokens, num_topk, num_rows, hidden, stream);
  return moe::launch_combine_rows(y_rows, static_cast<const int32_t*>(route_to_row), topk_weights, shared, out,
                                  num_tokens, num_topk, num_rows, hidden, stream);
}

}  // namespace mok
