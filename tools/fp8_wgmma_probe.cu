// Can FP8 wgmma with MXFP8's per-32 block scales beat the BF16 wgmma that mok's MXFP8 path runs on dequantized
// operands? Issue 5 asks to try "FP8 wgmma with promotion after every k32 step"; this probe measures the two things
// that decide it before any kernel is built (docs/l2_fused_log.md, "FP8 wgmma, probed"):
//
//   rate  TFLOP/s of the consumer loop alone: one CTA per SM, two consumer warpgroups of 64 rows each, operands
//         resident in shared memory (a mainloop whose loads are fully hidden: an upper bound for any kernel), ways
//           bf16_n256     per 128-byte k-block, 4 k16 slices × 2 wgmma m64n128k16 into two accumulators (mok's
//                         GEMM mainloop: B0 and B1, 256 columns)
//           bf16_n128     the same with one accumulator (128 columns)
//           fp8_n256      4 k32 slices × 2 wgmma m64n128k32 e4m3: FP8's raw rate, no scales
//           fp8_n128_mx   per k32 slice, wgmma into a fresh accumulator, wait, then acc += tmp · s_row · s_col
//                         (MX: one power-of-two scale per row of A and per column of B for every 32 k): the
//                         promotion MXFP8 needs (n128: the fresh accumulator beside the running one). The two
//                         warpgroups interleave, so one's promotion runs under the other's MMAs. (Promoting slice j
//                         under slice j + 1's MMA in the same warpgroup needs a third 64-float accumulator: ptxas
//                         then spills and serializes every wgmma, C7514, at 255 registers: not measured.)
//         Each way runs 100 ms before it is timed (the H200's power cap; docs/l2_fused.md), rounds alternate ways.
//   bits  one m64n128k32 on random finite E4M3 operands (every exponent, subnormals included) against the same
//         values in bf16 (two k16 wgmmas, fp32 accumulation: the dequantize path's product) and against the exact
//         sum rounded once to fp32.
//
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icsrc/include tools/fp8_wgmma_probe.cu -o probe
//   ./probe [out.csv]          (device step `fp8_probe`; about 10 s)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "mok/gemm/ptx.cuh"

namespace {

using namespace mok;

#define PROBE_REGS_64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define PROBE_ACC_64(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// D[64 x N] = (scale_d ? D : 0) + A[64 x 32] · B[N x 32]ᵀ, E4M3 operands K-major in shared memory (FP8 wgmma takes
// no transpose), fp32 D in the accumulator layout of ptx::wgmma_m64n128k16_bf16.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                      int scale_d) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " PROBE_REGS_64 ", %64, %65, p, 1, 1;\n\t}"
               : PROBE_ACC_64(d)
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// ---- rate ----------------------------------------------------------------------------------------------------

enum class Way { kBf16N256, kBf16N128, kFp8N256, kFp8N128Mx };
constexpr Way kWays[] = {Way::kBf16N256, Way::kBf16N128, Way::kFp8N256, Way::kFp8N128Mx};
constexpr const char* kWayNames[] = {"bf16_n256", "bf16_n128", "fp8_n256", "fp8_n128_mx"};
__host__ __device__ constexpr bool is_fp8(Way w) { return w != Way::kBf16N256 && w != Way::kBf16N128; }
__host__ __device__ constexpr int n_of(Way w) { return w == Way::kBf16N256 || w == Way::kFp8N256 ? 256 : 128; }

constexpr int kThreads = 256;                     // two consumer warpgroups, 64 rows each
constexpr int kRowBytes = 128;                    // a k-block: 64 bf16 or 128 E4M3 per row, 128-byte swizzle
constexpr int kABytes = 128 * kRowBytes, kBBytes = 256 * kRowBytes;
constexpr int kScaleSets = 8;                     // per-k-block scale tables cycled, so none is loop-invariant
constexpr int kSlices = 4;                        // k32 slices per FP8 k-block
constexpr int kScaleFloats = kScaleSets * kSlices * (128 + 256);
constexpr int kSmemBytes = 1024 + kABytes + kBBytes + kScaleFloats * 4;

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
  x ^= x >> 16, x *= 0x7feb352dU, x ^= x >> 15, x *= 0x846ca68bU, x ^= x >> 16;
  return x;
}

