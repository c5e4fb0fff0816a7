"""GEMM1 + GEMM2 in one launch (ops.grouped_gemm_bf16_chain) against the two launches, on the routed experts of the
named shapes: min of `rounds` rounds of bench.timing.time_ms each, alternating, in one process; asserts equal bits
first. `python tools/chain_probe.py --shapes qwen3-30b-a3b olmoe-7b`. An experiment: rows in
data/bench/chain_1bc468b.csv, verdict in docs/gemm.md."""

import argparse

import torch

from bench.timing import time_ms
from mok import ops
from mok.config import get_shape
from mok.testing import make_inputs


def probe(name: str, rounds: int) -> None:
    cfg = get_shape(name)
    inputs = make_inputs(cfg, device="cuda", seed=0, draw_on="cuda")
    x, wg, wu, wd = (inputs[n] for n in ("x", "w_gate", "w_up", "w_down"))
    sched = ops.make_schedule_cuda(inputs["topk_idx"], cfg.num_experts)

    def two():
        h, _, _ = ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched)
        return ops.grouped_gemm_bf16_nt_contiguous(h, wd, sched)

    def chain():
        return ops.grouped_gemm_bf16_chain(x, wg, wu, wd, sched)[0]

    assert torch.equal(two(), chain())
    times = {"two": [], "chain": []}
    for _ in range(rounds):
        for tag, fn in (("two", two), ("chain", chain)):
            times[tag].append(time_ms(fn, iters=20, warmup_ms=300))
    print(f"{name}: chain / two = {min(times['chain']) / min(times['two']):.3f} {times}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "olmoe-7b", "kimi-k2-rank-routed",
                                                      "dsv4pro-rank-routed", "qwen3-235b"])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    for shape in args.shapes:
        probe(shape, args.rounds)
        torch.cuda.empty_cache()
