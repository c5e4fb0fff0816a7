"""L2 `fused` on tensors of more than 2^31 elements: every kernel indexes them in 64 bits.

A user may run a whole layer on one GPU, e.g. 256 experts of width 2304 at hidden 4096 (each routed weight
2.4·10^9 elements) with 66,000 tokens of top-8 (the row buffers 2.2–2.3·10^9 elements). An offset computed in
32 bits anywhere would wrap there, silently. The check is exact and needs no L0 at that size: every per-token
result (out, d_x, d_topk_weights) is a function of the token's own routes' rows, summed in a fixed order
wherever those rows sit, and an expert's weight gradients sum its rows in route order from its segment's start
(DESIGN §5). So the tokens routed to the last expert, run alone with the same weights, must give their rows'
results and the last expert's weight gradients bit for bit, although in the big run those rows sit at the end of
the row buffers and that expert's gradients at the end of the weight gradients, past 2^31 elements. Both
precisions, and MXFP8 on both weight paths and inside the weight cache (its round trips are local to a token's
row or to the expert's segment's 32-row blocks, so the argument holds for them too). The big run peaks at 62 GB of
GPU memory in either precision, 15.6 GB of it the inputs (H200, 78e18e2; mark `bigmem`); inside the weight cache
the weights' round trips add 29 GB (mark `bigmem(gib=120)`: an H200).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import mok
from mok import fused, testing
from mok.config import MoEConfig
from mok.testing import bitwise_equal, fresh_seed, make_inputs, run_level

LARGE = MoEConfig("large", num_tokens=66_000, hidden=4096, intermediate=2304, num_experts=256, num_topk=8,
                  shared_intermediate=512)
ROUTED_GRADS = ("d_w_gate", "d_w_up", "d_w_down")
PER_TOKEN = ("x", "topk_idx", "topk_weights", "d_out")


def test_large_shape_is_past_int32():
    """The shape reaches past 2^31 elements where it should: each routed weight and the row buffers."""
    limit = 2**31
    assert LARGE.num_experts * LARGE.intermediate * LARGE.hidden > limit  # w_gate, w_up, w_down, their grads
    assert LARGE.num_routes * LARGE.hidden > limit  # y rows, dy rows, the backward's x rows: before padding
    assert LARGE.num_routes < limit  # route ids stay int32 (the schedule's launcher checks it)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.bigmem
@pytest.mark.parametrize("precision,mx_weights,cached", [("bf16", "dequantize", False),
                                                         ("mxfp8", "dequantize", False),
                                                         ("mxfp8", "mainloop", False),
                                                         pytest.param("mxfp8", "dequantize", True,
                                                                      marks=pytest.mark.bigmem(gib=120))],
                         ids=["bf16", "mxfp8", "mxfp8-mainloop", "mxfp8-cached"])
def test_past_int32_the_last_expert_matches_its_tokens_alone(precision, mx_weights, cached, monkeypatch):
    monkeypatch.setattr(fused, "DEFAULT_MX_WEIGHTS", mx_weights)
    seed = fresh_seed()
    inputs = make_inputs(LARGE, device="cuda", seed=seed, draw_on="cuda")
    last = LARGE.num_experts - 1
    tokens = (inputs["topk_idx"] == last).any(dim=1).nonzero().squeeze(1)  # ascending: route order is kept
    assert tokens.numel() > 0, f"no token routed to expert {last} (seed {seed})"
    context = mok.mxfp8_weight_cache if cached else contextlib.nullcontext

    def run(problem: dict, rows) -> tuple:
        """(out, grads), each per-token result cut to `rows` and each routed weight's grad to the last expert."""
        testing.poison_allocator(1 << 30)
        with context():
            out, grads = run_level(fused, problem, precision=precision, swiglu_limit=1.0)
        grads = dict(zip(testing.GRAD_NAMES, grads))
        kept = {name: grads[name][rows].clone() for name in ("d_x", "d_topk_weights")}
        kept.update({name: grads[name][last].clone() for name in ROUTED_GRADS})
        return out[rows].clone(), kept

    big = run(inputs, tokens)
    torch.cuda.empty_cache()
    alone = run({k: (v[tokens] if k in PER_TOKEN else v) for k, v in inputs.items()}, slice(None))
    what = f"{precision} {mx_weights}{' cached' if cached else ''}, {tokens.numel()} tokens (seed {seed})"
    assert torch.isfinite(big[0]).all(), f"out of the big run has non-finite elements: {what}"
    assert bitwise_equal(big[0], alone[0]), f"out: bits differ past 2^31 elements: {what}"
    for name, g in big[1].items():
        assert torch.isfinite(g).all(), f"{name} of the big run has non-finite elements: {what}"
        assert bitwise_equal(g, alone[1][name]), f"{name}: bits differ past 2^31 elements: {what}"
