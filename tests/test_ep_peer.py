"""mok.ep_peer: EP over peer memory, every rank's pass from its mok.ep_build tables, R ranks in one process on one
GPU. Its output and every gradient equal the fused level's at EP = 1 bit for bit, for any split of the tokens over
1-4 ranks (uneven, a rank with no tokens, experts in uneven blocks, one expert receiving every token), so the
bits do not depend on the EP degree. On the GPU, and on the CPU with every kernel replaced by its L0 twin."""

from __future__ import annotations

import pytest
import torch

from mok import fused
from mok.config import MoEConfig
from mok.ep_plan import expert_ranges
from mok.testing import bitwise_equal, fresh_seed, make_inputs, moe_args, poison_allocator


CASES = {  # name: (config, splits of its tokens over the ranks, routing)
    "shared": (MoEConfig("ep-shared", 300, 256, 192, 8, 3, shared_intermediate=128), [[300], [200, 100],
                                                                                    [120, 0, 180], [75] * 4]),
    "E5-hot": (MoEConfig("ep-hot", 257, 128, 64, 5, 2), [[257], [100, 157], [3, 250, 4]]),
}


def _hot(T, E, K, g):  # expert 0 in every token's routes
    idx = torch.stack([torch.zeros(T, dtype=torch.int64), torch.randint(1, E, (T,), generator=g)], 1)[:, :K]
    return idx, torch.rand(T, K, generator=g)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_every_ep_degree_gives_the_fused_levels_bits(name):
    _check_every_degree(name, "cuda")


def _check_every_degree(name: str, device: str) -> None:
    from mok import ep_peer

    cfg, splits = CASES[name]
    seed = fresh_seed()
    inp = make_inputs(cfg, device, seed=seed, routing_fn=_hot if name == "E5-hot" else None)
    args = moe_args(inp)
    out0, saved0 = fused.forward(*args)
    grads0 = fused.backward(saved0, inp["d_out"])
    for split in splits:
        R = len(split)
        experts = expert_ranges(cfg.num_experts, R)
        part = lambda t, split=split: list(t.split(split))  # noqa: E731
        local = lambda w, experts=experts: [w[g.start: g.stop] for g in experts]  # noqa: E731
        if device == "cuda":
            poison_allocator(64 << 20)
        outs, saved = ep_peer.forward_ranks(part(inp["x"]), part(inp["topk_idx"]), part(inp["topk_weights"]),
                                            local(inp["w_gate"]), local(inp["w_up"]), local(inp["w_down"]), *args[6:])
        assert bitwise_equal(torch.cat(outs), out0), f"out, split {split}, seed {seed}"
        grads = ep_peer.backward_ranks(saved, part(inp["d_out"]))
        assert bitwise_equal(torch.cat([g[0] for g in grads]), grads0[0]), f"d_x, split {split}, seed {seed}"
        assert bitwise_equal(torch.cat([g[1] for g in grads]), grads0[1]), f"d_topk_weights, {split}, seed {seed}"
        for j, name_w in enumerate(("d_w_gate", "d_w_up", "d_w_down"), 2):
            assert bitwise_equal(torch.cat([g[j] for g in grads]), grads0[j]), f"{name_w}, {split}, seed {seed}"
        for j in range(5, 8):
            assert all(bitwise_equal(g[j], grads0[j]) for g in grads), f"shared grad {j}, {split}, seed {seed}"


def test_every_ep_degree_gives_the_fused_levels_bits_with_l0_twins(monkeypatch):
    """The same on the CPU, every kernel (the fused level's and the pulls and combines) replaced by its L0 twin
    (mok.twins): the wiring of the tables, pulls, combines and saved state, in CI."""
    from mok import ops, twins

    for name in twins.KERNELS:
        monkeypatch.setattr(ops, name, getattr(twins, name))
    monkeypatch.setattr(fused, "_check_runs_here", lambda x, precision: None)
    for name in CASES:
        _check_every_degree(name, "cpu")
