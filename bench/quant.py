"""Benchmark of the MXFP8 kernels (mok.ops): effective bandwidth against the same-run copy bandwidth,
and speed-up over the L0 quantizer (mok.mxfp8) run on the same GPU.

Effective bandwidth counts the fewest bytes each kernel must move: every input byte read once, every
output byte written once (bf16 x: 2 B/element; E4M3 data: 1 B/element; E8M0 scales: 1/32 B/element).
Two ceilings, both measured in the same run:
- `copy_gbps`: a device-to-device copy (`dst.copy_(src)`, 4 GiB, read + write), eager (its launch is
  nothing next to 2 ms); `frac_of_copy` = gbps / copy_gbps.
- `copy_same_size_gbps`: a copy (`dst.copy_(src)`) moving the SAME bytes as the row's kernel (half read,
  half written), timed like the kernel: `graph_time_ms`, same calls per graph, replays and median, sources
  rotated the same way; `frac_of_same_size_copy` = gbps / it. At 14 us a call, launch, ramp-up and drain are
  a large part of any kernel; this column says how much of the gap to the 4 GiB copy a copy of that size shares.
Kernel times are CUDA-event medians over CUDA-graph replays (no Python overhead inside the timed
region). L2 (60 MB, DESIGN §2): no flush; instead inputs smaller than L2_ROTATE_BYTES rotate among
several copies (each with its own outputs), so that a call's input was last touched >= 240 MB of reads
ago and comes from HBM; the same-size copy rotates its sources by the same rule. Outputs are written
into L2 and written back by the hardware, for both alike.

    python -m bench quant                    # writes data/bench/quant.csv
    python -m bench quant --ops dual,rowwise --no-l0 --out data/bench/quant_dual.csv   # some ops only
    python -m bench quant --ops dual --shapes 147456x7168,258048x4096 --out data/bench/quant_geometry.csv
                                                 # other shapes (here: the same bytes in other row lengths)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from bench.timing import DATA, graph_time_ms, provenance, time_ms
from mok import mxfp8, ops
from mok.config import STANDARD_SHAPES

L2_ROTATE_BYTES = 4 * 60 * 2**20  # inputs are rotated until this many bytes are touched per round
OPS = ("rowwise", "colwise", "dual", "dequant_rowwise", "dequant_colwise", "fake_rowwise", "fake_colwise", "fake_dual")


def quant_shapes() -> list[tuple[str, tuple]]:
    """16384 x 7168, then each standard shape's activations [num_tokens, hidden] and weights
    [num_experts, intermediate, hidden]."""
    shapes = [("16384x7168", (16384, 7168))]
    for cfg in STANDARD_SHAPES.values():
        shapes.append((f"{cfg.name}/x", (cfg.num_tokens, cfg.hidden)))
        shapes.append((f"{cfg.name}/w_gate", (cfg.num_experts, cfg.intermediate, cfg.hidden)))
    return shapes


def parse_shapes(text: str) -> list[tuple[str, tuple]]:
    """'147456x7168,3x64x96' -> [('147456x7168', (147456, 7168)), ('3x64x96', (3, 64, 96))]."""
    shapes = []
    for name in text.split(","):
        dims = name.split("x")
        if len(dims) not in (2, 3) or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"--shapes: expected ROWSxCOLS or EXPERTSxROWSxCOLS of positive ints, got {name!r}")
        shapes.append((name, tuple(int(d) for d in dims)))
    return shapes


def bytes_moved(op: str, numel: int) -> int:
    """Bytes read + written by `op` on `numel` elements (scales: numel / 32 bytes per direction)."""
    scales = numel // mxfp8.BLOCK_SIZE
    return {
        "rowwise": 2 * numel + numel + scales,
        "colwise": 2 * numel + numel + scales,
        "dual": 2 * numel + 2 * (numel + scales),
        "dequant_rowwise": numel + scales + 2 * numel,
        "dequant_colwise": numel + scales + 2 * numel,
        "fake_rowwise": 2 * numel + 2 * numel,  # the one-pass round trip: bf16 in, bf16 out
        "fake_colwise": 2 * numel + 2 * numel,
        "fake_dual": 2 * numel + 2 * 2 * numel,
    }[op]


def rotation_copies(input_bytes: int) -> int:
    """How many copies of an input of `input_bytes` the timed calls rotate among (L2 policy above)."""
    return max(1, math.ceil(L2_ROTATE_BYTES / input_bytes))


def same_size_copy_bytes(nbytes: int) -> int:
    """Bytes of the same-size copy's source (and destination): half of `nbytes` (read + written),
    rounded up to 16-byte chunks."""
    return 16 * math.ceil(nbytes / 2 / 16)


def bandwidth_columns(nbytes: int, ms: float, copy_gbps: float, same_size_gbps: float) -> dict:
    """gbps of a call that moved `nbytes` in `ms`, and its fractions of the two copy ceilings."""
    gbps = nbytes / ms / 1e6
    return {"bytes": nbytes, "gbps": gbps, "copy_gbps": copy_gbps, "frac_of_copy": gbps / copy_gbps,
            "copy_same_size_gbps": same_size_gbps, "frac_of_same_size_copy": gbps / same_size_gbps}


# ---- timing -------------------------------------------------------------------------------------


def copy_bandwidth_gbps(nbytes: int = 2**32) -> float:
    """Device-to-device copy (`dst.copy_(src)`, eager: inside a CUDA graph the copy becomes a memcpy
    node that ran at ~2.7 TB/s on the H200, against ~4.3 eager), bytes read + written per second, GB/s."""
    src = torch.randint(0, 255, (nbytes // 4,), dtype=torch.int32, device="cuda")  # [nbytes / 4]
    dst = torch.empty_like(src)  # [nbytes / 4]
    ms = time_ms(lambda: dst.copy_(src), iters=10, warmup=1)
    return 2 * nbytes / ms / 1e6


def same_size_copy_gbps(nbytes: int) -> float:
    """Read + written GB/s of a copy moving `nbytes` in all (half each way), timed as the quantizers are
    (graph_time_ms over rotated sources)."""
    half = same_size_copy_bytes(nbytes)
    pairs = [(torch.empty(half, dtype=torch.uint8, device="cuda").random_(0, 255),  # [half] source
              torch.empty(half, dtype=torch.uint8, device="cuda"))  # [half] destination
             for _ in range(rotation_copies(half))]
    ms = graph_time_ms([lambda p=p: p[1].copy_(p[0]) for p in pairs])
    return 2 * half / ms / 1e6


# ---- one shape ----------------------------------------------------------------------------------


def _kernel_calls(op: str, xs: list) -> tuple[list, object]:
    """Closures that run `op` on each input with preallocated outputs, and the first call's outputs."""
    ext = ops.load_extension()
    if op.startswith("dequant"):
        rowwise = op == "dequant_rowwise"
        outs = [(torch.empty(d.shape, dtype=torch.bfloat16, device="cuda"), d, s) for d, s in xs]
        return [lambda o=o: ext.mxfp8_dequantize(data=o[1], scales=o[2], out=o[0], rowwise=rowwise) for o in outs], \
            outs[0][0]
    if op.startswith("fake"):
        dual, rowwise = op == "fake_dual", op == "fake_rowwise"
        outs = [(torch.empty_like(x), torch.empty_like(x) if dual else None) for x in xs]  # (col or row, row)
        calls = [lambda x=x, o=o: ext.mxfp8_fake_quantize(x=x, out=o[0], out_row=o[1], rowwise=rowwise, counts=None)
                 for x, o in zip(xs, outs)]
        return calls, (outs[0][1], outs[0][0]) if dual else outs[0][0]
    fn = {"rowwise": ops.mxfp8_quantize_rowwise, "colwise": ops.mxfp8_quantize_colwise,
          "dual": ops.mxfp8_quantize_dual}[op]
    outs = [fn(x) for x in xs]  # allocate once; the graph re-runs the raw binding into them
    if op == "dual":
        calls = [lambda x=x, o=o: ext.mxfp8_quantize_dual(x=x, data_row=o[0][0], scales_row=o[0][1],
                                                          data_col=o[1][0], scales_col=o[1][1])
                 for x, o in zip(xs, outs)]
    else:
        raw = getattr(ext, f"mxfp8_quantize_{op}")
        calls = [lambda x=x, o=o: raw(x=x, data=o[0], scales=o[1]) for x, o in zip(xs, outs)]
    return calls, outs[0]


