"""bench.torchao_fp8, the FP8 baseline peer: everything around TorchAO's FP8 grouped GEMM checked on the CPU with a
BF16 grouped GEMM in its place (row gather and padding to 16, gate/up in one GEMM, SwiGLU, down, weighted combine,
the gradients' names and layouts), the skip path where torchao or an sm_90 GPU is missing, and the rows `bench moe`
writes for it. On a Hopper GPU with torchao installed (tools/gpu_env.sh installs .whl/), the real peer against L0."""

from __future__ import annotations

import pytest
import torch

from bench import moe, torchao_fp8
from mok import reference
from mok.config import TINY_SHAPES, MoEConfig
from mok.testing import TOLERANCES, make_inputs, moe_args, rel_err
from mok.torch_native import gmm as bf16_gmm

ROUTED = ["d_x", "d_topk_weights", "d_w_gate", "d_w_up", "d_w_down"]  # reference.backward's first five
COLUMNS = {"shape", "level", "kind", "precision", "pass", "time_ms", "tflops", "ceiling_tflops", "frac_of_ceiling",
           "speedup_vs_torch", "peak_mem_gb", "err_vs_l0", "notes", "gpu", "torch", "cuda", "commit", "date"}


def checked_bf16_gmm(calls: list):
    """A BF16 grouped GEMM with TorchAO's signature that records each call and checks what TorchAO asserts: A
    row-major, B_t per-expert column-major, int32 segment ends that are multiples of 16."""
    def gmm(a, b_t, offs):
        assert a.is_contiguous() and b_t.stride(-2) == 1, (a.stride(), b_t.stride())
        assert offs.dtype == torch.int32 and bool((offs % torchao_fp8.GROUP_ROWS == 0).all()), offs
        calls.append((tuple(a.shape), tuple(b_t.shape)))
        return bf16_gmm(a, b_t, offs)
    return gmm



@pytest.mark.parametrize("name", ["tiny-noshared", "tiny-top1"])
def test_peer_is_the_routed_layer(name):
    """With a BF16 GEMM in the FP8 GEMM's place the peer computes L0's routed experts: output and the five routed
    gradients within the BF16 tolerance (two GEMMs per pass, gate and up in one)."""
    cfg = TINY_SHAPES[name]
    p = make_inputs(cfg, seed=3)
    calls = []
    peer = torchao_fp8.TorchaoFp8Peer(*moe_args(p)[:6], grouped_mm=checked_bf16_gmm(calls))
    out = peer()
    ref_out, saved = reference.forward(*moe_args(p))
    assert rel_err(out, ref_out) <= TOLERANCES["bf16_vs_l0"]
    I, H = cfg.intermediate, cfg.hidden
    assert [c[1] for c in calls] == [(cfg.num_experts, H, 2 * I), (cfg.num_experts, I, H)]
    grads = peer.grads(out, p["d_out"])
    ref_grads = dict(zip(ROUTED, reference.backward(saved, p["d_out"])))
    for g in ROUTED:
        assert grads[g].shape == ref_grads[g].shape, g
        assert rel_err(grads[g], ref_grads[g]) <= TOLERANCES["bf16_vs_l0"], (g, rel_err(grads[g], ref_grads[g]))


def test_padding_rows_change_nothing():
    """Segments padded to 16 rows: an expert with 1 route and one with 17 get 16 and 32 rows, and the padding rows
    (zeros) add nothing: the same output as with every segment padded further (to 48)."""
    cfg = MoEConfig("pad", num_tokens=18, hidden=32, intermediate=32, num_experts=3, num_topk=1)
    p = make_inputs(cfg, seed=5)
    p["topk_idx"] = torch.tensor([0] + [2] * 17).view(-1, 1)
    calls = []
    out = torchao_fp8.TorchaoFp8Peer(*moe_args(p)[:6], grouped_mm=checked_bf16_gmm(calls))()
    assert calls[0][0] == (48, 32)  # 16 + 0 + 32 rows
    ref_out, _ = reference.forward(*moe_args(p))
    assert rel_err(out, ref_out) <= TOLERANCES["bf16_vs_l0"]


