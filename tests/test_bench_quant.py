"""CPU checks of bench.quant's arithmetic: the bytes each op moves, the same-size copy's byte count,
the L2 rotation rule, and the bandwidth columns (no GPU: the timings themselves run on the H200)."""

from __future__ import annotations

import math

import pytest

from bench import quant as bench_quant


def test_bytes_moved_counts_each_byte_once():
    numel = 2048 * 7168  # dsv4pro-rank x
    scales = numel // 32
    assert bench_quant.bytes_moved("rowwise", numel) == 2 * numel + numel + scales
    assert bench_quant.bytes_moved("colwise", numel) == bench_quant.bytes_moved("rowwise", numel)
    assert bench_quant.bytes_moved("dual", numel) == 2 * numel + 2 * numel + 2 * scales
    assert bench_quant.bytes_moved("dequant_rowwise", numel) == numel + scales + 2 * numel
    assert bench_quant.bytes_moved("fake_rowwise", numel) == bench_quant.bytes_moved("fake_colwise", numel) == 4 * numel
    assert bench_quant.bytes_moved("fake_dual", numel) == 6 * numel  # bf16 in, two bf16 out, no bytes between


@pytest.mark.parametrize("nbytes", [44_498_944, 59_637_760, 3, 32, 33, 2 * 2**32])
def test_same_size_copy_moves_at_least_the_kernels_bytes(nbytes):
    """Source = destination = half the bytes, in whole 16-byte chunks: read + written = nbytes, plus
    at most 31 bytes of rounding."""
    half = bench_quant.same_size_copy_bytes(nbytes)
    assert half % 16 == 0
    assert nbytes <= 2 * half < nbytes + 32


def test_rotation_keeps_small_inputs_out_of_l2():
    l2_bytes = 50 * 2**20  # H200
    assert bench_quant.rotation_copies(2 * 2**32) == 1  # a 4 GiB input is never reused within a round
    for input_bytes in (29_360_128, 22_249_472, 88_997_888):  # dsv4pro x (bf16), its same-size copy, kimi x
        copies = bench_quant.rotation_copies(input_bytes)
        assert copies * input_bytes >= bench_quant.L2_ROTATE_BYTES  # bytes read per round
        assert (copies - 1) * input_bytes >= 2 * l2_bytes  # read between two reads of one input
        assert copies == math.ceil(bench_quant.L2_ROTATE_BYTES / input_bytes)


def test_bandwidth_columns():
    nbytes, ms = 44_498_944, 0.014  # 44.5 MB in 14 us
    row = bench_quant.bandwidth_columns(nbytes, ms, copy_gbps=4200.0, same_size_gbps=3500.0)
    gbps = nbytes / (ms * 1e-3) / 1e9
    assert row["bytes"] == nbytes
    assert row["gbps"] == pytest.approx(gbps, rel=1e-12)
    assert row["frac_of_copy"] == pytest.approx(gbps / 4200.0, rel=1e-12)
    assert row["copy_same_size_gbps"] == 3500.0
    assert row["frac_of_same_size_copy"] == pytest.approx(gbps / 3500.0, rel=1e-12)
    # the same-size copy is the smaller ceiling here, so the kernel is a larger fraction of it
    assert row["frac_of_same_size_copy"] > row["frac_of_copy"]


def test_parse_shapes():
    assert bench_quant.parse_shapes("147456x7168,3x64x96") == [("147456x7168", (147456, 7168)),
                                                                ("3x64x96", (3, 64, 96))]
    for bad in ("147456", "0x64", "2x3x4x5", "64xa"):
        with pytest.raises(ValueError, match="--shapes: expected ROWSxCOLS"):
            bench_quant.parse_shapes(bad)
