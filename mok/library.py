"""mok's torch.library custom ops: the MoE layer and mok.MoE's router, one code path for eager and torch.compile.

    mok::moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate?, w_shared_up?, w_shared_down?,
                     backend, precision, swiglu_limit?, num_sms?, mx_weights?, check_ids) -> (out, saved[])
    mok::moe_backward(d_out, <those nine tensors>, saved[], backend, precision, swiglu_limit?, num_sms?, mx_weights?)
        -> [d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down (, d_w_shared_gate, d_w_shared_up, d_w_shared_down)]
    mok::softmax_topk_router(x, w_router, num_topk, tile?) -> (topk_idx, topk_weights)
    mok::softmax_topk_router_backward(x, w_router, d_topk_weights, num_topk, tile?) -> [d_x, d_w_router]

A custom op is opaque to Dynamo, which runs its fake (shapes and dtypes) while tracing: inside the ops run, at run
time and as in eager, what Dynamo cannot trace: the level lookup (importlib), the levels' dataclass state, and the
checks that read device values on the host (expert ids in range, finite router logits). Eager calls the same ops:
it pays torch's custom-op dispatch (Python, per call) over the autograd.Function it replaces, and in exchange eager
and compiled run the same code, so their bits agree by construction.

Saved state. A level's forward returns (out, saved), saved a dataclass (mok.reference.Saved or a subclass) holding
tensors, tuples, a mok.schedule.Schedule and options. An op returns tensors only, so moe_forward returns saved's
tensors as a list, `saved[]` (every tensor leaf but the op's own inputs, which autograd saves beside it), and
moe_backward rebuilds the dataclass around them. Where each tensor goes comes from the level's `saved_like`
(mok.levels): the same structure with empty tensors of its forward's shapes and dtypes, built from the inputs' shapes
alone. The fake returns saved_like's tensors; the backward builds it on the meta device and reads the structure.
An op may not return a tensor sharing memory with an input or another output: such leaves (the fused level's
schedule arrays, views of one allocation; its MXFP8 scales, beside their data) are copied, in one foreach copy.

Autograd (register_autograd): the nine inputs and saved[] go through ctx.save_for_backward, so an input modified in
place since the forward raises, retain_graph keeps them and the last backward frees them. moe_backward has an
autograd formula that raises: a create_graph=True backward gives first-order gradients linked to d_out, x and the
weights, and differentiating them raises instead of returning silently missing second-order terms.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import torch
from torch import Tensor

from mok import routing
from mok.checks import check_expert_ids, fail
from mok.levels import get_level, level_options, resolve_backend
from mok.schedule import Schedule

NUM_INPUTS = 9  # x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down


# ---- saved state <-> a list of tensors --------------------------------------------------------------------------

class _Slot(int):
    """A tensor's position in the op's tensors (the nine inputs, then saved[]), standing in for it in a spec."""


@dataclasses.dataclass(frozen=True)
class _Node:
    """A dataclass instance in a spec: its class and its fields' specs."""
    cls: type
    fields: tuple  # ((name, spec), ...)


