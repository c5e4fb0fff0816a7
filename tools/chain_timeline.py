"""Per-task timeline of the megakernel level's passes (the chain kernels' trace, docs/megakernel.md): which task ran
on which SM and when, and how long each waited on its counter. One traced forward and backward (BF16) after a warm-up
pass; rows to $OUT (or --out)/chain_timeline_<shape>.csv.gz (µs to the ns), a summary per kind printed, a figure
per pass beside it. With --ranks R: the EP pass of mok.ep_chain instead, R processes sharing this GPU (the peers'
buffers by CUDA IPC, each rank a 1/R share of the SMs, barriers between phases), every rank's tasks on one clock
(chain_timeline_<shape>_ep<R>...).
    python3 tools/chain_timeline.py [--shapes dsv4pro-rank qwen3-30b-a3b] [--ranks R] [--out build/gpu]
Reading: a kind's wait_us is the time its tasks' producers spun on their counters (GEMM2 on h's rows, the gate/up
dgrad on the SwiGLU rows, the weight gradients on their expert's rows); busy is the SMs' share of the span in tasks."""

import argparse
import os
from pathlib import Path

import pandas as pd
import torch

from mok import ep_chain, ep_peer, megakernel, ops
from mok.config import get_shape
from mok.testing import make_inputs, moe_args, rank_inputs

CAPACITY = 1 << 20  # task rows of a trace buffer: more than any standard shape's pass has tasks


