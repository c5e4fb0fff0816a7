// Instantiates round_to_tiles' map steps, rounds and end game behind the host API of mok/api.h. Torch-free.
#include "mok/api.h"
#include "mok/moe/round_steps.cuh"
#include "mok/moe/round_to_tiles.cuh"

namespace mok {

cudaError_t route_round_step(const RouteRound& args, int step, cudaStream_t stream) {
  // route ids, chosen and slots in int32; the keys' high half 2·expert + 1 below 2^31
  if (args.num_tokens * args.num_topk > INT32_MAX || args.num_experts >= (int64_t{1} << 30) || args.tile < 1)
    return cudaErrorInvalidValue;
  return moe::launch_route_round_step(args, step, stream);
}

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

cudaError_t route_swap_leftovers(int64_t* idx, const int64_t* before, const uint8_t* allowed, const int64_t* left,
                                 int64_t* need, int32_t* waiting, int32_t* moved, int64_t num_tokens,
                                 int64_t num_topk, int64_t num_experts, int64_t num_left, cudaStream_t stream) {
  // route ids and the moved list in int32, the block's loop indices up to 1024 past their ends
  if (num_tokens * num_topk + num_left > INT32_MAX - 1024) return cudaErrorInvalidValue;
  const moe::SwapArgs args{idx, before, allowed, left, need, waiting, moved, static_cast<int>(num_tokens),
                           static_cast<int>(num_topk), static_cast<int>(num_experts), static_cast<int>(num_left)};
  return moe::launch_route_swap_leftovers(args, stream);
}

}  // namespace mok
