"""The overlap model (notebooks/timeline.py): costs from the byte model and FLOP convention, schedules that obey
their own rules, the limits a pipeline cannot beat, calibration from data/bench, bad inputs named.

Grid: random setups (fresh seed each run, printed on failure) over EP degree, minibatches, SM share,
precision and dedup, since the schedule's invariants must hold for any of them.
"""

from __future__ import annotations

import math
import os
import random
import sys
from pathlib import Path

import pandas as pd
import pytest

from mok import comm
from mok.config import STANDARD_SHAPES, MoEConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "notebooks"))  # the notebooks' helpers
import timeline  # noqa: E402
from timeline import EPSetup  # noqa: E402

SEED = int(os.environ.get("MOK_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def random_setups(n=40):
    rng = random.Random(SEED)
    for _ in range(n):
        yield EPSetup(
            ep_degree=rng.choice([1, 2, 3, 8, 72]), tokens_per_rank=rng.choice([1, 37, 512, 4096]),
            hidden=32 * rng.randint(1, 256), intermediate=rng.randint(1, 4096), num_topk=rng.randint(1, 8),
            shared_intermediate=rng.choice([0, 1024]), precision=rng.choice(["bf16", "mxfp8"]),
            pass_=rng.choice(["fwd", "bwd"]), dedup=rng.random() < 0.5, nvlink_gb_s=rng.uniform(50, 1800),
            compute_tflops=rng.uniform(10, 1000), comm_sm_fraction=rng.uniform(0.01, 0.9),
            num_minibatches=rng.randint(1, 40), sync_us=rng.choice([0.0, 5.0]))


def check_schedule(tl: pd.DataFrame, num_minibatches: int) -> None:
    for _, g in tl.groupby("resource"):  # one task at a time per resource
        g = g.sort_values("start_us")
        assert (g["start_us"].values[1:] >= g["end_us"].values[:-1] - 1e-9).all()
    assert (tl["end_us"] >= tl["start_us"]).all() and (tl["start_us"] >= 0).all()
    end = {(p, m): e for p, m, e in zip(tl.phase, tl.minibatch, tl.end_us)}
    for t in tl.itertuples():
        before = {"compute": "dispatch", "combine": "compute"}.get(t.phase)
        if before and (before, t.minibatch) in end:
            assert t.start_us >= end[(before, t.minibatch)] - 1e-9, f"{t.phase} {t.minibatch} before its input"
    for phase in set(tl.phase):
        assert sorted(tl[tl.phase == phase].minibatch) == list(range(num_minibatches)), phase


def test_costs_follow_the_byte_model_and_flop_convention():
    s = EPSetup(ep_degree=4, tokens_per_rank=100, hidden=256, intermediate=64, num_topk=3, shared_intermediate=64)
    c = timeline.costs(s)
    rows = 100 * 3 * 3 / 4  # K·(R-1)/R off-rank routes per token
    assert c["dispatch_bytes"] == rows * comm.bytes_per_row(256, "bf16") == c["combine_bytes"]
    assert c["flops"] == MoEConfig("x", 100, 256, 64, 4, 3, 64).flops("fwd")
    mx = timeline.costs(s.replace(precision="mxfp8", pass_="bwd"))
    assert mx["dispatch_bytes"] == rows * (256 + 8) and mx["combine_bytes"] == c["combine_bytes"], "combine stays bf16"
    assert mx["flops"] == 2 * c["flops"]
    dedup = timeline.costs(s.replace(dedup=True))
    assert math.isclose(dedup["dispatch_bytes"], 100 * 3 * (1 - 0.75**3) * 512)
    assert timeline.costs(s.replace(ep_degree=1))["dispatch_bytes"] == 0


def test_remote_rows_match_a_random_routing():
    """The model's rows per token against counting a real uniform routing with mok.comm.ep_traffic."""
    import torch

    from mok import routing

    gen = torch.Generator().manual_seed(SEED)
    R, E, K, T = 8, 64, 6, 4000
    idx, _ = routing.random_routing(T * R, E, K, generator=gen)
    rows = pd.DataFrame(comm.ep_traffic(idx, E, R, hidden=32)).query("direction == 'dispatch' and precision == 'bf16'")
    per_route = rows["routes"].sum() / (T * R)
    per_rank = rows["token_rows"].sum() / (T * R)
    assert abs(per_route - timeline.remote_rows_per_token(R, K)) < 0.05
    # distinct experts per token make the hit ranks slightly more spread than the with-replacement model
    assert abs(per_rank - timeline.remote_rows_per_token(R, K, dedup=True)) < 0.25


def test_schedules_obey_their_rules_and_limits():
    for s in random_setups():
        un, fu = timeline.unfused_timeline(s), timeline.fused_timeline(s)
        c = timeline.costs(s)
        compute_us = c["flops"] / (s.compute_tflops * 1e6)
        if c["dispatch_bytes"] == 0:  # EP = 1: nothing to send, compute alone, no SMs reserved
            assert fu.equals(un) and math.isclose(fu.end_us.max(), compute_us)
            continue
        check_schedule(un, 1)
        check_schedule(fu, s.num_minibatches)
        bw = timeline.comm_gb_s(s, fused=False) * 1e3
        serial = (c["dispatch_bytes"] + c["combine_bytes"]) / bw + 2 * s.sync_us + compute_us
        assert math.isclose(un.end_us.max(), serial, rel_tol=1e-9), "unfused = the sum of its phases"
        slowed = compute_us / (1 - s.comm_sm_fraction)
        busy = fu[fu.resource == "compute"].eval("end_us - start_us").sum()
        assert math.isclose(busy, slowed, rel_tol=1e-9), "fused compute runs at (1 - share) of the rate"
        comm_total = fu[fu.resource == "comm"].eval("end_us - start_us").sum()
        assert fu.end_us.max() >= max(slowed, comm_total) - 1e-6, "no faster than either resource alone"
        p = timeline.predict(s)
        assert math.isclose(p["speedup"], p["unfused_us"] / p["fused_us"])


def test_one_minibatch_is_the_serial_pipeline_slowed():
    s = EPSetup(num_minibatches=1, comm_sm_fraction=0.25, nvlink_gb_s=100.0)  # link-bound either way
    fu, un = timeline.fused_timeline(s), timeline.unfused_timeline(s)
    assert list(fu.sort_values("start_us").phase) == ["dispatch", "compute", "combine"]
    assert fu.end_us.max() > un.end_us.max(), "nothing overlaps, and the GEMMs lost a quarter of the SMs"


def test_more_minibatches_hide_more_communication():
    s = EPSetup.from_config(STANDARD_SHAPES["dsv4pro-rank"], sync_us=0.0)
    fused = [timeline.predict(s.replace(num_minibatches=m))["fused_us"] for m in (1, 2, 4, 8, 16, 32)]
    assert all(b <= a + 1e-9 for a, b in zip(fused, fused[1:]))
    limit = timeline.costs(s)["flops"] / (s.compute_tflops * (1 - s.comm_sm_fraction)) / 1e6
    assert fused[-1] < 1.05 * limit, "32 minibatches: only the first dispatch and last combine show"


def test_sweep_is_the_product_of_its_axes():
    df = timeline.sweep(EPSetup(), ep_degree=[1, 8], precision=["bf16", "mxfp8"], num_minibatches=[2, 4, 8])
    assert len(df) == 12 and set(df.ep_degree) == {1, 8}
    assert (df.query("ep_degree == 1").speedup == 1).all()
    row = df.query("ep_degree == 8 and precision == 'mxfp8' and num_minibatches == 4").iloc[0]
    assert row.speedup == timeline.predict(EPSetup(ep_degree=8, precision="mxfp8", num_minibatches=4))["speedup"]


def test_calibrate_tflops_reads_the_measured_row():
    df = pd.DataFrame([
        {"shape": "a", "level": "cublas-dense", "precision": "bf16", "pass": "fwd", "tflops": 700.0, "gpu": "g",
         "torch": "t", "cuda": "c", "commit": "x", "date": "d"},
        {"shape": "a", "level": "torch", "precision": "bf16", "pass": "fwd", "tflops": 300.0, "gpu": "g",
         "torch": "t", "cuda": "c", "commit": "x", "date": "d"},
    ])
    assert timeline.calibrate_tflops("a", "torch", csv=df) == (300.0, {"gpu": "g", "torch": "t", "cuda": "c",
                                                                       "commit": "x", "date": "d"})
    with pytest.raises(ValueError, match="shape/level"):
        timeline.calibrate_tflops("b", csv=df)
    with pytest.raises(ValueError, match="pass_"):
        timeline.calibrate_tflops("a", pass_="both", csv=df)
    rate, prov = timeline.calibrate_tflops("dsv4pro-rank")  # the committed H200 data
    assert 100 < rate < 2000 and prov["gpu"].startswith("NVIDIA")


@pytest.mark.parametrize("field, value", [
    ("ep_degree", 0), ("tokens_per_rank", 1.5), ("num_minibatches", True), ("precision", "fp8"),
    ("pass_", "fwd+bwd"), ("comm_sm_fraction", 1.0), ("comm_sm_fraction", 0.0), ("nvlink_gb_s", 0.0),
    ("compute_tflops", -1.0), ("sync_us", -1.0),
])
def test_bad_setup_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EPSetup(**{field: value})
