"""Problems and comparisons shared by tests, benchmarks and notebooks.

`make_inputs` draws a fresh MoE problem (never zeros); `fp64_moe` evaluates it in fp64 without
roundings; `rel_err` is DESIGN §9's metric Σ|Δ|/Σ|ref|; `TOLERANCES` names every bound a level is
held to; `saved_nbytes` measures what a forward keeps for its backward.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from mok import routing
from mok.config import MoEConfig
from mok.ep_plan import expert_ranges
from mok.ops.gemm import GEMM_BLOCK_M

# DESIGN §9, keyed by (what is compared, against what).
TOLERANCES = {
    "bf16_vs_l0": 1e-2,  # any level in bf16 vs L0 bf16
    "mxfp8_vs_l0_mxfp8": 1e-2,  # any level in mxfp8 vs L0 mxfp8 (same quantized operands)
    "mxfp8_vs_l0_bf16": 0.1,  # mxfp8 vs the bf16 L0 (MoK's bound)
    "l0_vs_fp64": 1e-2,  # L0 (bf16 between GEMMs) vs an fp64 evaluation without roundings
    # With a swiglu_limit, the bf16 rounding of the saved gate/up flips clamp masks near ±L, and
    # d_x amplifies those sparse jumps (measured: 4.4e-2 at L = 0.5 on tiny-noshared, 1.7e-2 at L = 2).
    "l0_vs_fp64_limit": 6e-2,
}

GRAD_NAMES = ("d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down",
              "d_w_shared_gate", "d_w_shared_up", "d_w_shared_down")


def make_inputs(cfg: MoEConfig, device="cpu", seed: int = 0, skew: float = 0.0,
                routing_fn=None, draw_on="cpu") -> dict:
    """A fresh problem for `cfg`: inputs and weights ~ N(0, 1/fan_in) in bf16, routing with
    Zipf(skew) expert popularity (or `routing_fn(num_tokens, num_experts, num_topk, generator)`),
    and an upstream gradient d_out. Drawn on `draw_on` with a seeded generator, then moved: with the
    default (CPU) the same seed gives the same problem on every device; benchmarks draw on the GPU,
    where the standard shapes' gigabytes of weights take milliseconds instead of minutes."""
    g = torch.Generator(device=draw_on).manual_seed(seed)
    T, H, I, E, K, I_sh = (cfg.num_tokens, cfg.hidden, cfg.intermediate, cfg.num_experts,
                           cfg.num_topk, cfg.shared_intermediate)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=draw_on) * scale).to(torch.bfloat16).to(device)

    if routing_fn is None:
        topk_idx, topk_weights = routing.random_routing(T, E, K, skew=skew, generator=g)
    else:
        topk_idx, topk_weights = routing_fn(T, E, K, g)
    shared = I_sh > 0
    return dict(
        x=randn(T, H),  # [T, H]
        topk_idx=topk_idx.contiguous().to(device),  # [T, K]
        topk_weights=topk_weights.contiguous().to(device),  # [T, K]
        w_gate=randn(E, I, H, scale=1 / math.sqrt(H)),  # [E, I, H]
        w_up=randn(E, I, H, scale=1 / math.sqrt(H)),  # [E, I, H]
        w_down=randn(E, H, I, scale=1 / math.sqrt(I)),  # [E, H, I]
        w_shared_gate=randn(I_sh, H, scale=1 / math.sqrt(H)) if shared else None,  # [I_sh, H]
        w_shared_up=randn(I_sh, H, scale=1 / math.sqrt(H)) if shared else None,  # [I_sh, H]
        w_shared_down=randn(H, I_sh, scale=1 / math.sqrt(I_sh)) if shared else None,  # [H, I_sh]
        d_out=randn(T, H),  # [T, H] upstream gradient
    )


