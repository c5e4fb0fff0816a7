"""Expert parallelism (EP), the plain-PyTorch reference of L4: dispatch and combine over
torch.distributed all-to-all, for any number of ranks (gloo on CPU, NCCL on GPU); the local experts by L0 or by
any level (`backend`: "fused" on Hopper GPUs is NCCL + mok's kernels).

World of R ranks. Experts are split contiguously: rank r owns experts [r·E/R, (r+1)·E/R). Every rank
holds its own tokens (x_local [T_r, H], topk_idx_local with GLOBAL expert ids); the global token
order is (rank, local token). Each route (t, k) sends the BF16 row x[t] to the expert's owner.

Determinism across EP degrees: the sender packs its routes expert-major, (t, k) ascending; the
receiver takes the blocks in source-rank order and regroups them per local expert. Since global
token order is (rank, local token), each expert then sees exactly the rows, in exactly the order,
of the single-process schedule (DESIGN §5), and L0's expert math gives identical bits.

Design note and measured choices: docs/ep.md. Launcher for tests and notebooks: `run_local_ep`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mok._ep_worker import run_local_ep  # noqa: F401  (re-exported: the launcher lives beside its worker)
from mok.checks import check_tensor, fail
from mok.config import PRECISIONS
from mok.levels import get_level, resolve_backend

BF16 = torch.bfloat16


# --- partition and byte model ---------------------------------------------------------------------

def num_local_experts(num_experts: int, world_size: int) -> int:
    """E/R, with a clear error when the experts do not split evenly over the ranks."""
    if world_size < 1:
        fail("world_size", "a positive number of ranks", world_size)
    if num_experts < 1 or num_experts % world_size:
        fail("num_experts", f"a positive multiple of the world size {world_size}", num_experts)
    return num_experts // world_size


def bytes_per_row(hidden: int, precision: str = "bf16") -> int:
    """Payload of one dispatched row: bf16 2·H; mxfp8 H E4M3 bytes + H/32 E8M0 scales."""
    if precision == "bf16":
        return 2 * hidden
    if precision == "mxfp8":
        if hidden % 32:
            fail("hidden", "a multiple of 32 for an mxfp8 payload", hidden)
        return hidden + hidden // 32
    fail("precision", f"one of {PRECISIONS}", repr(precision))


def rows_per_rank(topk_idx_local: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """int64 [R]: routes this rank sends to each rank (its own included)."""
    e_local = num_local_experts(num_experts, world_size)
    flat = topk_idx_local.flatten().cpu()  # [T_r·K]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        fail("topk_idx_local", f"global expert ids in [0, {num_experts})",
              f"ids in [{int(flat.min())}, {int(flat.max())}]")
    return torch.bincount(flat // e_local, minlength=world_size)  # [R]


def dispatch_bytes(topk_idx_local, num_experts: int, world_size: int, rank: int, hidden: int,
                   precision: str = "bf16", *, include_local: bool = False) -> int:
    """Bytes this rank puts on the wire in dispatch (one row per route; rows to itself excluded
    unless include_local). Combine sends the same rows back, always in BF16 (DESIGN §4)."""
    rows = rows_per_rank(topk_idx_local, num_experts, world_size)  # [R]
    if not include_local:
        rows[rank] = 0
    return int(rows.sum()) * bytes_per_row(hidden, precision)


def ep_traffic(topk_idx: torch.Tensor, num_experts: int, world_size: int, hidden: int,
               tokens_per_rank: list[int] | None = None) -> list[dict]:
    """Tidy rows {rank, direction, precision, routes, token_rows, bytes, bytes_dedup} for a global
    topk_idx [T, K] split over ranks (evenly, or by tokens_per_rank). `bytes` counts one row per
    off-rank route, as this reference sends; `bytes_dedup` one row per (token, destination rank)
    pair, as a kernel that sends a token once per rank and fans it out there would."""
    T = topk_idx.shape[0]
    if tokens_per_rank is None:
        tokens_per_rank = [T // world_size + (r < T % world_size) for r in range(world_size)]
    if len(tokens_per_rank) != world_size or sum(tokens_per_rank) != T:
        fail("tokens_per_rank", f"{world_size} counts summing to {T}", tokens_per_rank)
    e_local = num_local_experts(num_experts, world_size)
    out = []
    for r, chunk in enumerate(topk_idx.cpu().split(tokens_per_rank)):
        dest = chunk // e_local  # [T_r, K] destination rank of every route
        remote = dest != r  # [T_r, K]
        routes = int(remote.sum())
        onehot = torch.zeros(chunk.shape[0], world_size, dtype=torch.bool)  # [T_r, R]
        onehot.scatter_(1, dest, True)
        onehot[:, r] = False
        token_rows = int(onehot.sum())
        for direction, precs in (("dispatch", PRECISIONS), ("combine", ("bf16",))):
            for p in precs:
                out.append({"rank": r, "direction": direction, "precision": p, "routes": routes,
                            "token_rows": token_rows, "bytes": routes * bytes_per_row(hidden, p),
                            "bytes_dedup": token_rows * bytes_per_row(hidden, p)})
    return out


# --- dispatch and combine -------------------------------------------------------------------------

@dataclass
class DispatchState:
    """Everything combine (and the backward) needs to send rows back where they came from."""
    x_recv: torch.Tensor  # [N_recv, H] received rows, expert-major, ascending (global token, k)
    num_tokens_per_expert: list[int]  # [E/R] rows of each local expert, in x_recv order
    send_order: torch.Tensor  # [T_r·K] route ids t·K + k in the order they were sent
    send_splits: list[int]  # [R] rows sent to each rank
    recv_splits: list[int]  # [R] rows received from each rank
    recv_perm: torch.Tensor  # [N_recv] received (source-major) row of each expert-major row
    num_tokens: int  # T_r
    num_topk: int  # K
    group: object  # the process group


def _check_dispatch_inputs(x_local, topk_idx_local, num_experts, world_size) -> None:
    num_local_experts(num_experts, world_size)
    if not isinstance(x_local, torch.Tensor) or x_local.dim() != 2:
        fail("x_local", "a 2D tensor [num_tokens, hidden]", getattr(x_local, "shape", type(x_local)))
    T, H = x_local.shape
    check_tensor("x_local", x_local, BF16, (T, H), x_local.device)
    if not isinstance(topk_idx_local, torch.Tensor) or topk_idx_local.dim() != 2:
        fail("topk_idx_local", "a 2D tensor [num_tokens, num_topk]", getattr(topk_idx_local, "shape", None))
    check_tensor("topk_idx_local", topk_idx_local, torch.int64, (T, None), x_local.device)
    if topk_idx_local.numel() and (int(topk_idx_local.min()) < 0 or int(topk_idx_local.max()) >= num_experts):
        fail("topk_idx_local", f"global expert ids in [0, {num_experts})",
              f"ids in [{int(topk_idx_local.min())}, {int(topk_idx_local.max())}]")


def _to_experts(send_rows: torch.Tensor, state: DispatchState) -> torch.Tensor:
    """[N_send, H] rows in send order -> [N_recv, H] on the owners, expert-major."""
    recv = send_rows.new_empty(sum(state.recv_splits), send_rows.shape[1])  # [N_recv, H] source-major
    dist.all_to_all_single(recv, send_rows.contiguous(), state.recv_splits, state.send_splits,
                           group=state.group)
    return recv[state.recv_perm]  # [N_recv, H] expert-major


def _from_experts(rows: torch.Tensor, state: DispatchState) -> torch.Tensor:
    """[N_recv, H] expert-major rows -> [T_r·K, H] indexed by route id t·K + k on the token's owner."""
    src_major = torch.empty_like(rows)  # [N_recv, H]
    src_major[state.recv_perm] = rows
    back = rows.new_empty(sum(state.send_splits), rows.shape[1])  # [T_r·K, H] in send order
    dist.all_to_all_single(back, src_major, state.send_splits, state.recv_splits, group=state.group)
    out = torch.empty_like(back)  # [T_r·K, H] route order
    out[state.send_order] = back
    return out


