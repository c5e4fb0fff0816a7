"""The megakernel level at EP = 1 (mok.megakernel): the layer's forward in one launch of the chain kernel gives the
fused level's out and saved state bit for bit, and through mok.moe the fused level's gradients: on the CPU with every
kernel an L0 twin (the wiring: schedules, the shared expert's rows, what is saved), and on a Hopper GPU with the
kernels."""

from __future__ import annotations

import pytest
import torch

import mok
from mok import fused, megakernel, ops, twins
from mok.config import TINY_SHAPES, MoEConfig
from mok.ops.gemm import weight_grad_schedule_tensors
from mok.routing import hot_expert_routing, random_routing
from mok.testing import bitwise_equal, fresh_seed, make_inputs, moe_args, poison_allocator

SHAPES = {**TINY_SHAPES, "wide": MoEConfig("wide", 300, 544, 192, 8, 3, shared_intermediate=136)}


def _assert_fused_bits(shape: str, device: str, limit, precision: str = "bf16") -> None:
    seed = fresh_seed()
    inputs = make_inputs(SHAPES[shape], device=device, seed=seed, draw_on=device)
    args = moe_args(inputs)
    out0, saved0 = fused.forward(*args, swiglu_limit=limit, precision=precision)
    grads0 = fused.backward(saved0, inputs["d_out"])
    if device == "cuda":
        poison_allocator(64 << 20)
    out, saved = megakernel.forward(*args, swiglu_limit=limit, precision=precision)
    assert bitwise_equal(out, out0), f"{shape}: out (seed {seed})"
    grads = megakernel.backward(saved, inputs["d_out"])
    for i, (g, g0) in enumerate(zip(grads, grads0)):
        assert bitwise_equal(g, g0), f"{shape}: gradient {i} (seed {seed})"


def _assert_layer_gives_fused_bits(device: str, precision: str) -> None:
    """mok.moe(backend="megakernel") through autograd and the custom ops: the fused level's out and gradients."""
    seed = fresh_seed()
    inputs = make_inputs(SHAPES["wide"], device=device, seed=seed, draw_on=device)
    args = moe_args(inputs)
    out0, saved0 = fused.forward(*args, swiglu_limit=0.7, precision=precision)
    want = fused.backward(saved0, inputs["d_out"])
    leaves = [a.detach().clone().requires_grad_() if a is not None and a.is_floating_point() else a for a in args]
    out = mok.moe(*leaves, swiglu_limit=0.7, precision=precision, backend="megakernel")
    out.backward(inputs["d_out"])
    assert bitwise_equal(out.detach(), out0), f"out (seed {seed})"
    got = [leaves[0].grad, leaves[2].grad, *(a.grad for a in leaves[3:])]
    for i, (g, w) in enumerate(zip(got, want)):
        assert bitwise_equal(g, w), f"gradient {i} (seed {seed})"


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("limit", [None, 0.7])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_launch_gives_the_fused_bits_with_l0_twins(monkeypatch, shape, limit, precision):
    twins.install(monkeypatch.setattr)
    _assert_fused_bits(shape, "cpu", limit, precision)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("limit", [None, 0.7])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_one_launch_gives_the_fused_bits(shape, limit, precision):
    _assert_fused_bits(shape, "cuda", limit, precision)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_the_level_through_mok_moe_with_l0_twins(monkeypatch, precision):
    twins.install(monkeypatch.setattr)
    _assert_layer_gives_fused_bits("cpu", precision)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_the_level_through_mok_moe(precision):
    _assert_layer_gives_fused_bits("cuda", precision)


def test_one_launch_names_a_bad_precision_and_takes_an_empty_batch(monkeypatch):
    monkeypatch.setattr(fused, "_check_runs_here", lambda x, precision: None)
    inputs = make_inputs(TINY_SHAPES["tiny"].scaled(num_tokens=0))
    with pytest.raises(ValueError, match="precision"):
        megakernel.forward(*moe_args(inputs), precision="fp8")
    out, saved = megakernel.forward(*moe_args(inputs))
    assert out.shape == (0, 64) and all(not g.any() for g in megakernel.backward(saved, inputs["d_out"])[2:])