// acc[4i + 2h + j] += tmp[...] · s_row(h) · s_col(8i + 2(l%4) + j): the MX promotion of one k32 slice.
__device__ __forceinline__ void promote(float (&acc)[64], const float (&tmp)[64], const float* s_row,
                                        const float* s_col, uint32_t lane) {
  const float r0 = s_row[lane / 4], r1 = s_row[lane / 4 + 8];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float2 c = *reinterpret_cast<const float2*>(s_col + 8 * i + 2 * (lane % 4));
    acc[4 * i + 0] = fmaf(tmp[4 * i + 0], r0 * c.x, acc[4 * i + 0]);
    acc[4 * i + 1] = fmaf(tmp[4 * i + 1], r0 * c.y, acc[4 * i + 1]);
    acc[4 * i + 2] = fmaf(tmp[4 * i + 2], r1 * c.x, acc[4 * i + 2]);
    acc[4 * i + 3] = fmaf(tmp[4 * i + 3], r1 * c.y, acc[4 * i + 3]);
  }
}

template <int N>
__device__ __forceinline__ void fence_all(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) ptx::fence_operand(r[i]);
}

// acc += one k-slice (32 bytes of each row: k16 of bf16, k32 of E4M3) of A · Bᵀ, 128 columns.
template <bool kFp8>
__device__ __forceinline__ void mma_slice(float (&acc)[64], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (kFp8) wgmma_m64n128k32_e4m3(acc, desc_a, desc_b, 1);
  else ptx::wgmma_m64n128k16_bf16(acc, desc_a, desc_b);
}

template <Way kWay>
__global__ void __launch_bounds__(kThreads, 1) rate_kernel(int k_blocks, float* sink) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* a = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* b = a + kABytes;
  float* scales = reinterpret_cast<float*>(b + kBBytes);  // [set][slice][128 rows + 256 columns]
  for (int i = threadIdx.x; i < (kABytes + kBBytes) / 4; i += kThreads) {
    const uint32_t h = hash32(i + 977u * blockIdx.x);
    // bf16 pairs in ±[1, 2); E4M3 bytes with every exponent, never NaN (0x77 mask: at most 240)
    reinterpret_cast<uint32_t*>(a)[i] = is_fp8(kWay) ? (h & 0xF7F7F7F7u) & ~0x08080808u
                                                     : (0x3F803F80u | (h & 0x807F807Fu));
  }
  for (int i = threadIdx.x; i < kScaleFloats; i += kThreads) scales[i] = exp2f(static_cast<float>(hash32(i) % 9) - 4);
  ptx::fence_proxy_async_shared();
  __syncthreads();

  const uint32_t wg = threadIdx.x / 128, lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
  const uint64_t desc_a = ptx::smem_desc_sw128(a + wg * 64 * kRowBytes), desc_b = ptx::smem_desc_sw128(b);
  float sum = 0.0f;
  if constexpr (kWay == Way::kBf16N256 || kWay == Way::kBf16N128 || kWay == Way::kFp8N256) {
    constexpr bool kTwo = n_of(kWay) == 256;  // B0 = rows 0-127 of b, B1 = rows 128-255
    float acc0[64], acc1[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc0[i] = 0.0f, acc1[i] = 0.0f;
    for (int kb = 0; kb < k_blocks; ++kb) {
      fence_all(acc0), fence_all(acc1);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint64_t da = ptx::desc_advance(desc_a, 32 * kk), db = ptx::desc_advance(desc_b, 32 * kk);
        mma_slice<is_fp8(kWay)>(acc0, da, db);
        if constexpr (kTwo) mma_slice<is_fp8(kWay)>(acc1, da, ptx::desc_advance(db, 128 * kRowBytes));
      }
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<1>();
    }
    ptx::wgmma_wait_group<0>();
    fence_all(acc0), fence_all(acc1);
#pragma unroll
    for (int i = 0; i < 64; ++i) sum += acc0[i] + acc1[i];
  } else {
    float acc[64], tmp[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    const int row0 = static_cast<int>(wg * 64 + warp * 16);
    for (int kb = 0; kb < k_blocks; ++kb) {
      const float* set = scales + (kb % kScaleSets) * kSlices * (128 + 256);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        fence_all(tmp);
        ptx::wgmma_fence();
        wgmma_m64n128k32_e4m3(tmp, ptx::desc_advance(desc_a, 32 * kk), ptx::desc_advance(desc_b, 32 * kk), 0);
        ptx::wgmma_commit_group();
        ptx::wgmma_wait_group<0>();
        fence_all(tmp);
        promote(acc, tmp, set + kk * (128 + 256) + row0, set + kk * (128 + 256) + 128, lane);
      }
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) sum += acc[i];
  }
  if (sum == 12345.678f) sink[threadIdx.x] = sum;  // keeps the MMAs (never true in practice)
}