def check_ranks_agree(settings: dict, device, group=None) -> None:
    """Raise ValueError on every rank, naming the first of `settings` (name -> value) whose value differs
    between ranks and each rank's value (as repr). A disagreement would otherwise hang a later collective
    (a shared expert on some ranks only), crash it (num_experts) or mix results silently (precision).
    One all_gather of len(settings) x 32 bytes; a repr is compared on its first 32 characters."""
    width = 32
    local = torch.zeros(len(settings), width, dtype=torch.uint8)  # [n, width] each repr, zero-padded
    for i, value in enumerate(settings.values()):
        code = repr(value).encode()[:width]
        local[i, : len(code)] = torch.tensor(list(code), dtype=torch.uint8)
    local = local.to(device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    parts = [p.cpu() for p in parts]
    for i, name in enumerate(settings):
        values = [bytes(p[i].tolist()).rstrip(b"\0").decode() for p in parts]
        if len(set(values)) > 1:
            fail(name, "the same value on every rank", ", ".join(f"{v} on rank {r}" for r, v in enumerate(values)))


def ep_dispatch(x_local: torch.Tensor, topk_idx_local: torch.Tensor, num_experts: int,
                group=None) -> DispatchState:
    """Send x[t] for every route (t, k) to the owner of expert topk_idx_local[t, k]. The ranks check first
    that they agree on num_experts and hidden (check_ranks_agree)."""
    _check_dispatch_inputs(x_local, topk_idx_local, num_experts, dist.get_world_size(group))
    check_ranks_agree({"num_experts": num_experts, "hidden": x_local.shape[1]}, x_local.device, group)
    return _dispatch(x_local, topk_idx_local, num_experts, group)


def _dispatch(x_local, topk_idx_local, num_experts: int, group) -> DispatchState:
    """ep_dispatch on inputs checked, here and across ranks."""
    world_size = dist.get_world_size(group)
    e_local = num_experts // world_size
    T, K = topk_idx_local.shape
    flat = topk_idx_local.flatten()  # [T·K] global expert of each route t·K + k
    # Stable sort: expert-major, ascending (t, k) inside each expert; destinations are contiguous.
    send_order = torch.sort(flat, stable=True).indices  # [T·K]
    counts = torch.bincount(flat, minlength=num_experts)  # [E] = [R, E/R]: rows per (dest, expert)
    recv_counts = torch.empty_like(counts)  # [R, E/R] flattened: rows per (source, local expert)
    dist.all_to_all_single(recv_counts, counts, group=group)
    counts, recv_counts = counts.view(world_size, e_local).cpu(), recv_counts.view(world_size, e_local).cpu()
    # Received rows arrive source-major, then expert, then (t, k); a stable sort by local expert keeps
    # the source order inside each expert, and (source rank, local token) is the global token order.
    expert_of_row = torch.arange(e_local).repeat(world_size).repeat_interleave(recv_counts.flatten())
    state = DispatchState(
        x_recv=x_local.new_empty(0, x_local.shape[1]),
        num_tokens_per_expert=recv_counts.sum(0).tolist(),
        send_order=send_order,
        send_splits=counts.sum(1).tolist(),
        recv_splits=recv_counts.sum(1).tolist(),
        recv_perm=torch.sort(expert_of_row, stable=True).indices.to(x_local.device),  # [N_recv]
        num_tokens=T, num_topk=K, group=group)
    state.x_recv = _to_experts(x_local[send_order // K], state)  # [N_recv, H]
    return state


def ep_combine(y_rows: torch.Tensor, state: DispatchState, topk_weights_local: torch.Tensor,
               shared_local: torch.Tensor | None = None, *, return_routes: bool = False):
    """Send every route's output row home, then out[t] = bf16(Σ_k w[t,k]·y[t,k] + shared[t]) in fp32,
    increasing k (reference.combine). y_rows [N_recv, H] is in state.x_recv's order.
    With return_routes, also returns y [T_r, K, H] (what the backward needs for d_topk_weights)."""
    from mok import reference

    check_tensor("y_rows", y_rows, BF16, tuple(state.x_recv.shape), state.x_recv.device)
    T, K = state.num_tokens, state.num_topk
    check_tensor("topk_weights_local", topk_weights_local, torch.float32, (T, K), y_rows.device)
    y = _from_experts(y_rows, state).view(T, K, y_rows.shape[1])  # [T_r, K, H]
    out = reference.combine(y, topk_weights_local, shared_local)  # [T_r, H]
    return (out, y) if return_routes else out


# --- the EP MoE layer -----------------------------------------------------------------------------

@dataclass
class EPSaved:
    """What ep_moe_forward keeps for ep_moe_backward (the rank-local share of reference.Saved)."""
    state: DispatchState
    x_shared: torch.Tensor  # [T_sh, H] the shared expert's tokens: all ranks' (exact) or this rank's
    token_offset: int  # first row of this rank's tokens in x_shared
    exact_shared: bool
    topk_weights: torch.Tensor  # [T_r, K]
    weights: tuple  # local (w_gate, w_up, w_down) [E/R, ...] and replicated shared (or None) ×3
    backend: str  # the level that ran the local experts (_experts_forward)
    experts: object  # its saved state of the local experts on the received rows
    y: torch.Tensor  # [T_r, K, H] per-route expert outputs, back home
    shared_gate: torch.Tensor | None  # [T_sh, I_sh]
    shared_up: torch.Tensor | None  # [T_sh, I_sh]
    precision: str
    swiglu_limit: float | None


def _check_layer_inputs(x_local, topk_idx_local, topk_weights_local, w_gate_local, w_up_local, w_down_local,
                        shared, precision, swiglu_limit, world_size) -> None:
    if precision not in PRECISIONS:
        fail("precision", f"one of {PRECISIONS}", repr(precision))
    if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float)) and swiglu_limit > 0):
        fail("swiglu_limit", "None or a positive float", repr(swiglu_limit))
    if not isinstance(w_gate_local, torch.Tensor) or w_gate_local.dim() != 3:
        fail("w_gate_local", "a 3D tensor [num_experts / world_size, intermediate, hidden]",
              getattr(w_gate_local, "shape", None))
    e_local, I = w_gate_local.shape[:2]
    _check_dispatch_inputs(x_local, topk_idx_local, e_local * world_size, world_size)
    H, dev = x_local.shape[1], x_local.device
    check_tensor("topk_weights_local", topk_weights_local, torch.float32, tuple(topk_idx_local.shape), dev)
    check_tensor("w_gate_local", w_gate_local, BF16, (e_local, I, H), dev)
    check_tensor("w_up_local", w_up_local, BF16, (e_local, I, H), dev)
    check_tensor("w_down_local", w_down_local, BF16, (e_local, H, I), dev)
    if any(w is None for w in shared) and any(w is not None for w in shared):
        fail("w_shared_gate/w_shared_up/w_shared_down", "all three or none", "only some")
    if precision == "mxfp8" and (H % 32 or I % 32):
        fail("hidden/intermediate", "multiples of 32 in mxfp8 mode", (H, I))


