"""Python entry points of mok's CUDA kernels (csrc/), built on first use for Hopper (sm_90a).

The build: `torch.utils.cpp_extension.load` compiles csrc/bindings.cpp and csrc/*.cu with an explicit
`-gencode=arch=compute_90a,code=sm_90a`, into the git-ignored `.cache/torch_extensions/` inside the
repository. The extension's name carries a hash of every file under csrc/, so an edited kernel is
rebuilt and a stale build is never loaded. `MOK_VERBOSE_BUILD=1` shows the compiler's output.

MXFP8 ops (bit-exact with the L0 spec `mok.mxfp8`, DESIGN §4): bf16 in, outputs in the logical layout.

    mxfp8_quantize_rowwise(x)  -> (data, scales)   blocks along dim -1; scales [..., rows, cols // 32]
    mxfp8_quantize_colwise(x)  -> (data, scales)   blocks along dim -2; scales [..., rows // 32, cols]
    mxfp8_quantize_dual(x)     -> ((data_row, scales_row), (data_col, scales_col)), one read of x
    mxfp8_dequantize(data, scales, dim=-1) -> bf16

x: bf16 [rows, cols] or [experts, rows, cols], CUDA, contiguous, 16-byte aligned. Row-wise needs
cols % 32 == 0; column-wise needs rows % 32 == 0 and cols % 8 == 0 (16-byte row segments); dual both.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

from mok.checks import check_int, fail
from mok.routing import check_topk_idx
from mok.schedule import Schedule, make_schedule, max_num_rows

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
CACHE = REPO / ".cache" / "torch_extensions"
ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a"]
BLOCK_SIZE = 32  # MXFP8 elements per scale (mok.mxfp8.BLOCK_SIZE)


# ---- build --------------------------------------------------------------------------------------


def csrc_hash() -> str:
    """Short hash of every file under csrc/ (paths and contents): part of the extension's name."""
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(CSRC)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def require_hopper() -> None:
    """Raise a clear error unless the current CUDA device is a Hopper GPU (compute capability 9.0)."""
    if not torch.cuda.is_available():
        raise RuntimeError("mok.ops: the csrc kernels need a Hopper GPU (sm_90a), but torch sees no CUDA "
                           f"device (torch {torch.__version__}, torch.version.cuda={torch.version.cuda}); "
                           "use the L0/L1 levels on this machine")
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):
        name = torch.cuda.get_device_name()
        raise RuntimeError(f"mok.ops: the csrc kernels are built for Hopper (sm_90a, compute capability 9.0), "
                           f"got {name} with compute capability {capability[0]}.{capability[1]}")


@functools.cache
def load_extension():
    """Build (or load from .cache/) and return the compiled extension module."""
    require_hopper()
    from torch.utils.cpp_extension import load

    name = f"mok_ext_{csrc_hash()}"
    build_dir = CACHE / name
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [CSRC / "bindings.cpp", *sorted(CSRC.glob("*.cu"))]
    return load(
        name=name,
        sources=[str(s) for s in sources],
        extra_include_paths=[str(CSRC / "include")],
        extra_cflags=["-O3"],
        # ARCH_FLAGS given explicitly: torch then adds no arch flags of its own (no plain sm_90 pass).
        extra_cuda_cflags=["-O3", "-lineinfo", "--ftz=false", "--prec-div=true", *ARCH_FLAGS],
        build_directory=str(build_dir),
        verbose=os.environ.get("MOK_VERBOSE_BUILD", "0") == "1",
    )


# ---- input checks -------------------------------------------------------------------------------


