"""The megakernel's tables built with tensor ops (mok.ep_build) equal plan_tables of mok.ep_plan's plan, table by
table, on the plan tests' irregular cases at EP 1-4 (uneven ranks, a rank without tokens, a hot expert, E % R != 0, a
rank without experts, with and without a shared expert, tiles of 8 and 5 rows) and on 40 random problems (empty
batches, block_m 1 to 8, up to 5 ranks)."""

from __future__ import annotations

import pytest
import torch

from mok import ep_plan
from mok.ep_build import build_tables
from mok.ep_tables import TABLES, check_tables, plan_tables
from mok.schedule import make_schedule
from tests.test_ep_plan import CASES, SPLITS


def assert_same_tables(idx, split, E, **sizes):
    plan = ep_plan.make_ep_plan(idx, split, E, **sizes)
    for pass_ in ep_plan.PHASES:
        built = [build_tables(idx, split, E, r, pass_, **sizes) for r in range(len(split))]
        for r, tables in enumerate(built):
            want = plan_tables(plan, r, pass_)
            for name in TABLES:
                assert tables[name].dtype == torch.int32 and tables[name].is_contiguous(), name
                assert torch.equal(tables[name], want[name]), f"{pass_}, rank {r}, {name}: {sizes}, split {split}"
        check_tables(built, pass_)


@pytest.mark.parametrize("block_m", [8, 5])
@pytest.mark.parametrize("name,R", [(name, R) for name in CASES for R in (1, 2, 3)] + [("mxfp8-E3", 4)])
def test_built_tables_equal_the_plans(name, R, block_m):
    c = CASES[name]()
    shared = 0 if c["w_shared_gate"] is None else c["w_shared_gate"].shape[0]
    assert_same_tables(c["topk_idx"], SPLITS[R](c["x"].shape[0]), c["num_experts"], hidden=c["x"].shape[1],
                       intermediate=c["w_gate"].shape[1], shared_intermediate=shared, block_m=block_m, block_n=32)


def test_built_tables_equal_the_plans_on_random_problems():
    gen = torch.Generator().manual_seed(1)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (), generator=gen))  # noqa: E731
    for _ in range(40):
        T, E, K, R = draw(0, 40), draw(1, 9), draw(1, 4), draw(1, 6)
        idx = torch.randint(0, E, (T, K), generator=gen)
        cuts = torch.randint(0, T + 1, (R - 1,), generator=gen).sort().values.tolist()
        split = [b - a for a, b in zip([0, *cuts], [*cuts, T])]
        assert_same_tables(idx, split, E, hidden=32 * draw(1, 4), intermediate=32 * draw(1, 4),
                           shared_intermediate=32 * draw(0, 3), block_m=draw(1, 9), block_n=32)


def test_build_errors_name_the_argument():
    idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="pass_"):
        build_tables(idx, [4], 2, 0, "sideways", hidden=32, intermediate=32)
    with pytest.raises(ValueError, match="rank"):
        build_tables(idx, [2, 2], 2, 2, "forward", hidden=32, intermediate=32)
    with pytest.raises(ValueError, match="tokens_per_rank"):
        build_tables(idx, [2, 1], 2, 0, "forward", hidden=32, intermediate=32)
    with pytest.raises(ValueError, match="sched"):
        build_tables(idx, [4], 2, 0, "forward", hidden=32, intermediate=32, sched=make_schedule(idx, 2, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("sync", [True, False])
def test_built_tables_on_the_gpu_equal_the_plans(sync):
    """On a GPU from ops.make_schedule_cuda's schedule (with sync=False, its spare rows included): the CPU plan's
    tables, at EP = 3 with a shared expert and uneven ranks."""
    from mok import ops

    c = CASES["bf16-shared"]()
    split, E = SPLITS[3](c["x"].shape[0]), c["num_experts"]
    sizes = dict(hidden=64, intermediate=64, shared_intermediate=32, block_m=8, block_n=32)
    plan = ep_plan.make_ep_plan(c["topk_idx"], split, E, **sizes)
    idx = c["topk_idx"].cuda()
    sched = ops.make_schedule_cuda(idx, E, block_m=8, sync=sync)
    for pass_ in ep_plan.PHASES:
        for r in range(3):
            got = build_tables(idx, split, E, r, pass_, sched=sched, **sizes)
            want = plan_tables(plan, r, pass_)
            assert all(torch.equal(got[name].cpu(), want[name]) for name in TABLES), f"{pass_}, rank {r}"