def _to_spec(value, inputs: tuple, leaves: list, positions: dict | None = None):
    """value with every tensor replaced by its _Slot: one of `inputs` (by identity) by its position there, any other
    tensor by len(inputs) + its position in `leaves`, where it is appended (each leaf its own slot)."""
    if positions is None:
        positions = {id(t): i for i, t in reversed(list(enumerate(inputs))) if t is not None}  # the first if repeated
    if isinstance(value, torch.Tensor):
        if id(value) in positions:
            return _Slot(positions[id(value)])
        leaves.append(value)
        return _Slot(len(inputs) + len(leaves) - 1)
    if isinstance(value, tuple):
        return tuple(_to_spec(v, inputs, leaves, positions) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # fields only: other attributes are caches
        return _Node(type(value), tuple((f.name, _to_spec(getattr(value, f.name), inputs, leaves, positions))
                                        for f in dataclasses.fields(value)))
    return value


def _from_spec(spec, tensors: tuple):
    if isinstance(spec, _Slot):
        return tensors[spec]
    if isinstance(spec, tuple):
        return tuple(_from_spec(v, tensors) for v in spec)
    if isinstance(spec, _Node):
        kw = {name: _from_spec(v, tensors) for name, v in spec.fields}
        if spec.cls is Schedule:  # its row count is its row arrays' length (L1's in mxfp8: known only from them)
            kw["num_rows"] = kw["row_to_token"].shape[0]
        return spec.cls(**kw)
    return spec


def _unaliased(outputs: list, others) -> list:
    """outputs, each one sharing memory with a tensor of `others` or an earlier output replaced by a copy (what an
    op may return); the copies one foreach copy per dtype (one launch each on a GPU: its fast path takes one dtype)."""
    seen = {t.untyped_storage()._cdata for t in others if t is not None}  # torch's own aliasing test
    shared = {}  # dtype -> positions in outputs
    for i, t in enumerate(outputs):
        key = t.untyped_storage()._cdata
        if key in seen:
            shared.setdefault(t.dtype, []).append(i)
        seen.add(key)
    outputs = list(outputs)
    for positions in shared.values():
        copies = [torch.empty_like(outputs[i]) for i in positions]
        torch._foreach_copy_(copies, [outputs[i] for i in positions])
        for i, c in zip(positions, copies):
            outputs[i] = c
    return outputs


def _level(backend: str, x: Tensor, precision: str, num_sms, mx_weights):
    """(level module, its options given) for the arguments of mok.moe."""
    name = resolve_backend(backend, x.device, precision)
    return get_level(name), level_options(name, num_sms=num_sms, mx_weights=mx_weights)


def _saved_spec(level, inputs: tuple, precision: str, swiglu_limit, options: dict):
    """(spec, leaves) of the level's saved_like on the meta device: where each tensor of the op goes in its saved.
    Cached (building it is a meta tensor per saved tensor, before the backward's first launch): it depends on nothing
    but the key, the level's module defaults included (DEFAULT_*, which its saved_like may read: fused's)."""
    defaults = tuple((k, v) for k, v in vars(level).items() if k.startswith("DEFAULT_"))
    shapes = tuple(None if t is None else (tuple(t.shape), t.dtype) for t in inputs)
    return _saved_spec_of(level.__name__, shapes, precision, swiglu_limit, tuple(sorted(options.items())), defaults)


@functools.lru_cache(maxsize=256)
def _saved_spec_of(module: str, shapes: tuple, precision: str, swiglu_limit, options: tuple, defaults: tuple):
    meta = tuple(None if s is None else torch.empty(s[0], dtype=s[1], device="meta") for s in shapes)
    like = importlib.import_module(module).saved_like(*meta, precision=precision, swiglu_limit=swiglu_limit,
                                                      dynamic_size=lambda: 0, **dict(options))
    leaves = []
    return _to_spec(like, meta, leaves), tuple(leaves)


def _check_capturable(level, x: Tensor, check_ids: bool) -> None:
    """Inside a CUDA graph capture only a level that never reads the device on the host can run (NO_HOST_SYNC: the
    fused level, without check=True): another's first host read would invalidate the capture and leave the CUDA
    context unusable, so it raises here first, before any launch."""
    syncs = check_ids or not getattr(level, "NO_HOST_SYNC", False)
    if syncs and x.is_cuda and torch.cuda.is_current_stream_capturing():
        fail("backend", "'fused' with check=False inside a CUDA graph capture (every other level and check=True read "
                        "the device on the host)", f"{level.__name__.rsplit('.', 1)[-1]}, check={check_ids}")


# ---- mok::moe_forward / mok::moe_backward --------------------------------------------------------------------------

@torch.library.custom_op("mok::moe_forward", mutates_args=())
def moe_forward(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                w_shared_gate: Tensor | None, w_shared_up: Tensor | None, w_shared_down: Tensor | None,
                backend: str, precision: str, swiglu_limit: float | None, num_sms: int | None,
                mx_weights: str | None, check_ids: bool) -> tuple[Tensor, list[Tensor]]:
    """The level's forward: (out [T, H] bf16, saved's tensors). check_ids: read the ids' range on the host first (one
    sync on a GPU), which every level without a device check of its own (CHECKS_IDS_ON_DEVICE) always does."""
    inputs = (x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down)
    level, options = _level(backend, x, precision, num_sms, mx_weights)
    _check_capturable(level, x, check_ids)
    if check_ids or not getattr(level, "CHECKS_IDS_ON_DEVICE", False):
        check_expert_ids(topk_idx, w_gate.shape[0])
    out, saved = level.forward(*inputs, precision=precision, swiglu_limit=swiglu_limit, **options)
    leaves = []
    _to_spec(saved, inputs, leaves)
    return out, _unaliased(leaves, (*inputs, out))


@moe_forward.register_fake
def _moe_forward_fake(x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down,
                      backend, precision, swiglu_limit, num_sms, mx_weights, check_ids):
    inputs = (x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down)
    level, options = _level(backend, x, precision, num_sms, mx_weights)
    like = level.saved_like(*inputs, precision=precision, swiglu_limit=swiglu_limit,
                            dynamic_size=torch.library.get_ctx().new_dynamic_size, **options)
    leaves = []
    _to_spec(like, inputs, leaves)
    return x.new_empty(x.shape), leaves


@torch.library.custom_op("mok::moe_backward", mutates_args=())
def moe_backward(d_out: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Tensor,
                 w_down: Tensor, w_shared_gate: Tensor | None, w_shared_up: Tensor | None,
                 w_shared_down: Tensor | None, saved: list[Tensor], backend: str, precision: str,
                 swiglu_limit: float | None, num_sms: int | None, mx_weights: str | None) -> list[Tensor]:
    """The level's backward on the saved state rebuilt from `saved` (moe_forward's): the gradients in
    mok.reference.moe_backward's order, the shared expert's three only when it exists."""
    inputs = (x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down)
    level, options = _level(backend, x, precision, num_sms, mx_weights)
    _check_capturable(level, x, False)
    spec, like = _saved_spec(level, inputs, precision, swiglu_limit, options)
    if len(like) != len(saved) or any(a.dtype != b.dtype or a.dim() != b.dim() for a, b in zip(like, saved)):
        raise RuntimeError(f"mok::moe_backward: {level.__name__}.saved_like declares saved tensors "
                           f"{[(t.dtype, t.dim()) for t in like]} (dtype, dims), its forward saved "
                           f"{[(t.dtype, t.dim()) for t in saved]}")
    with torch.no_grad():
        grads = level.backward(_from_spec(spec, (*inputs, *saved)), d_out.contiguous())
    return _unaliased([g for g in grads if g is not None], (d_out, *inputs, *saved))


@moe_backward.register_fake
def _moe_backward_fake(d_out, x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up,
                       w_shared_down, saved, backend, precision, swiglu_limit, num_sms, mx_weights):
    like = (x, topk_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down)
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like if t is not None]


