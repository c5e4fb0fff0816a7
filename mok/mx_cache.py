"""Opt-in reuse of the `fused` level's MXFP8 weight round trips across calls (gradient accumulation).

    with mok.mxfp8_weight_cache():          # each routed weight quantized once per direction
        for mb in micro_batches:
            moe(mb).sum().backward()
    optimizer.step()                         # outside: the cache is gone

In precision "mxfp8" the fused level runs every routed weight (w_gate, w_up, w_down) through an MXFP8 round
trip along its K on every call: row-wise (dim -1) in the forward, column-wise (dim -2) in the backward, 4 bytes
moved per weight element each time (mok.fused `_mx`). A round trip is a pure function of the weight's values,
so while the weights do not change (the micro-batches of one optimizer step) it can be computed once: the same
bits, less time, and more memory until the context exits: one bf16 copy of each routed weight per direction,
2x the routed weights' bytes (`nbytes()` says what is held). Both directions come from one read of the weight
(mxfp8_fake_quantize_dual) at its first use, so even one forward + backward inside a context moves 6 bytes per
weight element instead of 8; a forward alone then holds both copies too. With MOK_MX_WEIGHTS=mainloop the
forward's quantized weights (E4M3 data + scales, 1 + 1/32 bytes per element) are cached instead of the row-wise
round trips, and the column-wise ones on their own. Activations, the shared expert and precision "bf16" never
touch the cache.

Inside a context, an entry is keyed by the weight's identity (data_ptr, shape, stride, dtype, device) and what
was computed from it, e.g. ("fake_quantize_dual",), and is valid while
  - the weight's storage is alive (a weak reference: once it is freed, another tensor allocated at the same
    address is a miss, never a stale hit; a freed weight's entry is dropped at the next miss), and
  - the weight's `_version` is the one it was computed at: an in-place update through the tensor or a view of
    it (`w.add_(...)` under no_grad, an optimizer step, `copy_`, `load_state_dict`) bumps it, so the round
    trip is recomputed.
NOTE: a write through `w.data` (`w.data.add_(...)`, `w.data.copy_(...)`) does NOT bump `w._version`: the cache
cannot see it and would keep returning the old values' round trip. That is why the cache exists only inside
a context the user opens around a span where the weights do not change, and never outside one. (Assigning
`w.data = other` moves w to another address: a miss, not a stale hit.) Inference tensors have no version
counter and are never cached.

Nesting: an inner context reuses the outer one's cache, which lives until the outermost context exits. On
exit, normally or by an exception, the store is dropped: the cached tensors are freed (nothing else refers to
them: the GEMMs only read them). Not thread-safe: one store per process, for the thread running the layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["active", "lookup", "mxfp8_weight_cache", "nbytes"]


@dataclass(eq=False)
class _Entry:
    storage: StorageWeakRef  # the weight's storage, weakly: expired = freed, its address may hold another tensor
    version: int  # weight._version when `value` was computed
    value: object  # a tensor or a tuple of tensors, computed from the weight's values


_store: dict | None = None  # key -> _Entry while a context is open; None outside every context
_depth = 0  # contexts open (nesting)


@contextlib.contextmanager
def mxfp8_weight_cache():
    """Inside: the fused level's MXFP8 weight round trips are computed once per weight version and reused
    (see the module docstring for the key, the invalidation rule and its `.data` caveat). Nested contexts
    share the outermost one's store; it is dropped when that one exits."""
    global _store, _depth
    if _store is None:
        _store = {}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _store = None


def active() -> bool:
    """Whether a mxfp8_weight_cache() context is open."""
    return _store is not None


def lookup(weight: torch.Tensor, what: tuple, compute: Callable[[], object]) -> object:
    """compute(), a pure function of weight's values named by `what` (hashable, e.g. ("fake_quantize", -1)):
    inside a context once per weight version, reused after; outside every context simply compute()."""
    if _store is None or weight.is_inference():
        return compute()
    key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device, what)
    entry = _store.get(key)
    if entry is not None and not entry.storage.expired() and entry.version == weight._version:
        return entry.value
    _store.pop(key, None)  # a stale value goes before its successor is computed: never both in memory
    for k in [k for k, e in _store.items() if e.storage.expired()]:  # weights freed since: their values too
        del _store[k]
    value = compute()
    _store[key] = _Entry(StorageWeakRef(weight.untyped_storage()), weight._version, value)
    return value


def nbytes() -> int:
    """Bytes of the values the open cache holds (0 outside every context)."""
    if _store is None:
        return 0
    values = [e.value if isinstance(e.value, tuple) else (e.value,) for e in _store.values()]
    return sum(t.untyped_storage().nbytes() for v in values for t in v)
