"""The megakernel's plan (mok.ep_plan) and its CPU twin (mok.ep_twin), across EP degrees 1-4, in one process and on
gloo ranks (docs/megakernel.md).

Two GEMMs. `row_mm` (patched into mok.reference, so L0 and the twin share it) gives a row the same bits whatever the
other rows of its GEMM, as the GPU kernel's tiles do: the twin must then equal L0 bit for bit for every EP degree and
tiling. torch's own mm does not (CPU BLAS picks kernels by shape, docs/ep.md): with it the twin equals L0 bit for bit
where each GEMM is one tile, equals itself across EP degrees where the tiles hold the same rows (routed experts), and
is within TOLERANCES elsewhere.
Grid: EP 1-4 with uneven token splits and a rank with no tokens; E = 6 (uneven blocks at R = 4), 5 (E % R != 0 at
every R > 1) and 3 (a rank without experts at R = 4); one expert with every token; repeated experts per token; bf16
and mxfp8 (with a swiglu limit); with and without a shared expert. Shapes are tiny (the twin runs tasks in Python);
widths are multiples of 32 so that torch's vectorized sigmoid gives every element the same bits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mok import comm, ep_plan, ep_twin, ep_twin_ranks, reference
from mok.schedule import make_schedule
from mok.testing import GRAD_NAMES, TOLERANCES, rel_err, row_mm

BF16 = torch.bfloat16
SPLITS = {1: lambda T: [T], 2: lambda T: [T - T // 3, T // 3], 3: lambda T: [T // 2, 0, T - T // 2],
          4: lambda T: [T // 2, 0, T - T // 2 - 3, 3]}  # uneven; a rank with no tokens at R = 3 and 4


TORCH_MM = reference.mm  # L0's own GEMM, before any test patches it


@pytest.fixture(autouse=True)
def one_thread():
    """The gloo ranks run one thread each; the parent's results must come from the same GEMM kernels."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def make_case(seed, T, E, K, shared, precision, limit, hot=False, H=64, I=64):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(BF16)

    c = {"precision": precision, "limit": limit, "num_experts": E, "x": randn(T, H), "d_out": randn(T, H),
         "topk_idx": torch.randint(0, E, (T, K), generator=g),  # repeats allowed: two routes to one expert
         "topk_weights": torch.rand(T, K, generator=g), "w_gate": randn(E, I, H, scale=H**-0.5),
         "w_up": randn(E, I, H, scale=H**-0.5), "w_down": randn(E, H, I, scale=I**-0.5)}
    if hot:
        c["topk_idx"][:, 0] = 2  # expert 2 receives every token
    for name, shape in (("w_shared_gate", (shared, H)), ("w_shared_up", (shared, H)), ("w_shared_down", (H, shared))):
        c[name] = randn(*shape, scale=shape[1] ** -0.5) if shared else None
    return c


CASES = {
    "bf16-shared": lambda: make_case(1, 37, 6, 2, 32, "bf16", None),
    "mxfp8-shared-limit": lambda: make_case(2, 29, 6, 3, 64, "mxfp8", 1.5),
    "hot-expert-E5": lambda: make_case(3, 33, 5, 2, 0, "bf16", 2.0, hot=True),
    "mxfp8-E3": lambda: make_case(4, 19, 3, 2, 0, "mxfp8", None),
}


def l0(c):
    out, saved = reference.moe_forward(c["x"], c["topk_idx"], c["topk_weights"], c["w_gate"], c["w_up"], c["w_down"],
                                       c["w_shared_gate"], c["w_shared_up"], c["w_shared_down"],
                                       precision=c["precision"], swiglu_limit=c["limit"])
    return (out, *reference.moe_backward(saved, c["d_out"]))


def plan_of(c, R, block_m=8, block_n=32):
    shared = 0 if c["w_shared_gate"] is None else c["w_shared_gate"].shape[0]
    return ep_plan.make_ep_plan(c["topk_idx"], SPLITS[R](c["x"].shape[0]), c["num_experts"], hidden=c["x"].shape[1],
                                intermediate=c["w_gate"].shape[1], shared_intermediate=shared, block_m=block_m,
                                block_n=block_n)


def results(bufs):
    """(out, d_x, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_w_shared_*): L0's order, ranks concatenated."""
    cat = [torch.cat([b[name] for b in bufs]) for name in ("out", "d_x", "d_topk_weights", "d_w_gate", "d_w_up",
                                                           "d_w_down")]
    shared = [bufs[0].get(name) for name in ep_twin.SHARED_GRADS]
    assert all(torch.equal(b[name], bufs[0][name]) for b in bufs for name in ep_twin.SHARED_GRADS
               if b.get(name) is not None)
    return (*cat, *shared)


