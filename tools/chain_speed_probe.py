"""Is the chain kernel as fast as its launches one by one again (docs/gemm.md, "The chain, measured")? An open
experiment (issue 45, roadmap item 7): delete it once answered, its answer in docs/gemm.md.

Per shape, by the method of record (bench.timing.time_ms, 1 s warm-up, calls queued), the routed GEMM1 and GEMM2 as
two launches and as one chain launch, bits checked equal first; the chain stood at 1.00× the launches at 1bc468b,
1.37× / 1.14× (dsv4pro-rank / qwen3-30b-a3b) at 3f5466e and 1.59× / 1.42× at d9b24e8 (H100). To compare builds in
one run, put an older tree beside this one (`git archive <commit> mok csrc tools bench | tar -x -C old/`) and run
this script from each, in the same command.
    python tools/chain_speed_probe.py [--shapes dsv4pro-rank qwen3-30b-a3b ...] [--rounds 2]"""

import argparse

import torch

from bench.timing import WARMUP_MS, time_ms
from mok import ops
from mok.config import get_shape
from mok.testing import make_inputs


def probe(name: str, rounds: int) -> None:
    cfg = get_shape(name)
    inp = make_inputs(cfg, "cuda", draw_on="cuda")
    x, wg, wu, wd = (inp[n] for n in ("x", "w_gate", "w_up", "w_down"))
    sched = ops.make_schedule_cuda(inp["topk_idx"], cfg.num_experts)

    def launches():
        return ops.grouped_gemm_bf16_nt_contiguous(ops.grouped_gemm_bf16_swiglu_gather(x, wg, wu, sched)[0], wd, sched)

    def chain():
        return ops.grouped_gemm_bf16_chain(x, wg, wu, wd, sched)[0]

    rows = int(sched.expert_offsets[-1])  # the real rows (spare rows past them are unwritten)
    assert torch.equal(chain()[:rows].view(torch.int16), launches()[:rows].view(torch.int16)), f"{name}: y differs"
    for r in range(rounds):
        ms = {f.__name__: time_ms(f, iters=20, warmup_ms=WARMUP_MS) for f in (launches, chain)}
        print(name, f"round {r}", "  ".join(f"{k} {v:.3f} ms" for k, v in ms.items()),
              f"chain/launches {ms['chain'] / ms['launches']:.3f}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["dsv4pro-rank", "qwen3-30b-a3b"])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    for shape in args.shapes:
        probe(shape, args.rounds)
