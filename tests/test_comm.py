"""EP reference (mok.comm) on CPU with gloo: R spawned ranks must reproduce single-process L0 bit for bit.

Spawning a world costs seconds, so each world size spawns once (module fixture `ep_world`) and runs
every case; the tests below then check the pieces. Grid: R in {2, 4} (even and uneven token splits,
a rank with no tokens at R=4), bf16 and mxfp8, with and without shared expert and swiglu limit,
one expert that receives no route in every case, distinct and repeated experts per token.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import pytest
import torch

from mok import comm, fused, reference
from mok.testing import TOLERANCES, rel_err

BF16 = torch.bfloat16
SEED = int(os.environ.get("MOK_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))  # printed on failure


def make_case(gen, T, H, I, E, K, shared_I, precision, limit, empty_expert, distinct=True):
    """Global inputs of one case; expert `empty_expert` receives no route."""
    allowed = torch.tensor([e for e in range(E) if e != empty_expert])  # [E-1]
    if distinct:  # K different experts per token, as routers pick them
        pick = torch.rand(T, E - 1, generator=gen).argsort(-1)[:, :K]  # [T, K]
    else:  # repeats allowed: two routes of one token to one expert
        pick = torch.randint(0, E - 1, (T, K), generator=gen)  # [T, K]
    c = {"precision": precision, "limit": limit, "num_experts": E, "empty_expert": empty_expert}
    c["x"] = torch.randn(T, H, generator=gen).to(BF16)  # [T, H]
    c["topk_idx"] = allowed[pick]  # [T, K] int64
    c["topk_weights"] = torch.randn(T, K, generator=gen).softmax(-1)  # [T, K] fp32
    c["w_gate"] = (torch.randn(E, I, H, generator=gen) * H**-0.5).to(BF16)  # [E, I, H]
    c["w_up"] = (torch.randn(E, I, H, generator=gen) * H**-0.5).to(BF16)  # [E, I, H]
    c["w_down"] = (torch.randn(E, H, I, generator=gen) * I**-0.5).to(BF16)  # [E, H, I]
    shared = (None, None, None)
    if shared_I:
        shared = ((torch.randn(shared_I, H, generator=gen) * H**-0.5).to(BF16),  # [I_sh, H]
                  (torch.randn(shared_I, H, generator=gen) * H**-0.5).to(BF16),  # [I_sh, H]
                  (torch.randn(H, shared_I, generator=gen) * shared_I**-0.5).to(BF16))  # [H, I_sh]
    c["shared"] = shared
    c["d_out"] = torch.randn(T, H, generator=gen).to(BF16)  # [T, H]
    return c


def make_cases(world_size):
    gen = torch.Generator().manual_seed(SEED + world_size)
    # Token splits: uneven; at R=4 one rank holds no token at all.
    split = {1: lambda T: [T], 2: lambda T: [T - T // 3, T // 3],
             4: lambda T: [T // 2, 0, T - T // 2 - 3, 3]}[world_size]
    cases = [
        make_case(gen, 37, 64, 96, 4, 2, 64, "bf16", None, empty_expert=1),
        make_case(gen, 37, 64, 96, 4, 2, 64, "mxfp8", 1.5, empty_expert=3),
        make_case(gen, 23, 96, 64, 8, 3, 0, "mxfp8", None, empty_expert=5, distinct=False),
        make_case(gen, 29, 64, 32, 8, 1, 0, "bf16", 2.0, empty_expert=0),
    ]
    for c in cases:
        c["tokens_per_rank"] = split(c["x"].shape[0])
    return cases


def local_slices(c, rank, world_size):
    lo = sum(c["tokens_per_rank"][:rank])
    tokens = slice(lo, lo + c["tokens_per_rank"][rank])
    e_local = c["num_experts"] // world_size
    return tokens, slice(rank * e_local, (rank + 1) * e_local)


def error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return None


def to_device(obj, dev):
    """Tensors inside dicts, lists and tuples moved to dev."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, dict):
        return {k: to_device(v, dev) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, dev) for v in obj)
    return obj


