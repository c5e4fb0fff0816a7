"""`python -m bench route` (bench.route) on the CPU: its rows, their moved share against the same draw
rounded here, and the CSV they merge into."""

import pandas as pd
import pytest
import torch

from bench.__main__ import main as bench_main
from bench.timing import read_rows
from mok import routing


def test_route_rows_on_a_tiny_shape(tmp_path):
    out = tmp_path / "route.csv"
    assert bench_main(["route", "--shapes", "tiny-noshared", "--tile", "8", "--iters", "2", "--out", str(out)]) == 0
    rows = read_rows(out)
    assert len(rows) == 1
    row = rows.iloc[0]
    assert (row["shape"], row["tile"], row["gpu"]) == ("tiny-noshared", 8, "cpu")
    assert row["plain_ms"] > 0 and row["rounded_ms"] > 0 and row["round_ms"] == pytest.approx(
        row["rounded_ms"] - row["plain_ms"])
    assert row["round_kernel_ms"] > 0 and row["round_twin_ms"] > 0  # on the CPU both time the twin
    assert pd.isna(row["round_graph_ms"])  # a CUDA graph's replay: GPUs only
    # the moved share is the one of the same draw, rounded here
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(int(row["num_tokens"]), int(row["num_experts"]), generator=g)
    k = int(row["num_topk"])
    plain, rounded = routing.softmax_topk(logits, k)[0], routing.softmax_topk(logits, k, tile=8)[0]
    assert row["routes_moved_pct"] == pytest.approx(100 * float(routing.moved_routes(plain, rounded).float().mean()))
    assert 0 < row["routes_moved_pct"] < 50
    # a second run replaces its row (same shape, tile, gpu) and keeps another tile's
    bench_main(["route", "--shapes", "tiny-noshared", "--tile", "4", "--iters", "2", "--out", str(out)])
    bench_main(["route", "--shapes", "tiny-noshared", "--tile", "8", "--iters", "2", "--out", str(out)])
    assert sorted(pd.read_csv(out)["tile"]) == [4, 8]
