"""MXFP8 quantizers (csrc/quant_mxfp8.cu), bit-exact with the L0 spec `mok.mxfp8` (DESIGN §4): bf16 in,
outputs in the logical layout.

    mxfp8_quantize_rowwise(x)  -> (data, scales)   blocks along dim -1; scales [..., rows, cols // 32]
    mxfp8_quantize_colwise(x)  -> (data, scales)   blocks along dim -2; scales [..., rows // 32, cols]
    mxfp8_quantize_dual(x)     -> ((data_row, scales_row), (data_col, scales_col)), one read of x
    mxfp8_dequantize(data, scales, dim=-1) -> bf16
    mxfp8_fake_quantize(x, dim=-1, counts=None) -> bf16      mxfp8_dequantize(*quantize(x), dim) in one pass
    mxfp8_fake_quantize_dual(x, counts=None) -> (row, col)   both directions from one read of x, bf16

x: bf16 [rows, cols] or [experts, rows, cols], CUDA, contiguous, 16-byte aligned. Row-wise needs
cols % 32 == 0; column-wise needs rows % 32 == 0 and cols % 8 == 0 (16-byte row segments); dual both.
`counts` (a schedule's Schedule.counts) stops a column-wise round trip over that schedule's row buffer at its
real rows: the MXFP8 backward's operands, whose spare rows no GEMM reads (mok.fused).
"""

from __future__ import annotations

import torch

from mok.checks import check_cuda, fail
from mok.ops.core import load_extension

BLOCK_SIZE = 32  # MXFP8 elements per scale (mok.mxfp8.BLOCK_SIZE)


def _check_matrix(name: str, t, dtype: torch.dtype) -> None:
    """A quantizer's operand: a 2D [rows, cols] or 3D [experts, rows, cols] tensor of `dtype`, CUDA, contiguous and
    16-byte aligned."""
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype != dtype:
        fail(name, f"dtype {dtype}", t.dtype)
    if t.dim() not in (2, 3):
        fail(name, "a 2D [rows, cols] or 3D [experts, rows, cols] tensor", f"shape {tuple(t.shape)}")
    check_cuda(name, t, aligned=True)


def _check_blocks(name: str, shape: tuple, rowwise: bool, colwise: bool) -> None:
    rows, cols = shape[-2], shape[-1]
    if rowwise and cols % BLOCK_SIZE:
        fail(name, f"cols (last dim) a multiple of {BLOCK_SIZE} for row-wise blocks", f"shape {shape}")
    if colwise and rows % BLOCK_SIZE:
        fail(name, f"rows (dim -2) a multiple of {BLOCK_SIZE} for column-wise blocks", f"shape {shape}")
    if colwise and cols % 8:
        fail(name, "cols (last dim) a multiple of 8 for column-wise kernels (16-byte row segments)",
              f"shape {shape}")


def _scales_shape(shape: tuple, dim: int) -> tuple:
    out = list(shape)
    out[dim] //= BLOCK_SIZE
    return tuple(out)


def mxfp8_quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along dim -1. Returns data float8_e4m3fn (x.shape), scales uint8 [..., cols // 32]."""
    _check_matrix("x", x, torch.bfloat16)
    _check_blocks("x", tuple(x.shape), rowwise=True, colwise=False)
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)  # x.shape
    scales = torch.empty(_scales_shape(tuple(x.shape), -1), dtype=torch.uint8, device=x.device)  # [..., cols / 32]
    load_extension().mxfp8_quantize_rowwise(x=x, data=data, scales=scales)
    return data, scales


def mxfp8_quantize_colwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along dim -2. Returns data float8_e4m3fn (x.shape), scales uint8 [..., rows // 32, cols]."""
    _check_matrix("x", x, torch.bfloat16)
    _check_blocks("x", tuple(x.shape), rowwise=False, colwise=True)
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)  # x.shape
    # [..., rows / 32, cols]
    scales = torch.empty(_scales_shape(tuple(x.shape), -2), dtype=torch.uint8, device=x.device)
    load_extension().mxfp8_quantize_colwise(x=x, data=data, scales=scales)
    return data, scales


def mxfp8_quantize_dual(x: torch.Tensor):
    """Row-wise and column-wise quantization from one read of x:
    ((data_row, scales_row), (data_col, scales_col)), each equal to the single-direction op's output."""
    _check_matrix("x", x, torch.bfloat16)
    _check_blocks("x", tuple(x.shape), rowwise=True, colwise=True)
    shape = tuple(x.shape)
    data_row = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)  # x.shape
    scales_row = torch.empty(_scales_shape(shape, -1), dtype=torch.uint8, device=x.device)  # [..., cols / 32]
    data_col = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)  # x.shape
    scales_col = torch.empty(_scales_shape(shape, -2), dtype=torch.uint8, device=x.device)  # [..., rows / 32, cols]
    load_extension().mxfp8_quantize_dual(x=x, data_row=data_row, scales_row=scales_row, data_col=data_col,
                                         scales_col=scales_col)
    return (data_row, scales_row), (data_col, scales_col)