def _l0_fn(op: str, x: torch.Tensor, quantized: dict):
    if op == "rowwise":
        return lambda: mxfp8.quantize(x, dim=-1)
    if op == "colwise":
        return lambda: mxfp8.quantize(x, dim=-2)
    if op == "dual":
        return lambda: (mxfp8.quantize(x, dim=-1), mxfp8.quantize(x, dim=-2))
    if op.startswith("fake"):
        dims = {"fake_rowwise": (-1,), "fake_colwise": (-2,), "fake_dual": (-1, -2)}[op]
        outs = lambda: tuple(mxfp8.fake_quantize(x, dim=d) for d in dims)
        return (lambda: outs()[0]) if len(dims) == 1 else outs
    dim = -1 if op == "dequant_rowwise" else -2
    data, scales = quantized[dim]
    return lambda: mxfp8.dequantize(data, scales, dim=dim)


def _same_bits(got, want) -> bool:
    if isinstance(got, torch.Tensor):
        if got.dtype == torch.bfloat16:  # dequantized: NaN payloads may differ; random data has none
            return torch.equal(got.view(torch.int16), want.view(torch.int16))
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return all(_same_bits(g, w) for g, w in zip(got, want))


def bench_shape(name: str, shape: tuple, copy_gbps: float, l0: bool = True, ops_list: tuple = OPS) -> list[dict]:
    numel = math.prod(shape)
    copies = rotation_copies(2 * numel)
    xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]  # shape, each
    dequant = any(op.startswith("dequant") for op in ops_list)  # the quantized inputs are only theirs
    quantized = {dim: [ops.mxfp8_quantize_rowwise(x) if dim == -1 else ops.mxfp8_quantize_colwise(x)
                       for x in xs] if dequant else [None] for dim in (-1, -2)}
    rows = []
    same_size = {}  # bytes moved -> the same-size copy's GB/s (measured once per byte count)
    for op in ops_list:
        inputs = quantized[-1 if op == "dequant_rowwise" else -2] if op.startswith("dequant") else xs
        l0_ms, exact, want = float("nan"), None, None
        if l0:
            l0_fn = _l0_fn(op, xs[0], {d: q[0] for d, q in quantized.items()})
            want = l0_fn()
            l0_ms = time_ms(l0_fn, iters=3, warmup=1)  # the slow L0 reference
        calls, first_out = _kernel_calls(op, inputs)
        ms = graph_time_ms(calls)
        if l0:
            calls[0]()
            exact = _same_bits(first_out, want)
        nbytes = bytes_moved(op, numel)
        if nbytes not in same_size:
            same_size[nbytes] = same_size_copy_gbps(nbytes)
        rows.append({"shape_name": name, "shape": "x".join(map(str, shape)), "op": op, "time_ms": ms,
                     **bandwidth_columns(nbytes, ms, copy_gbps, same_size[nbytes]),
                     "l0_time_ms": l0_ms, "speedup_vs_l0": l0_ms / ms, "bitexact_vs_l0": exact})
        del want
    return rows