def _ep_rank(rank, world_size, cases, device="cpu", level="torch"):
    """One rank: EP forward/backward (L0, then `level` for the local experts) and an identity-expert round trip per
    case, then bad inputs. device "cuda" puts rank r on GPU r (NCCL); results come back on the CPU."""
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    results = []
    for c in to_device(cases, dev):
        tokens, experts = local_slices(c, rank, world_size)
        x, idx = c["x"][tokens].contiguous(), c["topk_idx"][tokens].contiguous()  # [T_r, H], [T_r, K]
        w = c["topk_weights"][tokens].contiguous()  # [T_r, K]
        routed = [c[n][experts].contiguous() for n in ("w_gate", "w_up", "w_down")]  # [E/R, ...] ×3
        out, saved = comm.ep_moe_forward(x, idx, w, *routed, *c["shared"], precision=c["precision"],
                                         swiglu_limit=c["limit"])
        grads = comm.ep_moe_backward(saved, c["d_out"][tokens].contiguous())
        state = comm.ep_dispatch(x, idx, c["num_experts"])
        back = comm.ep_combine(state.x_recv, state, w)  # identity experts
        results.append({"out": out, "grads": grads, "x_recv": state.x_recv, "back": back,
                        "counts": state.num_tokens_per_expert})
        out, saved = comm.ep_moe_forward(x, idx, w, *routed, *c["shared"], precision=c["precision"],
                                         swiglu_limit=c["limit"], backend=level)
        results[-1]["level"] = (out, comm.ep_moe_backward(saved, c["d_out"][tokens].contiguous()))
        if c["shared"][0] is not None:  # the deployment mode: shared expert on local rows only
            out, saved = comm.ep_moe_forward(x, idx, w, *routed, *c["shared"], precision=c["precision"],
                                             swiglu_limit=c["limit"], exact_shared=False)
            results[-1]["local"] = (out, comm.ep_moe_backward(saved, c["d_out"][tokens].contiguous()))

    x, idx = torch.randn(5, 64, device=dev).to(BF16), torch.randint(0, 2 * world_size, (5, 2), device=dev)
    errors = {
        "not_divisible": error_of(comm.ep_dispatch, x, idx, 2 * world_size + 1),
        "id_too_large": error_of(comm.ep_dispatch, x, torch.full((5, 2), 2 * world_size), 2 * world_size),
        "id_negative": error_of(comm.ep_dispatch, x, idx - 2 * world_size, 2 * world_size),
        "idx_dtype": error_of(comm.ep_dispatch, x, idx.int(), 2 * world_size),
        "x_dtype": error_of(comm.ep_dispatch, x.float(), idx, 2 * world_size),
        "idx_rows": error_of(comm.ep_dispatch, x, idx[:4], 2 * world_size),
    }
    w_local = torch.randn(2, 32, 64, device=dev).to(BF16)
    errors["weights_shape"] = error_of(comm.ep_moe_forward, x, idx, torch.rand(5, 2, device=dev), w_local,
                                       w_local, w_local)
    errors["topk_weights_shape"] = error_of(comm.ep_moe_forward, x, idx, torch.rand(5, 3, device=dev),
                                            w_local, w_local, w_local.transpose(1, 2).contiguous())
    state = comm.ep_dispatch(x, idx, 2 * world_size)
    errors["y_rows_shape"] = error_of(comm.ep_combine, state.x_recv[:, :32].contiguous(), state,
                                      torch.rand(5, 2, device=dev))
    return to_device({"cases": results, "errors": errors}, "cpu")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda r: f"R{r}")
def ep_world(request):
    world_size = request.param
    cases = make_cases(world_size)
    ranks = comm.run_local_ep(_ep_rank, world_size, cases, timeout_s=60)
    return world_size, cases, ranks


@contextmanager
def num_threads(n):
    """CPU GEMM bits can depend on the thread count: compute L0 as the ranks do (1 thread each)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@num_threads(1)
def single_process(c):
    out, saved = reference.moe_forward(c["x"], c["topk_idx"], c["topk_weights"], c["w_gate"], c["w_up"],
                                       c["w_down"], *c["shared"], precision=c["precision"],
                                       swiglu_limit=c["limit"])
    return out, reference.moe_backward(saved, c["d_out"])


def test_ep_forward_equals_single_process_bitwise(ep_world):
    world_size, cases, ranks = ep_world
    for i, c in enumerate(cases):
        ref, _ = single_process(c)
        out = torch.cat([r["cases"][i]["out"] for r in ranks])  # [T, H] in (rank, token) order
        assert torch.equal(out, ref), f"case {i}, R={world_size}, seed {SEED}"


def test_ep_backward_equals_single_process_bitwise(ep_world):
    world_size, cases, ranks = ep_world
    names = ("d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down")
    for i, c in enumerate(cases):
        _, ref = single_process(c)
        grads = [r["cases"][i]["grads"] for r in ranks]
        for j, name in enumerate(names):  # tokens concatenate over ranks, routed experts too
            got = torch.cat([g[j] for g in grads])
            assert torch.equal(got, ref[j]), f"{name}, case {i}, R={world_size}, seed {SEED}"
        for j in range(5, 8):  # exact shared expert: the full gradient, on every rank
            for g in grads:
                assert (g[j] is None and ref[j] is None) or torch.equal(g[j], ref[j]), f"case {i}, {j}"


def rel_diff(a, b):
    return float((a.float() - b.float()).abs().sum() / b.float().abs().sum())


def test_ep_local_shared_expert_is_close(ep_world):
    """exact_shared=False: shared expert on each rank's rows; shared weight grads are partials."""
    _, cases, ranks = ep_world
    for i, c in enumerate(cases):
        if c["shared"][0] is None:
            continue
        ref_out, ref = single_process(c)
        local = [r["cases"][i]["local"] for r in ranks]
        assert rel_diff(torch.cat([o for o, _ in local]), ref_out) < 1e-3
        assert rel_diff(torch.cat([g[0] for _, g in local]), ref[0]) < 1e-3  # d_x
        for j in range(5, 8):  # reduced over ranks here, as data parallelism would
            assert rel_diff(sum(g[j].float() for _, g in local), ref[j]) < 1e-2, f"case {i}, {j}"


