"""The ladder (DESIGN §6): level names, which one "auto" picks, and the options each level takes.

Every level is a module with the same functions, so the ladder is one dictionary:
    forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_*, *, precision, swiglu_limit, **options)
        -> (out [T, H] bf16, saved)
    backward(saved, d_out [T, H] bf16) -> (d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_w_shared_*)
    saved_like(<forward's arguments>, dynamic_size) -> what forward's `saved` would be, with empty tensors of its
        shapes and dtypes, from the inputs' shapes alone (mok.library: torch.compile's fake and the backward's spec)
Optional module attributes: PRECISIONS (what it runs), OPTIONS (its keyword options), CHECKS_IDS_ON_DEVICE,
NO_HOST_SYNC (runs inside a CUDA graph capture).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from mok.checks import fail
from mok.config import PRECISIONS

# level name -> module implementing forward/backward/saved_like
LEVELS = {
    "reference": "mok.reference",  # L0
    "torch": "mok.torch_native",  # L1
    "fused": "mok.fused",  # L2 (Hopper kernels; bf16)
    "megakernel": "mok.megakernel",  # L3 at EP = 1: each pass one launch of a chain kernel
}
# Run only on sm_90 (Hopper); "auto" tries them in this order, the fastest measured first. The megakernel gives the
# fused level's bits and has not been measured faster (docs/megakernel.md): it runs by name only.
HOPPER_LEVELS = ("fused",)


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


@functools.cache
def _built(name: str) -> bool:
    """Whether level `name`'s module exists: asked once per process (a search of the package for a missing module
    costs tens to hundreds of µs, and every call of mok.moe resolves its level twice)."""
    return importlib.util.find_spec(LEVELS[name]) is not None


def _lists(name: str, attr: str, value, default=()) -> bool:
    """Whether level `name` is built and its `attr` (PRECISIONS, OPTIONS; `default` where it has none) holds `value`."""
    return _built(name) and value in getattr(get_level(name), attr, default)


def resolve_backend(backend: str, device: torch.device, precision: str = "bf16") -> str:
    """"auto" picks the first of HOPPER_LEVELS that exists and runs `precision` on `device` (an sm_90 GPU only);
    L1 ("torch") everywhere else."""
    if backend == "auto":
        if _is_hopper(device):
            for name in HOPPER_LEVELS:
                if _lists(name, "PRECISIONS", precision, PRECISIONS):
                    return name
        return "torch"
    if backend not in LEVELS:
        raise ValueError(f"backend: expected 'auto' or one of {list(LEVELS)}, got {backend!r}")
    if not _built(backend):
        raise NotImplementedError(f"backend: level {backend!r} is not built yet; use 'reference' or 'torch'")
    return backend


def get_level(backend: str):
    return importlib.import_module(LEVELS[backend])


def level_options(backend: str, **options) -> dict:
    """The options given (not None), checked against what level `backend` takes (its OPTIONS)."""
    given = {name: value for name, value in options.items() if value is not None}
    takes = getattr(get_level(backend), "OPTIONS", ())
    for name, value in given.items():
        if name not in takes:
            fail(name, f"None for backend {backend!r} (levels that take it: "
                       f"{[n for n in LEVELS if n != backend and _lists(n, 'OPTIONS', name)]})", repr(value))
    return given
