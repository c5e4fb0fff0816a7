"""Input validation shared by every level: a clear error naming the argument, expected and actual.

Checked once, at the functional op's entry, so that no level can be silently wrong on bad input.
"""

from __future__ import annotations

import torch

from mok.config import PRECISIONS


def fail(name: str, expected: str, actual) -> None:
    """The one error format of mok: `name: expected ..., got ...`."""
    raise ValueError(f"{name}: expected {expected}, got {actual}")


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        fail(name, f"an int in {bound}", value)
    return value


def check_tensor(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    """shape entries may be None (any size)."""
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype != dtype:
        fail(name, f"dtype {dtype}", t.dtype)
    if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        fail(name, f"shape {want}", list(t.shape))
    if t.device != device:
        fail(name, f"device {device} (the device of x)", t.device)
    if not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()}")


def check_topk_idx(topk_idx, num_experts: int) -> torch.Tensor:
    """Raise a clear error unless topk_idx is int64 `[num_tokens, num_topk]` with ids in [0, num_experts)."""
    check_int("num_experts", num_experts, 1)
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx: expected a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx: expected shape [num_tokens, num_topk], got {tuple(topk_idx.shape)}")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx: expected dtype torch.int64, got {topk_idx.dtype}")
    if topk_idx.shape[1] == 0:
        raise ValueError("topk_idx: expected num_topk >= 1, got shape with 0 columns")
    if topk_idx.numel() > 0:
        low, high = int(topk_idx.min()), int(topk_idx.max())
        if low < 0 or high >= num_experts:
            raise ValueError(
                f"topk_idx: expected expert ids in [0, {num_experts}), got values in [{low}, {high}]"
            )
    return topk_idx


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Every id in [0, num_experts): a min/max read, so a host sync on a GPU (mok.bad_ids for the level that
    checks on the device instead)."""
    if topk_idx.numel() and (int(topk_idx.min()) < 0 or int(topk_idx.max()) >= num_experts):
        fail("topk_idx", f"expert ids in [0, {num_experts})",
             f"ids in [{int(topk_idx.min())}, {int(topk_idx.max())}]")


def check_moe_inputs(x, topk_idx, topk_weights, w_gate, w_up, w_down,
                     w_shared_gate=None, w_shared_up=None, w_shared_down=None, *,
                     precision="bf16", swiglu_limit=None, check_ids=True) -> None:
    """DESIGN §3: dtypes, shapes, devices, contiguity, expert-id range (check_ids: a host sync on a GPU),
    precision and limit."""
    if precision not in PRECISIONS:
        fail("precision", f"one of {PRECISIONS}", repr(precision))
    if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float)) and swiglu_limit > 0):
        fail("swiglu_limit", "None or a positive float", repr(swiglu_limit))
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        fail("x", "a 2D tensor [num_tokens, hidden]", getattr(x, "shape", type(x).__name__))
    dev = x.device
    T, H = x.shape
    check_tensor("x", x, torch.bfloat16, (T, H), dev)
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        fail("topk_idx", "a 2D tensor [num_tokens, num_topk]", getattr(topk_idx, "shape", topk_idx))
    K = topk_idx.shape[1]
    check_tensor("topk_idx", topk_idx, torch.int64, (T, K), dev)
    check_tensor("topk_weights", topk_weights, torch.float32, (T, K), dev)
    if not isinstance(w_gate, torch.Tensor) or w_gate.dim() != 3:
        fail("w_gate", "a 3D tensor [num_experts, intermediate, hidden]", getattr(w_gate, "shape", w_gate))
    E, I = w_gate.shape[:2]
    check_tensor("w_gate", w_gate, torch.bfloat16, (E, I, H), dev)
    check_tensor("w_up", w_up, torch.bfloat16, (E, I, H), dev)
    check_tensor("w_down", w_down, torch.bfloat16, (E, H, I), dev)
    if K < 1 or E < 1:
        fail("topk_idx", "num_topk >= 1 and num_experts >= 1", f"num_topk={K}, num_experts={E}")
    if check_ids:
        check_expert_ids(topk_idx, E)

    shared = (w_shared_gate, w_shared_up, w_shared_down)
    if any(w is not None for w in shared):
        if any(w is None for w in shared):
            fail("w_shared_gate/w_shared_up/w_shared_down", "all three or none", "only some")
        if w_shared_gate.dim() != 2:
            fail("w_shared_gate", "a 2D tensor [shared_intermediate, hidden]", list(w_shared_gate.shape))
        I_sh = w_shared_gate.shape[0]
        check_tensor("w_shared_gate", w_shared_gate, torch.bfloat16, (I_sh, H), dev)
        check_tensor("w_shared_up", w_shared_up, torch.bfloat16, (I_sh, H), dev)
        check_tensor("w_shared_down", w_shared_down, torch.bfloat16, (H, I_sh), dev)

    if precision == "mxfp8":
        for name, size in (("hidden", H), ("intermediate", I)):
            if size % 32:
                fail(name, "a multiple of 32 in mxfp8 mode (MX blocks of 32 along K)", size)


def check_layout(name: str, t, dtype, shape: tuple, what: str) -> None:
    """A tensor of `dtype` (or of one of a tuple of dtypes) and `shape` (entries None: any size; `what` names the
    dims, e.g. "[num_rows, hidden]"), on any device: the checks before any device check, so CPU-testable."""
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        fail(name, "dtype " + " or ".join(str(d) for d in dtypes), t.dtype)
    if t.dim() != len(shape) or any(e is not None and s != e for s, e in zip(t.shape, shape)):
        want = ", ".join("*" if e is None else str(e) for e in shape)
        fail(name, f"shape {what} = [{want}]", f"shape {tuple(t.shape)}")


def check_cuda(name: str, t: torch.Tensor, device: torch.device | None = None, owner: str = "",
               contiguous: bool = True, aligned: bool = False) -> None:
    """A CUDA tensor; on `device` (whose tensor `owner` names, e.g. "x's"), contiguous, and with `aligned` a 16-byte
    aligned data pointer (kernels that read rows in 16-byte pieces)."""
    if t.device.type != "cuda":
        fail(name, "a CUDA tensor", f"device {t.device}")
    if device is not None and t.device != device:
        fail(name, f"device {device} ({owner})", t.device)
    if contiguous and not t.is_contiguous():
        fail(name, "a contiguous tensor (call .contiguous())", f"strides {t.stride()}")
    if aligned and t.data_ptr() % 16 != 0:
        fail(name, "a 16-byte aligned data pointer (a view with a storage offset is not)", f"address {t.data_ptr():#x}")


def check_optional_int(name: str, value, low: int) -> int | None:
    """None, or an int >= low (not a bool)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
        fail(name, f"None or an int >= {low}", repr(value))
    return value