def assert_level_close_to_l0(cases, ranks, what):
    """EP with a level for the local experts (_ep_rank's `level`) against single-process L0: out and every gradient
    within the level tolerances (the level's GEMMs are not L0's)."""
    for i, c in enumerate(cases):
        ref_out, ref = to_device(single_process(c), "cpu")
        tol = TOLERANCES["mxfp8_vs_l0_mxfp8" if c["precision"] == "mxfp8" else "bf16_vs_l0"]
        level = [r["cases"][i]["level"] for r in ranks]
        assert rel_err(torch.cat([o for o, _ in level]), ref_out) <= tol, f"{what}: out, case {i}, seed {SEED}"
        for j in range(5):  # d_x, d_topk_weights, routed weight grads: tokens and experts concatenate over ranks
            assert rel_err(torch.cat([g[j] for _, g in level]), ref[j]) <= tol, f"{what}: grad {j}, case {i}"
        for j in range(5, 8):  # the shared expert runs in L0 whatever the level: its exact gradients
            assert all((g[j] is None and ref[j] is None) or torch.equal(g[j], ref[j]) for _, g in level), f"case {i}"


def test_ep_with_the_torch_level_for_the_experts_is_close_to_l0(ep_world):
    world_size, cases, ranks = ep_world
    assert_level_close_to_l0(cases, ranks, f"torch level, R={world_size}")


