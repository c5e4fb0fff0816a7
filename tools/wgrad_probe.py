"""Why wgrad_gate/wgrad_up run at 0.69-0.70 of the ceiling at qwen3-235b on the H100 while wgrad_down, the same
kernel with M and N swapped, runs at 0.95 (docs/results.md, "Where the backward's time goes"). An open experiment
(issue 42): delete it once it has answered, its answer in docs/gemm.md.

One weight gradient d_w[e] = Σ_r a[r]ᵀ·b[r] per (M, N) on random bf16 rows over a schedule of random routing:
(I, H) is wgrad_gate's orientation, (H, I) wgrad_down's; + 64 columns change the rows' pitch (8 KiB at H = 4096).
    python tools/wgrad_probe.py [--shapes qwen3-235b qwen3-30b-a3b dsv4pro-rank]
Reading: (H, I) fast and (I, H) slow at every pitch: orientation (compute x_rowsᵀ·d_gate, store the tile
transposed); the + 64 variants fast: the pitch; no difference on random operands: the real operands' values."""

import argparse

import torch

from bench.timing import time_ms
from mok import ops, routing
from mok.config import get_shape


def probe(name: str) -> None:
    cfg = get_shape(name)
    T, H, I, E, K = cfg.num_tokens, cfg.hidden, cfg.intermediate, cfg.num_experts, cfg.num_topk
    topk_idx = routing.random_routing(T, E, K, generator=torch.Generator().manual_seed(0))[0].cuda()
    sched = ops.make_schedule_cuda(topk_idx, E)
    useful = 2.0 * T * K * H * I  # one weight gradient's FLOPs on the real rows
    for tag, m, n in (("gate (I, H)", I, H), ("down (H, I)", H, I), ("gate (I, H+64)", I, H + 64),
                      ("down (H+64, I)", H + 64, I), ("gate (I+64, H)", I + 64, H)):
        ms = _time_wgrad(sched, m, n)
        print(f"{name:14s} {tag:15s} {ms:8.3f} ms {useful * m * n / (I * H) / ms / 1e9:6.0f} TFLOP/s", flush=True)
        torch.cuda.empty_cache()


def _time_wgrad(sched, m: int, n: int) -> float:
    a = torch.randn(sched.num_rows, m, device="cuda").bfloat16()  # [rows, M]
    b = torch.randn(sched.num_rows, n, device="cuda").bfloat16()  # [rows, N]
    return time_ms(lambda: ops.grouped_gemm_bf16_weight_grad(a, b, sched), iters=20, warmup_ms=300)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["qwen3-235b", "qwen3-30b-a3b", "dsv4pro-rank"])
    for shape in p.parse_args().shapes:
        probe(shape)