// ---- bits ----------------------------------------------------------------------------------------------------

// Byte `byte` of row r of a K-major tile with 128-byte rows and the 128-byte swizzle (the layout the descriptors say).
__host__ __device__ inline int sw128(int r, int byte) { return r * 128 + (((byte / 16) ^ (r % 8)) * 16) + byte % 16; }

// One warpgroup: d8 = A·Bᵀ by one FP8 m64n128k32, d16 = the same values in bf16 by two m64n128k16; [64][128] fp32.
__global__ void __launch_bounds__(128) bits_kernel(const uint8_t* a8, const uint8_t* b8, const uint16_t* a16,
                                                   const uint16_t* b16, float* d8, float* d16) {
  __shared__ __align__(1024) uint8_t s[4][128 * 128];  // a8, b8, a16, b16
  for (int i = threadIdx.x; i < 4 * 128 * 128; i += 128) s[i / (128 * 128)][i % (128 * 128)] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < 128 * 32; i += 128) {
    const int r = i / 32, k = i % 32;
    if (r < 64) s[0][sw128(r, k)] = a8[i];
    s[1][sw128(r, k)] = b8[i];
    if (r < 64) *reinterpret_cast<uint16_t*>(&s[2][sw128(r, 2 * k)]) = a16[i];
    *reinterpret_cast<uint16_t*>(&s[3][sw128(r, 2 * k)]) = b16[i];
  }
  ptx::fence_proxy_async_shared();
  __syncthreads();
  float acc8[64], acc16[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc8[i] = 0.0f, acc16[i] = 0.0f;
  fence_all(acc8), fence_all(acc16);
  ptx::wgmma_fence();
  wgmma_m64n128k32_e4m3(acc8, ptx::smem_desc_sw128(s[0]), ptx::smem_desc_sw128(s[1]), 0);
  ptx::wgmma_m64n128k16_bf16(acc16, ptx::smem_desc_sw128(s[2]), ptx::smem_desc_sw128(s[3]));
  ptx::wgmma_m64n128k16_bf16(acc16, ptx::desc_advance(ptx::smem_desc_sw128(s[2]), 32),
                             ptx::desc_advance(ptx::smem_desc_sw128(s[3]), 32));
  ptx::wgmma_commit_group();
  ptx::wgmma_wait_group<0>();
  fence_all(acc8), fence_all(acc16);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 64; ++i) {  // d[4i' + 2h + j]: row 16w + l/4 + 8h, column 8i' + 2(l%4) + j
    const int row = 16 * warp + lane / 4 + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * (lane % 4) + i % 2;
    d8[row * 128 + col] = acc8[i];
    d16[row * 128 + col] = acc16[i];
  }
}

float e4m3_value(uint8_t byte) {
  const int sign = byte >> 7, exp = (byte >> 3) & 15, man = byte & 7;
  const float mag = exp == 0 ? std::ldexp(man / 8.0f, -6) : std::ldexp(1.0f + man / 8.0f, exp - 7);
  return sign ? -mag : mag;
}

