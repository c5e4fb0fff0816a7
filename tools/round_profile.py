"""Where routing.round_to_tiles' time goes, per shape: the routers' path (`_round_to_tiles`, softmax top-k of random
logits, seed 0, tile 128), as `bench route` calls it.

    python tools/round_profile.py [SHAPE ...] [--device cuda|cpu] [--iters 20]

Per shape: the aten calls of one rounding (views included: the host's work per call), its eager time (queued calls,
bench.timing.time_ms); on a GPU also its time replayed from a CUDA graph (graph_time_ms, as `bench route`'s
round_graph_ms: its GPU time alone), the GPU ops of one eager call and their busy time (torch.profiler), and the
kernels of most GPU time. These are what docs/routing.md's predictions are made of.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.timing import graph_time_ms, time_ms
from mok import rounding, routing
from mok.config import STANDARD_SHAPES, get_shape

TILE = 128


class _CountCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _gpu_ops(fn, top: int) -> tuple[int, float, list[tuple[str, float, int]]]:
    """(GPU ops of one call, their busy ms, the `top` kernels by GPU time: (name, ms, count))."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sorted(prof.key_averages(), key=lambda a: -a.self_device_time_total)[:top]
    return (len(ops), sum(e.device_time for e in ops) / 1e3,
            [(a.key, a.self_device_time_total / 1e3, a.count) for a in kernels])


def profile_shape(name: str, device: str, iters: int = 20, top: int = 8) -> list[str]:
    """The report's lines for one shape."""
    cfg = get_shape(name)
    logits = torch.randn(cfg.num_tokens, cfg.num_experts, generator=torch.Generator().manual_seed(0)).to(device)
    idx = routing.softmax_topk(logits, cfg.num_topk)[0]
    probs = logits.float().softmax(-1)
    tile = min(TILE, idx.numel() // cfg.num_experts)

    def fn():
        return rounding._round_to_tiles(idx, probs, tile)

    rounded = fn()  # builds and loads the kernels
    with _CountCalls() as calls:
        fn()
    eager = time_ms(fn, iters)
    moved = float(routing.moved_routes(idx, rounded).float().mean())
    lines = [f"== {name} (tile {tile}, {device}): {calls.count} aten calls, eager {eager:.3f} ms, "
             f"{moved:.2%} of the routes moved"]
    if device == "cuda":
        graph = graph_time_ms([fn], 5, iters)  # as bench route's round_graph_ms
        num_ops, busy, kernels = _gpu_ops(fn, top)
        lines.append(f"   graph replay {graph:.3f} ms; {num_ops} GPU ops, busy {busy:.3f} ms")
        lines += [f"   {key[:80]:80s} {ms:.3f} ms  x{count}" for key, ms, count in kernels]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", default=list(STANDARD_SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    for name in args.shapes:
        print("\n".join(profile_shape(name, args.device, args.iters)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
