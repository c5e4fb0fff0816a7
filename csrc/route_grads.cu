// Instantiates the routed-gradient prep behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/moe/route_grads.cuh"

namespace mok {

cudaError_t route_grads_prep(const void* d_out, const float* topk_weights, const void* y_rows,
                             const int64_t* route_to_row, const int64_t* tile_num_rows,
                             const int32_t* real_num_rows, void* dy_rows, float* d_topk_weights, int64_t num_tokens,
                             int64_t num_topk, int64_t num_rows, int64_t hidden, int64_t block_m,
                             cudaStream_t stream) {
  return moe::launch_route_grads(d_out, topk_weights, y_rows, route_to_row, tile_num_rows, real_num_rows, dy_rows,
                                 d_topk_weights, num_tokens, num_topk, num_rows, hidden, block_m, stream);
}

}  // namespace mok
