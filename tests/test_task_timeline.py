"""tools/task_timeline.py's summaries on synthetic MOK_GEMM_TRACE records (CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

spec = importlib.util.spec_from_file_location("task_timeline", Path(__file__).parents[1] / "tools" / "task_timeline.py")
timeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timeline)


def records(num_ctas=3, num_tasks=6, padded_task=2) -> pd.DataFrame:
    """CTA c's tasks back to back, each 100 + 10c cycles (90 of mainloop), from an SM clock offset of 10**6 · c;
    task `padded_task` of every CTA has rows 64.. padding. Both warpgroups record the same clocks."""
    rows = []
    for cta in range(num_ctas):
        length, clock = 100 + 10 * cta, 10**6 * cta
        for n in range(num_tasks):
            for group in (0, 1):
                rows.append([0, cta, group, cta + n * num_ctas, int(n == padded_task), clock, clock + 90,
                             clock + length])
            clock += length
    return pd.DataFrame(rows, columns=timeline.COLUMNS)


def test_start_spread_counts_from_each_ctas_first_task():
    # the n-th starts are 100n, 110n, 120n after each CTA's first (the clock offsets drop out): linear
    # quantiles of three values put p10 at 102n and p90 at 118n
    spread = timeline.start_spread(records())
    assert spread.tolist() == [16 * n for n in range(6)]


def test_summarize_splits_by_padding_and_the_previous_task():
    table = timeline.summarize(records())
    assert table.loc[(0, 1, 0), "tasks"] == 3  # the padded task, one per CTA
    assert table.loc[(0, 0, 1), "tasks"] == 3  # the task after it
    assert table.loc[(1, 0, 0), "tasks"] == 12  # the rest: 4 per CTA
    assert table.loc[(0, 0, 0), "task"] == 110 and table.loc[(0, 0, 0), "mainloop"] == 90
    assert table.loc[(0, 0, 0), "epilogue"] == 20 and table.loc[(0, 0, 0), "wait_next"] == 0