def _all_gather_tokens(t: torch.Tensor, group) -> tuple[torch.Tensor, int]:
    """[T_r, ...] on every rank -> ([T, ...] all ranks' rows in rank order, this rank's first row)."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    n = torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device)  # [1]
    ns = [torch.empty_like(n) for _ in range(world_size)]
    dist.all_gather(ns, n, group=group)
    ns = [int(v) for v in ns]
    padded = t.new_zeros(max(ns), *t.shape[1:])  # [max T_r, ...]: gloo gathers equal sizes only
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:m] for p, m in zip(parts, ns)]), sum(ns[:rank])


def _experts_forward(state: DispatchState, w_gate, w_up, w_down, level_name: str, precision: str, swiglu_limit):
    """The local experts on the received rows through level `level_name` (mok.levels): each row a token with one route,
    to its expert, of weight 1, so the level's out is the rows' y bit for bit (bf16(0 + 1·y) = y) and its backward
    on dy gives their dx and the weight gradients. Each expert's rows are the single-process schedule's, in its
    order (_dispatch), so a level whose GEMM rows do not depend on the other rows (L0's, the fused kernels') gives
    the bits it gives on one process. Returns (y_rows [N_recv, H], the level's saved state)."""
    x = state.x_recv  # [N_recv, H]
    level = get_level(level_name)
    counts = torch.tensor(state.num_tokens_per_expert, device=x.device)  # [E/R]
    expert_of_row = torch.arange(w_gate.shape[0], device=x.device).repeat_interleave(counts)[:, None]  # [N_recv, 1]
    ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)  # [N_recv, 1]
    return level.forward(x, expert_of_row, ones, w_gate, w_up, w_down, precision=precision,
                         swiglu_limit=swiglu_limit)