uint16_t bf16_bits(float v) {  // exact for E4M3 values (3 mantissa bits)
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return static_cast<uint16_t>(u >> 16);
}

#define CHECK(call)                                                                                           \
  do {                                                                                                        \
    const cudaError_t e = (call);                                                                             \
    if (e != cudaSuccess) {                                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e));               \
      std::exit(1);                                                                                           \
    }                                                                                                         \
  } while (0)

template <Way kWay>
float time_ms(int grid, int k_blocks, float* sink) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start));
  rate_kernel<kWay><<<grid, kThreads, kSmemBytes>>>(k_blocks, sink);
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return ms;
}

// Median TFLOP/s of `timed` launches after 100 ms of launches of the same way.
template <Way kWay>
double rate_tflops(int grid, int k_blocks, float* sink, int timed) {
  CHECK(cudaFuncSetAttribute(rate_kernel<kWay>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  for (float warm = 0.0f; warm < 100.0f;) warm += time_ms<kWay>(grid, k_blocks, sink);
  std::vector<float> ms;
  for (int i = 0; i < timed; ++i) ms.push_back(time_ms<kWay>(grid, k_blocks, sink));
  std::sort(ms.begin(), ms.end());
  const double k_per_block = is_fp8(kWay) ? 128.0 : 64.0;
  const double flops = 2.0 * grid * 128.0 * n_of(kWay) * k_per_block * k_blocks;
  return flops / (ms[ms.size() / 2] * 1e-3) / 1e12;
}

double rate_of(Way w, int grid, int k_blocks, float* sink, int timed) {
  switch (w) {
    case Way::kBf16N256: return rate_tflops<Way::kBf16N256>(grid, k_blocks, sink, timed);
    case Way::kBf16N128: return rate_tflops<Way::kBf16N128>(grid, k_blocks, sink, timed);
    case Way::kFp8N256: return rate_tflops<Way::kFp8N256>(grid, k_blocks, sink, timed);
    case Way::kFp8N128Mx: return rate_tflops<Way::kFp8N128Mx>(grid, k_blocks, sink, timed);
  }
  return 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  FILE* csv = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  if (argc > 1 && csv == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", argv[1]);
    return 1;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  // provenance columns of data/bench/ rows: the commit (MOK_COMMIT, set by tools/device_run.sh), CUDA, the date
  const char* commit = std::getenv("MOK_COMMIT") ? std::getenv("MOK_COMMIT") : "unknown";
  char date[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
  int runtime = 0;
  CHECK(cudaRuntimeGetVersion(&runtime));
  const std::string tail_text = std::string(prop.name) + "," + std::to_string(runtime / 1000) + "." +
                                std::to_string(runtime % 1000 / 10) + "," + commit + "," + date;
  const char* tail = tail_text.c_str();
  if (csv) std::fprintf(csv, "probe,way,value,rounds,gpu,cuda,commit,date\n");

  // rate: 3 rounds over the ways, each way's median per round; the median of the rounds
  constexpr int kRounds = 3, kKBlocks = 20000, kTimed = 5;
  float* sink;
  CHECK(cudaMalloc(&sink, kThreads * sizeof(float)));
  constexpr int kNumWays = sizeof(kWays) / sizeof(kWays[0]);
  std::vector<double> tflops[kNumWays];
  for (int round = 0; round < kRounds; ++round)
    for (int w = 0; w < kNumWays; ++w) tflops[w].push_back(rate_of(kWays[w], prop.multiProcessorCount, kKBlocks, sink, kTimed));
  std::printf("%-14s %9s %9s\n", "way", "TFLOP/s", "/ bf16_n256");
  double base = 0.0;
  for (int w = 0; w < kNumWays; ++w) {
    std::sort(tflops[w].begin(), tflops[w].end());
    const double median = tflops[w][kRounds / 2];
    if (w == 0) base = median;
    std::printf("%-14s %9.1f %9.3f\n", kWayNames[w], median, median / base);
    if (csv) std::fprintf(csv, "rate_tflops,%s,%.2f,%d,%s\n", kWayNames[w], median, kRounds, tail);
  }

  // bits: 16 random problems of 64 x 128 outputs
  constexpr int kProblems = 16;
  uint8_t *a8, *b8;
  uint16_t *a16, *b16;
  float *d8, *d16;
  CHECK(cudaMallocManaged(&a8, 64 * 32));
  CHECK(cudaMallocManaged(&b8, 128 * 32));
  CHECK(cudaMallocManaged(&a16, 64 * 32 * 2));
  CHECK(cudaMallocManaged(&b16, 128 * 32 * 2));
  CHECK(cudaMallocManaged(&d8, 64 * 128 * 4));
  CHECK(cudaMallocManaged(&d16, 64 * 128 * 4));
  long total = 0, fp8_exact = 0, bf16_exact = 0, fp8_is_bf16 = 0;
  double fp8_worst = 0.0, bf16_worst = 0.0;  // the largest |result − exact| / Σ|products| of any output
  uint32_t state = 12345;
  auto next_byte = [&]() {
    for (;;) {
      state = state * 1664525u + 1013904223u;
      const uint8_t byte = static_cast<uint8_t>(state >> 24);
      if ((byte & 0x7F) != 0x7F) return byte;  // no NaN
    }
  };
  for (int p = 0; p < kProblems; ++p) {
    for (int i = 0; i < 64 * 32; ++i) a8[i] = next_byte(), a16[i] = bf16_bits(e4m3_value(a8[i]));
    for (int i = 0; i < 128 * 32; ++i) b8[i] = next_byte(), b16[i] = bf16_bits(e4m3_value(b8[i]));
    bits_kernel<<<1, 128>>>(a8, b8, a16, b16, d8, d16);
    CHECK(cudaDeviceSynchronize());
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < 128; ++n) {
        double exact = 0.0, magnitude = 0.0;  // products of E4M3 values and their sum are exact in double
        for (int k = 0; k < 32; ++k) {
          const double prod = static_cast<double>(e4m3_value(a8[m * 32 + k])) * e4m3_value(b8[n * 32 + k]);
          exact += prod, magnitude += std::fabs(prod);
        }
        const float rounded = static_cast<float>(exact), v8 = d8[m * 128 + n], v16 = d16[m * 128 + n];
        ++total;
        fp8_exact += v8 == rounded, bf16_exact += v16 == rounded;
        fp8_is_bf16 += std::memcmp(&v8, &v16, 4) == 0;
        fp8_worst = std::max(fp8_worst, std::fabs(v8 - exact) / magnitude);
        bf16_worst = std::max(bf16_worst, std::fabs(v16 - exact) / magnitude);
      }
  }
  std::printf("bits over %ld outputs: fp8 = exact-rounded %.4f, bf16 = exact-rounded %.4f, fp8 bits = bf16 bits %.4f;\n"
              "  worst |result - exact| / sum|products|: fp8 %.3g, bf16 %.3g\n",
              total, double(fp8_exact) / total, double(bf16_exact) / total, double(fp8_is_bf16) / total, fp8_worst,
              bf16_worst);
  if (csv) {
    std::fprintf(csv, "bits_equal_exact,fp8,%.5f,%d,%s\n", double(fp8_exact) / total, kProblems, tail);
    std::fprintf(csv, "bits_equal_exact,bf16,%.5f,%d,%s\n", double(bf16_exact) / total, kProblems, tail);
    std::fprintf(csv, "bits_fp8_equal_bf16,fp8,%.5f,%d,%s\n", double(fp8_is_bf16) / total, kProblems, tail);
    std::fprintf(csv, "worst_rel_err,fp8,%.4g,%d,%s\n", fp8_worst, kProblems, tail);
    std::fprintf(csv, "worst_rel_err,bf16,%.4g,%d,%s\n", bf16_worst, kProblems, tail);
    std::fclose(csv);
  }
  return 0;
}
