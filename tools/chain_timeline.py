"""Per-task timeline of the megakernel level's passes (the chain kernels' trace, docs/megakernel.md): which task ran
on which SM and when, and how long each waited on its counter. One traced forward and backward (BF16) after a warm-up
pass; rows to $OUT (or --out)/chain_timeline_<shape>.csv.gz (µs to the ns), a summary per kind printed, a figure
per pass beside it.
    python3 tools/chain_timeline.py [--shapes dsv4pro-rank qwen3-30b-a3b] [--out build/gpu]
Reading: a kind's wait_us is the time its tasks' producers spun on their counters (GEMM2 on h's rows, the gate/up
dgrad on the SwiGLU rows, the weight gradients on their expert's rows); busy is the SMs' share of the span in tasks."""

import argparse
import os
from pathlib import Path

import pandas as pd
import torch

from mok import megakernel, ops
from mok.config import get_shape
from mok.testing import make_inputs, moe_args

CAPACITY = 1 << 20  # task rows of a trace buffer: more than any standard shape's pass has tasks


def rows_of(trace: torch.Tensor, kinds: tuple, pass_: str) -> pd.DataFrame:
    """The written rows of a trace buffer as a table, times in µs from the pass's first task."""
    t = trace.cpu()
    t = t[t[:, 3] != 0]  # begun tasks (begin set)
    where, wait0, wait1, begin, end = (t[:, i] for i in range(5))
    t0 = int(begin.min())
    kind = (where & 0xFFFF).tolist()
    return pd.DataFrame({"pass": pass_, "sm": (where >> 32).tolist(), "kind": [kinds[k // 2] for k in kind],
                         "group": ["shared" if k % 2 == 0 else "routed" for k in kind],
                         "begin_us": ((begin - t0) / 1e3).tolist(), "end_us": ((end - t0) / 1e3).tolist(),
                         "wait_us": (torch.where(wait1 > 0, wait1 - wait0, 0) / 1e3).tolist()})


def summary(df: pd.DataFrame) -> pd.DataFrame:
    df = df.assign(busy_us=df.end_us - df.begin_us)
    span = df.end_us.max()
    out = df.groupby(["kind", "group"]).agg(tasks=("sm", "size"), busy_us=("busy_us", "mean"),
                                            wait_us=("wait_us", "sum")).reset_index()
    out["share_of_sm_time"] = df.groupby(["kind", "group"]).busy_us.sum().values / (span * df.sm.nunique())
    return out


def figure(df: pd.DataFrame, path: Path, title: str) -> None:
    """A bar per task on its SM's row, coloured by kind (skipped where matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no matplotlib here: {path.name} not drawn")
        return
    kinds = sorted(set(zip(df.kind, df.group)))
    colors = dict(zip(kinds, plt.cm.tab20.colors))  # up to 12 kinds (6 per group in the backward)
    fig, ax = plt.subplots(figsize=(11, 6), layout="constrained")
    for (kind, group), d in df.groupby(["kind", "group"]):
        for sm, s in d.groupby("sm"):
            ax.broken_barh(list(zip(s.begin_us, s.end_us - s.begin_us)), (sm - 0.4, 0.8), color=colors[kind, group])
        ax.plot([], [], color=colors[kind, group], lw=6, label=f"{kind} ({group})")
    ax.set(xlabel="µs from the first task", ylabel="SM", title=title)
    ax.legend(loc="upper right", fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["dsv4pro-rank", "qwen3-30b-a3b"])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "build/gpu")))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        inp = make_inputs(get_shape(name), "cuda", draw_on="cuda")
        megakernel.backward(megakernel.forward(*moe_args(inp))[1], inp["d_out"])  # warm-up: the build, the caches
        traces = [torch.zeros(CAPACITY, len(ops.chain.TRACE_FIELDS), dtype=torch.int64, device="cuda")
                  for _ in range(2)]
        _, saved = megakernel.forward(*moe_args(inp), trace=traces[0])
        megakernel.run_backward(saved, inp["d_out"], trace=traces[1])
        df = pd.concat([rows_of(traces[0], ops.chain.FORWARD_KINDS, "fwd"),
                        rows_of(traces[1], ops.chain.BACKWARD_KINDS, "bwd")])
        df.insert(0, "shape", name)
        df.to_csv(args.out / f"chain_timeline_{name}.csv.gz", index=False, float_format="%.3f")
        for pass_, d in df.groupby("pass"):
            print(f"{name} {pass_}: span {d.end_us.max():.0f} µs on {d.sm.nunique()} SMs")
            print(summary(d).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
            figure(d, args.out / f"chain_timeline_{name}_{pass_}.png", f"{name}, {pass_}: one chain launch")


if __name__ == "__main__":
    main()