def ep_moe_forward(x_local, topk_idx_local, topk_weights_local, w_gate_local, w_up_local, w_down_local,
                   w_shared_gate=None, w_shared_up=None, w_shared_down=None, *, precision="bf16",
                   swiglu_limit=None, exact_shared=True, backend="reference",
                   group=None) -> tuple[torch.Tensor, EPSaved]:
    """The MoE layer with EP: out_local [T_r, H] bf16 and the saved state. Routed weights are this
    rank's experts [E/R, ...]. The shared expert is replicated and runs in BF16 (DESIGN §4).
    backend: the level that runs the local experts on the received rows ("reference": L0; "torch"; "fused" on a
    Hopper GPU; "auto"), as mok.moe names them (_experts_forward).

    exact_shared: a GEMM's row results may depend on its number of rows (CPU BLAS and cuBLAS pick
    kernels by M), so the shared expert on T_r rows can differ in a last bit from the single-process
    one on T rows. True (default) all-gathers the tokens and runs it on all T rows: bitwise equal to
    L0 whatever the EP degree, at R× the shared compute. False runs it on the local rows only, as a
    deployment does. Before any collective the ranks check that they agree on every setting (check_ranks_agree).
    """
    from mok import reference

    shared = (w_shared_gate, w_shared_up, w_shared_down)
    world_size = dist.get_world_size(group)
    _check_layer_inputs(x_local, topk_idx_local, topk_weights_local, w_gate_local, w_up_local, w_down_local,
                        shared, precision, swiglu_limit, world_size)
    num_experts, exact_shared = w_gate_local.shape[0] * world_size, bool(exact_shared and w_shared_gate is not None)
    level_name = resolve_backend(backend, x_local.device, precision)
    check_ranks_agree({"num_experts": num_experts, "hidden": x_local.shape[1], "intermediate": w_gate_local.shape[1],
                       "shared_intermediate": 0 if w_shared_gate is None else w_shared_gate.shape[0],
                       "precision": precision, "swiglu_limit": swiglu_limit, "exact_shared": exact_shared,
                       "backend": level_name}, x_local.device, group)
    state = _dispatch(x_local, topk_idx_local, num_experts, group)
    y_rows, experts = _experts_forward(state, w_gate_local, w_up_local, w_down_local, level_name, precision,
                                       swiglu_limit)  # [N_recv, H]

    T = x_local.shape[0]
    x_shared, offset = _all_gather_tokens(x_local, group) if exact_shared else (x_local, 0)  # [T_sh, H]
    shared_out, shared_gate, shared_up = None, None, None
    if w_shared_gate is not None:
        shared_out, shared_gate, shared_up = reference.expert_forward(
            x_shared, *shared, precision="bf16", swiglu_limit=swiglu_limit)  # [T_sh, H]
        shared_out = shared_out[offset: offset + T]  # [T_r, H]
    out, y = ep_combine(y_rows, state, topk_weights_local, shared_out, return_routes=True)
    weights = (w_gate_local, w_up_local, w_down_local, *shared)
    saved = EPSaved(state, x_shared, offset, exact_shared, topk_weights_local, weights, level_name, experts, y,
                    shared_gate, shared_up, precision, swiglu_limit)
    return out, saved


