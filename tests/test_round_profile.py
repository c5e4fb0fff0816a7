"""tools/round_profile.py on the CPU: its report's first line per shape (the GPU's lines need a GPU)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

spec = importlib.util.spec_from_file_location("round_profile", Path(__file__).parents[1] / "tools" / "round_profile.py")
round_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(round_profile)


def test_round_profile_reports_calls_time_and_moved_routes(capsys):
    assert round_profile.main(["tiny", "--device", "cpu", "--iters", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, "a CPU report is one line per shape"
    match = re.fullmatch(r"== tiny \(tile (\d+), cpu\): (\d+) aten calls, eager ([\d.]+) ms, ([\d.]+)% of the routes "
                         r"moved", out[0])
    assert match, out[0]
    tile, calls, eager, moved = int(match[1]), int(match[2]), float(match[3]), float(match[4])
    assert tile >= 1 and calls > 50 and eager > 0 and 0 < moved < 100
