// The MXFP8 backward's SwiGLU backward, after the down-projection dgrad GEMM (kDownDgrad), in one pass over
// 32-row tiles: from d_h and the forward's saved MXFP8 gate/up (row-wise data + scales) it writes exactly what the
// next GEMMs read, as the round trips of DESIGN §4:
//   d_gate, d_up: both directions (row-wise for the gate/up dgrad, column-wise for the weight gradients)
//   h (recomputed, swiglu(gate, up)): column-wise (d_w_down's operand)
// The bits are those of the kernels it replaces: mxfp8_dequantize of gate/up, swiglu_backward_rows, then
// mxfp8_fake_quantize_dual of d_gate and d_up and mxfp8_fake_quantize(h, -2) (the same device functions: dequantize8,
// swiglu_backward_n, quantize_and_store_tile). Padding rows (row_to_token < 0) are zeros in every output, as the
// quantizers make them from the zeros swiglu_backward_rows writes there. Rows from *real_num_rows on (spare rows)
// are neither read nor written.
// Per element of [rows, n]: 2 + 2·(1 + 1/32) bytes read, 5·2 written; the kernels it replaces move 34.
// d_gate_row may be d_h's own buffer: a warp reads every d_h element of its tile before it writes any output.
#pragma once

#include "mok/quant/mxfp8_quantize.cuh"
#include "mok/swiglu.cuh"

