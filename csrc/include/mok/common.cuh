// Shared device helpers for mok's kernels: vector memory access with cache hints, bf16 bit views,
// warp shuffles, launch-error plumbing. Torch-free: CPU CI compiles this for sm_90a with plain nvcc.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#define MOK_DEVICE __device__ __forceinline__
#define MOK_HOST_DEVICE __host__ __device__ __forceinline__

namespace mok {

constexpr int kWarpSize = 32;
constexpr uint32_t kFullMask = 0xFFFFFFFFu;

// ---- global memory: 16-byte (and 8-byte) accesses -------------------------------------------------
// NOTE: inputs of the streaming kernels are read exactly once, so loads go through the read-only
// path and skip L1 allocation (`.nc.L1::no_allocate`); nothing is gained by keeping them.

MOK_DEVICE uint4 ld_stream_v4(const void* ptr) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
}

MOK_DEVICE uint2 ld_stream_v2(const void* ptr) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
  return v;
}

MOK_DEVICE uint32_t ld_stream_u8(const void* ptr) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u8 %0, [%1];" : "=r"(v) : "l"(ptr));
  return v;
}

// Outputs are written once and read by a later kernel: plain write-back stores (they land in L2).
MOK_DEVICE void st_v4(void* ptr, uint4 v) { *reinterpret_cast<uint4*>(ptr) = v; }
MOK_DEVICE void st_v2(void* ptr, uint2 v) { *reinterpret_cast<uint2*>(ptr) = v; }
MOK_DEVICE void st_u8(void* ptr, uint32_t v) { *reinterpret_cast<uint8_t*>(ptr) = static_cast<uint8_t>(v); }

// ---- bf16 as bits ----------------------------------------------------------------------------------
// A 32-bit word holds two bf16 values: element 2i in the low half, 2i+1 in the high half (little
// endian). bf16 -> fp32 is exact: the bf16 bits are the top half of the fp32 bits.

MOK_DEVICE float bf16_lo_as_f32(uint32_t w) { return __uint_as_float(w << 16); }
MOK_DEVICE float bf16_hi_as_f32(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// ---- warp ------------------------------------------------------------------------------------------

MOK_DEVICE uint32_t lane_id() { return threadIdx.x & (kWarpSize - 1); }

// Per-halfword unsigned max with the lane `lane_mask` away (all 32 lanes must call it).
MOK_DEVICE uint32_t warp_vmaxu2_xor(uint32_t v, int lane_mask) {
  return __vmaxu2(v, __shfl_xor_sync(kFullMask, v, lane_mask));
}

// ---- host ------------------------------------------------------------------------------------------

MOK_HOST_DEVICE constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace mok
