"""Where a kernel's warps spend their time, from Nsight Compute's per-instruction page (`ncu -i REPORT --page source
--csv --print-source sass > sass.csv`, as the device step `stalls` writes it): the instructions with the most warp
samples, each with its top stall reasons, and the samples summed over index ranges (the roles and phases of a
warp-specialized kernel, read off the listing: e.g. a consumer's mainloop, its epilogue, the producer).

    python tools/ncu_sass_summary.py sass.csv                      # instructions with >= 0.5% of the samples
    python tools/ncu_sass_summary.py sass.csv --ranges 0,157,285,3268,3575 --min-share 0.01

Shares are of all warp samples of the kernel: a role with more warps gets more samples for the same time.
"""

from __future__ import annotations

import argparse
import csv
import sys


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_sass(path: str) -> tuple[list[str], list[list[str]]]:
    """The header and instruction rows of one kernel's source page (the first row names the kernel)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if "Source" in r)
    return rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]


def summarize(header: list[str], rows: list[list[str]], ranges: list[int], min_share: float) -> str:
    samples, source = header.index("Warp Stall Sampling (All Samples)"), header.index("Source")
    executed = header.index("Instructions Executed")
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_num(r[samples]) for r in rows) or 1.0

    def top_reasons(group: list[list[str]], n: int) -> str:
        """The n largest reasons, then the samples no exported reason covers (an HGMMA's wait on the tensor
        cores, on sm_90)."""
        sums = sorted(((sum(_num(r[i]) for r in group), header[i].removeprefix("stall_")) for i in reasons),
                      reverse=True)
        unlisted = sum(_num(r[samples]) for r in group) - sum(value for value, _ in sums)
        text = " ".join(f"{name} {value / total:.1%}" for value, name in sums[:n] if value > 0)
        return text + (f" unlisted {unlisted / total:.1%}" if unlisted / total >= 0.001 else "")

    lines = [f"{int(total)} warp samples, {len(rows)} instructions", "", "index  share  executed  instruction"]
    for k, r in enumerate(rows):
        if _num(r[samples]) / total >= min_share:
            lines.append(f"{k:5d} {_num(r[samples]) / total:6.1%} {r[executed]:>9}  {r[source].strip()[:64]:64}  "
                         f"{top_reasons([r], 2)}")
    if ranges:
        lines += ["", "range           share  top stall reasons"]
        for lo, hi in zip(ranges, ranges[1:]):
            group = rows[lo:hi]
            share = sum(_num(r[samples]) for r in group) / total
            lines.append(f"[{lo:5d}, {hi:5d}) {share:6.1%}  {top_reasons(group, 4)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sass_csv")
    parser.add_argument("--ranges", default="", help="comma-separated instruction indices bounding the ranges")
    parser.add_argument("--min-share", type=float, default=0.005, help="list instructions with this share or more")
    args = parser.parse_args(argv)
    header, rows = read_sass(args.sass_csv)
    ranges = [int(v) for v in args.ranges.split(",")] if args.ranges else []
    print(summarize(header, rows, ranges, args.min_share))
    return 0


if __name__ == "__main__":
    sys.exit(main())