def rows_of(trace: torch.Tensor, kinds: tuple, pass_: str, t0: int | None = None) -> pd.DataFrame:
    """The written rows of a trace buffer as a table, times in µs from t0 (None: the pass's first task)."""
    t = begun(trace)
    where, wait0, wait1, begin, end = (t[:, i] for i in range(5))
    t0 = int(begin.min()) if t0 is None else t0
    kind = (where & 0xFFFF).tolist()
    return pd.DataFrame({"pass": pass_, "sm": (where >> 32).tolist(), "kind": [kinds[k // 2] for k in kind],
                         "group": ["shared" if k % 2 == 0 else "routed" for k in kind],
                         "begin_us": ((begin - t0) / 1e3).tolist(), "end_us": ((end - t0) / 1e3).tolist(),
                         "wait_us": (torch.where(wait1 > 0, wait1 - wait0, 0) / 1e3).tolist()})


def begun(trace: torch.Tensor) -> torch.Tensor:
    t = trace.cpu()
    return t[t[:, 3] != 0]  # begun tasks (begin set)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    df = df.assign(busy_us=df.end_us - df.begin_us)
    span = df.end_us.max() - df.begin_us.min()
    out = df.groupby(["kind", "group"]).agg(tasks=("sm", "size"), busy_us=("busy_us", "mean"),
                                            wait_us=("wait_us", "sum")).reset_index()
    out["share_of_sm_time"] = df.groupby(["kind", "group"]).busy_us.sum().values / (span * df.sm.nunique())
    return out


def figure(df: pd.DataFrame, path: Path, title: str) -> None:
    """A bar per task on its SM's row (with a rank column: rank r's rows above rank r - 1's), coloured by kind
    (skipped where matplotlib is not installed)."""
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
    df = df.assign(row=df.sm + df.get("rank", 0) * (df.sm.max() + 4))
    for (kind, group), d in df.groupby(["kind", "group"]):
        for sm, s in d.groupby("row"):
            ax.broken_barh(list(zip(s.begin_us, s.end_us - s.begin_us)), (sm - 0.4, 0.8), color=colors[kind, group])
        ax.plot([], [], color=colors[kind, group], lw=6, label=f"{kind} ({group})")
    ax.set(xlabel="µs from the first task", ylabel="SM" + (" (rank by rank)" if "rank" in df else ""), title=title)
    ax.legend(loc="upper right", fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def new_traces() -> list:
    return [torch.zeros(CAPACITY, len(ops.chain.TRACE_FIELDS), dtype=torch.int64, device="cuda") for _ in range(2)]


def one_gpu(name: str) -> pd.DataFrame:
    """The megakernel level's passes, traced after a warm-up."""
    inp = make_inputs(get_shape(name), "cuda", draw_on="cuda")
    megakernel.backward(megakernel.forward(*moe_args(inp))[1], inp["d_out"])  # warm-up: the build, the caches
    traces = new_traces()
    _, saved = megakernel.forward(*moe_args(inp), trace=traces[0])
    megakernel.run_backward(saved, inp["d_out"], trace=traces[1])
    return pd.concat([rows_of(traces[0], ops.chain.FORWARD_KINDS, "fwd"),
                      rows_of(traces[1], ops.chain.BACKWARD_KINDS, "bwd")])


def rank_passes(rank: int, buffers: list, barrier, inp: dict, split: list, num_sms: int, results) -> None:
    """One rank of ranks_on_one_gpu in its own process: a warm-up pass, then a traced one; puts (rank, the traces'
    begun rows) or (rank, the error)."""
    try:
        def wait():  # this rank's writes have landed before its peers pass the barrier
            torch.cuda.synchronize()
            barrier.wait(120)

        P, E, mine = ep_peer.peers(buffers), inp["w_gate"].shape[0], rank_inputs(inp, split)[rank]
        for traces in ([None, None], new_traces()):
            _, saved = ep_peer.run_rank(ep_chain.forward_rank(P, rank, *moe_args(mine), num_experts=E,
                                                              num_sms=num_sms, trace=traces[0]), wait)
            ep_peer.run_rank(ep_chain.backward_rank(P, saved, mine["d_out"], trace=traces[1]), wait)
        results.put((rank, [begun(t).numpy() for t in traces]))  # by value: the process ends
    except BaseException as e:  # noqa: BLE001 (the parent reports it)
        results.put((rank, repr(e)))


def ranks_on_one_gpu(name: str, R: int) -> pd.DataFrame:
    """mok.ep_chain's passes over R processes on this GPU, traced after a warm-up; column rank, one clock."""
    cfg = get_shape(name)
    inp = make_inputs(cfg, "cuda", draw_on="cuda")
    split = [len(c) for c in torch.arange(cfg.num_tokens).tensor_split(R)]
    buffers = ep_peer.allocate(R, max(split), cfg.num_topk, cfg.num_experts, cfg.hidden, "cuda",
                               cfg.shared_intermediate)
    ctx = torch.multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(R), ctx.Queue()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count // R
    procs = [ctx.Process(target=rank_passes, args=(r, buffers, barrier, inp, split, num_sms, results), daemon=True)
             for r in range(R)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)  # rank -> [fwd rows, bwd rows], or its error
    for p in procs:
        p.join(30)
    if errors := {r: v for r, v in got.items() if isinstance(v, str)}:
        raise RuntimeError(f"{name} over {R} ranks: {errors}")
    got = {r: [torch.from_numpy(a) for a in v] for r, v in got.items()}
    dfs = []
    for j, (pass_, kinds) in enumerate((("fwd", ops.chain.FORWARD_KINDS), ("bwd", ops.chain.BACKWARD_KINDS))):
        t0 = min(int(got[r][j][:, 3].min()) for r in got if len(got[r][j]))
        dfs += [rows_of(got[r][j], kinds, pass_, t0).assign(rank=r) for r in sorted(got) if len(got[r][j])]
    return pd.concat(dfs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["dsv4pro-rank", "qwen3-30b-a3b"])
    p.add_argument("--ranks", type=int, default=1, help="EP ranks as processes sharing this GPU (1: the level)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "build/gpu")))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        df = one_gpu(name) if args.ranks == 1 else ranks_on_one_gpu(name, args.ranks)
        df.insert(0, "shape", name)
        stem = f"chain_timeline_{name}" + (f"_ep{args.ranks}" if args.ranks > 1 else "")
        df.to_csv(args.out / f"{stem}.csv.gz", index=False, float_format="%.3f")
        for (pass_, *rank), d in df.groupby(["pass"] + (["rank"] if args.ranks > 1 else [])):
            on = f" rank {rank[0]} of {args.ranks}" if rank else ""
            print(f"{name} {pass_}{on}: tasks from {d.begin_us.min():.0f} to {d.end_us.max():.0f} µs on "
                  f"{d.sm.nunique()} SMs")
            print(summary(d).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        for pass_, d in df.groupby("pass"):
            title = f"{name}, {pass_}: " + (f"{args.ranks} ranks' launches" if args.ranks > 1 else "one chain launch")
            figure(d, args.out / f"{stem}_{pass_}.png", title)


if __name__ == "__main__":
    main()