def _check_cuda_tensor(name: str, t, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype != dtype:
        fail(name, f"dtype {dtype}", t.dtype)
    if t.dim() not in (2, 3):
        fail(name, "a 2D [rows, cols] or 3D [experts, rows, cols] tensor", f"shape {tuple(t.shape)}")
    if t.device.type != "cuda":
        fail(name, "a CUDA tensor", f"device {t.device}")
    if not t.is_contiguous():
        fail(name, "a contiguous tensor (call .contiguous())", f"strides {t.stride()}")
    if t.data_ptr() % 16 != 0:
        fail(name, "a 16-byte aligned data pointer (a view with a storage offset is not)",
              f"address {t.data_ptr():#x}")


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


# ---- MXFP8 ---------------------------------------------------------------------------------------


def mxfp8_quantize_rowwise(x: torch.Tensor, variant: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along dim -1. Returns data float8_e4m3fn (x.shape), scales uint8 [..., cols // 32]."""
    _check_cuda_tensor("x", x, torch.bfloat16)
    _check_blocks("x", tuple(x.shape), rowwise=True, colwise=False)
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)  # x.shape
    scales = torch.empty(_scales_shape(tuple(x.shape), -1), dtype=torch.uint8, device=x.device)  # [..., cols / 32]
    load_extension().mxfp8_quantize_rowwise(x, data, scales, variant)
    return data, scales


def mxfp8_quantize_colwise(x: torch.Tensor, variant: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of 32 along dim -2. Returns data float8_e4m3fn (x.shape), scales uint8 [..., rows // 32, cols]."""
    _check_cuda_tensor("x", x, torch.bfloat16)
    _check_blocks("x", tuple(x.shape), rowwise=False, colwise=True)
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)  # x.shape
    # [..., rows / 32, cols]
    scales = torch.empty(_scales_shape(tuple(x.shape), -2), dtype=torch.uint8, device=x.device)
    load_extension().mxfp8_quantize_colwise(x, data, scales, variant)
    return data, scales


def mxfp8_quantize_dual(x: torch.Tensor, variant: int = 0):
    """Row-wise and column-wise quantization from one read of x:
    ((data_row, scales_row), (data_col, scales_col)), each equal to the single-direction op's output."""
    _check_cuda_tensor("x", x, torch.bfloat16)
    _check_blocks("x", tuple(x.shape), rowwise=True, colwise=True)
    shape = tuple(x.shape)
    data_row = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)  # x.shape
    scales_row = torch.empty(_scales_shape(shape, -1), dtype=torch.uint8, device=x.device)  # [..., cols / 32]
    data_col = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)  # x.shape
    scales_col = torch.empty(_scales_shape(shape, -2), dtype=torch.uint8, device=x.device)  # [..., rows / 32, cols]
    load_extension().mxfp8_quantize_dual(x, data_row, scales_row, data_col, scales_col, variant)
    return (data_row, scales_row), (data_col, scales_col)


def mxfp8_dequantize(data: torch.Tensor, scales: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """q * 2^e rounded to bf16 (NaN for a 0xFF scale); dim = -1 (row-wise scales) or -2 (column-wise)."""
    _check_cuda_tensor("data", data, torch.float8_e4m3fn)
    _check_cuda_tensor("scales", scales, torch.uint8)
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
    load_extension().mxfp8_dequantize(data, scales, out, rowwise)
    return out


# ---- grouped BF16 GEMMs over the route schedule (L2 building blocks, docs/l2_fused.md) ------------------
# Rows follow mok.schedule (expert-major segments padded to the schedule's block_m, which must be a
# multiple of the kernels' 128-row tile). Outputs stay in that row layout. Bitwise deterministic: every
# output is one fp32 sum over the full K in a fixed order, whatever `num_sms` (the persistent grid size;
# None = the device's SM count).

GEMM_BLOCK_M = 128  # rows per kernel tile: BLOCK_M of csrc/include/mok/gemm/grouped_gemm_bf16.cuh
GEMM_K_ALIGN = 8  # k and n multiples of 8 elements: 16-byte rows for TMA and cp.async


def gemm_schedule_tensors(sched, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The schedule as the GEMM kernels read it, on `device`: (row_to_token int32 [num_rows],
    tile_to_expert int32 [num_rows / 128], one entry per 128-row kernel tile)."""
    if sched.block_m % GEMM_BLOCK_M:
        fail("sched", f"block_m a multiple of {GEMM_BLOCK_M} (make_schedule(..., block_m=128), the default)",
              f"block_m={sched.block_m}")
    row_to_token = sched.row_to_token.to(device=device, dtype=torch.int32).contiguous()  # [num_rows]
    tile_to_expert = sched.tile_to_expert.to(device=device, dtype=torch.int32)  # [num_tiles]
    tile_to_expert = tile_to_expert.repeat_interleave(sched.block_m // GEMM_BLOCK_M)  # [num_rows / 128]
    return row_to_token, tile_to_expert.contiguous()


def _check_shape(name: str, t, expected: tuple, what: str) -> None:
    """dtype bf16 and shape `expected` (None = any size), before any device check (CPU-testable)."""
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype != torch.bfloat16:
        fail(name, "dtype torch.bfloat16", t.dtype)
    if t.dim() != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        want = ", ".join("*" if e is None else str(e) for e in expected)
        fail(name, f"shape {what} = [{want}]", f"shape {tuple(t.shape)}")


def _check_gemm_dim(name: str, size: int, what: str) -> None:
    if size < GEMM_K_ALIGN or size % GEMM_K_ALIGN:
        fail(name, f"{what} a positive multiple of {GEMM_K_ALIGN}", size)


def _check_num_sms(num_sms) -> int:
    if num_sms is None:
        return 0
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        fail("num_sms", "None or an int >= 1", repr(num_sms))
    return num_sms


def _check_limit(swiglu_limit) -> None:
    if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float)) and swiglu_limit == swiglu_limit):
        fail("swiglu_limit", "None or a float (not NaN)", repr(swiglu_limit))


def _check_devices(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        _check_cuda_tensor(name, t, torch.bfloat16)
        if t.device != device:
            fail(name, f"device {device} (the first operand's)", t.device)


def grouped_gemm_bf16_swiglu_gather(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, sched,
                                    swiglu_limit: float | None = None, num_sms: int | None = None):
    """GEMM1 of the routed experts with fused dispatch and SwiGLU, in the schedule's row layout:
    for row r with token t = row_to_token[r] and expert e, gate[r] = bf16(x[t]·w_gate[e]ᵀ),
    up[r] = bf16(x[t]·w_up[e]ᵀ), h[r] = bf16(swiglu(gate[r], up[r], swiglu_limit)) (mok.reference);
    padding rows are zeros. x [num_tokens, hidden]; w_gate, w_up [num_experts, intermediate, hidden];
    hidden and intermediate multiples of 8. Returns (h, gate, up), bf16 [num_rows, intermediate] each."""
    _check_shape("x", x, (sched.num_tokens, None), "[num_tokens, hidden]")
    hidden = x.shape[1]
    _check_gemm_dim("x", hidden, "hidden (dim 1)")
    _check_shape("w_gate", w_gate, (sched.num_experts, None, hidden), "[num_experts, intermediate, hidden]")
    intermediate = w_gate.shape[1]
    _check_gemm_dim("w_gate", intermediate, "intermediate (dim 1)")
    _check_shape("w_up", w_up, tuple(w_gate.shape), "[num_experts, intermediate, hidden] (w_gate's)")
    _check_limit(swiglu_limit)
    sms = _check_num_sms(num_sms)
    _check_devices(x.device, x=x, w_gate=w_gate, w_up=w_up)
    row_to_token, tile_to_expert = gemm_schedule_tensors(sched, x.device)  # [num_rows], [num_rows / 128]
    h, gate, up = (torch.empty(sched.num_rows, intermediate, dtype=torch.bfloat16, device=x.device)
                   for _ in range(3))  # [num_rows, intermediate] each
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    load_extension().grouped_gemm_bf16_swiglu_gather(x, w_gate, w_up, row_to_token, tile_to_expert, h, gate, up,
                                                     limit, swiglu_limit is not None, sms)
    return h, gate, up


def grouped_gemm_bf16_nt_contiguous(a_rows: torch.Tensor, w: torch.Tensor, sched,
                                    num_sms: int | None = None) -> torch.Tensor:
    """GEMM2 of the routed experts, a plain grouped GEMM over the schedule's rows (no gather):
    out_rows[r] = bf16(a_rows[r]·w[e]ᵀ), e = the expert of row r's segment; padding rows are zeros.
    a_rows [num_rows, k]; w [num_experts, n, k]; k and n multiples of 8. Returns bf16 [num_rows, n]."""
    _check_shape("a_rows", a_rows, (sched.num_rows, None), "[num_rows, k]")
    k = a_rows.shape[1]
    _check_gemm_dim("a_rows", k, "k (dim 1)")
    _check_shape("w", w, (sched.num_experts, None, k), "[num_experts, n, k]")
    _check_gemm_dim("w", w.shape[1], "n (dim 1)")
    sms = _check_num_sms(num_sms)
    _check_devices(a_rows.device, a_rows=a_rows, w=w)
    row_to_token, tile_to_expert = gemm_schedule_tensors(sched, a_rows.device)  # [num_rows], [num_rows / 128]
    out_rows = torch.empty(sched.num_rows, w.shape[1], dtype=torch.bfloat16, device=a_rows.device)  # [num_rows, n]
    load_extension().grouped_gemm_bf16_nt_contiguous(a_rows, w, row_to_token, tile_to_expert, out_rows, sms)
    return out_rows


def grouped_gemm_bf16_dgrad_swiglu(dy_rows: torch.Tensor, w_down: torch.Tensor, gate: torch.Tensor,
                                   up: torch.Tensor, sched, swiglu_limit: float | None = None,
                                   num_sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of the down projection and of SwiGLU, in the schedule's row layout (L0's
    mok.reference.expert_backward): d_h = bf16(dy_rows[r]·w_down[e]), then
    (d_gate[r], d_up[r]) = bf16(swiglu_backward(gate[r], up[r], d_h, swiglu_limit)); padding rows are zeros.
    dy_rows [num_rows, hidden]; w_down [num_experts, hidden, intermediate] (read transposed, no copy);
    gate, up [num_rows, intermediate] as the forward saved them. Returns (d_gate, d_up), bf16 each."""
    _check_shape("dy_rows", dy_rows, (sched.num_rows, None), "[num_rows, hidden]")
    hidden = dy_rows.shape[1]
    _check_gemm_dim("dy_rows", hidden, "hidden (dim 1)")
    _check_shape("w_down", w_down, (sched.num_experts, hidden, None), "[num_experts, hidden, intermediate]")
    intermediate = w_down.shape[2]
    _check_gemm_dim("w_down", intermediate, "intermediate (dim 2)")
    _check_shape("gate", gate, (sched.num_rows, intermediate), "[num_rows, intermediate]")
    _check_shape("up", up, (sched.num_rows, intermediate), "[num_rows, intermediate]")
    _check_limit(swiglu_limit)
    sms = _check_num_sms(num_sms)
    _check_devices(dy_rows.device, dy_rows=dy_rows, w_down=w_down, gate=gate, up=up)
    row_to_token, tile_to_expert = gemm_schedule_tensors(sched, dy_rows.device)  # [num_rows], [num_rows / 128]
    d_gate, d_up = (torch.empty_like(gate) for _ in range(2))  # [num_rows, intermediate] each
    limit = 0.0 if swiglu_limit is None else float(swiglu_limit)
    load_extension().grouped_gemm_bf16_dgrad_swiglu(dy_rows, w_down, gate, up, row_to_token, tile_to_expert, d_gate,
                                                    d_up, limit, swiglu_limit is not None, sms)
    return d_gate, d_up


def grouped_gemm_bf16_dgrad_gate_up(d_gate: torch.Tensor, d_up: torch.Tensor, w_gate: torch.Tensor,
                                    w_up: torch.Tensor, sched, num_sms: int | None = None) -> torch.Tensor:
    """Backward of the gate/up projections in the schedule's row layout: dx_rows[r] =
    bf16(d_gate[r]·w_gate[e] + d_up[r]·w_up[e]), one fp32 sum over K = 2·intermediate (L0 rounds once too);
    padding rows are zeros. d_gate, d_up [num_rows, intermediate]; w_gate, w_up [num_experts, intermediate,
    hidden] (read transposed, no copy). Returns dx_rows bf16 [num_rows, hidden]."""
    _check_shape("d_gate", d_gate, (sched.num_rows, None), "[num_rows, intermediate]")
    intermediate = d_gate.shape[1]
    _check_gemm_dim("d_gate", intermediate, "intermediate (dim 1)")
    _check_shape("d_up", d_up, tuple(d_gate.shape), "[num_rows, intermediate] (d_gate's)")
    _check_shape("w_gate", w_gate, (sched.num_experts, intermediate, None), "[num_experts, intermediate, hidden]")
    _check_gemm_dim("w_gate", w_gate.shape[2], "hidden (dim 2)")
    _check_shape("w_up", w_up, tuple(w_gate.shape), "[num_experts, intermediate, hidden] (w_gate's)")
    sms = _check_num_sms(num_sms)
    _check_devices(d_gate.device, d_gate=d_gate, d_up=d_up, w_gate=w_gate, w_up=w_up)
    row_to_token, tile_to_expert = gemm_schedule_tensors(sched, d_gate.device)  # [num_rows], [num_rows / 128]
    dx_rows = torch.empty(sched.num_rows, w_gate.shape[2], dtype=torch.bfloat16, device=d_gate.device)
    load_extension().grouped_gemm_bf16_dgrad_gate_up(d_gate, d_up, w_gate, w_up, row_to_token, tile_to_expert,
                                                     dx_rows, sms)
    return dx_rows


# ---- fixed-order combine (L2; csrc/include/mok/moe/combine.cuh) ----------------------------------------
# out[t] = bf16(Σ_k w[t,k]·y_rows[route_to_row[t,k]] + shared[t]): fp32, increasing k, then shared; each
# product and sum rounded on its own, so the bits equal mok.reference.combine's (and, without weights, the
# d_x sum of mok.reference.moe_backward). One thread per output element: no atomics, no grid dependence.


def _check_combine_operand(name: str, t, dtype: torch.dtype, expected: tuple, what: str) -> None:
    """dtype(s) and shape, before any device check (CPU-testable); `dtype` may be a tuple of choices."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        fail(name, "dtype " + " or ".join(str(d) for d in dtypes), t.dtype)
    if t.dim() != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        want = ", ".join("*" if e is None else str(e) for e in expected)
        fail(name, f"shape {what} = [{want}]", f"shape {tuple(t.shape)}")


def _check_on_device(name: str, t: torch.Tensor, device: torch.device, vector_rows: bool) -> None:
    """CUDA, on `device`, contiguous; vector_rows: 16-byte aligned (the kernel reads rows in 16 bytes)."""
    if t.device.type != "cuda":
        fail(name, "a CUDA tensor", f"device {t.device}")
    if t.device != device:
        fail(name, f"device {device} (y_rows')", t.device)
    if not t.is_contiguous():
        fail(name, "a contiguous tensor (call .contiguous())", f"strides {t.stride()}")
    if vector_rows and t.data_ptr() % 16 != 0:
        fail(name, "a 16-byte aligned data pointer (a view with a storage offset is not)",
              f"address {t.data_ptr():#x}")


def combine_rows(y_rows: torch.Tensor, route_to_row: torch.Tensor, topk_weights: torch.Tensor | None = None,
                 shared: torch.Tensor | None = None, check_rows: bool = True) -> torch.Tensor:
    """Fixed-order combine of per-route rows into tokens: out [num_tokens, hidden] bf16 with
    out[t] = bf16(Σ_k topk_weights[t,k]·y_rows[route_to_row[t,k]] + shared[t]) in fp32, increasing k.

    y_rows bf16 [num_rows, hidden] (hidden % 8 == 0); route_to_row int64 or int32 [num_tokens, num_topk]
    (a schedule's `route_to_row`); topk_weights fp32 [num_tokens, num_topk] or None (weights 1: the d_x sum
    of the backward); shared bf16 [num_tokens, hidden] or None. check_rows: verify every row id is in
    [0, num_rows) (one host sync); without the check, a bad id gives NaN for its token, never a stray read."""
    _check_combine_operand("y_rows", y_rows, torch.bfloat16, (None, None), "[num_rows, hidden]")
    num_rows, hidden = y_rows.shape
    if hidden % GEMM_K_ALIGN:
        fail("y_rows", f"hidden (dim 1) a multiple of {GEMM_K_ALIGN} (16-byte rows)", hidden)
    _check_combine_operand("route_to_row", route_to_row, (torch.int64, torch.int32), (None, None),
                           "[num_tokens, num_topk]")
    num_tokens, num_topk = route_to_row.shape
    if topk_weights is not None:
        _check_combine_operand("topk_weights", topk_weights, torch.float32, (num_tokens, num_topk),
                               "[num_tokens, num_topk] (route_to_row's)")
    if shared is not None:
        _check_combine_operand("shared", shared, torch.bfloat16, (num_tokens, hidden), "[num_tokens, hidden]")
    operands = {"y_rows": (y_rows, True), "route_to_row": (route_to_row, False),
                "topk_weights": (topk_weights, False), "shared": (shared, True)}
    for name, (t, vector_rows) in operands.items():
        if t is not None:
            _check_on_device(name, t, y_rows.device, vector_rows)
    if check_rows and route_to_row.numel():
        low, high = int(route_to_row.min()), int(route_to_row.max())  # host sync
        if low < 0 or high >= num_rows:
            fail("route_to_row", f"row ids in [0, {num_rows}) (y_rows has {num_rows} rows)", f"ids in [{low}, {high}]")
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=y_rows.device)  # [num_tokens, hidden]
    load_extension().combine_rows(y_rows, route_to_row, topk_weights, shared, out)
    return out


# ---- route schedule on the device (csrc/include/mok/moe/schedule.cuh) -----------------------------------
# make_schedule_cuda = mok.schedule.make_schedule in three integer-only launches (counts per chunk of 1024
# routes, a scan per expert, placement + row fill) and ONE host sync: the row arrays are allocated for
# max_num_rows (no routing needs more), the kernels write the first num_rows entries, and a single read of
# [num_rows, bad ids] at the end sizes the returned views. Every field is bitwise make_schedule's.

SCHEDULE_MAX_EXPERTS = 4096  # kScheduleMaxExperts (mok/api.h): per-warp expert cursors in shared memory
_ALIGN = 256  # bytes: every carved array starts on its own allocation-like boundary


def _carve(dtype: torch.dtype, sizes: dict, device) -> dict:
    """One allocation cut into contiguous 1-D arrays of `sizes[name]` elements, each 256-byte aligned."""
    step = _ALIGN // torch.empty((), dtype=dtype).element_size()
    starts, total = {}, 0
    for name, n in sizes.items():
        starts[name] = total
        total += -(-n // step) * step
    buf = torch.empty(total, dtype=dtype, device=device)  # [total]
    return {name: buf[start:start + sizes[name]] for name, start in starts.items()}


def _check_topk_idx_layout(topk_idx, num_experts: int) -> None:
    """check_topk_idx's type, shape and dtype errors (same text) without its min/max host sync: an empty
    slice passes through its range check; the kernels count ids outside [0, num_experts)."""
    ok_shape = isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2
    check_topk_idx(topk_idx[:0] if ok_shape else topk_idx, num_experts)


def make_schedule_cuda(topk_idx: torch.Tensor, num_experts: int, block_m: int = 128) -> Schedule:
    """mok.schedule.make_schedule on the GPU: the same Schedule, bit for bit (Schedule.equal), same errors.

    topk_idx: int64 CUDA `[num_tokens, num_topk]`, ids in [0, num_experts); duplicates allowed.
    One host sync (reading num_rows and the number of bad ids together). The row arrays are views of
    buffers sized for `max_num_rows` (a few MB at most; no copy). With block_m a multiple of 128 the result
    also carries `gemm_tensors`, what `gemm_schedule_tensors(sched, device)` returns (int32 row_to_token
    [num_rows], tile_to_expert per 128-row tile), written by the same launches; it is not a dataclass
    field, so equality and `Schedule.to` ignore it. Beyond the kernels' limits (num_experts >
    SCHEDULE_MAX_EXPERTS, or max_num_rows >= 2^31) it returns make_schedule's result.
    """
    _check_topk_idx_layout(topk_idx, num_experts)
    check_int("block_m", block_m, 1)
    if topk_idx.device.type != "cuda":
        fail("topk_idx", "a CUDA tensor (mok.schedule.make_schedule runs on any device)", f"device {topk_idx.device}")
    num_tokens, num_topk = topk_idx.shape
    rows = max_num_rows(num_tokens, num_topk, num_experts, block_m)
    if num_experts > SCHEDULE_MAX_EXPERTS or rows >= 2**31:  # beyond the kernels' int32 rows / smem cursors
        return make_schedule(topk_idx, num_experts, block_m)  # the same bits from torch ops
    E, device = num_experts, topk_idx.device
    gemm_tiles = rows // GEMM_BLOCK_M if block_m % GEMM_BLOCK_M == 0 else 0
    v = _carve(torch.int64, {"tokens_per_expert": E, "padded_per_expert": E, "expert_offsets": E + 1,
                             "tile_offsets": E + 1, "route_to_row": num_tokens * num_topk, "row_to_token": rows,
                             "row_to_k": rows, "row_to_route": rows, "row_to_expert": rows,
                             "tile_to_expert": rows // block_m, "tile_num_rows": rows // block_m, "info": 2}, device)
    v32 = _carve(torch.int32, {"row_to_token": rows, "tile_to_expert": gemm_tiles}, device)
    load_extension().make_schedule(
        topk_idx.contiguous(), v["tokens_per_expert"], v["padded_per_expert"], v["expert_offsets"],
        v["tile_offsets"], v["route_to_row"], v["row_to_token"], v["row_to_k"], v["row_to_route"],
        v["row_to_expert"], v["tile_to_expert"], v["tile_num_rows"], v["info"], v32["row_to_token"],
        v32["tile_to_expert"] if gemm_tiles else None, num_experts, block_m)
    num_rows, num_bad = v["info"].tolist()  # the one host sync
    if num_bad:
        check_topk_idx(topk_idx, num_experts)  # raises its error, with the ids' min and max
        raise AssertionError(f"make_schedule_cuda: {num_bad} ids outside [0, {num_experts}) not seen by the check")
    num_tiles = num_rows // block_m
    sched = Schedule(
        num_tokens=num_tokens, num_topk=num_topk, num_experts=num_experts, block_m=block_m, num_rows=num_rows,
        tokens_per_expert=v["tokens_per_expert"], padded_per_expert=v["padded_per_expert"],
        expert_offsets=v["expert_offsets"], row_to_token=v["row_to_token"][:num_rows],
        row_to_k=v["row_to_k"][:num_rows], row_to_route=v["row_to_route"][:num_rows],
        row_to_expert=v["row_to_expert"][:num_rows], route_to_row=v["route_to_row"].view(num_tokens, num_topk),
        tile_offsets=v["tile_offsets"], tile_to_expert=v["tile_to_expert"][:num_tiles],
        tile_num_rows=v["tile_num_rows"][:num_tiles])
    if gemm_tiles:
        sched.gemm_tensors = (v32["row_to_token"][:num_rows], v32["tile_to_expert"][:num_rows // GEMM_BLOCK_M])
    return sched


# ---- routed-gradient prep (csrc/include/mok/moe/route_grads.cuh) -----------------------------------------

ROUTE_GRADS_MAX_TOPK = 1024  # kRouteGradsMaxTopk (mok/api.h): the per-warp partial sums in shared memory


def route_grads_prep(d_out: torch.Tensor, topk_weights: torch.Tensor, y_rows: torch.Tensor,
                     sched: Schedule) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's first step on the schedule's rows, one pass over d_out and y_rows:
    dy_rows [num_rows, hidden] bf16, dy_rows[r] = bf16(fp32(d_out[t]) · w[t, k]) for r's route (t, k), zeros
    in padding rows (bit for bit L0's dy gathered into rows); d_topk_weights [num_tokens, num_topk] fp32,
    Σ_h fp32(d_out[t, h]) · fp32(y_rows[route_to_row[t, k], h]) in a fixed order (not torch's: agrees with
    L0 to a few fp32 roundings, identical bits run to run). d_out bf16 [num_tokens, hidden] (hidden % 8 == 0);
    topk_weights fp32 [num_tokens, num_topk]; y_rows bf16 [num_rows, hidden]; sched from make_schedule(_cuda)
    on their device (its route_to_row is trusted: no host sync; a row id out of range gives NaN)."""
    if not isinstance(sched, Schedule):
        fail("sched", "a mok.schedule.Schedule", type(sched).__name__)
    num_tokens, num_topk = sched.num_tokens, sched.num_topk
    _check_combine_operand("y_rows", y_rows, torch.bfloat16, (sched.num_rows, None), "[num_rows, hidden]")
    hidden = y_rows.shape[1]
    if hidden % GEMM_K_ALIGN:
        fail("y_rows", f"hidden (dim 1) a multiple of {GEMM_K_ALIGN} (16-byte rows)", hidden)
    _check_combine_operand("d_out", d_out, torch.bfloat16, (num_tokens, hidden), "[num_tokens, hidden]")
    _check_combine_operand("topk_weights", topk_weights, torch.float32, (num_tokens, num_topk),
                           "[num_tokens, num_topk]")
    if num_topk > ROUTE_GRADS_MAX_TOPK:
        fail("sched", f"num_topk <= {ROUTE_GRADS_MAX_TOPK}", num_topk)
    operands = {"y_rows": (y_rows, True), "d_out": (d_out, True), "topk_weights": (topk_weights, False),
                "sched.route_to_row": (sched.route_to_row, False), "sched.tile_num_rows": (sched.tile_num_rows, False)}
    for name, (t, vector_rows) in operands.items():
        _check_on_device(name, t, y_rows.device, vector_rows)
    dy_rows = torch.empty(sched.num_rows, hidden, dtype=torch.bfloat16, device=y_rows.device)  # [num_rows, hidden]
    d_topk_weights = torch.empty(num_tokens, num_topk, dtype=torch.float32, device=y_rows.device)  # [T, K]
    load_extension().route_grads_prep(d_out, topk_weights, y_rows, sched.route_to_row, sched.tile_num_rows, dy_rows,
                                      d_topk_weights, sched.block_m)
    return dy_rows, d_topk_weights