namespace mok::moe {

// A row-wise MXFP8 matrix [rows, n]: E4M3 data and one E8M0 scale per 32 columns ([rows, n / 32]).
struct RowwiseMx {
  const uint8_t* data;
  const uint8_t* scales;
};

// The five bf16 [rows, n] outputs.
struct SwigluBackwardMxOut {
  uint16_t *d_gate_row, *d_gate_col, *d_up_row, *d_up_col, *h_col;
};

constexpr int kSwigluMxWarps = 8;
constexpr int kRowLanes = 8;  // 4 rows per thread: three outputs' chunks stay in registers
using SwigluMxTile = mxfp8::ColTile<kRowLanes>;  // a warp: 32 rows × 32 columns; a thread: 8 columns of rows row_lane + 8i

// 8 bf16 (one 16-byte chunk) of a row-wise MXFP8 matrix, as mxfp8_dequantize writes them.
MOK_DEVICE uint4 dequantize_chunk(const RowwiseMx& m, int64_t row, int64_t col, int64_t n) {
  const uint2 q = *reinterpret_cast<const uint2*>(m.data + row * n + col);
  const float s = mxfp8::scale_byte_to_f32(m.scales[row * (n / mxfp8::kBlockSize) + col / mxfp8::kBlockSize]);
  const float scale[8] = {s, s, s, s, s, s, s, s};
  return mxfp8::dequantize8(q, scale);
}

__global__ void __launch_bounds__(kSwigluMxWarps * kWarpSize)
    swiglu_backward_mx_kernel(const uint16_t* d_h, RowwiseMx gate, RowwiseMx up, const int32_t* row_to_token,
                              const int32_t* real_num_rows, SwigluBackwardMxOut out, int64_t num_rows, int64_t n,
                              float limit, bool has_limit) {
  using Tile = SwigluMxTile;
  if (real_num_rows != nullptr && *real_num_rows < num_rows) num_rows = *real_num_rows < 0 ? 0 : *real_num_rows;
  const int64_t col_tiles = ceil_div(n, Tile::kCols);
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kSwigluMxWarps + threadIdx.x / kWarpSize;
  if (tile >= (num_rows / mxfp8::kBlockSize) * col_tiles) return;  // whole warps leave together
  const int lane = static_cast<int>(lane_id());
  const int row_lane = lane / Tile::kColLanes, col_lane = lane % Tile::kColLanes;
  const int64_t row0 = (tile / col_tiles) * mxfp8::kBlockSize;
  const int64_t col = (tile % col_tiles) * Tile::kCols + col_lane * mxfp8::kChunkElems;
  const bool valid = col < n;  // n % 32 == 0: a chunk is all in or all out

  // loaded as d_h, gate, up; the SwiGLU backward turns them into d_gate, d_up, h in place
  uint4 d_gate[Tile::kRowsPerThread], d_up[Tile::kRowsPerThread], h[Tile::kRowsPerThread];
#pragma unroll
  for (int i = 0; i < Tile::kRowsPerThread; ++i) {  // every load first (d_h may alias out.d_gate_row)
    const int64_t row = row0 + row_lane + kRowLanes * i;
    const bool live = valid && row_to_token[row] >= 0;  // padding rows stay zeros
    d_gate[i] = live ? *reinterpret_cast<const uint4*>(d_h + row * n + col) : make_uint4(0u, 0u, 0u, 0u);
    d_up[i] = live ? dequantize_chunk(gate, row, col, n) : make_uint4(0u, 0u, 0u, 0u);
    h[i] = live ? dequantize_chunk(up, row, col, n) : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int i = 0; i < Tile::kRowsPerThread; ++i) {  // (d_h, gate, up) -> (d_gate, d_up, h), in place
    const uint32_t dh_w[4] = {d_gate[i].x, d_gate[i].y, d_gate[i].z, d_gate[i].w};
    const uint32_t g_w[4] = {d_up[i].x, d_up[i].y, d_up[i].z, d_up[i].w}, u_w[4] = {h[i].x, h[i].y, h[i].z, h[i].w};
    float g[8], u[8], dh[8];  // element 2k + j = word k's half j (j = 0: low)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      g[2 * k] = bf16_lo_as_f32(g_w[k]), g[2 * k + 1] = bf16_hi_as_f32(g_w[k]);
      u[2 * k] = bf16_lo_as_f32(u_w[k]), u[2 * k + 1] = bf16_hi_as_f32(u_w[k]);
      dh[2 * k] = bf16_lo_as_f32(dh_w[k]), dh[2 * k + 1] = bf16_hi_as_f32(dh_w[k]);
    }
    swiglu_backward_n(g, u, dh, limit, has_limit);  // g, u, dh <- d_gate, d_up, h
    const bool live = valid && row_to_token[row0 + row_lane + kRowLanes * i] >= 0;
    const auto pack = [live](const float (&v)[8]) {
      return live ? make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                               pack_bf16x2(v[6], v[7]))
                  : make_uint4(0u, 0u, 0u, 0u);
    };
    d_gate[i] = pack(g), d_up[i] = pack(u), h[i] = pack(dh);
  }
  const auto store = [&](const uint4 (&v)[Tile::kRowsPerThread], uint16_t* col_out, uint16_t* row_out) {
    mxfp8::TiledOut o{nullptr, nullptr, nullptr, nullptr};
    o.round_trip_col = reinterpret_cast<uint8_t*>(col_out);
    o.round_trip_row = reinterpret_cast<uint8_t*>(row_out);
    if (row_out != nullptr) {
      mxfp8::quantize_and_store_tile<kRowLanes, true, true>(v, row0, col, n, valid, row_lane, col_lane, o);
    } else {
      mxfp8::quantize_and_store_tile<kRowLanes, false, true>(v, row0, col, n, valid, row_lane, col_lane, o);
    }
  };
  store(d_gate, out.d_gate_col, out.d_gate_row);
  store(d_up, out.d_up_col, out.d_up_row);
  store(h, out.h_col, nullptr);
}

// num_rows: the row buffers' rows (a multiple of 32; the grid is sized for them); real_num_rows: int32 [1] on the
// device or null; n = intermediate (% 32 == 0); every pointer 16-byte aligned.
inline cudaError_t launch_swiglu_backward_mx(const void* d_h, RowwiseMx gate, RowwiseMx up,
                                             const int32_t* row_to_token, const int32_t* real_num_rows,
                                             const SwigluBackwardMxOut& out, int64_t num_rows, int64_t n,
                                             float limit, bool has_limit, cudaStream_t stream) {
  if (n % mxfp8::kBlockSize != 0 || num_rows % mxfp8::kBlockSize != 0) return cudaErrorInvalidValue;
  const int64_t tiles = (num_rows / mxfp8::kBlockSize) * ceil_div(n, SwigluMxTile::kCols);
  if (tiles == 0) return cudaSuccess;
  swiglu_backward_mx_kernel<<<ceil_div(tiles, int64_t{kSwigluMxWarps}), kSwigluMxWarps * kWarpSize, 0, stream>>>(
      static_cast<const uint16_t*>(d_h), gate, up, row_to_token, real_num_rows, out, num_rows, n, limit, has_limit);
  return cudaGetLastError();
}

}  // namespace mok::moe