def mxfp8_dequantize(data: torch.Tensor, scales: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """q * 2^e rounded to bf16 (NaN for a 0xFF scale); dim = -1 (row-wise scales) or -2 (column-wise)."""
    _check_matrix("data", data, torch.float8_e4m3fn)
    _check_matrix("scales", scales, torch.uint8)
    if dim not in (-1, -2, data.dim() - 1, data.dim() - 2):
        fail("dim", f"-1 or -2 (or {data.dim() - 1} / {data.dim() - 2}) for data of rank {data.dim()}", dim)
    rowwise = dim in (-1, data.dim() - 1)
    shape = tuple(data.shape)
    _check_blocks("data", shape, rowwise=rowwise, colwise=not rowwise)
    expected = _scales_shape(shape, -1 if rowwise else -2)
    if tuple(scales.shape) != expected:
        fail("scales", f"shape {expected} for data of shape {shape} and dim {dim}", tuple(scales.shape))
    if scales.device != data.device:
        fail("scales", f"device {data.device} (data's)", scales.device)
    out = torch.empty(shape, dtype=torch.bfloat16, device=data.device)  # data.shape
    load_extension().mxfp8_dequantize(data=data, scales=scales, out=out, rowwise=rowwise)
    return out


def _check_counts(counts, x: torch.Tensor) -> None:
    """counts of a round trip over a schedule's row buffer x [rows, cols]: None, or the schedule's device counts
    (Schedule.counts: int32, counts[0] its real row count; the rows from there on are spare)."""
    if counts is None:
        return
    if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int32 or counts.numel() < 1:
        fail("counts", "None or a schedule's int32 counts tensor", counts)
    if counts.device != x.device or not counts.is_contiguous():
        fail("counts", f"a contiguous tensor on {x.device} (x's device)", f"device {counts.device}")
    if x.dim() != 2:
        fail("counts", f"None for x of rank {x.dim()} (counts bound the rows of a 2D row buffer)", "a tensor")


def mxfp8_fake_quantize(x: torch.Tensor, dim: int = -1, counts: torch.Tensor | None = None) -> torch.Tensor:
    """The MXFP8 round trip of x in one kernel: mxfp8_dequantize(*mxfp8_quantize_*(x), dim) bit for bit (L0's
    mok.mxfp8.fake_quantize), without the E4M3 bytes and scales in memory: 4 bytes moved per element instead
    of 6. dim = -1 (row-wise) or -2 (column-wise). Returns bf16, x.shape.
    counts (column-wise only): a schedule's device counts for x, a row buffer of that schedule: the 32-row
    blocks from counts[0] on (its spare rows, which no GEMM reads) are neither read nor written, so the output
    holds whatever torch.empty left there."""
    _check_matrix("x", x, torch.bfloat16)
    if dim not in (-1, -2, x.dim() - 1, x.dim() - 2):
        fail("dim", f"-1 or -2 (or {x.dim() - 1} / {x.dim() - 2}) for x of rank {x.dim()}", dim)
    rowwise = dim in (-1, x.dim() - 1)
    _check_blocks("x", tuple(x.shape), rowwise=rowwise, colwise=not rowwise)
    _check_counts(counts, x)
    if rowwise and counts is not None:
        fail("counts", "None for a row-wise round trip (dim -1)", "a tensor")
    out = torch.empty_like(x)  # x.shape, bf16
    load_extension().mxfp8_fake_quantize(x=x, out=out, out_row=None, rowwise=rowwise, counts=counts)
    return out


def mxfp8_fake_quantize_dual(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mxfp8_fake_quantize(x, -1), mxfp8_fake_quantize(x, -2)) from one read of x, bf16 x.shape each; counts
    as mxfp8_fake_quantize's (both outputs' spare blocks left alone)."""
    _check_matrix("x", x, torch.bfloat16)
    _check_blocks("x", tuple(x.shape), rowwise=True, colwise=True)
    _check_counts(counts, x)
    out_row, out_col = torch.empty_like(x), torch.empty_like(x)  # x.shape each
    load_extension().mxfp8_fake_quantize(x=x, out=out_col, out_row=out_row, rowwise=False, counts=counts)
    return out_row, out_col
