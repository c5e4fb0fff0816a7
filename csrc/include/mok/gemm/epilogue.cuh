// The grouped GEMMs' epilogues: a consumer warp's accumulators to global memory through its staging boxes
// and TMA stores, SwiGLU and the MXFP8 outputs of GEMM1.
#pragma once

#include "mok/gemm/tasks.cuh"

namespace mok::gemm {

// ---- epilogues: registers -> shared memory -> global --------------------------------------------------

constexpr int kAccPerThread = WG_M * BLOCK_N_B / kWarpgroup;  // 64 fp32 per accumulator

// A consumer warp's staging area (kStagingBytesPerWarp) and the box its next store writes.
struct Staging {
  uint8_t* smem;
  int box;
};

// One output matrix of an epilogue: rows [0, num_rows) × columns [0, n) of entry `batch` of tensor map `tmap`
// (dims (n, rows, batch)). kAllRows: the schedule's outputs, whose tiles cover their rows exactly (no bound to check).
struct Output {
  const CUtensorMap* tmap;
  int batch, n, num_rows;
};
constexpr int kAllRows = INT32_MAX;

// Columns [col0, col0 + 128) of rows row0 .. row0 + 15 of `out`, a warp's fragment of one 128-column accumulator
// (thread (lane l) holding rows l/4 and l/4 + 8, columns 8i + 2(l%4) + {0, 1}, i in [0, 16); values(i, h) -> the
// bf16x2 word of column pair i, row half h), as two boxes of 64 columns in a staging area of kBoxes boxes. Per box:
// lane 0 waits until the box's staging was read by the store issued kBoxes boxes ago (its bulk groups complete in
// order), stmatrix writes the 8 column groups with the 128-byte swizzle the tensor map reads (the box is
// 1024-aligned, so sw128_offset is the address XOR TMA applies), every lane fences its writes to the async proxy,
// and lane 0 issues the store and commits it as one group. Boxes entirely past n or m are skipped (the map clips the
// rest: a partial box writes only columns < n and rows < num_rows).
template <int kBoxes, typename Values>
MOK_DEVICE void store_tile(Staging& st, const Output& out, int row0, int col0, uint32_t lane, Values values) {
  const uint32_t matrix = lane / 8, matrix_row = lane % 8 + 8 * (matrix & 1);
#pragma unroll
  for (int b = 0; b < BLOCK_N_B / kStoreBoxCols; ++b) {
    const int col = col0 + b * kStoreBoxCols;
    if (col >= out.n || row0 >= out.num_rows) break;  // warp-uniform
    uint8_t* box = st.smem + st.box * kStoreBoxBytes;
    if (lane == 0) ptx::bulk_wait_group_read<kBoxes - 1>();
    __syncwarp();  // no lane writes the box before its last store has read it
#pragma unroll
    for (int c = 0; c < kStoreBoxCols / 8; c += 2) {  // chunk c of a box row: the tile's 8 columns i = 8b + c
      const int i = b * (kStoreBoxCols / 8) + c;
      ptx::stmatrix_x4(box + sw128_offset(matrix_row, c + (matrix >> 1)), values(i, 0), values(i, 1),
                       values(i + 1, 0), values(i + 1, 1));
    }
    ptx::fence_proxy_async_shared();  // this lane's stmatrix writes, before the TMA engine reads them
    __syncwarp();
    if (lane == 0) {
      ptx::tma_store_3d(out.tmap, box, col, row0, out.batch);
      ptx::bulk_commit_group();
    }
    st.box = st.box + 1 == kBoxes ? 0 : st.box + 1;
  }
}

// kGateUpMxOut's E4M3 tiles: a warp's 16 rows × 128 one-byte columns [col0, col0 + 128) of `data` ([rows, n],
// n % 16 == 0) are one staging box, 128 bytes a row like a bf16 box. `fill(put)` calls put(i, h, two_bytes) for
// every word position of the accumulator layout (columns 8i + 2(l%4) + {0, 1}, row half h), which lands as a
// 2-byte store at its place in the 128-byte swizzle (a row's 8 lanes hit 8 distinct 16-byte slots). Then the
// box leaves as store_tile's boxes do: one TMA store through `tmap` (uint8, box 128 × 16).
static_assert(BLOCK_N_B * kStoreBoxRows == static_cast<int>(kStoreBoxBytes), "a warp's E4M3 tile is one store box");
template <int kBoxes, typename Fill>
MOK_DEVICE void store_tile_e4m3(Staging& st, const CUtensorMap* tmap, int row0, int col0, uint32_t lane, Fill fill) {
  uint8_t* box = st.smem + st.box * kStoreBoxBytes;
  if (lane == 0) ptx::bulk_wait_group_read<kBoxes - 1>();
  __syncwarp();  // no lane writes the box before its last store has read it
  fill([&](int i, int h, uint32_t two_bytes) {
    const uint32_t row = lane / 4 + 8 * h, byte = 8 * (i % 2) + 2 * (lane % 4);
    *reinterpret_cast<uint16_t*>(box + sw128_offset(row, i / 2) + byte) = static_cast<uint16_t>(two_bytes);
  });
  ptx::fence_proxy_async_shared();
  __syncwarp();
  if (lane == 0) {
    ptx::tma_store_3d(tmap, box, col0, row0, 0);
    ptx::bulk_commit_group();
  }
  st.box = st.box + 1 == kBoxes ? 0 : st.box + 1;
}

// The row-wise MXFP8 blocks of a warp's 16 × 128 tile in the accumulator layout, word(i, h) = the bf16x2 of
// columns 8i + 2(l%4) + {0, 1} in row half h: block b of a row is i in [4b, 4b + 4) across the quad of lanes that
// holds the row, so its amax is a max over 4 words and the lanes xor 1, 2 (both row halves in one word:
// mxfp8_quantize's amax on bits, NaN/Inf flagged). Calls on_block(b, scale of row half 0, of row half 1); every
// lane of the warp must call it (shuffles).
template <typename Word, typename OnBlock>
MOK_DEVICE void rowwise_blocks(Word word, OnBlock on_block) {
  static_assert(BLOCK_N_B % mxfp8::kBlockSize == 0 && mxfp8::kBlockSize == 4 * 8, "a block: 4 lanes × 4 words");
#pragma unroll
  for (int b = 0; b < BLOCK_N_B / mxfp8::kBlockSize; ++b) {
    uint32_t amax[2] = {0u, 0u};
#pragma unroll
    for (int i = 4 * b; i < 4 * b + 4; ++i)
      amax[0] = mxfp8::amax2_acc(amax[0], word(i, 0)), amax[1] = mxfp8::amax2_acc(amax[1], word(i, 1));
    uint32_t both = mxfp8::amax2_fold(amax[0]) | (mxfp8::amax2_fold(amax[1]) << 16);
    both = warp_vmaxu2_xor(warp_vmaxu2_xor(both, 1), 2);
    on_block(b, mxfp8::scale_from_amax_bits(both & 0xFFFFu), mxfp8::scale_from_amax_bits(both >> 16));
  }
}

// Before the consumer exits: its last stores have finished (the global writes, not only the staging reads).
MOK_DEVICE void drain_stores(uint32_t lane) {
  if (lane == 0) ptx::bulk_wait_group<0>();
}

// The output tensor maps (kernel parameters), boxes of
// kStoreBoxCols × kStoreBoxRows: dims (n, num_rows, 1), kWeightGrad's out (n, m, num_experts).
struct Outputs {
  const CUtensorMap *out, *gate, *up;  // gate, up: the SwiGLU kinds only (kGateUpMxOut: their E4M3 data)
};

// The epilogue of one consumer warp: its 16 rows of a finished task's tile. kGateUp stores gate, up and h =
// swiglu(gate, up) from the accumulators at once (gate and up first: the accumulators then die as h is computed,
// which kGateUpMx's 192 registers need). The others pack the tile as bf16, two 16 × 128 pieces (columns n0.. and
// n0 + 128..; word w of an accumulator is pack_bf16x2(acc[2w], acc[2w + 1]), so stmatrix's values(i, h), column
// pair i and row half h, is word 2i + h), and store them at once or, with kDefer (the weight gradients), hold them
// while the next task's first two k-blocks multiply and store one after each of their wgmma commits
// (mma_k_blocks): the tensor cores keep working through most of the epilogue. 64 words beside the 128 accumulator
// floats fit the consumers' 232 registers (ptxas -v, CUDA 13.0). Padding rows of the
// schedule's outputs are stored as zeros whatever the weights hold (0·Inf would be NaN).
template <Gemm kGemm, bool kDefer>
struct Epilogue {
  using T = Tile<kGemm>;
  static_assert(!(kDefer && T::kSwiGLU), "kGateUp stores its tile at once");
  static constexpr int kWords = kAccPerThread / 2;
  static constexpr int kPieces = 2;
  uint32_t words[kPieces][kWords];  // acc0, acc1 packed
  int row0, n0, expert;             // this warp's 16 rows, the tile's first column, kWeightGrad's dW[expert]
  bool real[2];                     // row halves l/4 and l/4 + 8 are routes (always, in kWeightGrad)
  int next = kPieces;               // the piece to store next; kPieces: nothing held

