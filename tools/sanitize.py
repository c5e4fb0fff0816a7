"""The workload compute-sanitizer checks (issue 5): the L2 `fused` level, forward and backward, on small shapes.

One pass runs every L2 kernel (the four GEMM kinds and the weight-gradient kind, the schedule, the
route-gradient glue and the combine, and in mxfp8 the quantizers and GEMM1 with MXFP8 outputs; the last case
with MOK_MX_WEIGHTS=mainloop, the MXFP8-weight GEMMs) with and without the shared expert, then checks the
result against L0 so that a sanitizer run that silently skipped a kernel cannot pass. The case "tails" gives each
expert a full tile and a short tail.

    compute-sanitizer --tool memcheck  python tools/sanitize.py             (`make sanitize`: both, and synccheck)
    compute-sanitizer --tool racecheck python tools/sanitize.py [WORD ...]   (only the cases naming a WORD)

The word `rounding` also runs routing.round_to_tiles' kernels (the prep, the rounds and the end game) on end games
with swaps, against the CPU's routing; the other words skip it. synccheck is the tool for their barriers. The word
`chain` runs the megakernel level (mok.megakernel: each pass one launch, its tasks on counters between CTAs) against
the fused level's out and gradients, at a grid of 3 and the full grid, and over 2 and 3 ranks in this process
(mok.ep_chain: counters, rows and outputs of other ranks).
"""

import sys

import torch

from mok import fused, megakernel, routing, testing
from mok import reference as L0
from mok.config import TINY_SHAPES, MoEConfig

SHAPES = {**TINY_SHAPES, "tails": MoEConfig("tails", 293, 128, 96, 4, 2)}  # testing.routing_of("tails")
CASES = [("tiny", "bf16", "dequantize"), ("tiny-top8", "bf16", "dequantize"), ("tiny-noshared", "bf16", "dequantize"),
         ("tails", "bf16", "dequantize"), ("tiny", "mxfp8", "dequantize"), ("tiny-top8", "mxfp8", "mainloop")]
TOLERANCE = {"bf16": testing.TOLERANCES["bf16_vs_l0"], "mxfp8": testing.TOLERANCES["mxfp8_vs_l0_mxfp8"]}

words = sys.argv[1:]
if not words or "rounding" in words:
    for T, E, K, tile in [(1024, 14, 7, 64), (2048, 8, 4, 128), (8192, 128, 8, 128)]:
        scores = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).softmax(-1)
        idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :K]
        got = routing.round_to_tiles(idx.cuda(), scores.cuda(), tile).cpu()
        assert torch.equal(got, routing.round_to_tiles(idx, scores, tile)), f"rounding {T, E, K, tile}: not the CPU's"
        print(f"rounding {T, E, K, tile}: the GPU's kernels give the CPU's routing", flush=True)
for name, precision, mx_weights in CASES:
    if words and not any(w in (name, precision, mx_weights) for w in words):
        continue
    routing_fn = testing.routing_of("tails") if name == "tails" else None
    inputs = testing.make_inputs(SHAPES[name], device="cuda", seed=1, draw_on="cuda", routing_fn=routing_fn)
    out, grads = testing.run_level(fused, inputs, precision=precision, swiglu_limit=1.0, mx_weights=mx_weights)
    out0, grads0 = testing.run_level(L0, inputs, precision=precision, swiglu_limit=1.0)
    torch.cuda.synchronize()
    errors = [testing.rel_err(a, b) for a, b in zip((out, *grads), (out0, *grads0)) if b is not None]
    worst = max(errors)
    assert worst <= TOLERANCE[precision], f"{name} {precision}: worst rel_err {worst:.3e}"
    print(f"{name} {precision} ({mx_weights}): fused == L0 within tolerance (worst rel_err {worst:.2e})", flush=True)
if not words or "chain" in words:  # the passes in one launch: counters between CTAs (rows, the combines' slices)
    for name, precision in [("tiny", "bf16"), ("tiny-top8", "mxfp8"), ("tails", "bf16")]:
        routing_fn = testing.routing_of("tails") if name == "tails" else None
        inputs = testing.make_inputs(SHAPES[name], device="cuda", seed=1, draw_on="cuda", routing_fn=routing_fn)
        for num_sms in (3, None):
            want = testing.run_level(fused, inputs, precision=precision, swiglu_limit=1.0, num_sms=num_sms)
            got = testing.run_level(megakernel, inputs, precision=precision, swiglu_limit=1.0, num_sms=num_sms)
            torch.cuda.synchronize()
            for i, (a, b) in enumerate(zip((got[0], *got[1]), (want[0], *want[1]))):
                same = a is None if b is None else testing.bitwise_equal(a, b)
                assert same, f"chain {name} {precision} num_sms={num_sms}: output {i} not the fused level's"
        print(f"chain {name} {precision}: both passes in one launch give the fused level's bits", flush=True)
if not words or "chain" in words:  # over ranks: counters, rows and out of other ranks (R ranks in this process)
    from mok import ep_chain

    inputs = testing.make_inputs(SHAPES["tiny"], device="cuda", seed=2, draw_on="cuda")
    want = testing.run_level(fused, inputs)
    T = SHAPES["tiny"].num_tokens
    for split in ([T // 2, T - T // 2], [T - 3, 0, 3]):
        args, d_outs = testing.by_rank(testing.rank_inputs(inputs, split))
        outs, saved = ep_chain.forward_ranks(*args, *testing.moe_args(inputs)[6:])
        grads = ep_chain.backward_ranks(saved, d_outs)
        torch.cuda.synchronize()
        assert testing.bitwise_equal(torch.cat(outs), want[0]), f"chain over ranks {split}: out not the fused level's"
        assert testing.bitwise_equal(torch.cat([g[0] for g in grads]), want[1][0]), f"chain over ranks {split}: d_x"
        print(f"chain over ranks {split}: out and d_x are the fused level's bits", flush=True)
