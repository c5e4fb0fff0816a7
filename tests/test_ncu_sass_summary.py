"""tools/ncu_sass_summary.py on a small page in Nsight Compute's CSV layout (CPU)."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("ncu_sass_summary",
                                              Path(__file__).parents[1] / "tools" / "ncu_sass_summary.py")
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
          "stall_wait", "stall_long_sb (Not Issued)"]
ROWS = [["0x0", "  LDC R1, c[0x0][0x28]", "10", "4", "0", "10", "0"],
        ["0x10", "  @P0 BRA 0x40", "60", "400", "50", "10", "30"],
        ["0x20", "  HGMMA.64x128x16.F32.BF16 R8, gdesc[UR4], R8", "30", "400", "0", "5", "0"]]


def test_shares_reasons_and_ranges(tmp_path):
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Kernel Name", "k", ""])
        writer.writerow(HEADER)
        writer.writerows(ROWS)
    header, rows = summary.read_sass(str(path))
    assert header == HEADER and len(rows) == 3
    text = summary.summarize(header, rows, ranges=[0, 1, 3], min_share=0.2)
    lines = text.splitlines()
    assert lines[0] == "100 warp samples, 3 instructions"
    listed = [line for line in lines if line.startswith(("    0", "    1", "    2"))]
    assert [line.split()[0] for line in listed] == ["1", "2"]  # the LDC has 10% < 20%
    assert "long_sb 50.0% wait 10.0%" in listed[0]  # the "(Not Issued)" columns are not reasons of their own
    assert listed[1].endswith("wait 5.0% unlisted 25.0%")  # samples no exported reason covers
    assert "[    1,     3)  90.0%  long_sb 50.0% wait 15.0% unlisted 25.0%" in lines