  MOK_DEVICE void finish(const float (&acc0)[kAccPerThread], const float (&acc1)[kAccPerThread], const Params& p,
                       const Outputs& o, Staging& st, int row0_, int n0_, int expert_, uint32_t lane) {
    row0 = row0_, n0 = n0_, expert = expert_;
    real[0] = kGemm == Gemm::kWeightGrad || p.row_to_token[row0 + lane / 4] >= 0;
    real[1] = kGemm == Gemm::kWeightGrad || p.row_to_token[row0 + lane / 4 + 8] >= 0;
    if constexpr (T::kMxOut) {
      store_mx_piece(mx_of(p.gate, p), o.gate, p, st, lane, acc0);
      store_mx_piece(mx_of(p.up, p), o.up, p, st, lane, acc1);
    } else if constexpr (T::kSwiGLU) {
      store_piece_from(p, o, st, lane, 0, acc_values(acc0));
      store_piece_from(p, o, st, lane, 1, acc_values(acc1));
    }
    if constexpr (T::kSwiGLU) {
      // h in batches of 8 elements (swiglu_n: see mok/swiglu.cuh for why batches; 16 spilled), packed as the
      // stores read it: word k = elements 2k, 2k + 1
      constexpr int kBatch = 8;
      uint32_t h_words[kWords];
#pragma unroll
      for (int b = 0; b < kAccPerThread; b += kBatch) {
        float g[kBatch], u[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) g[j] = round_bf16(acc0[b + j]), u[j] = round_bf16(acc1[b + j]);
        swiglu_n(g, u, p.swiglu_limit, p.has_limit != 0);
#pragma unroll
        for (int j = 0; j < kBatch; j += 2) h_words[(b + j) / 2] = pack_bf16x2(g[j], g[j + 1]);
      }
      if constexpr (T::kMxOut) {  // h's row-wise round trip in place (padding rows: zeros, as stored)
        const auto word = [&](int i, int h) { return real[h] ? h_words[2 * i + h] : 0u; };
        rowwise_blocks(word, [&](int b, const mxfp8::Scale& s0, const mxfp8::Scale& s1) {
#pragma unroll
          for (int i = 4 * b; i < 4 * b + 4; ++i) {
            h_words[2 * i] = mxfp8::round_trip2(word(i, 0), s0);
            h_words[2 * i + 1] = mxfp8::round_trip2(word(i, 1), s1);
          }
        });
      }
      store_tile<kStoreBoxesPerWarp>(st, {o.out, 0, p.n, kAllRows}, row0, n0, lane,
                 [&](int i, int h) { return real[h] ? h_words[2 * i + h] : 0u; });
    } else {
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        words[0][w] = pack_bf16x2(acc0[2 * w], acc0[2 * w + 1]);
        words[1][w] = pack_bf16x2(acc1[2 * w], acc1[2 * w + 1]);
      }
      next = 0;
    }
  }

