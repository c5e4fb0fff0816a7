"""Expert parallelism over peer memory, phase by phase: every rank's pass from its mok.ep_build tables, with the
all-gather, dispatch and combine as reads of the other ranks' buffers (mok.ops.Peers: the megakernel's pull and
combine bodies) and the local experts by the fused level. The megakernel (docs/megakernel.md) runs the same data
movement inside one launch per rank on dependency counters; here a barrier between phases stands for the counters,
so that the tables, the pulls and the determinism claim are proven before the kernel exists.

Each rank's pass is a generator that yields where every rank must have finished the phase before (a barrier):
- `forward_ranks` / `backward_ranks`: R ranks in one process, advanced in lockstep (inputs as lists by rank);
- `run_rank`: one rank in this process, `barrier()` at each yield: R processes sharing the buffers of `allocate`
  (CPU shared memory, or CUDA IPC on one GPU), or one per GPU over `allocate_symmetric` (symmetric memory).
BF16 or MXFP8 (the shared expert BF16, DESIGN §4). The bits equal the fused level's at EP = 1, in the output and
all eight gradients, for any split of the tokens over any number of ranks (tests/test_ep_peer.py):
- rank r's rows are the single-GPU schedule's rows cut at its experts (the pull), each expert's rows in ascending
  global route id, and a fused GEMM row's bits depend only on that row;
- each token's sum runs over its routes in increasing k on its home rank (combine_peers), then the shared expert;
- the backward gives each row its route's real weight (the level's d_h = w·g and w·h; in MXFP8 its dy = bf16(w·d_out)
  and ⟨d_out, y⟩), as the fused level does; MXFP8 blocks lie within a row or within an expert's segment of rows.
The shared expert runs over each rank's own tokens, its weight gradients dealt over the ranks by columns of hidden
(mok.ep_shared)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mok import ep_shared, fused, ops
from mok.checks import check_int, fail
from mok.ep_build import build_tables
from mok.ep_plan import expert_ranges
from mok.ops.gemm import GEMM_DOWN_TILE_N
from mok.schedule import make_schedule, max_num_rows

BF16 = torch.bfloat16


def buffer_shapes(num_ranks: int, max_tokens: int, num_topk: int, num_experts: int, hidden: int,
                  shared_intermediate: int = 0) -> dict:
    """name -> (rows, width, dtype) of each rank's buffers, the same on every rank (symmetric): routing ids, token
    count, x, topk_weights and d_out over max_tokens tokens; y, dx and the rows' d_topk_weights over the most rows
    a rank's experts can receive (every route of every rank to its largest block of experts). mok.ep_chain's too:
    x's MXFP8 round trip (xq), out, the shared expert's rows (sy, whole tiles) and the combine's counters (done).
    With a shared expert (shared_intermediate), mok.ep_shared's buffers of its backward."""
    experts = max(len(g) for g in expert_ranges(num_experts, num_ranks))
    rows = max(max_num_rows(num_ranks * max_tokens, num_topk, experts, fused.BLOCK_M), 1)
    tokens = max(max_tokens, 1)
    return {"idx": (tokens, num_topk, torch.int64), "count": (1, 1, torch.int64), "x": (tokens, hidden, BF16),
            "w": (tokens, num_topk, torch.float32), "d_out": (tokens, hidden, BF16), "y": (rows, hidden, BF16),
            "dx": (rows, hidden, BF16), "dtw": (rows, 1, torch.float32), "xq": (tokens, hidden, BF16),
            "out": (tokens, hidden, BF16), "sy": (-(-tokens // fused.BLOCK_M) * fused.BLOCK_M, hidden, BF16),
            "done": (tokens, -(-hidden // GEMM_DOWN_TILE_N), torch.int32),
            **ep_shared.buffer_shapes(num_ranks, tokens, hidden, shared_intermediate)}


def allocate(num_ranks: int, max_tokens: int, num_topk: int, num_experts: int, hidden: int, device,
             shared_intermediate: int = 0) -> list[dict]:
    """Every rank's buffers (buffer_shapes), zeroed: rank s's are entry s. Share them with each rank's process
    (torch.multiprocessing passes CPU shared-memory and CUDA tensors by handle), which reads them through
    `peers(...)`."""
    shapes = buffer_shapes(num_ranks, max_tokens, num_topk, num_experts, hidden, shared_intermediate)
    return [{name: torch.zeros(rows, width, dtype=dtype, device=device)
             for name, (rows, width, dtype) in shapes.items()} for _ in range(num_ranks)]


def allocate_symmetric(max_tokens: int, num_topk: int, num_experts: int, hidden: int, group=None,
                       shared_intermediate: int = 0) -> tuple:
    """allocate() over torch's symmetric memory, one rank per GPU (an NCCL group; NVLink multicast off, as
    docs/ep.md says): (buffers, handles). Entry s of buffers holds rank s's buffers as this GPU reaches them (its
    own, or symmetric memory's peer tensors over NVLink); keep the handles as long as the buffers. Between phases
    `handles[0].barrier()` orders every rank's writes before any read (stream-ordered, on the GPU)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    R, rank = dist.get_world_size(group), dist.get_rank(group)
    group = group if group is not None else dist.group.WORLD
    out, handles = [{} for _ in range(R)], []
    shapes = buffer_shapes(R, max_tokens, num_topk, num_experts, hidden, shared_intermediate)
    for name, (rows, width, dtype) in shapes.items():
        local = symm_mem.empty(rows, width, dtype=dtype, device=torch.device("cuda", torch.cuda.current_device()))
        local.zero_()
        handles.append(symm_mem.rendezvous(local, group))
        for s in range(R):
            out[s][name] = local if s == rank else handles[-1].get_remote_tensor(s, (rows, width), dtype)
    return out, handles


def peers(buffers: list[dict]) -> dict:
    """name -> ops.Peers over every rank's buffer of that name."""
    return {name: ops.Peers.of([b[name] for b in buffers]) for name in buffers[0]}


@dataclass
class PeerSaved:
    """What a rank's forward keeps for its backward."""
    rank: int
    tables: dict  # its forward tables (mok.ep_build)
    real: torch.Tensor  # bool [rows]: the rows holding a route (pull_rank >= 0)
    experts: object  # the fused level's saved state of its rows
    split: list  # every rank's token count
    shared: ep_shared.Saved | None  # the shared expert's
    swiglu_limit: float | None


def check_rank_inputs(P: dict, rank: int, x, w_gate, num_experts: int, w_shared_gate=None) -> None:
    """A rank's forward inputs against the peers' buffers: its rank, its token count, its block of experts, and the
    shared expert's buffers where it has one (allocate's shared_intermediate)."""
    R, T = P["x"].num_ranks, x.shape[0]
    check_int("rank", rank, 0, R - 1)
    if T > P["x"].keep[rank].shape[0]:
        fail("x", f"at most {P['x'].keep[rank].shape[0]} tokens (the buffers' capacity)", T)
    if w_gate.shape[0] != len(expert_ranges(num_experts, R)[rank]):
        fail("w_gate", f"rank {rank}'s {len(expert_ranges(num_experts, R)[rank])} experts of {num_experts}",
             w_gate.shape[0])
    if w_shared_gate is not None and ("sdg" not in P or P["sdg"].keep[rank].shape[1] != w_shared_gate.shape[0]):
        fail("P", f"buffers allocated with shared_intermediate={w_shared_gate.shape[0]} (w_shared_gate's)",
             P["sdg"].keep[rank].shape[1] if "sdg" in P else 0)


def plan_rank(P: dict, rank: int, num_experts: int, x, w_gate, w_shared_gate) -> tuple:
    """After every rank's inputs are in place: (every rank's token count, the schedule of every rank's tokens, this
    rank's forward tables (mok.ep_build), its real rows (bool [rows]), the local expert of each real row [n, 1])."""
    split = [int(c[0, 0]) for c in P["count"].keep]
    idx = P["idx"].tokens(split)  # [T_all, K]: the all-gather
    schedule = ops.make_schedule_cuda if idx.is_cuda and len(idx) else make_schedule
    sched = schedule(idx, num_experts, block_m=fused.BLOCK_M)
    t = build_tables(idx, split, num_experts, rank, "forward", hidden=x.shape[1], intermediate=w_gate.shape[1],
                     shared_intermediate=0 if w_shared_gate is None else w_shared_gate.shape[0],
                     block_m=fused.BLOCK_M, sched=sched)
    expert_of_row = torch.repeat_interleave(torch.arange(w_gate.shape[0], device=x.device),
                                            t["tokens_per_expert"].long())[:, None]  # [n, 1]
    return split, sched, t, t["pull_rank"] >= 0, expert_of_row


def forward_rank(P: dict, rank: int, x, topk_idx, topk_weights, w_gate, w_up, w_down, w_shared_gate=None,
                 w_shared_up=None, w_shared_down=None, *, num_experts: int, precision="bf16", swiglu_limit=None):
    """Rank `rank`'s forward over the peers' buffers P (peers()): a generator yielding at each barrier, returning
    (out [T_r, H], PeerSaved). topk_idx holds global expert ids; w_gate, w_up, w_down are its experts [E_r, ...]
    (mok.ep_plan.expert_ranges); the shared expert's weights are replicated."""
    check_rank_inputs(P, rank, x, w_gate, num_experts, w_shared_gate)
    T = x.shape[0]
    own = {name: p.keep[rank] for name, p in P.items()}
    own["x"][:T], own["w"][:T], own["idx"][:T], own["count"][0, 0] = x, topk_weights, topk_idx, T
    yield  # every rank's inputs are in place

    split, sched, t, real, expert_of_row = plan_rank(P, rank, num_experts, x, w_gate, w_shared_gate)
    x_rows = ops.pull_rows(P["x"], t["pull_rank"][real], t["pull_token"][real])  # [n, H]: the real rows
    ones = torch.ones(x_rows.shape[0], 1, device=x.device)  # [n, 1]: the level's out is y itself
    y, experts = fused.forward(x_rows, expert_of_row, ones, w_gate, w_up, w_down, precision=precision,
                               swiglu_limit=swiglu_limit)
    own["y"][: real.shape[0]][real] = y
    shared_out, shared = None, None
    if w_shared_gate is not None:  # this rank's tokens: row t's bits are those of any split
        ws = (w_shared_gate, w_shared_up, w_shared_down)
        shared_out, shared = ep_shared.forward(P, rank, split, x, ws, swiglu_limit)
    yield  # every rank's y rows are in place

    out = ops.combine_peers(P["y"], t["combine_rank"], t["combine_row"], topk_weights, shared_out)
    return out, PeerSaved(rank, t, real, experts, split, shared, swiglu_limit)


def backward_rank(P: dict, saved: PeerSaved, d_out):
    """The rank's gradients (d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down of its experts, and the shared
    expert's three, the same on every rank), reference.moe_backward's order: a generator yielding at each
    barrier."""
    s, t, real = saved, saved.tables, saved.real
    own = {name: p.keep[s.rank] for name, p in P.items()}
    own["d_out"][: d_out.shape[0]] = d_out
    yield  # every rank's d_out is in place

    d_rows = ops.pull_rows(P["d_out"], t["pull_rank"][real], t["pull_token"][real])  # [n, H] unweighted
    rank, token, k = (t[name][real].long() for name in ("pull_rank", "pull_token", "pull_k"))
    w_rows = torch.stack(P["w"].keep)[rank, token, k][:, None]  # [n, 1]: each row's route weight
    dx_rows, d_tw, *d_w = fused.backward(replace(s.experts, topk_weights=w_rows), d_rows)[:5]
    own["dx"][: real.shape[0]][real] = dx_rows
    own["dtw"][: real.shape[0]][real] = d_tw
    dx_shared, d_shared = None, [None, None, None]
    if s.shared is not None:  # its tokens' rows (mok.ep_shared)
        dx_shared = ep_shared.backward_local(own, s.shared, d_out, s.swiglu_limit)
    yield  # every rank's dx rows (and the shared expert's rows) are in place

    d_x = ops.combine_peers(P["dx"], t["combine_rank"], t["combine_row"], None, dx_shared)
    d_topk_weights = torch.stack(P["dtw"].keep)[t["combine_rank"].long(), t["combine_row"].long(), 0]  # [T_r, K]
    if s.shared is not None:  # its share of the shared expert's weight gradients, then every rank's
        ep_shared.backward_share(P, s.rank, s.split, s.shared)
        yield  # every rank's share is in place
        d_shared = ep_shared.backward_gather(P, d_out.shape[1])
    return (d_x, d_topk_weights, *d_w, *d_shared)


def lockstep(generators: list) -> list:
    """Every rank's pass in one process: each phase of every rank before the next phase of any; their results."""
    results, live = [None] * len(generators), dict(enumerate(generators))
    while live:
        for i, g in list(live.items()):
            try:
                next(g)
            except StopIteration as done:
                results[i] = done.value
                del live[i]
    return results


def run_rank(generator, barrier):
    """One rank's pass in this process, barrier() at each of its phases' ends: its result."""
    try:
        while True:
            next(generator)
            barrier()
    except StopIteration as done:
        return done.value


def forward_ranks(xs, topk_idxs, topk_weights, w_gates, w_ups, w_downs, w_shared_gate=None, w_shared_up=None,
                  w_shared_down=None, *, precision="bf16", swiglu_limit=None, rank_forward=None,
                  **options) -> tuple[list, list]:
    """R ranks in one process (inputs as lists by rank, each rank's experts a block of expert_ranges): every
    rank's out, and per rank (the peers' buffers, its PeerSaved) for backward_ranks. rank_forward: a rank's pass,
    forward_rank (None) or mok.ep_chain's, which takes the options."""
    R = len(xs)
    if not all(len(v) == R for v in (topk_idxs, topk_weights, w_gates, w_ups, w_downs)):
        fail("xs, topk_idxs, topk_weights, w_gates, w_ups, w_downs", f"{R} entries each (one per rank)",
             [len(v) for v in (xs, topk_idxs, topk_weights, w_gates, w_ups, w_downs)])
    E = sum(w.shape[0] for w in w_gates)
    P = peers(allocate(R, max(x.shape[0] for x in xs), topk_idxs[0].shape[1], E, xs[0].shape[1], xs[0].device,
                       0 if w_shared_gate is None else w_shared_gate.shape[0]))
    shared = (w_shared_gate, w_shared_up, w_shared_down)
    results = lockstep([(rank_forward or forward_rank)(
        P, r, xs[r], topk_idxs[r], topk_weights[r], w_gates[r], w_ups[r], w_downs[r], *shared, num_experts=E,
        precision=precision, swiglu_limit=swiglu_limit, **options) for r in range(R)])
    return [o for o, _ in results], [(P, s) for _, s in results]


def backward_ranks(saved: list, d_outs: list, rank_backward=None) -> list[tuple]:
    """backward_rank (or rank_backward) of every rank in one process, from forward_ranks' saved states."""
    if len(d_outs) != len(saved):
        fail("d_outs", f"{len(saved)} tensors (one per rank)", len(d_outs))
    return lockstep([(rank_backward or backward_rank)(P, s, d) for (P, s), d in zip(saved, d_outs)])
