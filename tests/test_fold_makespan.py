"""tools/fold_makespan.py (CPU): the kernel's grouped task order, the tails it would fold, and the two ways of
handing out tasks that the model compares."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mok.config import MoEConfig

spec = importlib.util.spec_from_file_location("fold_makespan", Path(__file__).parents[1] / "tools" / "fold_makespan.py")
fold_makespan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fold_makespan)


def test_task_order_is_decode_tasks_grouped_order():
    order = fold_makespan.task_order(num_m_tiles=10, num_n_tiles=3, group_m=8)
    assert sorted(order) == [(m, n) for m in range(10) for n in range(3)], "every tile once"
    assert order[:9] == [(m, 0) for m in range(8)] + [(0, 1)], "m fastest inside a group of 8"
    assert order[24:] == [(8, 0), (9, 0), (8, 1), (9, 1), (8, 2), (9, 2)], "the last group, smaller"
    assert fold_makespan.task_order(3, 2, group_m=1) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_tails_are_an_experts_later_tiles_of_at_most_32_routes_after_a_full_one():
    experts = [0, 0, 1, 1, 1, 2, 3, 3, 4, 4, 4]
    rows = [128, 20, 128, 128, 40, 5, 128, 32, 128, 14, 0]  # expert 4: a schedule of 384-row segments
    assert fold_makespan.tails(experts, rows) == [False, True, False, False, False, False, False, True, False, True,
                                                  False]


@pytest.mark.parametrize("counter", [False, True])
def test_makespan_of_even_tasks_is_the_waves(counter):
    assert fold_makespan.makespan([1.0] * 10, grid=4, counter=counter) == 3


def test_the_counter_evens_out_uneven_tasks_that_the_stride_piles_up():
    costs = [2.0, 1.0, 2.0, 1.0, 0.0]  # the stride gives CTA 0 both long tasks; a cost 0 task is not run
    assert fold_makespan.makespan(costs, grid=2, counter=False) == 4
    assert fold_makespan.makespan(costs, grid=2, counter=True) == 3


def test_fold_rows_on_a_small_shape():
    cfg = MoEConfig("small", 560, 256, 256, 4, 2)  # ~280 routes per expert: tiles of 128, 128 and ~24
    rows = fold_makespan.fold_rows(cfg, costs=(1.0,), grid=8)
    assert rows[0]["tails"] > 0
    gemms = ("gemm1", "gemm2", "down_dgrad", "gate_up_dgrad")
    assert {(r["gemm"], r["order"]) for r in rows} == {(g, o) for g in gemms for o in ("static", "counter")}
    for r in rows:  # folding at no extra cost never adds work, and removes the tails' tasks
        assert r["work_ratio"] == pytest.approx(1 - r["tails"] / r["m_tiles"])
        assert 0 < r["end_ratio"] <= 1 + 1e-9 or r["order"] == "static"
