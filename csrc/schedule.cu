// Instantiates the device route schedule behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/moe/schedule.cuh"

namespace mok {

cudaError_t make_schedule(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                          int64_t block_m, int64_t max_num_rows, const ScheduleOutputs& out, int32_t* chunk_counts,
                          cudaStream_t stream) {
  return moe::launch_make_schedule(topk_idx, num_tokens, num_topk, num_experts, block_m, max_num_rows, out,
                                   chunk_counts, stream);
}

}  // namespace mok
