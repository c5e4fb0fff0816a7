"""TorchAO's FP8 rowwise grouped GEMM (`torchao` 0.18.0, `torchao.prototype.moe_training`) as a benchmark peer: the
FP8 baseline that runs on Hopper, beside which mok's MXFP8 rows are read (notebook 04). Hopper has no MX tensor
cores; TorchAO's Hopper recipe for MoE training is FP8 e4m3 with one power-of-two scale per row of each operand
(`_to_fp8_rowwise_then_scaled_grouped_mm`, a differentiable drop-in for `torch._grouped_mm` that quantizes both
operands, runs `torch._scaled_grouped_mm`, and in the backward quantizes the gradients the same way). Its recipe is
coarser than MXFP8 (a scale per row of K elements, not per 32), so the rows also record its error against L0 BF16.

The peer is mok's routed experts (DESIGN §3; no shared expert, as the SonicMoE peer) built from TorchAO's grouped GEMM
and torch ops, differentiable in x, topk_weights, the fused gate/up weight and w_down:

    rows     = x[token of each row]                       [R, H]   expert-major, each segment padded to 16 rows
    gate_up  = fp8_gmm(rows, w_gate_up^T, offs)            [R, 2I]  one grouped GEMM for gate and up
    h        = silu(gate) · up                             [R, I]   BF16
    y_rows   = fp8_gmm(h, w_down^T, offs)                  [R, H]
    out[t]   = bf16(Σ_k w[t,k] · y[row of (t, k)])         [T, H]   fp32 sum, increasing k

Segments are padded to 16 rows with zero rows (mok.schedule, block_m=16) because TorchAO's FP8 grouped GEMM needs
every group's size to be a multiple of 16 (`pad_token_groups_for_grouped_mm=True` is not supported in 0.18.0); a zero
row stays zero through both GEMMs and the SwiGLU, so padding changes no output or gradient.

torchao is imported only when the peer is built or its version asked for, never at this module's import, so the CPU
suite imports this module freely; `grouped_mm` can be any function with the FP8 GEMM's signature (the CPU tests pass a
BF16 one, which checks everything around the GEMM).
"""

from __future__ import annotations

import torch

from bench.timing import peer_pass
from mok import reference
from mok import schedule as sch

NAME = "torchao-fp8"  # the peer's name in `--peers` and its rows' `level`
PRECISION = "fp8_rowwise"  # its rows' `precision`: not mok's MXFP8 recipe; read beside mok's mxfp8 rows
REF_PRECISION = "bf16"  # the L0 its err_vs_l0 is taken against
GROUP_ROWS = 16  # every expert's segment is padded to a multiple of this (TorchAO's FP8 grouped GEMM needs it)


def _torchao_gmm():
    """TorchAO's differentiable FP8 rowwise grouped GEMM, (A [M, K], B_t [E, K, N] column-major, offs [E] int32)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    def gmm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offs, out_dtype=torch.bfloat16,
                                                      pad_token_groups_for_grouped_mm=False)

    return gmm


def version() -> str | None:
    """torchao's version if its FP8 MoE grouped GEMM imports, else None."""
    try:
        import torchao

        _torchao_gmm()
        return torchao.__version__
    except Exception:  # ImportError, or an error from its native libraries or Triton kernels at import
        return None


def unavailable_reason(device=None) -> str | None:
    """Why the peer cannot run here (None when it can): torchao's FP8 grouped GEMM must import, and the GPU must be
    sm_90 (torch's FP8 rowwise `_scaled_grouped_mm` is Hopper's kernel)."""
    if not torch.cuda.is_available():
        return "no CUDA device (TorchAO's FP8 grouped GEMM runs on sm_90)"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"needs an sm_90 GPU, this one is sm_{capability[0]}{capability[1]}"
    if version() is None:
        return "torchao.prototype.moe_training does not import (torchao 0.18.0 is carried in .whl/)"
    return None


def column_major_t(w: torch.Tensor) -> torch.Tensor:
    """w [E, N, K] (nn.Linear's [out, in] per expert), contiguous -> B_t [E, K, N] with strides (N·K, 1, K): the
    per-expert column-major right operand TorchAO's grouped GEMM asserts, as a view (no copy)."""
    return w.transpose(-2, -1)


class TorchaoFp8Peer:
    """mok's routed experts through an FP8 grouped GEMM (TorchAO's by default). Leaves, built once here: x [T, H],
    topk_weights [T, K] fp32, w_gate_up [E, 2I, H] (gate rows first, then up: one GEMM for both), w_down [E, H, I].
    `self()` runs one forward and builds its graph, as a module's forward does: the routing (the schedule, a pure
    function of topk_idx, one host sync as L1's) is recomputed in every call, as a training step must."""

    def __init__(self, x, topk_idx, topk_weights, w_gate, w_up, w_down, *, grouped_mm=None):
        self.gmm = grouped_mm or _torchao_gmm()
        self.num_experts = w_down.shape[0]
        self.topk_idx = topk_idx
        self.x = x.detach().clone().requires_grad_()
        self.topk_weights = topk_weights.detach().to(torch.float32).clone().requires_grad_()
        self.w_gate_up = torch.cat([w_gate.detach(), w_up.detach()], dim=1).requires_grad_()  # [E, 2I, H]
        self.w_down = w_down.detach().contiguous().clone().requires_grad_()  # [E, H, I]

    def leaves(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.topk_weights, self.w_gate_up, self.w_down

    def __call__(self) -> torch.Tensor:
        I = self.w_down.shape[2]
        sched = sch.make_schedule(self.topk_idx, self.num_experts, block_m=GROUP_ROWS)
        offs = sched.expert_offsets[1:].to(torch.int32)  # [E] segment ends, multiples of 16
        rows = sch.gather_rows(self.x, sched)  # [R, H], zero padding rows
        gate_up = self.gmm(rows, column_major_t(self.w_gate_up), offs)  # [R, 2I]
        h = reference.swiglu(gate_up[:, :I], gate_up[:, I:], None).to(torch.bfloat16)  # [R, I]
        y_rows = self.gmm(h, column_major_t(self.w_down), offs)  # [R, H]
        return reference.combine(y_rows[sched.route_to_row], self.topk_weights, None)  # [T, H], increasing k

    def grads(self, out: torch.Tensor, d_out: torch.Tensor, retain_graph: bool = False) -> dict:
        """The gradients in mok's names and layouts (the routed five of mok.testing.GRAD_NAMES), by
        torch.autograd.grad: nothing accumulates into .grad, so repeated timed backwards add nothing extra."""
        dx, dw, dw_gate_up, dw_down = torch.autograd.grad(out, self.leaves(), d_out, retain_graph=retain_graph)
        I = self.w_down.shape[2]
        return dict(d_x=dx, d_topk_weights=dw, d_w_gate=dw_gate_up[:, :I], d_w_up=dw_gate_up[:, I:], d_w_down=dw_down)


def pass_fn(inputs: dict, pass_: str, grouped_mm=None):
    """A no-argument callable timing one pass ("fwd", "bwd", "fwd+bwd") of the peer on mok.testing.make_inputs' dict,
    routed experts only (a shared expert, if any, is left out). Backward passes differentiate x, topk_weights and the
    weights with autograd.grad."""
    peer = TorchaoFp8Peer(*(inputs[n] for n in ("x", "topk_idx", "topk_weights", "w_gate", "w_up", "w_down")),
                          grouped_mm=grouped_mm)
    return peer_pass(peer, inputs["d_out"], pass_)
