"""Grouped GEMMs with MXFP8 weights dequantized in the mainloop (csrc/gemm_mxfp8.cu; docs/gemm.md).

GEMM1 and GEMM2 of the forward as in mok.ops.gemm, with each weight given as its MXFP8 quantization along
K, `(data, scales)` as mxfp8_quantize_rowwise returns them: float8_e4m3fn [E, n, k] and uint8 [E, n, k / 32].
The producer warpgroup dequantizes every weight tile in shared memory to exactly the bf16 mxfp8_dequantize
writes, so

    grouped_gemm_mxfp8_*(..., (data, scales), ...) == grouped_gemm_bf16_*(..., mxfp8_dequantize(data, scales), ...)

bit for bit, reading 1 + 1/32 bytes per weight element instead of 2, with no dequantized copy in HBM.
Activations stay bf16: x and h carry the caller's MXFP8 round trip (mok.fused), a small tensor next to
the weights.
"""

from __future__ import annotations

import torch

from mok.checks import check_cuda, check_layout, fail
from mok.ops.core import load_extension
from mok.ops.gemm import (
    _check_devices,
    _check_gemm_dim,
    _check_limit,
    _check_num_sms,
    _limit_kwargs,
    gemm_schedule_kwargs,
)
from mok.ops.quant import BLOCK_SIZE

MX_K_BLOCK = 64  # the kernels' k-block: two 32-element scale blocks per weight row


def mx_scales_by_k_block(scales: torch.Tensor) -> torch.Tensor:
    """Row-wise scales [E, n, k / 32] in the kernels' layout [E, ceil(k / 64), n, 2] (uint8): the scales of a
    tile's 128 rows in one k-block are 256 contiguous bytes, one TMA box. An odd k / 32 pads each row's last
    k-block with byte 127 (2^0), the scale of the zeros the kernel reads past k."""
    num_experts, n, num_blocks = scales.shape
    per_k_block = MX_K_BLOCK // BLOCK_SIZE  # 2
    if num_blocks % per_k_block:
        pad = torch.full((num_experts, n, 1), 127, dtype=scales.dtype, device=scales.device)
        scales = torch.cat([scales, pad], dim=2)  # [E, n, k / 32 + 1]
    return scales.view(num_experts, n, -1, per_k_block).permute(0, 2, 1, 3).contiguous()  # [E, ceil(k/64), n, 2]


def _check_mx_weight(name: str, w, num_experts: int, k: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scales) of a weight [num_experts, n, k] quantized row-wise (along k), before any device check."""
    if not (isinstance(w, (tuple, list)) and len(w) == 2):
        fail(name, f"(data, scales), the MXFP8 weight {what} from mxfp8_quantize_rowwise", type(w).__name__)
    data, scales = w
    if not isinstance(data, torch.Tensor) or data.dtype != torch.float8_e4m3fn:
        fail(f"{name}[0]", "data of dtype torch.float8_e4m3fn", getattr(data, "dtype", type(data).__name__))
    if data.dim() != 3 or data.shape[0] != num_experts or data.shape[2] != k:
        fail(f"{name}[0]", f"shape {what} = [{num_experts}, *, {k}]", f"shape {tuple(data.shape)}")
    _check_gemm_dim(f"{name}[0]", data.shape[1], "n (dim 1)")
    if k % BLOCK_SIZE:
        fail(f"{name}[0]", f"k (dim 2) a multiple of {BLOCK_SIZE} (whole MXFP8 blocks)", k)
    expected = (num_experts, data.shape[1], k // BLOCK_SIZE)
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
        fail(f"{name}[1]", "scales of dtype torch.uint8 (E8M0)", getattr(scales, "dtype", type(scales).__name__))
    if tuple(scales.shape) != expected:
        fail(f"{name}[1]", f"shape {list(expected)} (row-wise scales of {name}[0])", f"shape {tuple(scales.shape)}")
    return data, scales


def grouped_gemm_mxfp8_swiglu_gather(x: torch.Tensor, w_gate, w_up, sched, swiglu_limit: float | None = None,
                                     num_sms: int | None = None):
    """mok.ops.grouped_gemm_bf16_swiglu_gather with MXFP8 weights: w_gate, w_up = (data, scales) of
    [num_experts, intermediate, hidden] quantized along hidden. Returns (h, gate, up), bf16 [num_rows,
    intermediate] each, the BF16 kernel's bits on the dequantized weights."""
    check_layout("x", x, torch.bfloat16, (sched.num_tokens, None), "[num_tokens, hidden]")
    hidden = x.shape[1]
    _check_gemm_dim("x", hidden, "hidden (dim 1)")
    what = "[num_experts, intermediate, hidden]"
    gate_w, gate_s = _check_mx_weight("w_gate", w_gate, sched.num_experts, hidden, what)
    intermediate = gate_w.shape[1]
    up_w, up_s = _check_mx_weight("w_up", w_up, sched.num_experts, hidden, what)
    if up_w.shape != gate_w.shape:
        fail("w_up[0]", f"shape {tuple(gate_w.shape)} (w_gate's)", f"shape {tuple(up_w.shape)}")
    _check_limit(swiglu_limit)
    sms = _check_num_sms(num_sms)
    _check_devices(x.device, x=x)
    for name, t in (("w_gate[0]", gate_w), ("w_gate[1]", gate_s), ("w_up[0]", up_w), ("w_up[1]", up_s)):
        check_cuda(name, t, x.device, "the first operand's", aligned=True)
    h, gate, up = (torch.empty(sched.num_rows, intermediate, dtype=torch.bfloat16, device=x.device)
                   for _ in range(3))  # [num_rows, intermediate] each
    load_extension().grouped_gemm_mxfp8_swiglu_gather(
        x=x, w_gate=gate_w, w_gate_scales=mx_scales_by_k_block(gate_s), w_up=up_w,
        w_up_scales=mx_scales_by_k_block(up_s), h=h, gate=gate, up=up, num_sms=sms,
        **gemm_schedule_kwargs(sched, x.device), **_limit_kwargs(swiglu_limit))
    return h, gate, up


def grouped_gemm_mxfp8_nt_contiguous(a_rows: torch.Tensor, w, sched, num_sms: int | None = None) -> torch.Tensor:
    """mok.ops.grouped_gemm_bf16_nt_contiguous with an MXFP8 weight: w = (data, scales) of [num_experts, n, k]
    quantized along k. Returns bf16 [num_rows, n], the BF16 kernel's bits on the dequantized weight."""
    check_layout("a_rows", a_rows, torch.bfloat16, (sched.num_rows, None), "[num_rows, k]")
    k = a_rows.shape[1]
    _check_gemm_dim("a_rows", k, "k (dim 1)")
    data, scales = _check_mx_weight("w", w, sched.num_experts, k, "[num_experts, n, k]")
    sms = _check_num_sms(num_sms)
    _check_devices(a_rows.device, a_rows=a_rows)
    check_cuda("w[0]", data, a_rows.device, "the first operand's", aligned=True)
    check_cuda("w[1]", scales, a_rows.device, "the first operand's", aligned=True)
    out_rows = torch.empty(sched.num_rows, data.shape[1], dtype=torch.bfloat16, device=a_rows.device)  # [R, n]
    load_extension().grouped_gemm_mxfp8_nt_contiguous(a_rows=a_rows, w=data, w_scales=mx_scales_by_k_block(scales),
                                                      out=out_rows, num_sms=sms,
                                                      **gemm_schedule_kwargs(sched, a_rows.device))
    return out_rows