def ep_moe_backward(saved: EPSaved, d_out_local: torch.Tensor) -> tuple:
    """Gradients (d_x_local, d_topk_weights_local, d_w_gate_local, d_w_up_local, d_w_down_local,
    d_w_shared_gate, d_w_shared_up, d_w_shared_down), reference.moe_backward's order.

    dy = bf16(d_out·w) travels the dispatch path, each expert's dx comes back the combine path and is
    summed in increasing k: with backend "reference", routed grads, d_x and d_topk_weights equal the single-process
    bits (another level: its own bits on the same rows).
    Shared weight gradients: with exact_shared, the full gradient over all T tokens (the same on every
    rank, equal to L0's; do not reduce it again); without, this rank's partial over its own tokens
    (reduce over ranks, as data parallelism does)."""
    from mok import reference

    s, st = saved, saved.state
    T, K, H = s.y.shape
    check_tensor("d_out_local", d_out_local, BF16, (T, H), s.y.device)
    ws_gate, ws_up, ws_down = s.weights[3:]
    d_topk_weights = (d_out_local.float()[:, None, :] * s.y.float()).sum(-1)  # [T_r, K] fp32
    dy = (d_out_local.float()[:, None, :] * s.topk_weights[:, :, None]).to(BF16).view(T * K, H)
    dy_recv = _to_experts(dy[st.send_order], st)  # [N_recv, H] expert-major, like x_recv

    # the level's backward of its rows (one route each, weight 1: its dy is dy_recv itself): dx_rows, weight grads
    dx_rows, _, *d_w = get_level(s.backend).backward(s.experts, dy_recv)[:5]  # [N_recv, H], [E/R, ...] ×3
    dx = _from_experts(dx_rows, st).view(T, K, H)  # [T_r, K, H] per route, home again

    d_x = torch.zeros(T, H, dtype=torch.float32, device=d_out_local.device)  # [T_r, H] fp32
    for k in range(K):  # fixed order: increasing k, then the shared expert
        d_x += dx[:, k].float()
    d_shared = (None, None, None)
    if ws_gate is not None:
        d_out_shared = _all_gather_tokens(d_out_local, st.group)[0] if s.exact_shared else d_out_local
        dx_shared, *d_shared = reference.expert_backward(
            s.x_shared, s.shared_gate, s.shared_up, d_out_shared, ws_gate, ws_up, ws_down,
            precision="bf16", swiglu_limit=s.swiglu_limit)  # dx_shared [T_sh, H]
        d_x += dx_shared[s.token_offset: s.token_offset + T].float()
    return (d_x.to(BF16), d_topk_weights, *d_w, *d_shared)