def _moe_setup_context(ctx, inputs, output):
    _, saved = output
    ctx.save_for_backward(*inputs[:NUM_INPUTS], *saved)
    ctx.options = inputs[NUM_INPUTS:-1]  # backend, precision, swiglu_limit, num_sms, mx_weights (not check_ids)
    ctx.mark_non_differentiable(*saved)
    ctx.set_materialize_grads(False)  # no zero gradients made for saved[]


def _moe_backward(ctx, d_out, _d_saved):
    tensors = ctx.saved_tensors  # raises if an input was modified in place since the forward
    if d_out is None:
        return (None,) * (NUM_INPUTS + 6)
    inputs, saved = tensors[:NUM_INPUTS], list(tensors[NUM_INPUTS:])
    d_x, d_tw, *d_w = torch.ops.mok.moe_backward(d_out, *inputs, saved, *ctx.options)
    d_w += [None] * (6 - len(d_w))  # no shared expert: no gradients for its (None) weights
    return (d_x, None, d_tw, *d_w) + (None,) * 6  # topk_idx and the six options take none


def _keep_nothing(ctx, inputs, output):
    """setup_context of a backward op: its own backward only raises."""


def _no_double_backward(ctx, *_):
    raise RuntimeError("mok.moe: double backward is not supported (its backward is once-differentiable): "
                       "the gradients of a create_graph=True backward through it cannot be differentiated")


moe_forward.register_autograd(_moe_backward, setup_context=_moe_setup_context)
moe_backward.register_autograd(_no_double_backward, setup_context=_keep_nothing)


# ---- mok::softmax_topk_router: mok.MoE's router -------------------------------------------------------------------
# Inside ops so that its bits are eager's under torch.compile too: inductor would fuse the softmax, the normalization
# and the casts around them into kernels of its own, whose bits need not be ATen's. The backward op is autograd's
# formulas for these ops written out (a custom op's body runs below autograd), on the forward's probabilities and
# choice: tests/test_compile.py holds it to autograd's bits.

