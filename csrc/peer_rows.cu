// Instantiates the peer-row kernels behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/moe/peer_rows.cuh"

namespace mok {

cudaError_t pull_rows(const void* const* src, const float* const* weights, const int32_t* pull_rank,
                      const int32_t* pull_token, const int32_t* pull_k, void* out, int64_t num_rows, int64_t hidden,
                      int64_t capacity, int num_ranks, int num_topk, cudaStream_t stream) {
  return moe::launch_pull_rows(src, weights, pull_rank, pull_token, pull_k, out, num_rows, hidden, capacity,
                               num_ranks, num_topk, stream);
}

cudaError_t combine_peers(const void* const* rows, const int32_t* combine_rank, const int32_t* combine_row,
                          const float* topk_weights, const void* shared, void* out, int64_t num_tokens,
                          int64_t num_topk, int64_t capacity, int64_t hidden, int num_ranks, cudaStream_t stream) {
  return moe::launch_combine_peers(rows, combine_rank, combine_row, topk_weights, shared, out, num_tokens, num_topk,
                                   capacity, hidden, num_ranks, stream);
}

}  // namespace mok