def routing_of(kind: str):
    """A `make_inputs` routing_fn by name, for the kernels' irregular test cases: "random" (None: make_inputs'
    own), "hot" (95% of routes on expert 3), "two" (only experts 1 and 6 get tokens: the others stay empty),
    "balanced" (every expert the same routes, routing.balanced_routing), "rounded" (make_inputs' own draw with every
    expert's routes rounded to the fused level's 128-row tile, routing.round_to_tiles), "tails" (expert e gets a
    full 128-row tile and a tail of 1, 32, 8 or 33 routes, by e mod 4: T·K must be their sum)."""
    if kind == "random":
        return None
    if kind == "hot":
        return lambda T, E, K, g: routing.hot_expert_routing(T, E, K, hot_expert=3, hot_fraction=0.95, generator=g)
    if kind == "two":
        def two(T, E, K, g):
            idx = torch.where(torch.rand(T, K, generator=g) < 0.5, 1, 6)  # [T, K]
            return idx.long(), torch.ones(T, K)
        return two
    if kind == "balanced":
        return lambda T, E, K, g: routing.balanced_routing(T, E, K, generator=g)
    if kind == "rounded":
        return lambda T, E, K, g: routing.random_routing(T, E, K, generator=g, tile=GEMM_BLOCK_M)
    if kind == "tails":
        def tails(T, E, K, g):
            counts = torch.tensor([GEMM_BLOCK_M + (1, 32, 8, 33)[e % 4] for e in range(E)])  # [E]
            if int(counts.sum()) != T * K or int(counts.max()) > T:
                raise ValueError(f"num_tokens: expected T·K = {int(counts.sum())} routes, none over T, got "
                                 f"T = {T}, K = {K}")
            # token t takes the experts at t, t + T, ... of the routes sorted by expert: distinct, as no count > T
            idx = torch.repeat_interleave(torch.arange(E), counts).view(K, T).t()  # [T, K]
            return idx[torch.randperm(T, generator=g, device=g.device).cpu()], torch.ones(T, K)
        return tails
    raise ValueError(f"kind: expected one of 'random', 'hot', 'two', 'balanced', 'rounded', 'tails', got {kind!r}")


def row_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """mok.reference.mm with each output an fp32 torch sum over K of exact products: a row's bits do not depend on
    the other rows or columns, as a GPU tile's do not (CPU BLAS gives a row other bits in another GEMM)."""
    return (a.float().contiguous()[:, None, :] * b.float().contiguous()[None]).sum(-1)  # [m, n]


def fresh_seed() -> int:
    """A new seed per call (tests print it on failure, so a failing draw can be replayed)."""
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def poison_allocator(nbytes: int, byte: int = 0xFF) -> None:
    """Leave `byte` in the blocks the CUDA caching allocator hands out next, so an output a kernel
    forgets to write is never a lucky zero (0xFF: NaN in bf16; 0x55: a finite E4M3 and scale byte)."""
    torch.full((max(nbytes, 1),), byte, dtype=torch.uint8, device="cuda")


def moe_args(inputs: dict) -> tuple:
    """The positional arguments of mok.moe / a level's forward, in order."""
    names = ("x", "topk_idx", "topk_weights", "w_gate", "w_up", "w_down",
             "w_shared_gate", "w_shared_up", "w_shared_down")
    return tuple(inputs[n] for n in names)


def rank_inputs(inputs: dict, split: list) -> list[dict]:
    """make_inputs' problem dealt over len(split) EP ranks, rank s's as a dict of the same names: its split[s]
    tokens in order (x, topk_idx, topk_weights, d_out), its block of experts (w_gate, w_up, w_down: mok.ep_plan's
    expert_ranges) and the shared expert's weights whole."""
    tokens = {n: inputs[n].split(split) for n in ("x", "topk_idx", "topk_weights", "d_out")}
    return [{**inputs, **{n: t[s] for n, t in tokens.items()},
             **{n: inputs[n][g.start: g.stop] for n in ("w_gate", "w_up", "w_down")}}
            for s, g in enumerate(expert_ranges(inputs["w_gate"].shape[0], len(split)))]


def by_rank(ranks: list[dict]) -> tuple[list, list]:
    """(the first six of moe_args as lists by rank, as mok.ep_peer.forward_ranks takes them, d_out by rank)."""
    args = [moe_args(r) for r in ranks]
    return [[a[i] for a in args] for i in range(6)], [r["d_out"] for r in ranks]


