// PTX wrappers of the Hopper (sm_90a) GEMM machinery: wgmma (warpgroup MMA, accumulators in registers),
// shared-memory matrix descriptors, the tensor copy engine (TMA) for tiles (loads and stores), 16-byte
// cp.async with zero-fill for gathered rows, and the mbarrier/proxy plumbing between them. Torch-free.
//
// The mbarrier basics (init, arrive.expect_tx, try_wait.parity, 1D bulk copy) live in mok/common.cuh;
// this header adds what the GEMMs need on top, in the same namespace.
#pragma once

#include <cstdint>
#include <cuda.h>  // CUtensorMap

#include "mok/common.cuh"

namespace mok::ptx {

// ---- mbarrier ------------------------------------------------------------------------------------------

// One plain arrival (release: the thread's prior shared-memory reads/writes are ordered before it).
MOK_DEVICE void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// ---- cp.async (16 bytes, L2 only) with zero-fill -------------------------------------------------------
// Copies `src_bytes` (0 or 16) from global and fills the rest of the 16 bytes with zeros: src_bytes = 0
// writes a zero chunk and reads nothing (used for padding rows and for columns past K).

MOK_DEVICE void cp_async_16_zfill(void* smem_dst, const void* gmem_src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(smem_dst)), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}

// An arrival on `bar` that fires once all of this thread's earlier cp.async copies have landed. `.noinc`:
// the arrival counts against the count the barrier was initialized with (one per issuing thread).
MOK_DEVICE void cp_async_mbarrier_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

MOK_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Orders this thread's view of shared memory written through the generic proxy (ordinary stores,
// cp.async) before its later async-proxy accesses (wgmma operand reads, TMA).
MOK_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- TMA: one 3D tile of a tensor map into shared memory -------------------------------------------------
// Coordinates are innermost first (elements). Out-of-bounds elements are written as zeros and still
// count towards the transaction bytes, so a stage always expects the full box.

MOK_DEVICE void tma_load_3d(void* smem_dst, const CUtensorMap* tmap, int32_t c0, int32_t c1, int32_t c2,
                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(smem_addr(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}

// ---- TMA: one 3D tile of shared memory out to a tensor map (bulk tensor store) ---------------------------
// Elements outside the map's dims are not written (the box is clipped). The shared-memory source is read
// asynchronously: the issuing thread's stores join its current bulk async-group, `bulk_commit_group` closes
// the group, `bulk_wait_group_read<N>` returns once at most N of this thread's groups still read shared
// memory (the source may be overwritten), `bulk_wait_group<N>` once at most N are unfinished (the global
// writes done too). Shared memory written by ordinary stores (stmatrix) needs fence_proxy_async_shared by
// the writing threads before the store is issued.

MOK_DEVICE void tma_store_3d(const CUtensorMap* tmap, const void* smem_src, int32_t c0, int32_t c1, int32_t c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(tmap)),
               "r"(smem_addr(smem_src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}

MOK_DEVICE void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

template <int kPending>
MOK_DEVICE void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

template <int kPending>
MOK_DEVICE void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// ---- counters between CTAs: one CTA's TMA stores, read by another CTA's TMA loads ------------------------
// The writer waits for its stores (bulk_wait_group<0>), fences the async proxy's global writes against the generic
// proxy, then increments with release; the reader loads with acquire until the count is reached, then fences before
// its TMA loads (async proxy) read what the count announced. GPU scope: both CTAs on one device.

MOK_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

MOK_DEVICE void red_release_gpu_add(int32_t* counter, int32_t value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(counter), "r"(value) : "memory");
}

MOK_DEVICE int32_t ld_acquire_gpu(const int32_t* counter) {
  int32_t value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
  return value;
}


// The count before this increment (acquire and release: the increments of one counter form one chain, so the
// last one sees every earlier incrementer's writes). System scope: the counter and the writes it announces may
// live on other GPUs (peers' memory).
MOK_DEVICE int32_t atom_add_acq_rel_sys(int32_t* counter, int32_t value) {
  int32_t old;
  asm volatile("atom.acq_rel.sys.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(value) : "memory");
  return old;
}

// The same within one GPU.
MOK_DEVICE int32_t atom_add_acq_rel_gpu(int32_t* counter, int32_t value) {
  int32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(value) : "memory");
  return old;
}

MOK_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// 16 bytes another CTA wrote (announced by a counter), of this launch or a peer's: from L2, past the SM's L1.
MOK_DEVICE uint4 ld_cg_v4(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr)
               : "memory");
  return v;
}

