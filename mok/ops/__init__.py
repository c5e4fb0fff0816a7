"""Python entry points of mok's CUDA kernels (csrc/), built on first use for Hopper (sm_90a).

One module per family, everything re-exported here (call them as `mok.ops.<name>`):

    core   the JIT build (csrc_hash, require_hopper, load_extension)
    quant  MXFP8 quantizers, dequantization and the one-pass round trip (mxfp8_*)
    gemm   grouped BF16 GEMMs over the route schedule (grouped_gemm_bf16_*), the L2 mainloops
    chain  several of those kinds in one persistent launch on device counters (grouped_gemm_bf16_chain,
           grouped_gemm_bf16_chain_backward): the megakernel level's passes at EP = 1
    gemm_mx  GEMM1 and GEMM2 with MXFP8 weights dequantized in the mainloop (grouped_gemm_mxfp8_*)
    peer   rows of other ranks through tables of their addresses (Peers, pull_rows, combine_peers): the
           megakernel's pull and combine bodies
    moe    the fixed-order combine (combine_rows), the row gather (gather_rows_cuda), the device schedule
           (make_schedule_cuda), the backward's routed-gradient prep (route_grads_prep) and
           routing.round_to_tiles (route_round_to_tiles; its pieces route_round_prep, route_fill_rounds,
           route_swap_leftovers)

Every op checks its arguments first with mok.checks (errors name the argument, the expectation and the actual
value), then needs a Hopper GPU, and passes every tensor to its binding by name (keyword-only arguments of
csrc/bindings.cpp, filled into mok/api.h's structs field by field); `mok.twins` holds an L0 twin of every L2
kernel.
"""

from mok.ops.chain import ChainRanks, grouped_gemm_bf16_chain, grouped_gemm_bf16_chain_backward, row_ids
from mok.ops.core import ARCH_FLAGS, CACHE, CSRC, REPO, csrc_hash, load_extension, require_hopper
from mok.ops.gemm import (
    GEMM_BLOCK_M,
    GEMM_K_ALIGN,
    gemm_schedule_tensors,
    grouped_gemm_bf16_dgrad_gate_up,
    grouped_gemm_bf16_dgrad_swiglu,
    grouped_gemm_bf16_dgrad_swiglu_mxfp8,
    grouped_gemm_bf16_dgrad_swiglu_route_grads,
    grouped_gemm_bf16_nt_contiguous,
    grouped_gemm_bf16_swiglu_gather,
    grouped_gemm_bf16_swiglu_gather_mxfp8_out,
    grouped_gemm_bf16_weight_grad,
)
from mok.ops.gemm_mx import (
    MX_K_BLOCK,
    grouped_gemm_mxfp8_nt_contiguous,
    grouped_gemm_mxfp8_swiglu_gather,
    mx_scales_by_k_block,
)
from mok.ops.moe import (
    FILL_MAX_RECEIVERS,
    ROUTE_GRADS_MAX_TOPK,
    SCHEDULE_MAX_EXPERTS,
    combine_rows,
    gather_rows_cuda,
    make_schedule_cuda,
    mxfp8_fake_quantize_gathered,
    route_fill_rounds,
    route_grads_prep,
    route_round_prep,
    route_round_to_tiles,
    route_swap_leftovers,
)
from mok.ops.peer import Peers, combine_peers, pull_rows
from mok.ops.quant import (
    BLOCK_SIZE,
    mxfp8_dequantize,
    mxfp8_fake_quantize,
    mxfp8_fake_quantize_dual,
    mxfp8_quantize_colwise,
    mxfp8_quantize_dual,
    mxfp8_quantize_rowwise,
)

__all__ = [
    "ARCH_FLAGS", "BLOCK_SIZE", "CACHE", "ChainRanks", "CSRC", "FILL_MAX_RECEIVERS", "GEMM_BLOCK_M", "GEMM_K_ALIGN",
    "Peers", "REPO",
    "ROUTE_GRADS_MAX_TOPK",
    "SCHEDULE_MAX_EXPERTS", "combine_peers", "combine_rows", "csrc_hash", "gather_rows_cuda", "gemm_schedule_tensors",
    "grouped_gemm_bf16_chain", "grouped_gemm_bf16_chain_backward", "grouped_gemm_bf16_dgrad_gate_up",
    "grouped_gemm_bf16_dgrad_swiglu",
    "grouped_gemm_bf16_dgrad_swiglu_mxfp8",
    "grouped_gemm_bf16_dgrad_swiglu_route_grads", "grouped_gemm_bf16_nt_contiguous",
    "grouped_gemm_bf16_swiglu_gather", "grouped_gemm_bf16_swiglu_gather_mxfp8_out",
    "grouped_gemm_bf16_weight_grad", "MX_K_BLOCK", "grouped_gemm_mxfp8_nt_contiguous",
    "grouped_gemm_mxfp8_swiglu_gather", "mx_scales_by_k_block", "row_ids",
    "load_extension", "make_schedule_cuda", "mxfp8_dequantize", "mxfp8_fake_quantize",
    "mxfp8_fake_quantize_dual", "mxfp8_fake_quantize_gathered", "mxfp8_quantize_colwise", "mxfp8_quantize_dual",
    "mxfp8_quantize_rowwise", "pull_rows", "require_hopper", "route_fill_rounds", "route_grads_prep",
    "route_round_prep", "route_round_to_tiles", "route_swap_leftovers",
]
