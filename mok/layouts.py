"""The expert-weight layouts users' models hold, converted to and from mok's separate w_gate, w_up [E, I, H].

A fused gate/up weight w_gate_up [E, 2I, H] comes in two conventions:
    "concat"       rows [gate_0 .. gate_{I-1}, up_0 .. up_{I-1}]   (Hugging Face transformers' gate_up_proj)
    "interleaved"  rows [gate_0, up_0, gate_1, up_1, ...]          (SonicMoE's c_fc)
mok's kernels read w_gate and w_up as two contiguous [E, I, H] tensors, so `split_gate_up` makes them with one copy
per call, through autograd: the gradient comes back into w_gate_up in its own layout. That copy reads and writes the
routed gate/up weights once per forward (its gradient's once per backward): at dsv4pro-rank's 4.2 GB of bf16 gate/up,
a few milliseconds on a Hopper GPU. Hold separate weights (mok.MoE's default) to avoid it.
"""

from __future__ import annotations

import torch

from mok.checks import fail

GATE_UP_LAYOUTS = ("concat", "interleaved")


def _check_layout(layout: str) -> None:
    if layout not in GATE_UP_LAYOUTS:
        fail("layout", f"one of {GATE_UP_LAYOUTS}", repr(layout))


def split_gate_up(w_gate_up: torch.Tensor, layout: str = "concat") -> tuple[torch.Tensor, torch.Tensor]:
    """w_gate_up [E, 2I, H] in `layout` -> (w_gate, w_up), contiguous [E, I, H] each, differentiable."""
    _check_layout(layout)
    if not isinstance(w_gate_up, torch.Tensor) or w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2:
        fail("w_gate_up", "a tensor [num_experts, 2·intermediate, hidden]", list(getattr(w_gate_up, "shape", [])))
    if layout == "concat":
        w_gate, w_up = w_gate_up.chunk(2, dim=1)  # [E, I, H] views
    else:
        w_gate, w_up = w_gate_up[:, 0::2], w_gate_up[:, 1::2]  # [E, I, H] strided views
    return w_gate.contiguous(), w_up.contiguous()


def join_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor, layout: str = "concat") -> torch.Tensor:
    """(w_gate, w_up) [E, I, H] each -> w_gate_up [E, 2I, H] in `layout`: split_gate_up's inverse."""
    _check_layout(layout)
    if layout == "concat":
        return torch.cat([w_gate, w_up], dim=1)  # [E, 2I, H]
    return torch.stack([w_gate, w_up], dim=2).flatten(1, 2)  # [E, I, 2, H] -> [E, 2I, H]: gate, up, gate, ...
