// Instantiates the row gather behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/moe/gather_rows.cuh"

namespace mok {

cudaError_t gather_rows(const void* x, const int32_t* row_to_token, const int64_t* row_to_k,
                        const int64_t* route_to_row, const int32_t* real_num_rows, void* out, int64_t num_tokens,
                        int64_t num_topk, int64_t num_rows, int64_t hidden, cudaStream_t stream) {
  return moe::launch_gather_rows(x, row_to_token, row_to_k, route_to_row, real_num_rows, out, num_tokens, num_topk,
                                 num_rows, hidden, stream);
}

}  // namespace mok
