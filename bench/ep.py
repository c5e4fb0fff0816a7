"""Expert parallelism per GPU (`python -m bench ep`): mok.comm's all-to-all dispatch and combine with a level for
the local experts (`--levels`, "fused": NCCL + mok's kernels, the path issue 46 times against the megakernel), or
level "megakernel": mok.ep_chain over symmetric memory (each rank's pass one chain launch; its shared expert exact),
at EP degrees R on R GPUs of one host (NCCL; `--device cpu`: gloo, for a smoke run of the all-to-all levels).

Each shape's num_tokens are one rank's tokens: the global batch is R of them, routed by one seeded draw that every
rank makes alike (random routing, mok.testing.make_inputs on the global shape), every rank holding E / R experts
whose weights it draws itself (a timing: no rank needs another's); with --experts-per-rank the shape's num_experts
are one rank's (the *-rank shapes: E = R · num_experts).
The shared expert, if any, runs on each rank's own tokens (exact_shared=False, as a deployment). Per pass, each rank
times its calls with bench.timing.time_ms between barriers; a row gives the slowest rank's median (the pass ends when
it does) and the mean over ranks, and TFLOP/s per GPU on MoK's flops of one rank's tokens (mok.config).

    python -m bench ep --shapes qwen3-30b-a3b --ep 8 [--levels fused] [--precisions bf16 mxfp8]
        [--passes fwd bwd fwd+bwd] [--iters 20] [--out data/bench/ep.csv]
    python -m bench ep --shapes dsv4pro-rank kimi-k2-rank --experts-per-rank --ep 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from bench.timing import DATA, provenance, time_ms, write_rows
from mok import comm
from mok.config import PASSES, PRECISIONS, get_shape
from mok.testing import make_inputs

KEY = ["shape", "ep_degree", "level", "precision", "pass"]


def _rank_times(rank: int, world_size: int, shape: str, experts_per_rank: bool, levels: list, precisions: list,
                passes: list, iters: int, device: str) -> dict:
    """One rank: {(level, precision, pass): median ms} of its calls (comm.run_local_ep's fn)."""
    cfg = get_shape(shape)
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    T, E = cfg.num_tokens, cfg.num_experts * (world_size if experts_per_rank else 1)
    # the global batch, drawn alike on every rank (with narrow experts: their weights go unused), then this rank's
    # experts and the shared expert at full width (E / R of them: all E at dsv4pro × 8 would be 50 GB a GPU)
    g = make_inputs(cfg.scaled(num_tokens=T * world_size, num_experts=E, intermediate=32, shared_intermediate=0),
                    device=dev, seed=0, draw_on=dev.type)
    tokens = slice(rank * T, (rank + 1) * T)
    x, idx, w, d_out = (g[n][tokens].contiguous() for n in ("x", "topk_idx", "topk_weights", "d_out"))
    del g
    mine = make_inputs(cfg.scaled(num_tokens=1, num_experts=E // world_size), device=dev, seed=1 + rank,
                       draw_on=dev.type)
    routed = [mine[n] for n in ("w_gate", "w_up", "w_down")]  # [E/R, ...] each
    shared = [mine[n] for n in ("w_shared_gate", "w_shared_up", "w_shared_down")]
    times = {}
    for level in levels:
        for precision in precisions:
            calls = _chain_calls((x, idx, w, *routed, *shared), d_out, E, precision) if level == "megakernel" \
                else _pass_calls((x, idx, w, *routed, *shared), d_out, level, precision)
            for pass_ in passes:
                dist.barrier()
                times[(level, precision, pass_)] = time_ms(calls[pass_], iters=iters, warmup_ms=0.0)
    return times


def _pass_calls(args: tuple, d_out: torch.Tensor, level: str, precision: str) -> dict:
    """pass -> a call of it on this rank (bwd: on one forward's saved state)."""
    def forward():
        return comm.ep_moe_forward(*args, precision=precision, backend=level, exact_shared=False)

    saved = forward()[1]
    return {"fwd": forward, "bwd": lambda: comm.ep_moe_backward(saved, d_out),
            "fwd+bwd": lambda: comm.ep_moe_backward(forward()[1], d_out)}


def _chain_calls(args: tuple, d_out: torch.Tensor, num_experts: int, precision: str) -> dict:
    """pass -> a call of mok.ep_chain's (each rank's pass one chain launch) over symmetric memory, its barriers on
    the GPU (the shared expert exact: its weight gradients' columns dealt over the ranks, mok.ep_shared)."""
    from mok import ep_chain, ep_peer

    x, idx, shared = args[0], args[1], args[6]  # args: the rank's mok.moe arguments
    P, handles = ep_peer.allocate_symmetric(x.shape[0], idx.shape[1], num_experts, x.shape[1],
                                            shared_intermediate=0 if shared is None else shared.shape[0])
    P = ep_peer.peers(P)
    barrier = lambda: handles[0].barrier(channel=0)  # noqa: E731
    rank = dist.get_rank()

    def forward():
        return ep_peer.run_rank(ep_chain.forward_rank(P, rank, *args, num_experts=num_experts, precision=precision),
                                barrier)

    def backward(saved):
        return ep_peer.run_rank(ep_chain.backward_rank(P, saved, d_out), barrier)

    saved = forward()[1]
    return {"fwd": forward, "bwd": lambda: backward(saved), "fwd+bwd": lambda: backward(forward()[1])}


def ep_rows(shape: str, ep_size: int, levels: list, precisions: list, passes: list, iters: int,
            device: str = "cuda", experts_per_rank: bool = False) -> list[dict]:
    """The rows of one shape at one EP degree: R ranks (NCCL on R GPUs, or gloo on the CPU)."""
    cfg = get_shape(shape)
    ranks = comm.run_local_ep(_rank_times, ep_size, shape, experts_per_rank, levels, precisions, passes, iters,
                              device,
                              backend="nccl" if device == "cuda" else "gloo", timeout_s=1800,
                              num_threads=None if device == "cuda" else 1)
    rows = []
    for key in ranks[0]:
        level, precision, pass_ = key
        per_rank = [r[key] for r in ranks]
        slowest = max(per_rank)
        rows.append({"shape": shape, "ep_degree": ep_size, "level": level, "precision": precision, "pass": pass_,
                     "time_ms": slowest, "time_ms_mean": sum(per_rank) / len(per_rank),
                     "tflops_per_gpu": cfg.flops(pass_) / slowest / 1e9, "tokens_per_rank": cfg.num_tokens,
                     "num_experts": cfg.num_experts * (ep_size if experts_per_rank else 1),
                     "iters": iters, **provenance()})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench ep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b"], help="names from mok.config (tokens per rank)")
    p.add_argument("--ep", nargs="+", type=int, default=None, help="EP degrees (default: every GPU of this host)")
    p.add_argument("--levels", nargs="+", default=["fused"], help="levels for the local experts (mok.levels)")
    p.add_argument("--precisions", nargs="+", default=["bf16"], choices=PRECISIONS)
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    p.add_argument("--iters", type=int, default=20, help="timed calls per pass and rank")
    p.add_argument("--experts-per-rank", action="store_true",
                   help="the shapes' num_experts are one rank's (the *-rank shapes): E = R · num_experts")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo ranks, a smoke run")
    p.add_argument("--out", type=Path, default=DATA / "ep.csv", help="CSV the rows merge into")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench ep: no CUDA GPU here (--device cpu runs gloo ranks)", file=sys.stderr)
        return 2
    degrees = args.ep or [torch.cuda.device_count() if args.device == "cuda" else 2]
    if args.device == "cuda" and max(degrees) > torch.cuda.device_count():
        p.error(f"--ep: at most the {torch.cuda.device_count()} GPUs of this host, got {max(degrees)}")
    rows = []
    for shape in args.shapes:
        for ep_size in degrees:
            new = ep_rows(shape, ep_size, args.levels, args.precisions, args.passes, args.iters, args.device,
                          args.experts_per_rank)
            write_rows(new, args.out, KEY)  # a killed sweep keeps what it measured
            rows += new
    for r in rows:
        print(f"{r['shape']} EP={r['ep_degree']} {r['level']} {r['precision']} {r['pass']}: {r['time_ms']:.3f} ms "
              f"(mean over ranks {r['time_ms_mean']:.3f}), {r['tflops_per_gpu']:.0f} TFLOP/s per GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
