"""The routed forward in one binding call (mok.ops.routed_forward_bf16) against the four calls it stands for.

GPU (Hopper): make_schedule_cuda(sync=False), GEMM1, GEMM2 and combine_rows(check_rows=False) called one by one
must give the same bits: every schedule field (Schedule.equal) and GEMM view, gate, up and y_rows on the
schedule's real rows (spare rows are never written by either), and out; on routings with empty experts and a
hot expert, with and without the shared expert's rows and a swiglu_limit, for two persistent grid sizes. The
allocator is poisoned before each call. CPU: bad arguments raise errors that name them, before any device work.
"""

from __future__ import annotations

import pytest
import torch

from mok import ops
from mok.config import STANDARD_SHAPES, TINY_SHAPES
from mok.routing import hot_expert_routing
from mok.testing import bitwise_equal, fresh_seed, make_inputs, poison_allocator

CASES = {"tiny": TINY_SHAPES["tiny"], "tiny-top1": TINY_SHAPES["tiny-top1"], "tiny-top8": TINY_SHAPES["tiny-top8"],
         "qwen3-30b-300": STANDARD_SHAPES["qwen3-30b-a3b"].scaled(num_tokens=300)}


def _step_by_step(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared, limit, num_sms):
    sched = ops.make_schedule_cuda(topk_idx, w_gate.shape[0], block_m=128, sync=False)
    h, gate, up = ops.grouped_gemm_bf16_swiglu_gather(x, w_gate, w_up, sched, swiglu_limit=limit, num_sms=num_sms)
    y_rows = ops.grouped_gemm_bf16_nt_contiguous(h, w_down, sched, num_sms=num_sms)
    out = ops.combine_rows(y_rows, sched.route_to_row, topk_weights, shared, check_rows=False)
    return sched, y_rows, gate, up, out


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("routing", ["random", "hot"])
@pytest.mark.parametrize("case", list(CASES))
def test_routed_forward_is_the_four_calls(case, routing, limit):
    seed = fresh_seed()
    cfg = CASES[case]
    routing_fn = None
    if routing == "hot":  # expert 0 on 90% of the tokens, the last experts on none
        def routing_fn(T, E, K, generator):
            used = max(K, E - 2)
            return hot_expert_routing(T, used, K, hot_fraction=1.0 if used == K else 0.9, generator=generator)
    inputs = make_inputs(cfg, device="cuda", seed=seed, draw_on="cuda", routing_fn=routing_fn)
    x, w_gate, w_up, w_down = (inputs[n] for n in ("x", "w_gate", "w_up", "w_down"))
    g = torch.Generator(device="cuda").manual_seed(seed)
    shared = torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16)  # [T, H]
    for with_shared, num_sms in ((True, None), (False, 3)):
        args = (x, inputs["topk_idx"], inputs["topk_weights"], w_gate, w_up, w_down, shared if with_shared else None,
                limit, num_sms)
        poison_allocator(64 << 20)
        want = _step_by_step(*args)
        poison_allocator(64 << 20)
        got = ops.routed_forward_bf16(*args)
        what = f"{case} {routing} limit={limit} shared={with_shared} num_sms={num_sms} (seed {seed})"
        assert got[0].equal(want[0]), f"{what}: schedule"
        for a, b in zip(got[0].gemm_tensors, want[0].gemm_tensors):
            assert torch.equal(a, b), f"{what}: the schedule's GEMM views"
        real = int(want[0].counts[0])  # the schedule's real padded rows; spare rows past them are never written
        for name, a, b in zip(("y_rows", "gate", "up"), got[1:4], want[1:4]):
            assert a.shape == b.shape and bitwise_equal(a[:real], b[:real]), f"{what}: {name}"
        assert bitwise_equal(got[4], want[4]), f"{what}: out"


# ---- CPU: bad arguments ---------------------------------------------------------------------------------


def _cpu_args():
    cfg = TINY_SHAPES["tiny"]
    inputs = make_inputs(cfg, seed=0)
    return {n: inputs[n] for n in ("x", "topk_idx", "topk_weights", "w_gate", "w_up", "w_down")}


@pytest.mark.parametrize("name,bad,message", [
    ("w_down", lambda a: a["w_down"].transpose(1, 2), r"w_down: expected shape \[num_experts, hidden, intermediate\]"),
    ("w_up", lambda a: a["w_up"].float(), "w_up: expected dtype torch.bfloat16"),
    ("x", lambda a: a["x"][:-1], r"x: expected shape \[num_tokens, hidden\]"),
    ("topk_weights", lambda a: a["topk_weights"].bfloat16(), "topk_weights: expected dtype torch.float32"),
    ("topk_idx", lambda a: a["topk_idx"].int(), "topk_idx"),
    ("x", lambda a: a["x"], "x: expected a CUDA tensor"),  # every operand right, but on the CPU
])
def test_routed_forward_bad_arguments_raise_clear_errors(name, bad, message):
    args = _cpu_args()
    args[name] = bad(args)
    with pytest.raises((ValueError, TypeError), match=message):
        ops.routed_forward_bf16(**args)
