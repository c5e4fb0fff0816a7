"""SonicMoE (Dao-AILab `sonic-moe` 0.1.2.post1, on QuACK/CuTe-DSL) as a benchmark peer: mok's routed experts
(DESIGN: out[t] = Σ_k w[t,k]·(silu(x·Wg[e]ᵀ)·(x·Wu[e]ᵀ))·Wd[e]ᵀ, no shared expert: SonicMoE has none) computed by
`sonicmoe.moe_general_routing_inputs`, differentiable in x, topk_weights and the three expert weights.

sonicmoe is imported only when a peer is built or its version asked for, never at this module's import: the CPU
suite and the machines without the carried wheels (tools/gpu_env.sh) import this module freely.

What SonicMoE takes (read in sonicmoe/functional/__init__.py and quack/gemm_interface.py, 0.1.2.post1 / 0.3.11):
  x              [T, H] bf16
  router_scores  [T·K] fp32: the routing weights themselves; each route's down-projection output is multiplied by
                 its score and summed per token (`_router_forward`); its gradient is the router gradient.
  token_indices  [T·K] int32, SORTED ascending (routes of token t are a contiguous run: the per-token offsets are a
                 searchsorted over it). Token-major flattening of topk_idx gives exactly that.
  expert_indices [T·K] int32, aligned with token_indices; no order needed (SonicMoE sorts by expert itself).
  w1             (2I, H, E), stride order (2, 0, 1): c_fc.permute(1, 2, 0) of a contiguous c_fc [E, 2I, H] whose
                 rows interleave gate and up (row 2j = gate row j, row 2j+1 = up row j): QuACK's gated GEMM reads
                 preact[:, ::2] as the gate and preact[:, 1::2] as the up projection, SwiGLU = silu(gate)·up.
  w2             (H, I, E), stride order (2, 0, 1): c_proj.permute(1, 2, 0) of c_proj [E, H, I], which is mok's w_down
                 as it is: no copy.
  b1, b2         None (no biases).
  E, stream_id   E is re-read from w2; stream_id is unused by this entry point (we pass the current stream's).
  activation     ActivationType.SWIGLU.
  inference      False for training: True skips storing the pre-activations (no backward possible).
It returns (out [T, H] bf16, expert_frequency [E] int32).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from bench.timing import peer_pass

REPO = Path(__file__).resolve().parents[1]
# Where compiled kernels persist between processes (tools/gpu_env.sh exports the same; git-ignored .cache/):
# CuTe-DSL's own file cache (compiled MLIR with its cubin), QuACK's exported .o per kernel, and QuACK's autotuning
# choice per shape (only written when QUACK_CACHE_AUTOTUNING=1; it also keeps the choice fixed across processes).
CACHE_ENV = {
    "CUTE_DSL_CACHE_DIR": str(REPO / ".cache" / "cute_dsl"),
    "QUACK_CACHE_DIR": str(REPO / ".cache" / "quack"),
    "QUACK_CACHE_AUTOTUNING": "1",
}


def _import_sonicmoe():
    """sonicmoe, with the compile caches pointed into the repo unless the caller set them (before cutlass's import:
    CuTe-DSL reads CUTE_DSL_CACHE_DIR once, when cutlass is first imported)."""
    for k, v in CACHE_ENV.items():
        os.environ.setdefault(k, v)
    import sonicmoe

    return sonicmoe


def version() -> str | None:
    """SonicMoE's version if it imports, else None (not installed, or its CuTe-DSL libraries fail to load)."""
    try:
        return _import_sonicmoe().__version__
    except Exception:  # ImportError, or an OSError/RuntimeError from the native libraries
        return None


# --- layouts: pure torch, checked on the CPU by tests/test_sonic_layout.py -----------------------------------------

def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """c_fc [E, 2I, H], contiguous, a new tensor: row 2j = w_gate[:, j], row 2j+1 = w_up[:, j]."""
    E, I, H = w_gate.shape
    return torch.stack((w_gate, w_up), dim=2).reshape(E, 2 * I, H)