// Spins until *counter >= target (acquire), with spin_until's timeout.
MOK_DEVICE void wait_counter(const int32_t* counter, int32_t target) {
  spin_until([&] { return ld_acquire_gpu(counter) >= target; });
}

MOK_DEVICE void prefetch_tensor_map(const CUtensorMap* tmap) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}

// ---- wgmma ---------------------------------------------------------------------------------------------
// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"), for a K-major operand tile whose
// rows are 128 bytes (64 bf16) stored with the 128-byte swizzle, 8-row atoms of 1024 bytes back to back:
//   bits  0-13  start address >> 4
//   bits 16-29  leading-dimension byte offset >> 4 (unused for swizzled K-major layouts; 1 by convention)
//   bits 32-45  stride-dimension byte offset >> 4 = 1024 >> 4 (from one 8-row atom to the next)
//   bits 49-51  base offset = 0 (atoms are 1024-byte aligned)
//   bits 62-63  layout: 1 = 128-byte swizzle
// The k-th 16-element slice of the 64-element row starts 32·k bytes further: advancing the start address
// is enough, the hardware applies the XOR on the address bits (which is why atoms must be 1024-aligned).
constexpr uint32_t kSw128AtomBytes = 1024;

MOK_DEVICE uint64_t smem_desc_sw128(const void* smem_tile) {
  const uint64_t addr = smem_addr(smem_tile);
  return ((addr >> 4) & 0x3FFFull) | (1ull << 16) | (static_cast<uint64_t>(kSw128AtomBytes >> 4) << 32) |
         (1ull << 62);
}

// The same for an MN-major tile (M or N contiguous: the operand transposed, `kTrans* = 1` in the wgmma):
// rows of 128 bytes are now 64 consecutive M (or N) elements of one k, 8 k-rows make a 1024-byte atom
// (SBO, from one 8-k group to the next), and `mn_atom_bytes` (LBO) leads from one 64-element M/N chunk to
// the next (one TMA box of 64 × box_k each). A k16 step is 2 atoms further: +2048 bytes.
MOK_DEVICE uint64_t smem_desc_sw128_mn(const void* smem_tile, uint32_t mn_atom_bytes) {
  const uint64_t addr = smem_addr(smem_tile);
  return ((addr >> 4) & 0x3FFFull) | (static_cast<uint64_t>((mn_atom_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>(kSw128AtomBytes >> 4) << 32) | (1ull << 62);
}

// The descriptor of the same tile `bytes` further along K (bytes a multiple of 16, within the row).
MOK_HOST_DEVICE constexpr uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

MOK_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
MOK_DEVICE void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

template <int kPending>
MOK_DEVICE void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads/writes of an accumulator register across the asynchronous MMA.
MOK_DEVICE void fence_operand(float& reg) { asm volatile("" : "+f"(reg)::"memory"); }

// D[64xN] (+)= A[64x16] · B[Nx16]ᵀ, bf16 operands in shared memory, D fp32 in registers (scale-d = 1: always
// accumulate; callers zero the accumulators first). kTransA/kTransB = 0: the operand is K-major (K
// contiguous, the nn.Linear layout); 1: MN-major (M or N contiguous), see smem_desc_sw128_mn.
// Fragment of D held by thread t of the warpgroup (warp w = t / 32 of the warpgroup, lane l):
// d[4i + 2h + j] is row 16w + l/4 + 8h, column 8i + 2(l%4) + j, for i in [0, N/8), h, j in {0, 1}.
template <int kTransA = 0, int kTransB = 0>
MOK_DEVICE void wgmma_m64n128k16_bf16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, %66, %67;\n\t}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB));
}

