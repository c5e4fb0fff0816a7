"""The weight-gradient kernel with K over each expert's real rows (rounded up to 64: mok.ops.gemm, since
f63f262) against K over its whole padded segment (the kernel before), in one process (device-side;
docs/l2_fused_log.md, "The backward's x rows and the weight gradients' K"). Both calls are the same kernel: the old
behaviour is the new kernel given each segment's padded length as its row count. 7 alternating rounds of
mok.bench.time_ms per shape on the operands of d_w_gate (d_gate rows [R, I], x rows [R, H], zeros in padding
rows); prints the median of the rounds' ratios, the k-blocks each runs and checks that both give the same bits
(they differ only where a real sum is exactly -0, which random operands never give).

    python tools/wgrad_k_ab.py [SHAPE ...]
"""

from __future__ import annotations

import statistics
import sys

import torch

from mok import bench, fused, ops
from mok.config import STANDARD_SHAPES, get_shape
from mok.ops.gemm import weight_grad_schedule_tensors
from mok.reference import BF16
from mok.testing import make_inputs


def ab(name: str) -> str:
    """One shape's A/B line."""
    cfg = get_shape(name)
    ext = ops.load_extension()
    inputs = make_inputs(cfg, device="cuda", draw_on="cuda")
    sched = ops.make_schedule_cuda(inputs["topk_idx"], cfg.num_experts, block_m=fused.BLOCK_M)
    padding = (sched.row_to_token < 0)[:, None]  # [R, 1]
    a_rows = torch.randn(sched.num_rows, cfg.intermediate, device="cuda").to(BF16).masked_fill(padding, 0)
    b_rows = torch.randn(sched.num_rows, cfg.hidden, device="cuda").to(BF16).masked_fill(padding, 0)
    offsets, real_rows = weight_grad_schedule_tensors(sched, "cuda")  # [E + 1], [E]
    segment_rows = (offsets[1:] - offsets[:-1]).contiguous()  # [E]: the whole padded segment

    def run(rows: torch.Tensor) -> torch.Tensor:
        d_w = torch.empty(cfg.num_experts, cfg.intermediate, cfg.hidden, dtype=BF16, device="cuda")
        ext.grouped_gemm_bf16_weight_grad(a_rows, b_rows, offsets, rows, d_w, 0)
        return d_w

    same = torch.equal(run(real_rows).view(torch.int16), run(segment_rows).view(torch.int16))
    times = {"real": [], "segment": []}
    for r in range(7):  # alternate which goes first
        for label, rows in (("real", real_rows), ("segment", segment_rows))[:: 1 if r % 2 == 0 else -1]:
            times[label].append(bench.time_ms(lambda: run(rows)))  # noqa: B023 (used within the iteration)
    ratio = statistics.median(a / b for a, b in zip(times["real"], times["segment"]))
    blocks = [int(((rows + 63) // 64).sum()) for rows in (real_rows, segment_rows)]
    return (f"{name}: real {statistics.median(times['real']):.3f} ms ({blocks[0]} k-blocks per tile column) "
            f"segment {statistics.median(times['segment']):.3f} ms ({blocks[1]}), median ratio {ratio:.3f}, "
            f"same bits {same}")


def main(shapes: list[str]) -> None:
    for name in shapes:
        print(ab(name))


if __name__ == "__main__":
    main(sys.argv[1:] or list(STANDARD_SHAPES))
