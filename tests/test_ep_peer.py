"""mok.ep_peer: EP over peer memory, every rank's pass from its mok.ep_build tables. Its output and every gradient
equal the fused level's at EP = 1 bit for bit, for any split of the tokens over 1-4 ranks (uneven, a rank with no
tokens, experts in uneven blocks, one expert receiving every token), so the bits do not depend on the EP degree:
R ranks in one process on the GPU, and on the CPU with every kernel replaced by its L0 twin, in one process and
one rank per process (buffers in shared memory, or by CUDA IPC on one GPU)."""

from __future__ import annotations

import pytest
import torch

from mok import ep_chain, ep_peer, ep_shared, fused, ops, twins
from mok.config import MoEConfig
from mok.ep_plan import expert_ranges
from mok.testing import bitwise_equal, by_rank, fresh_seed, make_inputs, moe_args, poison_allocator, rank_inputs, row_mm

CASES = {  # name: (config, splits of its tokens over the ranks)
    "shared": (MoEConfig("ep-shared", 300, 256, 192, 8, 3, shared_intermediate=128),
               [[300], [200, 100], [120, 0, 180], [75] * 4]),
    "E5-hot": (MoEConfig("ep-hot", 257, 128, 64, 5, 2), [[257], [100, 157], [3, 250, 4]]),
    # E = 3 over 4 ranks: one rank without experts (and one without tokens)
    "E3-over-4": (MoEConfig("ep-few", 90, 128, 64, 3, 2, shared_intermediate=64), [[30, 0, 40, 20]]),
}
GRADS = ("d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down")


def _hot(T, E, K, g):  # expert 0 in every token's routes
    idx = torch.stack([torch.zeros(T, dtype=torch.int64), torch.randint(1, E, (T,), generator=g)], 1)[:, :K]
    return idx, torch.rand(T, K, generator=g)


def _problem(name: str, device: str, precision: str = "bf16"):
    cfg, splits = CASES[name]
    seed = fresh_seed()
    inp = make_inputs(cfg, device, seed=seed, routing_fn=_hot if name == "E5-hot" else None)
    out0, saved0 = fused.forward(*moe_args(inp), precision=precision)
    return cfg, splits, seed, inp, (out0, *fused.backward(saved0, inp["d_out"]))


def _mismatches(outs: list, grads: list, want: tuple) -> list[str]:
    """What differs from the EP = 1 results `want` (out, then the eight gradients), with rank-local results
    concatenated in rank order (routed weight gradients: over the ranks' expert blocks) and the shared expert's
    weight gradients the same on every rank."""
    bad = [] if bitwise_equal(torch.cat(outs), want[0]) else ["out"]
    bad += [n for j, n in enumerate(GRADS, 1) if not bitwise_equal(torch.cat([g[j - 1] for g in grads]), want[j])]
    return bad + [f"shared grad {j}" for j in range(5, 8) if not all(bitwise_equal(g[j], want[j + 1]) for g in grads)]


def _check_every_degree(name: str, device: str, precision: str = "bf16", module=ep_peer) -> None:
    cfg, splits, seed, inp, want = _problem(name, device, precision)
    for split in splits:
        args, d_outs = by_rank(rank_inputs(inp, split))
        if device == "cuda":
            poison_allocator(64 << 20)
        outs, saved = module.forward_ranks(*args, *moe_args(inp)[6:], precision=precision)
        grads = module.backward_ranks(saved, d_outs)
        assert _mismatches(outs, grads, want) == [], f"{precision}, split {split}, seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_ep_degree_gives_the_fused_levels_bits(name, precision):
    _check_every_degree(name, "cuda", precision)