// One m64n256k16 over B0|B1 (the two 128-row B tiles contiguous in shared memory: one descriptor spans both) into
// d0 (columns 0..127) and d1 (128..255): the same fragments as two m64n128k16 into d0 and d1, with each A slice read
// from shared memory once.
template <int kTransA = 0, int kTransB = 0>
MOK_DEVICE void wgmma_m64n256k16_bf16(float (&d0)[64], float (&d1)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, 1, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      " %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      " %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      " %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      " %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, p, 1, 1, %130, %131;\n\t}"
      : "+f"(d0[0]), "+f"(d0[1]), "+f"(d0[2]), "+f"(d0[3]), "+f"(d0[4]), "+f"(d0[5]), "+f"(d0[6]), "+f"(d0[7]),
        "+f"(d0[8]), "+f"(d0[9]), "+f"(d0[10]), "+f"(d0[11]), "+f"(d0[12]), "+f"(d0[13]), "+f"(d0[14]), "+f"(d0[15]),
        "+f"(d0[16]), "+f"(d0[17]), "+f"(d0[18]), "+f"(d0[19]), "+f"(d0[20]), "+f"(d0[21]), "+f"(d0[22]), "+f"(d0[23]),
        "+f"(d0[24]), "+f"(d0[25]), "+f"(d0[26]), "+f"(d0[27]), "+f"(d0[28]), "+f"(d0[29]), "+f"(d0[30]), "+f"(d0[31]),
        "+f"(d0[32]), "+f"(d0[33]), "+f"(d0[34]), "+f"(d0[35]), "+f"(d0[36]), "+f"(d0[37]), "+f"(d0[38]), "+f"(d0[39]),
        "+f"(d0[40]), "+f"(d0[41]), "+f"(d0[42]), "+f"(d0[43]), "+f"(d0[44]), "+f"(d0[45]), "+f"(d0[46]), "+f"(d0[47]),
        "+f"(d0[48]), "+f"(d0[49]), "+f"(d0[50]), "+f"(d0[51]), "+f"(d0[52]), "+f"(d0[53]), "+f"(d0[54]), "+f"(d0[55]),
        "+f"(d0[56]), "+f"(d0[57]), "+f"(d0[58]), "+f"(d0[59]), "+f"(d0[60]), "+f"(d0[61]), "+f"(d0[62]), "+f"(d0[63]),
        "+f"(d1[0]), "+f"(d1[1]), "+f"(d1[2]), "+f"(d1[3]), "+f"(d1[4]), "+f"(d1[5]), "+f"(d1[6]), "+f"(d1[7]),
        "+f"(d1[8]), "+f"(d1[9]), "+f"(d1[10]), "+f"(d1[11]), "+f"(d1[12]), "+f"(d1[13]), "+f"(d1[14]), "+f"(d1[15]),
        "+f"(d1[16]), "+f"(d1[17]), "+f"(d1[18]), "+f"(d1[19]), "+f"(d1[20]), "+f"(d1[21]), "+f"(d1[22]), "+f"(d1[23]),
        "+f"(d1[24]), "+f"(d1[25]), "+f"(d1[26]), "+f"(d1[27]), "+f"(d1[28]), "+f"(d1[29]), "+f"(d1[30]), "+f"(d1[31]),
        "+f"(d1[32]), "+f"(d1[33]), "+f"(d1[34]), "+f"(d1[35]), "+f"(d1[36]), "+f"(d1[37]), "+f"(d1[38]), "+f"(d1[39]),
        "+f"(d1[40]), "+f"(d1[41]), "+f"(d1[42]), "+f"(d1[43]), "+f"(d1[44]), "+f"(d1[45]), "+f"(d1[46]), "+f"(d1[47]),
        "+f"(d1[48]), "+f"(d1[49]), "+f"(d1[50]), "+f"(d1[51]), "+f"(d1[52]), "+f"(d1[53]), "+f"(d1[54]), "+f"(d1[55]),
        "+f"(d1[56]), "+f"(d1[57]), "+f"(d1[58]), "+f"(d1[59]), "+f"(d1[60]), "+f"(d1[61]), "+f"(d1[62]), "+f"(d1[63])
      : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB));
}

// ---- stmatrix: four 8x8 bf16 matrices from the mma accumulator layout into shared memory -------------
// Register m of every lane holds its pair of matrix m (lane l: row l/4, columns 2(l%4), 2(l%4) + 1, the
// layout of a wgmma/mma accumulator fragment packed to bf16x2); lane l gives the address of row l % 8 of
// matrix l / 8 (16-byte aligned).
MOK_DEVICE void stmatrix_x4(void* smem_row, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr(smem_row)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// ---- register budget per warpgroup (warp specialization) ---------------------------------------------
// Every warp of the warpgroup executes it. The producer gives registers back, the consumers take them.
template <int kRegs>
MOK_DEVICE void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs)); }
template <int kRegs>
MOK_DEVICE void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs)); }

}  // namespace mok::ptx