def split_gate_up(c_fc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of interleave_gate_up, as strided views: (gate [E, I, H], up [E, I, H]). Applied to c_fc.grad it
    gives d_w_gate and d_w_up, since interleaving is a permutation of rows (its gradient is the same permutation)."""
    return c_fc[:, 0::2], c_fc[:, 1::2]


def sonic_weights(c_fc: torch.Tensor, c_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 (2I, H, E), w2 (H, I, E)): the permuted views SonicMoE takes; autograd carries their gradients back to
    c_fc [E, 2I, H] and c_proj [E, H, I]."""
    return c_fc.permute(1, 2, 0), c_proj.permute(1, 2, 0)


def flat_routes(topk_idx: torch.Tensor, topk_weights: torch.Tensor):
    """(scores [T·K] fp32, a view of topk_weights, so its gradient lands in topk_weights.grad; token_idx [T·K] int32,
    sorted; expert_idx [T·K] int32), route r = t·K + k."""
    T, K = topk_idx.shape
    token_idx = torch.arange(T, device=topk_idx.device, dtype=torch.int32).repeat_interleave(K)
    return topk_weights.view(-1), token_idx, topk_idx.reshape(-1).to(torch.int32)


# --- the peer --------------------------------------------------------------------------------------------------------

class SonicPeer:
    """SonicMoE over one problem's inputs. The conversions (interleaved c_fc, int32 routes, leaf copies) happen here,
    once; `self()` runs one forward (out [T, H] bf16) and builds its graph, like any module's forward.

    Leaves whose .grad the benchmark can read back (after out.backward(d_out)) or that `grads` differentiates:
    x [T, H], topk_weights [T, K] fp32, c_fc [E, 2I, H] (interleaved), c_proj [E, H, I] (= w_down's layout)."""

    def __init__(self, x, topk_idx, topk_weights, w_gate, w_up, w_down, *, inference: bool = False):
        sonicmoe = _import_sonicmoe()
        from sonicmoe.enums import ActivationType

        self._entry, self._swiglu = sonicmoe.moe_general_routing_inputs, ActivationType.SWIGLU
        self.inference = inference
        self.num_experts = w_down.shape[0]
        self.x = x.detach().clone().requires_grad_()
        self.topk_weights = topk_weights.detach().to(torch.float32).contiguous().clone().requires_grad_()
        self.c_fc = interleave_gate_up(w_gate.detach(), w_up.detach()).requires_grad_()
        self.c_proj = w_down.detach().contiguous().clone().requires_grad_()
        _, self.token_idx, self.expert_idx = flat_routes(topk_idx, self.topk_weights)

    def leaves(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.topk_weights, self.c_fc, self.c_proj

    def __call__(self) -> torch.Tensor:
        scores = self.topk_weights.view(-1)  # a view: no copy, and the router gradient flows to topk_weights
        w1, w2 = sonic_weights(self.c_fc, self.c_proj)
        out, _expert_frequency = self._entry(
            self.x, scores, self.token_idx, self.expert_idx, w1, None, w2, None, self.num_experts,
            torch.cuda.current_stream().cuda_stream, self._swiglu, self.inference)
        return out

    def grads(self, out: torch.Tensor, d_out: torch.Tensor, retain_graph: bool = False) -> dict:
        """The gradients in mok's names and layouts (mok.testing.GRAD_NAMES' routed five), through
        torch.autograd.grad: nothing accumulates into .grad, so repeated timed backwards run no extra adds."""
        dx, dw, dc_fc, dc_proj = torch.autograd.grad(out, self.leaves(), d_out, retain_graph=retain_graph)
        d_gate, d_up = split_gate_up(dc_fc)
        return dict(d_x=dx, d_topk_weights=dw, d_w_gate=d_gate, d_w_up=d_up, d_w_down=dc_proj)


def moe_fn(x, topk_idx, topk_weights, w_gate, w_up, w_down, *, inference: bool = False) -> SonicPeer:
    """A callable f() -> out [T, H] bf16 through SonicMoE (see SonicPeer); the inputs are mok's (mok.testing.moe_args'
    first six)."""
    return SonicPeer(x, topk_idx, topk_weights, w_gate, w_up, w_down, inference=inference)


def pass_fn(inputs: dict, pass_: str):
    """A no-argument callable timing one pass ("fwd", "bwd", "fwd+bwd") of SonicMoE on mok.testing.make_inputs'
    dict, routed experts only (its shared expert, if any, is left out: SonicMoE has none). The backward passes
    differentiate x, topk_weights and the weights with autograd.grad (no .grad accumulation)."""
    peer = moe_fn(*(inputs[n] for n in ("x", "topk_idx", "topk_weights", "w_gate", "w_up", "w_down")))
    return peer_pass(peer, inputs["d_out"], pass_)
