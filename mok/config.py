"""Problem shapes and the FLOP convention of DESIGN §8.

Names follow the one grammar of the README glossary: num_tokens, hidden, intermediate,
num_experts, num_topk, shared_intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

PASSES = ("fwd", "bwd", "fwd+bwd")
PRECISIONS = ("bf16", "mxfp8")


@dataclass(frozen=True)
class MoEConfig:
    name: str
    num_tokens: int  # T: tokens on this GPU
    hidden: int  # H: model width
    intermediate: int  # I: routed expert width
    num_experts: int  # E
    num_topk: int  # K: routes per token
    shared_intermediate: int = 0  # shared expert width; 0 = no shared expert

    @property
    def num_routes(self) -> int:
        return self.num_tokens * self.num_topk

    @property
    def has_shared(self) -> bool:
        return self.shared_intermediate > 0

    def flops(self, pass_: str = "fwd") -> float:
        """MoK's convention: fwd = 6·(T_sh + T·K)·H·I (T_sh = T with a shared expert of width I),
        bwd = 2× fwd, fwd+bwd = 3× fwd. A shared expert of another width counts with its own width."""
        if pass_ not in PASSES:
            raise ValueError(f"pass_: expected one of {PASSES}, got {pass_!r}")
        routed = 6.0 * self.num_routes * self.hidden * self.intermediate
        shared = 6.0 * self.num_tokens * self.hidden * self.shared_intermediate
        return (routed + shared) * {"fwd": 1, "bwd": 2, "fwd+bwd": 3}[pass_]

    def scaled(self, **changes) -> "MoEConfig":
        return replace(self, **changes)


# DESIGN §8: one GPU's share ("rank") of an EP=8 deployment, or the whole model on one GPU.
STANDARD_SHAPES: dict[str, MoEConfig] = {
    c.name: c
    for c in (
        MoEConfig("dsv4pro-rank", 2048, 7168, 3072, 48, 6, shared_intermediate=3072),
        MoEConfig("kimi-k2-rank", 4096, 7168, 2048, 48, 8, shared_intermediate=2048),
        MoEConfig("qwen3-30b-a3b", 8192, 2048, 768, 128, 8),
        MoEConfig("qwen3-235b", 32768, 4096, 1536, 128, 8),
    )
}

# The routed experts alone, for peers without a shared expert (SonicMoE): the two standard shapes that have one,
# without it, the two that have none, and olmoe-7b (SonicMoE's paper config; DESIGN §8).
ROUTED_SHAPES: dict[str, MoEConfig] = {
    c.name: c
    for c in (
        MoEConfig("dsv4pro-rank-routed", 2048, 7168, 3072, 48, 6),
        MoEConfig("kimi-k2-rank-routed", 4096, 7168, 2048, 48, 8),
        STANDARD_SHAPES["qwen3-30b-a3b"],
        STANDARD_SHAPES["qwen3-235b"],
        MoEConfig("olmoe-7b", 16384, 2048, 1024, 64, 8),
    )
}

# Small shapes for tests and smoke runs: irregular on purpose (T not a tile multiple, K = 1 and 8).
TINY_SHAPES: dict[str, MoEConfig] = {
    c.name: c
    for c in (
        MoEConfig("tiny", 37, 64, 96, 4, 2, shared_intermediate=64),
        MoEConfig("tiny-noshared", 50, 128, 64, 6, 3),
        MoEConfig("tiny-top1", 29, 64, 32, 3, 1),
        MoEConfig("tiny-top8", 23, 96, 64, 9, 8, shared_intermediate=32),
    )
}


def get_shape(name: str) -> MoEConfig:
    shapes = {**STANDARD_SHAPES, **ROUTED_SHAPES, **TINY_SHAPES}
    if name not in shapes:
        raise ValueError(f"shape: expected one of {sorted(shapes)}, got {name!r}")
    return shapes[name]
