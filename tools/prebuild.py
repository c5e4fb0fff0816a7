"""Build mok's extension for several sets of build switches side by side, before the steps that load them
(mok.ops.core.prebuild). Builds already in .cache/ are skipped.

    python tools/prebuild.py [--timeout-s S] default MOK_GEMM_DYNAMIC=1,MOK_GEMM_TRACE=1 MOK_GEMM_TRACE=1 ...

A build still running after S seconds (default 600) is killed, with its children, and reported.
"""

from __future__ import annotations

import argparse
import sys
import time

from mok.bench_ab import parse_switch

from mok.ops import core


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("builds", nargs="+", help="'default', or NAME=VALUE[,NAME=VALUE ...] (mok.ops.core.BUILD_SWITCHES)")
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args(argv)
    variants = [{} if spec == "default" else parse_switch(spec) for spec in args.builds]
    start = time.monotonic()
    built = core.prebuild(variants, timeout_s=args.timeout_s)
    print(f"prebuild: {len(built)} built, {len(variants) - len(built)} already there or repeated, "
          f"{time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
