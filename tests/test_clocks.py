"""bench.clocks: NVML readings around the timed calls of a benchmark. CPU: every value NaN, the sampler brackets
exactly the timed calls of bench.timing.time_ms. GPU: the readings are a live clock."""

from __future__ import annotations

import math

import pytest
import torch

from bench import clocks, timing


class _Bracket:
    """A `during` that records which calls of fn ran inside it."""

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("enter")

    def __exit__(self, *exc):
        self.log.append("exit")


def test_time_ms_enters_during_around_the_timed_calls_only():
    log = []
    timing.time_ms(lambda: log.append("call"), iters=4, warmup=2, during=_Bracket(log))
    primer = 1 if torch.cuda.is_available() and timing.QUEUED else 0  # queued timing: one call before the first timed
    assert log == ["call"] * 2 + ["enter"] + ["call"] * (primer + 4) + ["exit"]


def test_sampler_summary_is_nan_without_nvml_and_brackets_its_block(monkeypatch):
    monkeypatch.setattr(clocks, "_device", lambda: None)
    with clocks.Sampler(period_ms=1.0) as sampler:
        pass
    assert len(sampler.samples) >= 2  # one at each end
    assert all(math.isnan(v) for v in clocks.read())
    assert all(math.isnan(v) for v in sampler.summary().values())


class _FakeNvml:
    """NVML's three readings as ctypes hands them back: through byref'd outputs, 0 for success."""

    def nvmlDeviceGetClockInfo(self, handle, clock, out):
        assert clock == 1  # NVML_CLOCK_SM
        out._obj.value = 1605
        return 0

    def nvmlDeviceGetPowerUsage(self, handle, out):
        out._obj.value = 690_500  # mW
        return 0

    def reasons(self, handle, out):
        out._obj.value = 0x4 | 0x1  # software power cap, and idle
        return 0


def test_read_decodes_nvml(monkeypatch):
    fake = _FakeNvml()
    monkeypatch.setattr(clocks, "_device", lambda: (fake, None, fake.reasons))
    assert clocks.read() == (1605.0, 690.5, 1.0)


def test_sampler_summary_medians_and_capped_fraction():
    sampler = clocks.Sampler()
    sampler.samples = [(1980.0, 500.0, 0.0), (1700.0, 690.0, 1.0), (1750.0, math.nan, 1.0), (math.nan,) * 3]
    assert sampler.summary() == {"sm_mhz": 1750.0, "power_w": 595.0, "power_capped": pytest.approx(2 / 3)}


@pytest.mark.gpu
def test_read_gives_a_live_clock_on_a_gpu():
    mhz, watts, capped = clocks.read()
    assert 100 < mhz < 5000 and 10 < watts < 2000 and capped in (0.0, 1.0)
