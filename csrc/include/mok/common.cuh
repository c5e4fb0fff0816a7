// Shared device helpers for mok's kernels: vector memory access with cache hints, bf16 bit views,
// warp shuffles, launch-error plumbing. Torch-free: CPU CI compiles this for sm_90a with plain nvcc.
#pragma once

#include <atomic>
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

// L2 eviction hints, for a small input read many times while a larger stream passes through L2 (the gathered x
// rows: each token's row once per route, a route's turn far from the token's last one, while the kernel writes K
// times x's bytes): the input's loads ask L2 to keep their lines (evict_last), the stream's stores to drop theirs
// first (evict_first).
MOK_DEVICE uint64_t l2_evict_last_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

MOK_DEVICE uint4 ld_keep_v4(const void* ptr, uint64_t policy) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr), "l"(policy));
  return v;
}

MOK_DEVICE uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

MOK_DEVICE void st_hint_v4(void* ptr, uint4 v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;"
               :: "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy) : "memory");
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

// Lane 0's v in every lane (all 32 lanes must call it). A value loaded from memory is per-thread to ptxas even
// when every lane loads the same address; broadcast, it is warp-uniform to the compiler too, which then keeps
// what depends on it (a loop bound, the wgmma descriptors inside that loop) in the uniform datapath.
MOK_DEVICE int warp_uniform(int v) { return __shfl_sync(kFullMask, v, 0); }

// Per-halfword unsigned max with the lane `lane_mask` away (all 32 lanes must call it).
MOK_DEVICE uint32_t warp_vmaxu2_xor(uint32_t v, int lane_mask) {
  return __vmaxu2(v, __shfl_xor_sync(kFullMask, v, lane_mask));
}

// ---- host ------------------------------------------------------------------------------------------

MOK_HOST_DEVICE constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- shared memory, mbarriers and the bulk copy engine (sm_90) ----------------------------------------
// A 1D bulk copy (`cp.async.bulk`, TMA without a tensor map) moves `bytes` (a multiple of 16, both
// addresses 16-byte aligned) from global to shared memory and counts them against an mbarrier's
// transaction count; a consumer waits on the barrier's phase parity. One CTA is its own cluster here.

namespace ptx {

MOK_DEVICE uint32_t smem_addr(const void* ptr) { return static_cast<uint32_t>(__cvta_generic_to_shared(ptr)); }

MOK_DEVICE void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes the initialized barriers visible to the async proxy (the bulk copy engine); __syncthreads after.
MOK_DEVICE void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival that also expects `bytes` more of this phase's transactions.
MOK_DEVICE void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

MOK_DEVICE uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

constexpr uint64_t kWaitTimeoutNs = 10ull * 1000 * 1000 * 1000;  // 10 s: far beyond any real stall

// Spins until done() holds, or faults after kWaitTimeoutNs (a store to address 8: the launch fails with "an illegal
// memory access was encountered") instead of hanging forever (DESIGN §9: device spin-waits carry a timeout).
// NOTE: no printf here: any call in a kernel makes ptxas serialize all of its wgmmas (C7510). And no __trap():
// with a trap reachable, ptxas (CUDA 13.0) kept every warp of a kernel within its launch registers, so the GEMM
// consumers got 168 of the 224 their setmaxnreg grants (ptxas -v: spills past that; docs/gemm.md).
template <typename Done>
MOK_DEVICE void spin_until(Done done) {
  uint64_t start = 0;
  for (uint32_t spins = 0;; ++spins) {
    if (done()) return;
    if (spins == 0) start = global_timer_ns();
    if ((spins & 1023) == 1023 && global_timer_ns() - start > kWaitTimeoutNs)
      *reinterpret_cast<volatile uint32_t*>(uintptr_t{8}) = 1u;  // the null page: faults, never returns
  }
}

// Spins until the phase with parity `parity` has completed (acquire: its copies' bytes are visible).
MOK_DEVICE void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
  spin_until([&] {
    uint32_t done;
    asm volatile("{\n\t.reg .pred p;\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}"
                 : "=r"(done)
                 : "r"(smem_addr(bar)), "r"(parity)
                 : "memory");
    return done != 0;
  });
}

MOK_DEVICE void bulk_copy_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

}  // namespace ptx

// ---- launch ---------------------------------------------------------------------------------------------

// Grid of a persistent kernel: as many CTAs as fit on the device at once, at most one per tile. The
// shared-memory opt-in and the occupancy query run once per kernel and device and are cached, so a launch
// inside a CUDA graph capture makes no such calls (every caller runs the op once before capturing).
template <auto* kKernel>
inline cudaError_t persistent_grid(int threads, int smem_bytes, int64_t num_tiles, unsigned* grid) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> resident_ctas[kMaxDevices];  // per device; 0 = not set up yet
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int resident = device < kMaxDevices ? resident_ctas[device].load() : 0;
  if (resident == 0) {
    int per_sm = 0, sms = 0;
    if ((err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes)) ||
        (err = cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    cudaSharedmemCarveoutMaxShared)) ||
        (err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, smem_bytes)) ||
        (err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)))
      return err;
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    resident = per_sm * sms;
    if (device < kMaxDevices) resident_ctas[device].store(resident);
  }
  *grid = static_cast<unsigned>(num_tiles < resident ? num_tiles : resident);
  return cudaSuccess;
}

}  // namespace mok
