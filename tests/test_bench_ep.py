"""bench.ep on the CPU: gloo ranks, L1 for the local experts, a tiny shape; the rows its GPU run writes."""

from __future__ import annotations

from bench import ep
from bench.timing import read_rows


def test_ep_bench_writes_a_row_per_level_precision_and_pass(tmp_path):
    out = tmp_path / "ep.csv"
    assert ep.main(["--shapes", "tiny", "--ep", "2", "--levels", "torch", "reference", "--precisions", "bf16",
                    "--passes", "fwd", "fwd+bwd", "--iters", "2", "--device", "cpu", "--out", str(out)]) == 0
    rows = read_rows(out)
    assert len(rows) == 4 and set(rows["level"]) == {"torch", "reference"} and set(rows["ep_degree"]) == {2}
    assert (rows["time_ms"] >= rows["time_ms_mean"]).all() and (rows["time_ms"] > 0).all()
    assert (rows["tflops_per_gpu"] > 0).all() and set(rows["num_experts"]) == {4}


def test_ep_bench_experts_per_rank_multiplies_the_experts(tmp_path):
    rows = ep.ep_rows("tiny-top1", 3, ["torch"], ["bf16"], ["fwd"], 1, device="cpu", experts_per_rank=True)
    assert [r["num_experts"] for r in rows] == [9] and rows[0]["tokens_per_rank"] == 29