def test_every_ep_degree_gives_the_fused_levels_bits_with_l0_twins(monkeypatch):
    """The same on the CPU with L0 twins: the wiring of the tables, pulls, combines and saved state, in CI. The
    shared expert runs on each rank's tokens and its weight gradients by columns (mok.ep_shared), so the GEMM is
    row_mm (an output's bits alone, as on the GPU)."""
    twins.install(monkeypatch.setattr)
    monkeypatch.setattr(twins, "mm", row_mm)
    for name in CASES:
        for precision in ("bf16", "mxfp8"):
            _check_every_degree(name, "cpu", precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_chain_over_ranks_gives_the_fused_levels_bits(name, precision):
    """mok.ep_chain: each rank's forward one chain launch (x gathered from the tokens' ranks, the combine by the
    tile completing a token, on any rank), the backward phase by phase."""
    _check_every_degree(name, "cuda", precision, ep_chain)


def _checked_chain_ops(monkeypatch) -> list:
    """The chain ops as the twins compute them, each call first through the real op's checks and argument building
    (mok.ops.chain, its device checks off) into a binding that records its keyword arguments: returns the records."""
    from mok.ops import chain, gemm

    calls = []

    class Binding:
        def __getattr__(self, name):
            return lambda **kwargs: calls.append((name, kwargs))

    for module, name in ((chain, "check_cuda"), (chain, "_check_devices"), (gemm, "_check_devices")):
        monkeypatch.setattr(module, name, lambda *a, **k: None)
    monkeypatch.setattr(chain, "load_extension", Binding)
    def checked(real, twin):
        def call(*args, **kwargs):
            real(*args, **kwargs)
            return twin(*args, **kwargs)
        return call

    for name in ("grouped_gemm_bf16_chain", "grouped_gemm_bf16_chain_backward"):
        monkeypatch.setattr(ops, name, checked(getattr(chain, name), getattr(twins, name)))
    return calls


def test_the_chain_over_ranks_gives_the_fused_levels_bits_with_l0_twins(monkeypatch):
    """The same with L0 twins: the row ids, route table, counters and saved state, in CI, every chain launch through
    the ops' own checks to their bindings' arguments. The shared expert runs on each rank's tokens here, so the GEMM
    is row_mm (an output's bits alone, as on the GPU)."""
    twins.install(monkeypatch.setattr)
    monkeypatch.setattr(twins, "mm", row_mm)
    calls = _checked_chain_ops(monkeypatch)
    for name in CASES:
        for precision in ("bf16", "mxfp8"):
            _check_every_degree(name, "cpu", precision, ep_chain)
    over_ranks = [kw for _, kw in calls if kw["ranks"] is not None]
    assert {n for n, _ in calls} == {"grouped_gemm_bf16_chain", "grouped_gemm_bf16_chain_backward"} and over_ranks
    for kw in over_ranks:  # one entry per rank in each list the pass reads; this rank's own buffers at its entry
        lists, rank = kw["ranks"], kw["rank"]
        assert all(len(entries) in (0, len(lists[1])) for entries in lists) and 0 <= rank < len(lists[1])
        assert lists[4][rank].data_ptr() == kw["out" if "out" in kw else "d_x"].data_ptr()
        whole = ("x", "y", "topk_weights", "out", "token_done") if "out" in kw else ("d_x", "token_done")
        assert all(kw[n].data_ptr() != 0 for n in whole), "an empty view's address is 0: the launcher reads none"


PASSES = {"ep_peer": ep_peer, "ep_chain": ep_chain}  # a rank's passes, by module name


def _rank_mismatches(P: dict, rank: int, barrier, inputs: dict, split: list, want: tuple,
                     passes: str = "ep_peer") -> list[str]:
    """One rank's pass over the peers' buffers P, barrier() between phases (its passes: PASSES[passes]'s): what
    differs from the EP = 1 results of its tokens and experts."""
    g = expert_ranges(inputs["w_gate"].shape[0], len(split))[rank]
    mine = rank_inputs(inputs, split)[rank]
    module = PASSES[passes]
    out, saved = ep_peer.run_rank(module.forward_rank(P, rank, *moe_args(mine), num_experts=inputs["w_gate"].shape[0]),
                                  barrier)
    grads = ep_peer.run_rank(module.backward_rank(P, saved, mine["d_out"]), barrier)
    rows = slice(sum(split[:rank]), sum(split[: rank + 1]))
    on = lambda t: t.to(out.device)  # noqa: E731
    mine_want = (on(want[0][rows]), on(want[1][rows]), on(want[2][rows]),
                 *(on(w[g.start: g.stop]) for w in want[3:6]), *(None if w is None else on(w) for w in want[6:]))
    return _mismatches([out], [grads], mine_want)


def _one_rank(rank: int, buffers: list, barrier, inputs: dict, split: list, want: tuple, on_twins: bool, results,
              slow_rank: int, passes: str):
    """One rank in its own process over every rank's buffers (CPU shared memory or CUDA IPC: torch.multiprocessing
    passed them by handle); rank slow_rank sleeps before each of its phases (its peers wait at the barrier); puts
    (rank, its mismatches or the error)."""
    import time

    try:
        if on_twins:
            twins.install(setattr)

        def wait():
            if buffers[rank]["x"].is_cuda:  # this rank's writes have landed before its peers pass the barrier
                torch.cuda.synchronize()
            barrier.wait(60)  # a lost peer breaks the barrier: no hang
            if rank == slow_rank:
                time.sleep(0.2)
        results.put((rank, _rank_mismatches(ep_peer.peers(buffers), rank, wait, inputs, split, want, passes)))
    except BaseException as e:  # noqa: BLE001 (the parent reports it)
        results.put((rank, [repr(e)]))


def _symmetric_rank(rank: int, world_size: int, inputs: dict, split: list, want: tuple, passes: str) -> list[str]:
    """One rank per GPU (run_local_ep over NCCL), its buffers in symmetric memory."""
    import os

    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # NVLink multicast off (docs/ep.md)
    dev = torch.device("cuda", rank)
    inputs = {n: None if t is None else t.to(dev) for n, t in inputs.items()}
    shared = inputs["w_shared_gate"]
    buffers, handles = ep_peer.allocate_symmetric(max(split), inputs["topk_idx"].shape[1],
                                                  inputs["w_gate"].shape[0], inputs["x"].shape[1],
                                                  shared_intermediate=0 if shared is None else shared.shape[0])
    return _rank_mismatches(ep_peer.peers(buffers), rank, lambda: handles[0].barrier(channel=0), inputs, split,
                            want, passes)


def _run_processes(name: str, device: str, on_twins: bool, slow_rank: int = -1, passes: str = "ep_peer") -> None:
    """R = 3 processes (one rank each, uneven, a rank of no tokens) sharing the buffers of ep_peer.allocate."""
    cfg, splits, seed, inp, want = _problem(name, device)
    split = splits[2]
    ctx = torch.multiprocessing.get_context("spawn")
    buffers = ep_peer.allocate(len(split), max(split), cfg.num_topk, cfg.num_experts, cfg.hidden, device,
                               cfg.shared_intermediate)
    for b in buffers:
        for t in b.values():
            t.share_memory_()  # CPU: shared memory (CUDA tensors travel by IPC handle)
    barrier, results = ctx.Barrier(len(split)), ctx.Queue()
    procs = [ctx.Process(target=_one_rank, args=(r, buffers, barrier, inp, split, want, on_twins, results, slow_rank,
                                                 passes), daemon=True) for r in range(len(split))]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == {r: [] for r in range(len(split))}, f"seed {seed}"


@pytest.mark.slow
def test_one_rank_per_process_gives_the_same_bits(monkeypatch):
    """Each rank in its own process, buffers in CPU shared memory, L0 twins, rank 2 slow (a sleep before each of
    its phases): each rank's results are the EP = 1 bits of its tokens and experts."""
    twins.install(monkeypatch.setattr)
    _run_processes("shared", "cpu", on_twins=True, slow_rank=2)


@pytest.mark.gpu
@pytest.mark.parametrize("passes", list(PASSES))
def test_one_rank_per_process_on_one_gpu_gives_the_same_bits(passes):
    """The same on one GPU, the buffers shared by CUDA IPC, the kernels themselves; rank 0 slow. ep_chain: the
    ranks' chain launches run at once, their counters and combines crossing processes."""
    _run_processes("shared", "cuda", on_twins=False, slow_rank=0, passes=passes)


@pytest.mark.multigpu
@pytest.mark.parametrize("passes", list(PASSES))
def test_one_rank_per_gpu_over_symmetric_memory_gives_the_same_bits(passes):
    """One rank per GPU (2, uneven), the buffers in torch's symmetric memory, read over NVLink: each rank's results
    are the EP = 1 bits on GPU 0 (the same GPU model: the same kernel bits)."""
    from mok.comm import run_local_ep

    cfg, splits, seed, inp, want = _problem("shared", "cuda")
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    got = run_local_ep(_symmetric_rank, 2, {n: cpu(t) for n, t in inp.items()}, splits[1],
                       tuple(cpu(w) for w in want), passes, backend="nccl", timeout_s=300)
    assert got == [[], []], f"seed {seed}"


@pytest.mark.parametrize("hidden, R", [(256, 1), (256, 3), (7168, 8), (8, 2), (24, 4)])
def test_the_shared_weight_gradients_columns_cover_hidden_in_16_byte_units(hidden, R):
    cols = ep_shared.columns(hidden, R)
    assert len(cols) == R and cols[0].start == 0 and cols[-1].stop == hidden
    assert all(a.stop == b.start for a, b in zip(cols, cols[1:]))
    assert all(c.start % ep_shared.UNIT == 0 and 0 <= c.stop - c.start <= -(-hidden // R) + ep_shared.UNIT
               for c in cols)


@pytest.mark.parametrize("module", [ep_peer, ep_chain])
def test_the_shared_weight_gradients_are_computed_once_over_the_ranks(monkeypatch, module):
    """Each rank computes its columns of the shared expert's three weight gradients, not all of them: the
    one-expert weight-gradient calls of every rank together produce each gradient's elements once."""
    twins.install(monkeypatch.setattr)
    monkeypatch.setattr(twins, "mm", row_mm)
    if module is ep_chain:
        _checked_chain_ops(monkeypatch)
    produced = []
    real = ops.grouped_gemm_bf16_weight_grad

    def recorded(a_rows, b_rows, sched, num_sms=None):
        if sched.num_experts == 1 and sched.num_topk == 1 and sched.num_tokens == 300:  # the shared expert's
            produced.append(a_rows.shape[1] * b_rows.shape[1])
        return real(a_rows, b_rows, sched, num_sms=num_sms)

    monkeypatch.setattr(ops, "grouped_gemm_bf16_weight_grad", recorded)
    cfg, _ = CASES["shared"]
    inp = make_inputs(cfg, "cpu", seed=fresh_seed())
    args, d_outs = by_rank(rank_inputs(inp, [120, 0, 180]))
    module.backward_ranks(module.forward_ranks(*args, *moe_args(inp)[6:])[1], d_outs)
    assert sum(produced) == 3 * cfg.shared_intermediate * cfg.hidden and len(produced) == 3 * len(d_outs)


@pytest.mark.parametrize("module", [ep_peer, ep_chain])
def test_a_batch_without_tokens_gives_zero_shared_gradients_over_stale_buffers(monkeypatch, module):
    twins.install(monkeypatch.setattr)
    x, idx, w = torch.zeros(0, 16, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.int64), torch.ones(0, 2)
    experts = [torch.randn(1, 8, 16).bfloat16() for _ in range(2)]
    down = [torch.randn(1, 16, 8).bfloat16() for _ in range(2)]
    shared = [torch.randn(8, 16).bfloat16(), torch.randn(8, 16).bfloat16(), torch.randn(16, 8).bfloat16()]
    _, saved = module.forward_ranks([x, x], [idx, idx], [w, w], experts, experts, down, *shared)
    for b in saved[0][0]["sdw"].keep:
        b.fill_(7)  # an earlier pass's columns
    grads = module.backward_ranks(saved, [x, x])
    assert all(not g[j].any() for g in grads for j in range(5, 8))


def test_bad_arguments_are_named():
    x, idx, w = torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    experts = lambda n: torch.zeros(n, 8, 16, dtype=torch.bfloat16)  # noqa: E731
    with pytest.raises(ValueError, match="w_gate"):  # E = 5 over 2 ranks is blocks of 2 and 3, not 3 and 2
        ep_peer.forward_ranks([x, x], [idx, idx], [w, w], [experts(3), experts(2)], [experts(3), experts(2)],
                              [experts(3), experts(2)])
    with pytest.raises(ValueError, match="d_outs"):
        ep_peer.backward_ranks([None, None], [x])
    P = ep_peer.peers(ep_peer.allocate(1, 4, 2, 2, 16, "cpu"))  # no shared expert's buffers
    shared = [torch.zeros(8, 16, dtype=torch.bfloat16)] * 2 + [torch.zeros(16, 8, dtype=torch.bfloat16)]
    for module in (ep_peer, ep_chain):
        with pytest.raises(ValueError, match="shared_intermediate=8"):
            next(module.forward_rank(P, 0, x, idx % 2, w, experts(2), experts(2), experts(2).transpose(1, 2),
                                     *shared, num_experts=2))


def test_peers_tokens_puts_every_ranks_first_rows_in_rank_order_then_zeros():
    bufs = [torch.arange(s * 100, s * 100 + 12, dtype=torch.float32).view(4, 3) for s in range(3)]
    p = ops.Peers.of(bufs)
    assert torch.equal(p.tokens([2, 0, 1]), torch.cat([bufs[0][:2], bufs[2][:1]]))
    padded = p.tokens([2, 0, 1], slice(1, 3), num_rows=5)
    assert torch.equal(padded[:3], torch.cat([bufs[0][:2, 1:], bufs[2][:1, 1:]])) and not padded[3:].any()
