"""mok.ep_peer: EP over peer memory, every rank's pass from its mok.ep_build tables. Its output and every gradient
equal the fused level's at EP = 1 bit for bit, for any split of the tokens over 1-4 ranks (uneven, a rank with no
tokens, experts in uneven blocks, one expert receiving every token), so the bits do not depend on the EP degree:
R ranks in one process on the GPU, and on the CPU with every kernel replaced by its L0 twin, in one process and
one rank per process (gloo barriers, buffers in shared files)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from mok import ep_peer, fused
from mok.comm import run_local_ep
from mok.config import MoEConfig
from mok.ep_plan import expert_ranges
from mok.testing import bitwise_equal, fresh_seed, make_inputs, moe_args, poison_allocator

CASES = {  # name: (config, splits of its tokens over the ranks)
    "shared": (MoEConfig("ep-shared", 300, 256, 192, 8, 3, shared_intermediate=128),
               [[300], [200, 100], [120, 0, 180], [75] * 4]),
    "E5-hot": (MoEConfig("ep-hot", 257, 128, 64, 5, 2), [[257], [100, 157], [3, 250, 4]]),
}
GRADS = ("d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down")


def _hot(T, E, K, g):  # expert 0 in every token's routes
    idx = torch.stack([torch.zeros(T, dtype=torch.int64), torch.randint(1, E, (T,), generator=g)], 1)[:, :K]
    return idx, torch.rand(T, K, generator=g)


def _use_twins(setattr=setattr) -> None:
    """Every kernel (the fused level's, the pulls and combines) replaced by its L0 twin (setattr: a test's
    monkeypatch.setattr, or plain setattr in a rank's own process)."""
    from mok import ops, twins
    for name in twins.KERNELS:
        setattr(ops, name, getattr(twins, name))
    setattr(fused, "_check_runs_here", lambda x, precision: None)


def _problem(name: str, device: str):
    cfg, splits = CASES[name]
    seed = fresh_seed()
    inp = make_inputs(cfg, device, seed=seed, routing_fn=_hot if name == "E5-hot" else None)
    out0, saved0 = fused.forward(*moe_args(inp))
    return cfg, splits, seed, inp, (out0, *fused.backward(saved0, inp["d_out"]))


def _mismatches(outs: list, grads: list, want: tuple) -> list[str]:
    """What differs from the EP = 1 results `want` (out, then the eight gradients), with rank-local results
    concatenated in rank order (routed weight gradients: over the ranks' expert blocks) and the shared expert's
    weight gradients the same on every rank."""
    bad = [] if bitwise_equal(torch.cat(outs), want[0]) else ["out"]
    bad += [n for j, n in enumerate(GRADS, 1) if not bitwise_equal(torch.cat([g[j - 1] for g in grads]), want[j])]
    return bad + [f"shared grad {j}" for j in range(5, 8) if not all(bitwise_equal(g[j], want[j + 1]) for g in grads)]


def _check_every_degree(name: str, device: str) -> None:
    cfg, splits, seed, inp, want = _problem(name, device)
    args = moe_args(inp)
    for split in splits:
        experts = expert_ranges(cfg.num_experts, len(split))
        part = [list(inp[n].split(split)) for n in ("x", "topk_idx", "topk_weights", "d_out")]
        local = [[inp[n][g.start: g.stop] for g in experts] for n in ("w_gate", "w_up", "w_down")]
        if device == "cuda":
            poison_allocator(64 << 20)
        outs, saved = ep_peer.forward_ranks(*part[:3], *local, *args[6:])
        grads = ep_peer.backward_ranks(saved, part[3])
        assert _mismatches(outs, grads, want) == [], f"split {split}, seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_every_ep_degree_gives_the_fused_levels_bits(name):
    _check_every_degree(name, "cuda")


def test_every_ep_degree_gives_the_fused_levels_bits_with_l0_twins(monkeypatch):
    """The same on the CPU with L0 twins: the wiring of the tables, pulls, combines and saved state, in CI."""
    _use_twins(monkeypatch.setattr)
    for name in CASES:
        _check_every_degree(name, "cpu")


def _mapped_buffers(directory: str, shapes: dict, num_ranks: int) -> list[dict]:
    """Every rank's buffers as files in `directory` mapped into this process (shared: one rank's writes are every
    process's reads), the CPU stand-in for CUDA IPC or symmetric memory."""
    return [{name: torch.from_file(os.path.join(directory, f"{s}_{name}"), shared=True, size=rows * width,
                                   dtype=dtype).view(rows, width) for name, (rows, width, dtype) in shapes.items()}
            for s in range(num_ranks)]


def _one_rank(rank: int, world_size: int, directory: str, shapes: dict, inputs: dict, split: list, want: tuple):
    """One rank in its own process (run_local_ep): its pass over the mapped buffers, gloo barriers between phases;
    what differs from the EP = 1 results."""
    import torch.distributed as dist

    _use_twins()
    P = ep_peer.peers(_mapped_buffers(directory, shapes, world_size))
    g = expert_ranges(inputs["w_gate"].shape[0], world_size)[rank]
    mine = {n: inputs[n].split(split)[rank] for n in ("x", "topk_idx", "topk_weights", "d_out")}
    experts = [inputs[n][g.start: g.stop] for n in ("w_gate", "w_up", "w_down")]
    shared = [inputs[n] for n in ("w_shared_gate", "w_shared_up", "w_shared_down")]
    out, saved = ep_peer.run_rank(ep_peer.forward_rank(P, rank, mine["x"], mine["topk_idx"], mine["topk_weights"],
                                                       *experts, *shared, num_experts=inputs["w_gate"].shape[0]),
                                  dist.barrier)
    grads = ep_peer.run_rank(ep_peer.backward_rank(P, saved, mine["d_out"]), dist.barrier)
    first = sum(split[:rank])
    rows = slice(first, first + split[rank])
    mine_want = (want[0][rows], want[1][rows], want[2][rows], *(w[g.start: g.stop] for w in want[3:6]), *want[6:])
    return _mismatches([out], [grads], mine_want)


@pytest.mark.slow
def test_one_rank_per_process_gives_the_same_bits(monkeypatch):
    """R = 3 processes (one rank each, uneven with a rank of no tokens), L0 twins, buffers shared through files:
    each rank's results are the EP = 1 bits of its tokens and experts."""
    _use_twins(monkeypatch.setattr)
    cfg, splits, seed, inp, want = _problem("shared", "cpu")
    split = splits[2]
    shapes = ep_peer.buffer_shapes(len(split), max(split), cfg.num_topk, cfg.num_experts, cfg.hidden)
    with tempfile.TemporaryDirectory(prefix="mok_ep_peer_") as directory:
        for s in range(len(split)):
            for name, (rows, width, dtype) in shapes.items():
                with open(os.path.join(directory, f"{s}_{name}"), "wb") as f:
                    f.truncate(rows * width * dtype.itemsize)
        results = run_local_ep(_one_rank, len(split), directory, shapes, inp, split, want)
    assert results == [[]] * len(split), f"seed {seed}"