@torch.library.custom_op("mok::softmax_topk_router", mutates_args=())
def softmax_topk_router(x: Tensor, w_router: Tensor, num_topk: int, tile: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """x [T, H], w_router [E, H] (float dtypes) -> (topk_idx int64 [T, K], topk_weights fp32 [T, K], probs fp32
    [T, E]): routing.softmax_topk of the fp32 logits x·w_routerᵀ, and its softmax (for the backward)."""
    logits = x.float() @ w_router.float().T  # [T, E] fp32
    topk_idx, topk_weights, probs = routing._softmax_topk(logits, num_topk, tile=tile)  # [T, K] x2, [T, E]
    return topk_idx.contiguous(), topk_weights.contiguous(), probs


@softmax_topk_router.register_fake
def _router_fake(x, w_router, num_topk, tile):
    T, E = x.shape[0], w_router.shape[0]
    return (x.new_empty(T, num_topk, dtype=torch.int64), x.new_empty(T, num_topk, dtype=torch.float32),
            x.new_empty(T, E, dtype=torch.float32))


def _mm_backward(grad: Tensor, mat1: Tensor, mat2: Tensor) -> tuple[Tensor, Tensor]:
    """autograd's gradients of mat1 @ mat2 (torch's mm_mat1_backward, mm_mat2_backward): a column-major operand gets
    its gradient from the transposed product, which sums in another order."""
    def column_major(t):
        return t.stride(0) == 1 and t.stride(1) == t.shape[0]

    d_mat1 = mat2.mm(grad.t()).t() if column_major(mat1) else grad.mm(mat2.t())
    d_mat2 = grad.t().mm(mat1).t() if column_major(mat2) else mat1.t().mm(grad)
    return d_mat1, d_mat2


@torch.library.custom_op("mok::softmax_topk_router_backward", mutates_args=())
def softmax_topk_router_backward(x: Tensor, w_router: Tensor, topk_idx: Tensor, probs: Tensor,
                                 d_topk_weights: Tensor, tile: int | None) -> list[Tensor]:
    """[d_x, d_w_router] in x's and w_router's dtypes, autograd's bits through softmax_topk_router's ops."""
    chosen = probs.gather(1, topk_idx)  # [T, K] the weights before normalization (exact copies either way)
    total = chosen.sum(dim=-1, keepdim=True)  # [T, 1]
    # w = chosen / total: d_chosen = d / total + Σ_k -d·((chosen / total) / total), torch's div and sum formulas
    d_chosen = d_topk_weights / total + (-d_topk_weights * ((chosen / total) / total)).sum(dim=-1, keepdim=True)
    d_probs = torch.zeros_like(probs)  # [T, E]
    if tile is None:  # chosen = the sorted probabilities' first K: slice and sort backward, a scatter
        d_probs.scatter_(1, topk_idx, d_chosen)
    else:  # chosen = probs.gather(1, rounded topk_idx): gather backward, a scatter_add (-0.0 + 0 = +0.0)
        d_probs.scatter_add_(1, topk_idx, d_chosen)
    d_logits = torch._softmax_backward_data(d_probs, probs, -1, torch.float32)  # [T, E]
    a, b = x.float(), w_router.float()  # logits = a @ b.T
    d_a, d_bt = _mm_backward(d_logits, a, b.T)  # [T, H], [H, E]
    return [d_a.to(x.dtype), d_bt.t().to(w_router.dtype)]


@softmax_topk_router_backward.register_fake
def _router_backward_fake(x, w_router, topk_idx, probs, d_topk_weights, tile):
    return [torch.empty_like(x), torch.empty_like(w_router)]


def _router_setup_context(ctx, inputs, output):
    x, w_router, _, ctx.tile = inputs
    topk_idx, _, probs = output
    ctx.save_for_backward(x, w_router, topk_idx, probs)
    ctx.mark_non_differentiable(topk_idx, probs)
    ctx.set_materialize_grads(False)


def _router_backward(ctx, _d_idx, d_topk_weights, _d_probs):
    if d_topk_weights is None:
        return None, None, None, None
    d_x, d_w = torch.ops.mok.softmax_topk_router_backward(*ctx.saved_tensors, d_topk_weights, ctx.tile)
    return d_x, d_w, None, None


def _router_no_double_backward(ctx, *_):
    raise RuntimeError("mok.MoE's router: double backward is not supported (its backward is once-differentiable)")


softmax_topk_router.register_autograd(_router_backward, setup_context=_router_setup_context)
softmax_topk_router_backward.register_autograd(_router_no_double_backward, setup_context=_keep_nothing)