# ---- provenance and main ------------------------------------------------------------------------


def bench_quant(shapes: list | None = None, l0: bool = True, ops_list: tuple = OPS) -> list[dict]:
    """Tidy rows, one per (shape, op), provenance columns included."""
    ops.require_hopper()
    copy_gbps = copy_bandwidth_gbps()
    meta = provenance()
    none = {"l0_time_ms": float("nan"), "speedup_vs_l0": float("nan"), "bitexact_vs_l0": None}
    # The eager 4 GiB copy's row, against the same copy timed as the kernels are (from a CUDA graph)
    graph_gbps = same_size_copy_gbps(2 * 2**32)
    rows = [{"shape_name": "copy-4GiB", "shape": str(2**32), "op": "copy", "time_ms": 2 * 2**32 / copy_gbps / 1e6,
             **bandwidth_columns(2 * 2**32, 2 * 2**32 / copy_gbps / 1e6, copy_gbps, graph_gbps), **none}]
    for name, shape in shapes or quant_shapes():
        rows += bench_shape(name, shape, copy_gbps, l0=l0, ops_list=ops_list)
        torch.cuda.empty_cache()
    return [{**row, **meta} for row in rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DATA / "quant.csv"))
    parser.add_argument("--no-l0", action="store_true", help="skip the L0 reference (no speed-up column)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated ROWSxCOLS or EXPERTSxROWSxCOLS; default: 16384x7168 and each standard "
                             "shape's activations and weights")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes) if args.shapes else None
    except ValueError as e:
        parser.error(str(e))
    ops_list = tuple(args.ops.split(","))
    unknown = [op for op in ops_list if op not in OPS]
    if unknown:
        parser.error(f"--ops: expected a subset of {','.join(OPS)}, got {','.join(unknown)}")
    import pandas as pd

    df = pd.DataFrame(bench_quant(shapes, l0=not args.no_l0, ops_list=ops_list))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    cols = ["shape_name", "op", "time_ms", "gbps", "frac_of_copy", "frac_of_same_size_copy",
            "speedup_vs_l0", "bitexact_vs_l0"]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
