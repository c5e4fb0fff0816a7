"""python -m bench WHAT [options]: one benchmark per WHAT, each writing tidy rows under data/bench/.

    moe       the MoE layer per shape, level, precision and pass, beside its peers and the ceiling  (bench.moe)
    parts     the fused level's passes step by step                                                 (bench.parts)
    quant     the MXFP8 quantization kernels against a copy's bandwidth                             (bench.quant)
    route     the router with and without rounding to the tile                                      (bench.route)
    ep        expert parallelism per GPU: all-to-all + a level for the local experts, EP = R GPUs  (bench.ep)
    summary   the README's table from a CSV, in markdown                                            (bench.moe)
"""

import importlib
import sys

COMMANDS = {"moe": "bench.moe:main", "parts": "bench.parts:main", "quant": "bench.quant:main",
            "route": "bench.route:main", "summary": "bench.moe:summary_main", "ep": "bench.ep:main"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module, func = COMMANDS[argv[0]].split(":")
    return getattr(importlib.import_module(module), func)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
