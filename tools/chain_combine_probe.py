"""Does the combine behind GEMM2's tiles pay (docs/gemm.md, "The combine behind GEMM2's tiles")? An open
experiment (issue 45): delete it once it has answered, its answer in docs/gemm.md.

Per shape, by the method of record (bench.timing.time_ms, 1 s warm-up, calls queued), the routed forward's GEMMs and
combine three ways: the fused level's two launches + combine_rows, the chain + combine_rows, and the chain with the
combine inside. Bits checked equal first. (The layer's forward in one launch against the fused level's is the
megakernel level's row of `python -m bench moe --levels fused megakernel --passes fwd`.)
    python tools/chain_combine_probe.py [--shapes dsv4pro-rank qwen3-30b-a3b ...] [--rounds 2]
Reading: "inside" below "chain_then_combine" by about the combine's time: it hides; equal: the store waits per tile
cost what the combine saved; above: they cost more."""

import argparse

import torch

from bench.timing import WARMUP_MS, time_ms
from mok import ops
from mok.config import get_shape
from mok.testing import make_inputs


def probe(name: str, rounds: int) -> None:
    cfg = get_shape(name)
    inp = make_inputs(cfg, "cuda", draw_on="cuda")
    x, wg, wu, wd, w = (inp[n] for n in ("x", "w_gate", "w_up", "w_down", "topk_weights"))
    sched = ops.make_schedule_cuda(inp["topk_idx"], cfg.num_experts)

    def launches():
        h, _, _ = ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched)
        return ops.combine_rows(ops.grouped_gemm_bf16_nt_contiguous(h, wd, sched), sched.route_to_row, w,
                                check_rows=False)

    def chain_then_combine():
        return ops.combine_rows(ops.grouped_gemm_bf16_chain(x, wg, wu, wd, sched)[0], sched.route_to_row, w,
                                check_rows=False)

    def inside():
        return ops.grouped_gemm_bf16_chain(x, wg, wu, wd, sched, topk_weights=w)[4]

    same = lambda a, b: torch.equal(a.view(torch.int16), b.view(torch.int16))  # noqa: E731
    assert same(inside(), launches()), f"{name}: out differs"
    calls = (launches, chain_then_combine, inside)
    for r in range(rounds):
        ms = {f.__name__: time_ms(f, iters=20, warmup_ms=WARMUP_MS) for f in calls}
        print(name, f"round {r}", "  ".join(f"{k} {v:.3f} ms" for k, v in ms.items()),
              f"inside/launches {ms['inside'] / ms['launches']:.3f}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["dsv4pro-rank", "kimi-k2-rank", "qwen3-30b-a3b", "qwen3-235b",
                                                   "olmoe-7b"])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    for shape in args.shapes:
        probe(shape, args.rounds)