def test_dispatch_gives_each_expert_the_schedule_order(ep_world):
    world_size, cases, ranks = ep_world
    for i, c in enumerate(cases):
        K, E = c["topk_idx"].shape[1], c["num_experts"]
        for rank, r in enumerate(ranks):
            res = r["cases"][i]
            _, experts = local_slices(c, rank, world_size)
            want = [c["x"][reference.routes_of_expert(c["topk_idx"], e) // K] for e in range(E)[experts]]
            assert res["counts"] == [len(w) for w in want]
            assert torch.equal(res["x_recv"], torch.cat(want)), f"case {i}, rank {rank}, seed {SEED}"
        owner = c["empty_expert"] // (E // world_size)
        assert ranks[owner]["cases"][i]["counts"][c["empty_expert"] % (E // world_size)] == 0


def test_identity_experts_round_trip(ep_world):
    _, cases, ranks = ep_world
    for i, c in enumerate(cases):
        T, K = c["topk_idx"].shape
        y = c["x"][:, None, :].expand(T, K, -1)  # [T, K, H] every route returns its token
        want = reference.combine(y, c["topk_weights"], None)  # [T, H]
        assert torch.equal(torch.cat([r["cases"][i]["back"] for r in ranks]), want), f"case {i}"


def check_nccl_against_single_process(world_size):
    """The cases on R GPUs over NCCL, against L0 on GPU 0 (same GPU model: same GEMM bits); the local experts also
    by the fused level on a Hopper GPU (L1 elsewhere): close to L0, and where there is no shared expert (which runs
    in L0) its out is the single-process fused level's bit for bit (the same rows per expert tile)."""
    cases = make_cases(world_size)
    level = "fused" if torch.cuda.get_device_capability(0) == (9, 0) else "torch"
    ranks = comm.run_local_ep(_ep_rank, world_size, cases, "cuda", level, backend="nccl", timeout_s=120)
    gpu_cases = to_device(cases, "cuda:0")
    assert_level_close_to_l0(gpu_cases, ranks, f"{level} level over NCCL, R={world_size}")
    for i, c in enumerate(gpu_cases):
        if level == "fused" and c["shared"][0] is None:
            want, _ = fused.forward(c["x"], c["topk_idx"], c["topk_weights"], c["w_gate"], c["w_up"], c["w_down"],
                                    None, None, None, precision=c["precision"], swiglu_limit=c["limit"])
            assert torch.equal(torch.cat([r["cases"][i]["level"][0] for r in ranks]), want.cpu()), f"case {i}"
    for i, c in enumerate(cases):
        ref_out, ref = to_device(single_process(to_device(c, "cuda:0")), "cpu")
        assert torch.equal(torch.cat([r["cases"][i]["out"] for r in ranks]), ref_out), f"case {i}"
        for j in range(5):  # d_x, d_topk_weights, routed weight grads
            assert torch.equal(torch.cat([r["cases"][i]["grads"][j] for r in ranks]), ref[j]), f"{i}, {j}"
        for j in range(5, 8):
            assert all((g is None and ref[j] is None) or torch.equal(g, ref[j])
                       for g in (r["cases"][i]["grads"][j] for r in ranks)), f"case {i}, {j}"
    for r in ranks:  # at R = 1 every num_experts divides evenly
        assert all(msg is not None for case, msg in r["errors"].items()
                   if world_size > 1 or case != "not_divisible"), r["errors"]


@pytest.mark.gpu
def test_ep_nccl_one_gpu_equals_single_process_bitwise():
    check_nccl_against_single_process(1)


@pytest.mark.multigpu
def test_ep_nccl_two_gpus_equals_single_process_bitwise():
    check_nccl_against_single_process(2)


def test_bad_inputs_name_the_argument(ep_world):
    world_size, _, ranks = ep_world
    expected = {"not_divisible": "num_experts", "id_too_large": "topk_idx_local",
                "id_negative": "topk_idx_local", "idx_dtype": "topk_idx_local", "x_dtype": "x_local",
                "idx_rows": "topk_idx_local", "weights_shape": "w_down_local",
                "topk_weights_shape": "topk_weights_local", "y_rows_shape": "y_rows"}
    for r in ranks:
        for case, name in expected.items():
            msg = r["errors"][case]
            assert msg is not None and msg.startswith(name), f"{case}: {msg!r}"
    assert f"multiple of the world size {world_size}" in ranks[0]["errors"]["not_divisible"]
    assert "[0, " in ranks[0]["errors"]["id_too_large"]


def _fails_on_rank_one(rank, world_size):
    if rank == 1:
        raise KeyError("boom on purpose")
    torch.distributed.barrier()  # rank 0 would wait here forever without the launcher's care
    return rank


def test_run_local_ep_reports_a_failing_rank_without_hanging():
    with pytest.raises(RuntimeError, match=r"(?s)failed on rank 1:.*boom on purpose"):
        comm.run_local_ep(_fails_on_rank_one, 2, timeout_s=60)


# --- partition and byte model (no processes) ------------------------------------------------------

def test_partition_errors():
    assert comm.num_local_experts(48, 8) == 6
    with pytest.raises(ValueError, match="num_experts: expected a positive multiple of the world size 4"):
        comm.num_local_experts(6, 4)
    with pytest.raises(ValueError, match="world_size"):
        comm.num_local_experts(6, 0)


def test_bytes_per_row():
    H = 32 * int(torch.randint(1, 300, ()))
    assert comm.bytes_per_row(H, "bf16") == 2 * H
    assert comm.bytes_per_row(H, "mxfp8") == H + H // 32  # E4M3 elements + one E8M0 scale per 32
    assert comm.bytes_per_row(7168, "mxfp8") == 7392
    with pytest.raises(ValueError, match="hidden"):
        comm.bytes_per_row(H + 16, "mxfp8")
    with pytest.raises(ValueError, match="precision"):
        comm.bytes_per_row(H, "fp8")


def test_dispatch_bytes_counts_off_rank_routes():
    T, K, E, R, H = 41, 4, 16, 4, 256
    idx = torch.randint(0, E, (T, K))  # [T, K]
    for rank in range(R):
        # hand count: a route is off-rank when its expert's owner is not `rank`
        remote = sum(1 for e in idx.flatten().tolist() if e * R // E != rank)
        assert comm.dispatch_bytes(idx, E, R, rank, H) == remote * 2 * H
        assert comm.dispatch_bytes(idx, E, R, rank, H, "mxfp8") == remote * (H + H // 32)
        assert comm.dispatch_bytes(idx, E, R, rank, H, include_local=True) == T * K * 2 * H
    with pytest.raises(ValueError, match=r"topk_idx_local: expected global expert ids in \[0, 16\)"):
        comm.dispatch_bytes(idx + E, E, R, 0, H)


def test_ep_traffic_rows():
    T, K, E, R, H = 50, 3, 8, 2, 128
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])  # [T, K] distinct experts
    rows = comm.ep_traffic(idx, E, R, H)
    assert len(rows) == R * 3  # dispatch bf16 + mxfp8, combine bf16, per rank
    for rank, chunk in enumerate(idx.split([25, 25])):
        mine = {(r["direction"], r["precision"]): r for r in rows if r["rank"] == rank}
        assert mine["dispatch", "bf16"]["bytes"] == comm.dispatch_bytes(chunk, E, R, rank, H)
        assert mine["dispatch", "mxfp8"]["bytes"] < mine["dispatch", "bf16"]["bytes"] or \
            mine["dispatch", "bf16"]["routes"] == 0
        assert mine["combine", "bf16"]["bytes"] == mine["dispatch", "bf16"]["bytes"]
        # one row per token that has at least one route on the other rank
        other = sum(1 for t in chunk.tolist() if any(e * R // E != rank for e in t))
        assert mine["dispatch", "bf16"]["token_rows"] == other
    with pytest.raises(ValueError, match="tokens_per_rank"):
        comm.ep_traffic(idx, E, R, H, tokens_per_rank=[10, 10])


def _rank_one_never_arrives(rank, world_size):
    if rank == 1:
        time.sleep(60)
    torch.distributed.barrier()  # rank 0: the group's timeout fires, its error stops the launch
    return rank


def test_run_local_ep_times_out_on_a_missing_rank():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="failed on rank 0"):
        comm.run_local_ep(_rank_one_never_arrives, 2, timeout_s=2)
    assert time.monotonic() - start < 30


# --- ranks that disagree: a clear error on every rank, before any collective that could hang ---------

DISAGREEMENTS = {  # setting -> the change rank 1 makes; each names the setting, then every rank's value
    "num_experts": ({"e_local": 4}, "num_experts: expected the same value on every rank, got 4 on rank 0, 8 on rank 1"),
    "hidden": ({"H": 96}, "hidden: expected the same value on every rank, got 64 on rank 0, 96 on rank 1"),
    "shared_intermediate": ({"shared": 0}, "got 32 on rank 0, 0 on rank 1"),
    "precision": ({"precision": "mxfp8"}, "got 'bf16' on rank 0, 'mxfp8' on rank 1"),
    "swiglu_limit": ({"limit": 1.5}, "got None on rank 0, 1.5 on rank 1"),
    "exact_shared": ({"exact_shared": False}, "got True on rank 0, False on rank 1"),
}


def _disagreeing_rank(rank, world_size, changes):
    """Per case, ep_moe_forward with rank 1's settings changed; returns each case's error (None: no error)."""
    errors, gen = {}, torch.Generator().manual_seed(rank)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(BF16)

    for case, change in changes.items():
        s = {"e_local": 2, "H": 64, "I": 32, "shared": 32, "precision": "bf16", "limit": None, "exact_shared": True,
             **(change if rank == 1 else {})}
        x = randn(6, s["H"])  # [T_r, H]
        idx = torch.randint(0, s["e_local"] * world_size, (6, 2), generator=gen)  # [T_r, K] global ids
        w = torch.rand(6, 2, generator=gen)  # [T_r, K]
        E, H, I, I_sh = s["e_local"], s["H"], s["I"], s["shared"]
        routed = [randn(E, I, H), randn(E, I, H), randn(E, H, I)]  # this rank's experts
        shared = (randn(I_sh, H), randn(I_sh, H), randn(H, I_sh)) if I_sh else (None, None, None)
        errors[case] = error_of(comm.ep_moe_forward, x, idx, w, *routed, *shared, precision=s["precision"],
                                swiglu_limit=s["limit"], exact_shared=s["exact_shared"])
    errors["dispatch"] = error_of(comm.ep_dispatch, torch.zeros(3, 64).to(BF16), torch.zeros(3, 1, dtype=torch.int64),
                                  4 + 4 * rank)
    return errors


def test_ranks_that_disagree_name_the_setting_and_each_value():
    ranks = comm.run_local_ep(_disagreeing_rank, 2, {case: c for case, (c, _) in DISAGREEMENTS.items()},
                              timeout_s=60)
    for errors in ranks:  # the same error on both ranks: neither waits for the other
        for case, (_, message) in DISAGREEMENTS.items():
            assert errors[case] is not None and errors[case].startswith(f"{case}: expected the same value"), case
            assert errors[case].endswith(message), errors[case]
        assert errors["dispatch"] == "num_experts: expected the same value on every rank, got 4 on rank 0, 8 on rank 1"