def test_the_level_takes_num_sms_only_and_auto_keeps_the_fused_level():
    inputs = make_inputs(TINY_SHAPES["tiny"])
    with pytest.raises(ValueError, match="mx_weights"):
        mok.moe(*moe_args(inputs), backend="megakernel", mx_weights="mainloop")
    assert mok.levels.HOPPER_LEVELS[0] == "fused"


@pytest.mark.parametrize("block_m", [128, 256])
@pytest.mark.parametrize("kind", ["random", "hot", "empty-experts"])
def test_backward_chain_counter_targets_match_the_schedule(kind, block_m):
    """The backward chain's weight-gradient tasks wait until expert e's counter reaches kNumConsumerWarps ·
    (expert_offsets[e + 1] - expert_offsets[e]) / 128, and each consumer warp of a row task (in MXFP8: of a round-trip
    task, one per row task) adds 1 to the counter of its tile's expert (tile_to_expert): the two agree only if the
    real 128-row tiles of each expert are exactly its segment's. On the schedules the kernels read
    (make_schedule_cuda without a sync: spare tiles past the real rows), for skewed routings, empty experts and
    schedule tiles of two kernel tiles."""
    g = torch.Generator().manual_seed(fresh_seed())
    T, E, K = 300, 16, 4
    if kind == "hot":
        topk_idx, _ = hot_expert_routing(T, E, K, hot_expert=3, hot_fraction=0.9, generator=g)
    else:
        topk_idx, _ = random_routing(T, K + 1 if kind == "empty-experts" else E, K, generator=g)
    sched = twins.make_schedule_cuda(topk_idx, E, block_m=block_m, sync=False)
    _, tile_to_expert = ops.gemm_schedule_tensors(sched, "cpu")  # per 128-row kernel tile
    offsets, _ = weight_grad_schedule_tensors(sched, "cpu")
    real_tiles = int(sched.counts[0]) // ops.GEMM_BLOCK_M  # the row tasks: the real m-tiles
    signals = torch.bincount(tile_to_expert[:real_tiles].long(), minlength=E)  # row tasks per expert
    targets = (offsets[1:] - offsets[:-1]) // ops.GEMM_BLOCK_M  # the kernel's expert_target / kNumConsumerWarps
    assert signals.tolist() == targets.tolist()
    assert int(offsets[-1]) == int(sched.counts[0]) and bool((tile_to_expert[real_tiles:] < 0).all())


def test_the_timeline_tool_reads_a_trace():
    """tools/chain_timeline.py's decoding of a chain trace (gemm/trace.cuh's rows) and its summary, on a made-up
    trace: SM and kind from the where field, times from the first begin, waits only where a wait was marked, rows
    never begun left out."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("chain_timeline",
                                                  Path(__file__).parents[1] / "tools" / "chain_timeline.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ns = 1_000_000
    trace = torch.tensor([[5 << 32 | 1, 0, 0, ns, ns + 4000],  # routed gate_up on SM 5
                          [7 << 32 | 3, ns + 1000, ns + 3000, ns + 500, ns + 9000],  # routed down, waited 2 µs
                          [0, 0, 0, 0, 0]])  # never begun
    df = tool.rows_of(trace, ops.chain.FORWARD_KINDS, "fwd")
    assert df[["sm", "kind", "group"]].values.tolist() == [[5, "gate_up", "routed"], [7, "down", "routed"]]
    assert df.begin_us.tolist() == [0.0, 0.5] and df.end_us.tolist() == [4.0, 9.0] and df.wait_us.tolist() == [0, 2]
    s = tool.summary(df).set_index("kind")
    assert s.loc["down", "wait_us"] == 2 and s.loc["gate_up", "busy_us"] == 4
    late = tool.rows_of(trace, ops.chain.FORWARD_KINDS, "fwd", t0=ns - 10_000)  # a rank's rows on a shared clock
    assert late.begin_us.tolist() == [10.0, 10.5]
    assert tool.summary(late).share_of_sm_time.sum() == pytest.approx((4 + 8.5) / (9 * 2))  # span from the first