def twin(c, R, block_m=8, block_n=32, grid=1, generator=None):
    plan = plan_of(c, R, block_m, block_n)
    ep_plan.check_plan(plan)
    bufs = [ep_twin.rank_buffers(plan, r, c) for r in range(R)]
    for pass_ in ("forward", "backward"):
        ep_twin.run_pass(plan, pass_, bufs, precision=c["precision"], swiglu_limit=c["limit"], grid=grid,
                         generator=generator)
    return results(bufs)


def assert_equal(got, want, what):
    for name, a, b in zip(("out", *GRAD_NAMES), got, want):
        assert (a is None and b is None) or torch.equal(a, b), f"{name}: {what}"


# ---- (a) the plan ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_plan_rows_are_the_single_gpu_schedule(name):
    c = CASES[name]()
    T, K = c["topk_idx"].shape
    for block_m in (4, 8, 64):
        sched = make_schedule(c["topk_idx"], c["num_experts"], block_m)
        for R in (1, 2, 3, 4):
            plan = plan_of(c, R, block_m)
            if R == 1:
                rp = plan.ranks[0]
                assert torch.equal(rp.row_to_route, sched.row_to_route)
                assert torch.equal(rp.tile_to_expert, sched.tile_to_expert)
                assert torch.equal(rp.tile_num_rows, sched.tile_num_rows)
                assert torch.equal(rp.expert_offsets, sched.expert_offsets)
            assert torch.equal(torch.cat([rp.row_to_route for rp in plan.ranks]), sched.row_to_route)
            sizes = [len(rp.experts) for rp in plan.ranks]
            assert [e for rp in plan.ranks for e in rp.experts] == list(range(c["num_experts"]))
            assert max(sizes) - min(sizes) <= 1
            for rp in plan.ranks:
                real = rp.row_to_route >= 0
                assert set(rp.tile_to_expert.tolist()) <= set(rp.experts)
                # the pull list names the row's token: global token = the source rank's offset + local token
                offsets = torch.tensor([0, *plan.tokens_per_rank]).cumsum(0)
                token = offsets[rp.pull_rank[real]] + rp.pull_token[real]
                assert torch.equal(token, rp.row_to_route[real] // K)
                assert (rp.pull_rank[~real] == -1).all() and (rp.pull_token[~real] == -1).all()
                # the combine plan inverts the rows: route (t, k)'s row on its owner holds route t·K + k
                route = torch.arange(rp.num_tokens * K).view(-1, K) + rp.token_offset * K
                for t_, k_ in [(t_, k_) for t_ in range(rp.num_tokens) for k_ in range(K)]:
                    owner = plan.ranks[int(rp.combine_rank[t_, k_])]
                    assert int(owner.row_to_route[rp.combine_row[t_, k_]]) == int(route[t_, k_])
            assert plan.ranks[-1].row_offset + plan.ranks[-1].num_rows == sched.num_rows


def test_experts_split_in_contiguous_blocks():
    assert ep_plan.expert_ranges(48, 8) == [range(6 * r, 6 * r + 6) for r in range(8)]
    assert ep_plan.expert_ranges(5, 2) == [range(0, 2), range(2, 5)]
    assert ep_plan.expert_ranges(3, 4) == [range(0, 0), range(0, 1), range(1, 2), range(2, 3)]  # rank 0: none


def test_plan_errors_name_the_argument():
    idx = torch.zeros(5, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"tokens_per_rank: expected counts summing to num_tokens=5"):
        ep_plan.make_ep_plan(idx, [2, 2], 4, hidden=32, intermediate=32)
    with pytest.raises(ValueError, match="topk_idx: expected expert ids in"):
        ep_plan.make_ep_plan(idx + 4, [5], 4, hidden=32, intermediate=32)
    with pytest.raises(ValueError, match="block_m"):
        ep_plan.make_ep_plan(idx, [5], 4, hidden=32, intermediate=32, block_m=0)
    c = CASES["mxfp8-E3"]()
    plan = plan_of(c, 2, block_n=48)
    with pytest.raises(ValueError, match="block_n/hidden/intermediate: expected multiples of 32"):
        ep_twin.run_pass(plan, "forward", [ep_twin.rank_buffers(plan, r, c) for r in range(2)], precision="mxfp8")


# ---- (b, c) the twin against L0 and across EP degrees --------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_twin_equals_l0_bitwise_at_every_ep_degree_with_a_row_exact_gemm(name, monkeypatch):
    monkeypatch.setattr(reference, "mm", row_mm)
    c = CASES[name]()
    want = l0(c)
    for R in (1, 2, 3, 4):
        for block_m, block_n in ((8, 32), (4, 64)):
            assert_equal(twin(c, R, block_m, block_n), want, f"{name}, R={R}, tiles {block_m}x{block_n}")


@pytest.mark.parametrize("name", CASES)
def test_twin_with_torch_mm(name):
    """One tile per GEMM (BLOCK_M >= T, BLOCK_N >= every width) at EP = 1: L0's GEMM calls exactly, L0's bits.
    Small tiles: other GEMM shapes than L0's, so other fp32 bits (within the level tolerance); without a shared
    expert every tile holds the same rows at every EP degree, so the bits match across EP degrees."""
    c = CASES[name]()
    want = l0(c)
    assert_equal(twin(c, 1, block_m=64, block_n=64), want, f"{name}, one tile per GEMM")
    small = twin(c, 1)
    bound = TOLERANCES["bf16_vs_l0" if c["precision"] == "bf16" else "mxfp8_vs_l0_mxfp8"]
    for what, a, b in zip(("out", *GRAD_NAMES), small, want):
        assert (a is None and b is None) or rel_err(a, b) <= bound, what
    if c["w_shared_gate"] is None:
        for R in (2, 3, 4):
            assert_equal(twin(c, R), small, f"{name}, R={R} against R=1")


# ---- (d) no deadlock ---------------------------------------------------------------------------------------------


def random_plan(gen):
    T, E, K, R = (int(torch.randint(lo, hi, (), generator=gen)) for lo, hi in ((0, 40), (1, 9), (1, 4), (1, 6)))
    idx = torch.randint(0, E, (T, K), generator=gen)
    cuts = torch.randint(0, T + 1, (R - 1,), generator=gen).sort().values.tolist()
    split = [b - a for a, b in zip([0, *cuts], [*cuts, T])]
    return ep_plan.make_ep_plan(idx, split, E, hidden=32 * int(torch.randint(1, 4, (), generator=gen)),
                                intermediate=32 * int(torch.randint(1, 4, (), generator=gen)),
                                shared_intermediate=32 * int(torch.randint(0, 3, (), generator=gen)),
                                block_m=int(torch.randint(1, 9, (), generator=gen)), block_n=32)


def test_random_plans_pass_the_checker_and_never_deadlock():
    gen = torch.Generator().manual_seed(0)
    empty = ep_plan.make_ep_plan(torch.zeros(0, 2, dtype=torch.int64), [0, 0, 0], 4, hidden=32, intermediate=32,
                                 shared_intermediate=32, block_m=4, block_n=32)  # no tokens: weight gradients only
    for plan in [empty] + [random_plan(gen) for _ in range(25)]:
        ep_plan.check_plan(plan)
        for pass_ in ep_plan.PHASES:
            total = sum(len(rp.tasks[pass_]) for rp in plan.ranks)
            for grid in (1, 2, 7, None):
                order = ep_plan.task_order(plan, pass_, grid=grid, generator=gen if grid is None else None)
                assert sorted(order) == sorted((r, i) for r, rp in enumerate(plan.ranks)
                                               for i in range(len(rp.tasks[pass_])))
                assert len(order) == total


def mutated(plan, pass_, rank, edit):
    """A copy of plan whose rank `rank` has the task list edit(tasks) in pass_ (the counters unchanged)."""
    ranks = list(plan.ranks)
    rp = ranks[rank]
    ranks[rank] = dataclasses.replace(rp, tasks={**rp.tasks, pass_: edit(list(rp.tasks[pass_]))})
    return dataclasses.replace(plan, ranks=ranks)


def test_checker_rejects_a_consumer_before_its_producer():
    plan = plan_of(CASES["bf16-shared"](), 2)
    ep_plan.check_plan(plan)
    tasks = plan.ranks[1].tasks["forward"]
    first_combine = next(i for i, t in enumerate(tasks) if t.kind == "combine")
    early = mutated(plan, "forward", 1, lambda ts: [ts[first_combine]] + ts[:first_combine] + ts[first_combine + 1:])
    with pytest.raises(ValueError, match=r"forward plan: expected each rank's tickets in non-decreasing phase, got "
                                         r"rank 1 ticket 1 \(pull_x m=0 n=-1\) in phase 0 after phase 3"):
        ep_plan.check_plan(early)
    with pytest.raises(RuntimeError, match="forward deadlock with grid=1"):  # its shared_down tiles come later
        ep_plan.task_order(early, "forward", grid=1)
    ep_plan.task_order(early, "forward", grid=len(tasks))  # a grid as large as the pass hides the bug

    # a gate_up tile that waits for the h_ready counter its own tile increments: a producer after the consumer
    i = next(i for i, t in enumerate(tasks) if t.kind == "gate_up")
    h_ready = plan.ranks[1].counters["forward"].index(f"h_ready[{tasks[i].m}]")
    cycle = mutated(plan, "forward", 1, lambda ts: ts[:i] + [dataclasses.replace(ts[i], wait=h_ready)] + ts[i + 1:])
    with pytest.raises(ValueError, match=r"expected every producer before its consumer .* feeding rank 1 ticket"):
        ep_plan.check_plan(cycle)
    with pytest.raises(RuntimeError, match="deadlock"):
        ep_plan.task_order(cycle, "forward", grid=None)

    # a target one above its producers' increments would hang; one below would let a consumer read early
    for delta in (1, -1):
        targets = list(plan.ranks[0].targets["backward"])
        targets[0] += delta
        ranks = [dataclasses.replace(plan.ranks[0], targets={**plan.ranks[0].targets, "backward": targets}),
                 plan.ranks[1]]
        with pytest.raises(ValueError, match=r"backward counter dy_ready\[0\] on rank 0: expected a target equal"):
            ep_plan.check_plan(dataclasses.replace(plan, ranks=ranks))


# ---- (e) any ready order gives the ticket order's bits ----------------------------------------------------------


@pytest.mark.parametrize("name", ["bf16-shared", "mxfp8-shared-limit"])
def test_random_ready_order_equals_ticket_order_bitwise(name):
    c = CASES[name]()
    for R in (1, 3):
        ticket = twin(c, R)
        for seed in range(2):
            gen = torch.Generator().manual_seed(seed)
            assert_equal(twin(c, R, grid=None, generator=gen), ticket, f"{name}, R={R}, random order {seed}")
        assert_equal(twin(c, R, grid=3), ticket, f"{name}, R={R}, grid 3")


# ---- (f) gloo ranks, each with only its tokens and experts -------------------------------------------------------


def _twin_rank(rank, world_size, cases):
    """One rank: the routing all-gathered, the plan, then both passes with peer rows exchanged over gloo; with
    torch's mm and with row_mm."""
    out = []
    for c in cases:
        T = c["x"].shape[0]
        split = SPLITS[world_size](T)
        lo = sum(split[:rank])
        tokens = slice(lo, lo + split[rank])
        topk_idx, tokens_per_rank = ep_twin_ranks.all_gather_routing(c["topk_idx"][tokens].contiguous())
        assert tokens_per_rank == split and torch.equal(topk_idx, c["topk_idx"])
        shared = 0 if c["w_shared_gate"] is None else c["w_shared_gate"].shape[0]
        plan = ep_plan.make_ep_plan(topk_idx, tokens_per_rank, c["num_experts"], hidden=c["x"].shape[1],
                                    intermediate=c["w_gate"].shape[1], shared_intermediate=shared, block_m=8,
                                    block_n=32)
        local = ep_twin.rank_buffers(plan, rank, c)  # this rank's tokens and experts only
        for gemm in (TORCH_MM, row_mm):
            reference.mm = gemm
            buf = dict(local)
            for pass_ in ("forward", "backward"):
                ep_twin_ranks.run_rank_pass(plan, pass_, rank, buf, precision=c["precision"], swiglu_limit=c["limit"])
            out.append({name: buf.get(name) for name in ("out", "d_x", "d_topk_weights", "d_w_gate", "d_w_up",
                                                         "d_w_down", *ep_twin.SHARED_GRADS)})
    return out


GLOO_CASES = ("bf16-shared", "mxfp8-shared-limit", "hot-expert-E5")


@pytest.mark.parametrize("R", [2, 3])
def test_gloo_ranks_equal_the_single_process_twin_and_l0_bitwise(R, monkeypatch):
    cases = [CASES[name]() for name in GLOO_CASES]
    ranks = comm.run_local_ep(_twin_rank, R, cases, timeout_s=60)
    for i, (name, c) in enumerate(zip(GLOO_CASES, cases)):
        for j, gemm in enumerate((TORCH_MM, row_mm)):
            got = results([r[2 * i + j] for r in ranks])
            monkeypatch.setattr(reference, "mm", gemm)
            assert_equal(got, twin(c, R), f"{name}, R={R}, gloo against one process, {gemm.__name__}")
            if gemm is row_mm:  # hence the same bits at R = 2 and 3
                assert_equal(got, l0(c), f"{name}, R={R}, gloo against L0")
            monkeypatch.undo()