  // The next piece, if one is held (each branch names its piece at compile time: the words stay registers).
  MOK_DEVICE void store_next(const Params& p, const Outputs& o, Staging& st, uint32_t lane) {
    if (next == 0) {
      store_piece<0>(p, o, st, lane);
    } else if (next == 1) {
      store_piece<1>(p, o, st, lane);
    }
    if (next < kPieces) ++next;
  }

  MOK_DEVICE void store_rest(const Params& p, const Outputs& o, Staging& st, uint32_t lane) {
    while (next < kPieces) store_next(p, o, st, lane);
  }

  template <int kPiece>
  MOK_DEVICE void store_piece(const Params& p, const Outputs& o, Staging& st, uint32_t lane) {
    store_piece_from(p, o, st, lane, kPiece, [&](int i, int h) { return real[h] ? words[kPiece][2 * i + h] : 0u; });
  }

  MOK_DEVICE auto acc_values(const float* acc) const {  // stmatrix's values of an accumulator, packed as read
    return [acc, this](int i, int h) {
      return real[h] ? pack_bf16x2(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]) : 0u;
    };
  }

  // kGateUpMxOut's gate or up from its accumulator: the bf16 values (zeros in padding rows) quantized row-wise, the
  // E4M3 box by store_tile_e4m3 and each block's scale byte by the quad lane b of its row (st.global).
  MOK_DEVICE void store_mx_piece(MxOut mx, const CUtensorMap* tmap, const Params& p, Staging& st, uint32_t lane,
                                 const float* acc) const {
    const auto word = acc_values(acc);
    const int64_t scale_cols = p.n / mxfp8::kBlockSize;
    store_tile_e4m3<kStoreBoxesPerWarp>(st, tmap, row0, n0, lane, [&](auto put) {
      rowwise_blocks(word, [&](int b, const mxfp8::Scale& s0, const mxfp8::Scale& s1) {
#pragma unroll
        for (int i = 4 * b; i < 4 * b + 4; ++i)
          put(i, 0, mxfp8::quantize2(word(i, 0), s0)), put(i, 1, mxfp8::quantize2(word(i, 1), s1));
        const int col = n0 + mxfp8::kBlockSize * b;
        if (lane % 4 == static_cast<uint32_t>(b) && col < p.n) {
          uint8_t* s = mx.scales + (row0 + lane / 4) * scale_cols + col / mxfp8::kBlockSize;
          st_u8(s, s0.byte);
          st_u8(s + 8 * scale_cols, s1.byte);
        }
      });
    });
  }

  // Piece `piece` (0 or 1) of the tile: kGateUp's gate or up, the others' columns n0 + 128 · piece.. (if < n).
  template <typename Values>
  MOK_DEVICE void store_piece_from(const Params& p, const Outputs& o, Staging& st, uint32_t lane, int piece,
                                   Values values) const {
    if constexpr (T::kSwiGLU) {
      const Output out{piece == 0 ? o.gate : o.up, 0, p.n, kAllRows};
      store_tile<kStoreBoxesPerWarp>(st, out, row0, n0, lane, values);
    } else if (piece == 0 || n0 + BLOCK_N_B < p.n) {
      const Output out = kGemm == Gemm::kWeightGrad ? Output{o.out, expert, p.n, p.m} : Output{o.out, 0, p.n, kAllRows};
      store_tile<kStoreBoxesPerWarp>(st, out, row0, n0 + piece * BLOCK_N_B, lane, values);
    }
  }
};

}  // namespace mok::gemm
