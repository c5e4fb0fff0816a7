"""tools/mx_steps_ab.py on the CPU, its kernels replaced by their L0 twins: the two ways of each step give the
same bits, so its A/B times the same work done two ways."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from mok import fused, ops, twins
from mok.config import TINY_SHAPES
from mok.testing import bitwise_equal, fresh_seed, make_inputs

spec = importlib.util.spec_from_file_location("mx_steps_ab", Path(__file__).parents[1] / "tools" / "mx_steps_ab.py")
mx_steps_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mx_steps_ab)


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _flat(item)]
    return [] if out is None else [out]


def test_both_ways_of_every_step_give_the_same_bits(monkeypatch):
    for name in twins.KERNELS:
        monkeypatch.setattr(ops, name, getattr(twins, name))
    monkeypatch.setattr(fused, "_check_runs_here", lambda x, precision: None)  # cache_step runs the level
    seed = fresh_seed()
    cfg = TINY_SHAPES["tiny"]
    inputs = make_inputs(cfg, seed=seed)
    inputs["topk_idx"] = torch.arange(cfg.num_topk).expand(cfg.num_tokens, -1).contiguous()  # few, full experts:
    # the no-sync schedule of row_round_trips then has spare rows
    sched = ops.make_schedule_cuda(inputs["topk_idx"], cfg.num_experts)
    inputs = mx_steps_ab.with_backward_operands(inputs, sched)
    real = int(inputs["spare"]["sched"].expert_offsets[-1])  # row_round_trips' real rows (the rest are spare)
    for step, ways in mx_steps_ab.STEPS.items():
        separate, one = (_flat(way(inputs, sched)) for way in ways.values())
        assert len(separate) == len(one) > 0, step
        for i, (a, b) in enumerate(zip(separate, one)):
            if step == "row_round_trips":
                assert a.shape[0] > real, f"{step}: no spare rows (seed {seed})"
                a, b = a[:real], b[:real]
            assert bitwise_equal(a, b), f"{step}: output {i} differs between the ways (seed {seed})"
