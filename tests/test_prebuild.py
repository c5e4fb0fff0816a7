"""mok.ops.core.prebuild on the CPU: each build is a stand-in process (it sleeps, and fails where told), so what is
tested is the side-by-side running, the skipping, and how a failed or stuck build is reported."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from mok.ops import core

# Stands in for one build: sleeps MOK_GEMM_GROUP_M / 10 s (a minute if MOK_GEMM_NUM_STAGES is 3: stuck), exits
# with MOK_GEMM_TRACE.
FAKE_BUILD = ("import json, os, sys, time; s = json.loads(sys.argv[1]); "
              "print('building', s, 'MAX_JOBS', os.environ.get('MAX_JOBS'), flush=True); "
              "time.sleep(60 if s.get('MOK_GEMM_NUM_STAGES') == 3 else s.get('MOK_GEMM_GROUP_M', 1) / 10); "
              "sys.exit(s.get('MOK_GEMM_TRACE', 0))")


@pytest.fixture
def fake_builds(monkeypatch):
    monkeypatch.setattr(core, "_BUILD_ONE", FAKE_BUILD)
    monkeypatch.setattr(core, "is_built", lambda switches=None: switches == {"MOK_GEMM_TMA_STORE": 0})


def test_prebuild_runs_builds_side_by_side_once_each(fake_builds):
    variants = [{"MOK_GEMM_GROUP_M": 8}, {"MOK_GEMM_GROUP_M": 8, "MOK_GEMM_MULTICAST": 1}, {"MOK_GEMM_MULTICAST": 1,
                "MOK_GEMM_GROUP_M": 8}, {"MOK_GEMM_GROUP_M": 8, "MOK_GEMM_DYNAMIC": 1}, {"MOK_GEMM_TMA_STORE": 0}]
    start = time.monotonic()
    built = core.prebuild(variants, workers=3)
    elapsed = time.monotonic() - start
    # the same switches in another order are one build; an already built one is skipped
    assert built == [{"MOK_GEMM_GROUP_M": 8}, {"MOK_GEMM_GROUP_M": 8, "MOK_GEMM_MULTICAST": 1},
                     {"MOK_GEMM_DYNAMIC": 1, "MOK_GEMM_GROUP_M": 8}]
    assert elapsed < 2.4, f"three builds of 0.8 s each took {elapsed:.1f} s: not side by side"


def test_prebuild_runs_at_most_workers_builds_at_once(fake_builds):
    start = time.monotonic()
    core.prebuild([{"MOK_GEMM_GROUP_M": 4}, {"MOK_GEMM_GROUP_M": 4, "MOK_GEMM_MULTICAST": 1},
                   {"MOK_GEMM_GROUP_M": 4, "MOK_GEMM_DYNAMIC": 1}, {"MOK_GEMM_GROUP_M": 4, "MOK_GEMM_TMA_STORE": 0}],
                  workers=2)
    assert time.monotonic() - start >= 0.8, "four builds of 0.4 s, two at a time, take two rounds"


def test_prebuild_names_every_failed_build(fake_builds):
    with pytest.raises(RuntimeError) as err:
        core.prebuild([{"MOK_GEMM_TRACE": 1}, {"MOK_GEMM_DYNAMIC": 1}, {"MOK_GEMM_TRACE": 1, "MOK_GEMM_DYNAMIC": 1}])
    message = str(err.value)
    assert "{'MOK_GEMM_TRACE': 1}: exit 1" in message
    assert "building {'MOK_GEMM_TRACE': 1} MAX_JOBS 2" in message, "each build's compiles are bounded"
    assert "{'MOK_GEMM_DYNAMIC': 1, 'MOK_GEMM_TRACE': 1}: exit 1" in message
    assert "{'MOK_GEMM_DYNAMIC': 1}:" not in message


def test_prebuild_kills_a_build_past_the_timeout(fake_builds):
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        core.prebuild([{"MOK_GEMM_NUM_STAGES": 3}, {"MOK_GEMM_GROUP_M": 1}, {"MOK_GEMM_DYNAMIC": 1}], timeout_s=3,
                      workers=2)  # the third waits for the second, then runs while the first is stuck
    assert time.monotonic() - start < 10
    assert str(err.value).endswith("{'MOK_GEMM_NUM_STAGES': 3}: still building after 3 s, killed")
    assert "MOK_GEMM_DYNAMIC" not in str(err.value)


def test_prebuild_rejects_an_unknown_switch():
    with pytest.raises(ValueError, match="MOK_GEMM_DYNAMIC"):
        core.prebuild([{"MOK_GEMM_DYNAMIC": 5}])


def test_prebuild_tool_reads_build_specs(fake_builds, capsys):
    spec = importlib.util.spec_from_file_location("prebuild_tool", Path(__file__).parents[1] / "tools" / "prebuild.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["default", "MOK_GEMM_MULTICAST=1,MOK_GEMM_DYNAMIC=1", "MOK_GEMM_DYNAMIC=1,MOK_GEMM_MULTICAST=1",
                      "MOK_GEMM_TMA_STORE=0"]) == 0
    assert capsys.readouterr().out.startswith("prebuild: 2 built, 2 already there or repeated")
    with pytest.raises(ValueError, match="MOK_GEMM_DYNAMIC"):
        tool.main(["MOK_GEMM_DYNAMIC=9"])


def test_prebuild_reports_builds_never_started_before_the_timeout(fake_builds):
    with pytest.raises(RuntimeError) as err:
        core.prebuild([{"MOK_GEMM_NUM_STAGES": 3}, {"MOK_GEMM_GROUP_M": 1}], timeout_s=2, workers=1)
    assert "{'MOK_GEMM_NUM_STAGES': 3}: still building after 2 s, killed" in str(err.value)
    assert str(err.value).endswith("{'MOK_GEMM_GROUP_M': 1}: not started within 2 s")