def rel_err(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """Σ|actual − ref| / Σ|ref| in fp64 (DESIGN §9); 0 when both are all zero."""
    a, r = actual.double(), ref.double()
    den = r.abs().sum().item()
    num = (a - r).abs().sum().item()
    return num / den if den else (0.0 if num == 0 else math.inf)


def bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same dtype, shape and bytes (NaNs with the same payload compare equal)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def run_level(level, inputs: dict, *, precision="bf16", swiglu_limit=None, **options) -> tuple:
    """Forward and backward of one level module: (out, grads tuple); options: the level's own (its OPTIONS)."""
    out, saved = level.forward(*moe_args(inputs), precision=precision, swiglu_limit=swiglu_limit, **options)
    return out, level.backward(saved, inputs["d_out"])


INPUT_FIELDS = ("x", "topk_idx", "topk_weights", "weights")  # a Saved's references to the layer's own inputs


def _tensors_in(obj):
    """Every tensor reachable from obj through tuples, lists and dataclass attributes (a Schedule's too)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors_in(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for item in vars(obj).values():  # vars, not fields: attributes added later (sched.gemm_tensors) count
            yield from _tensors_in(item)


def saved_nbytes(saved, include_inputs: bool = False) -> int:
    """Bytes of memory a level's saved state (mok.reference.Saved or a subclass) keeps alive: each storage
    under its tensors counted once, whole (a view keeps its whole buffer alive). The layer's inputs (x,
    topk_idx, topk_weights, weights), which autograd keeps anyway, are left out unless include_inputs."""
    def key(t):
        return t.device, t.untyped_storage().data_ptr()

    inputs = () if include_inputs else tuple(getattr(saved, f) for f in INPUT_FIELDS)
    skip = {key(t) for t in _tensors_in(inputs)}
    storages = {}
    for t in _tensors_in(saved):
        if key(t) not in skip:
            storages[key(t)] = t.untyped_storage().nbytes()
    return sum(storages.values())


def twin_level_mismatches(grads, grads0, precision: str) -> list[str]:
    """Which gradients of the `fused` level on its kernels' L0 twins (mok.twins) differ from L0's grads0: each must
    be L0's bits, but the bf16 routed ones, which round in other places (the dgrad on the unweighted d_out rows,
    weighted in the SwiGLU backward; d_topk_weights = ⟨d_out·W_down, h⟩ without y, DESIGN §3) and are held to
    TOLERANCES["bf16_vs_l0"] (as close to fp64 as L0's: 0.85-1.03x its error, median over the tiny shapes)."""
    bad = []
    for name, g, g0 in zip(GRAD_NAMES, grads, grads0):
        if g is None or g0 is None:
            ok = g is None and g0 is None
        elif precision == "bf16" and "shared" not in name:
            ok = bool(torch.isfinite(g).all()) and rel_err(g, g0) <= TOLERANCES["bf16_vs_l0"]
        else:
            ok = bitwise_equal(g, g0)
        bad += [] if ok else [name]
    return bad


def fp64_moe(inputs: dict, swiglu_limit):
    """The same function in fp64 with no intermediate rounding, differentiable by autograd.
    Returns (out, grads in GRAD_NAMES order)."""
    names = ("x", "topk_weights", "w_gate", "w_up", "w_down", "w_shared_gate", "w_shared_up", "w_shared_down")
    leaves = {n: inputs[n].double().requires_grad_() for n in names if inputs[n] is not None}
    x, w = leaves["x"], leaves["topk_weights"]

    def swiglu(g, u):
        if swiglu_limit is not None:
            g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
        return torch.nn.functional.silu(g) * u

    out = torch.zeros_like(x)  # [T, H]
    for k in range(inputs["topk_idx"].shape[1]):
        e = inputs["topk_idx"][:, k]  # [T]
        gate = torch.einsum("th,tih->ti", x, leaves["w_gate"][e])  # [T, I]
        up = torch.einsum("th,tih->ti", x, leaves["w_up"][e])  # [T, I]
        y = torch.einsum("ti,thi->th", swiglu(gate, up), leaves["w_down"][e])  # [T, H]
        out = out + w[:, k, None] * y
    if "w_shared_gate" in leaves:
        h = swiglu(x @ leaves["w_shared_gate"].T, x @ leaves["w_shared_up"].T)  # [T, I_sh]
        out = out + h @ leaves["w_shared_down"].T
    out.backward(inputs["d_out"].double())
    return out.detach(), tuple(leaves[n].grad if n in leaves else None for n in names)