def test_weights_are_torchaos_column_major_views():
    w = torch.randn(4, 48, 32)  # [E, N, K]
    b_t = torchao_fp8.column_major_t(w)
    assert b_t.shape == (4, 32, 48) and b_t.stride() == (48 * 32, 1, 32) and b_t.data_ptr() == w.data_ptr()


def test_skipped_without_torchao_or_sm90(capsys):
    """On this CPU machine the peer says why it cannot run, and `bench moe` writes no row for it."""
    assert torchao_fp8.unavailable_reason() is not None
    cfg = TINY_SHAPES["tiny-noshared"]
    rows = moe.bench_shape(cfg, ["reference"], ["mxfp8"], ["fwd"], peers=[torchao_fp8.NAME], iters=2,
                           device="cpu", warmup_ms=0.0)
    assert {r["level"] for r in rows} == {"cublas-dense", "reference"}
    assert f"peer {torchao_fp8.NAME} skipped: " in capsys.readouterr().err


def test_rows_of_the_peer(monkeypatch, capsys):
    """Where it runs, the peer gets one row per pass beside the mxfp8 rows (precision fp8_rowwise, its error against
    L0 BF16, its version in the notes) and none beside bf16 alone or on a shape with a shared expert."""
    monkeypatch.setattr(torchao_fp8, "unavailable_reason", lambda device=None: None)
    monkeypatch.setattr(torchao_fp8, "_torchao_gmm", lambda: checked_bf16_gmm([]))
    monkeypatch.setattr(torchao_fp8, "version", lambda: "0.18.0")
    cfg = TINY_SHAPES["tiny-noshared"]
    rows = moe.bench_shape(cfg, ["reference"], ["bf16", "mxfp8"], ["fwd", "bwd", "fwd+bwd"],
                           peers=[torchao_fp8.NAME], iters=2, device="cpu", warmup_ms=0.0)
    peer = [r for r in rows if r["level"] == torchao_fp8.NAME]
    assert [r["pass"] for r in peer] == ["fwd", "bwd", "fwd+bwd"]
    for r in peer:
        assert COLUMNS <= set(r), COLUMNS - set(r)
        assert r["kind"] == "peer" and r["precision"] == "fp8_rowwise" and r["time_ms"] > 0
        assert r["notes"].startswith("torchao 0.18.0") and 0 <= r["err_vs_l0"] <= TOLERANCES["bf16_vs_l0"]
    bf16_only = moe.bench_shape(cfg, ["reference"], ["bf16"], ["fwd"], peers=[torchao_fp8.NAME], iters=2,
                                device="cpu", warmup_ms=0.0)
    assert torchao_fp8.NAME not in {r["level"] for r in bf16_only}
    shared = moe.bench_shape(TINY_SHAPES["tiny"], ["reference"], ["mxfp8"], ["fwd"], peers=[torchao_fp8.NAME],
                             iters=2, device="cpu", warmup_ms=0.0)
    assert torchao_fp8.NAME not in {r["level"] for r in shared}
    assert "the shape has a shared expert" in capsys.readouterr().err


def test_cli_offers_the_peer():
    with pytest.raises(SystemExit):
        moe.main(["--peers", "no-such-peer"])
    assert torchao_fp8.NAME in moe.PEERS and moe.PEERS[torchao_fp8.NAME][:2] == ("mxfp8", "fp8_rowwise")


@pytest.mark.sm90
def test_torchao_peer_on_hopper():
    """The real FP8 peer (TorchAO's kernels) against L0 BF16: MoK's MXFP8 bound (0.1) on the output and gradients."""
    pytest.importorskip("torchao.prototype.moe_training")
    cfg = MoEConfig("fp8-peer", num_tokens=300, hidden=256, intermediate=128, num_experts=8, num_topk=4)
    p = make_inputs(cfg, device="cuda", seed=1)
    peer = torchao_fp8.TorchaoFp8Peer(*moe_args(p)[:6])
    out = peer()
    ref_out, saved = reference.forward(*moe_args(p))
    assert rel_err(out, ref_out) <= TOLERANCES["mxfp8_vs_l0_bf16"]
    grads = peer.grads(out, p["d_out"])
    ref_grads = dict(zip(ROUTED, reference.backward(saved, p["d_out"])))
    for g in ROUTED:
        assert rel_err(grads[g], ref_grads[g]) <= TOLERANCES["mxfp8_vs_l0_bf16"], g
