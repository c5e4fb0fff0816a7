"""mok — Mixture-of-Kittens on Hopper: fused, deterministic MoE training in BF16 and MXFP8."""

from mok.bad_ids import check_errors
from mok.config import STANDARD_SHAPES, TINY_SHAPES, MoEConfig
from mok.layer import LEVELS, MoE, moe
from mok.layouts import join_gate_up, split_gate_up
from mok.mx_cache import mxfp8_weight_cache

__all__ = ["MoE", "moe", "mxfp8_weight_cache", "check_errors", "split_gate_up", "join_gate_up", "LEVELS", "MoEConfig",
           "STANDARD_SHAPES", "TINY_SHAPES"]
__version__ = "0.1.0"
