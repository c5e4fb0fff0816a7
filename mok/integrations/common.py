"""What every client's swap does alike (mok.integrations.hf, .torchtitan): check the options and every module found
before touching any, then shadow each module's forward on its instance."""

from __future__ import annotations

import types

from torch import nn

from mok.checks import fail
from mok.config import PRECISIONS
from mok.layer import LEVELS


def swap_forwards(model: nn.Module, found: list, forward, *, backend: str, precision: str, wanted: str, exact: str,
                  unsupported, dims) -> list[str]:
    """Give each (name, module) of `found` the bound `forward`, reading `mok_backend`/`mok_precision` off the module;
    returns the names. Nothing is swapped unless all pass: `found` empty (ValueError naming `wanted` and the model's
    MoE-like module types), `unsupported(module)` a reason (naming `exact`), or in mxfp8 a width of `dims(module)`
    (name, hidden, intermediate) that is no multiple of 32."""
    if backend != "auto" and backend not in LEVELS:
        fail("backend", f"'auto' or one of {list(LEVELS)}", repr(backend))
    if precision not in PRECISIONS:
        fail("precision", f"one of {PRECISIONS}", repr(precision))
    if not found:
        moe_like = sorted({type(m).__name__ for m in model.modules()
                           if "expert" in type(m).__name__.lower() or "moe" in type(m).__name__.lower()})
        fail("model", wanted, f"{type(model).__name__} with MoE-like modules {moe_like or 'none'}")
    for name, m in found:
        if (why := unsupported(m)) is not None:
            fail(f"model.{name}" if name else "model", exact, f"{type(m).__name__} with {why}")
        weight, *sizes = dims(m)
        if precision == "mxfp8" and any(s % 32 for s in sizes):
            fail(f"model.{name}", "hidden and intermediate multiples of 32 for precision='mxfp8'", weight)
    for _, m in found:
        m.mok_backend, m.mok_precision = backend, precision
        m.forward = types.MethodType(forward, m)  # shadows the class's forward on this instance only
    return [name for name, _ in found]
