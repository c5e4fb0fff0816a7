"""mok — Mixture-of-Kittens on Hopper: fused, deterministic MoE training in BF16 and MXFP8."""

from mok.config import STANDARD_SHAPES, TINY_SHAPES, MoEConfig
from mok.layer import LEVELS, MoE, moe

__all__ = ["MoE", "moe", "LEVELS", "MoEConfig", "STANDARD_SHAPES", "TINY_SHAPES"]
__version__ = "0.1.0"
