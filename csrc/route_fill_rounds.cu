// Instantiates round_to_tiles' rounds behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/moe/route_fill_rounds.cuh"

namespace mok {

cudaError_t route_fill_rounds(const int64_t* order, uint8_t* may, const int64_t* inv, int64_t* need, int64_t* assign,
                              int32_t* first, int32_t* pick, const int64_t* num_real, int64_t num_pool,
                              int64_t num_tokens, int64_t num_receivers, cudaStream_t stream) {
  // the block's loops step an int index by up to 1024 past the last entry
  if (num_receivers > kFillMaxReceivers || num_pool > INT32_MAX - 1024 || num_tokens > INT32_MAX)
    return cudaErrorInvalidValue;
  const moe::FillArgs args{order, may, inv, need, assign, first, pick, num_real, static_cast<int>(num_pool),
                           static_cast<int>(num_tokens), static_cast<int>(num_receivers)};
  return moe::launch_route_fill_rounds(args, stream);
}

}  // namespace mok
