"""mok.ops.pull_rows and combine_peers (csrc/include/mok/moe/peer_rows.cuh): the megakernel's pull and combine
bodies, each rank's buffer reached through a table of addresses. Here every rank's buffer is a tensor of this
process (Peers.of), the kernels cannot tell. Checked bit for bit against torch indexing and L0's combine, and,
driven by mok.ep_build's tables, against the single-GPU gather and combine: the rows a rank pulls are the
single-GPU schedule's rows cut at its experts, at any EP degree. GPU only."""

from __future__ import annotations

import pytest
import torch

from mok import reference, routing
from mok.ep_build import build_tables
from mok.schedule import gather_rows
from mok.testing import bitwise_equal, fresh_seed, poison_allocator

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16


def _ops():
    from mok import ops
    return ops


def _padded(rows: torch.Tensor, capacity: int) -> torch.Tensor:
    """rows [n, ...] in a buffer of `capacity` rows, the rest NaN (or -1): what a peer's spare rows may hold."""
    out = torch.full((capacity, *rows.shape[1:]), float("nan") if rows.is_floating_point() else -1,
                     dtype=rows.dtype, device=rows.device)
    out[: rows.shape[0]] = rows
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_pull_rows_equal_torch_indexing(weighted):
    ops = _ops()
    seed = fresh_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    R, cap, H, K, n = 3, 37, 136, 3, 301
    xs = [torch.randn(cap, H, generator=g, device="cuda").to(BF16) for _ in range(R)]
    xs[1][0, :8] = -0.0  # a -0 stays -0 through the weighting (one product, one rounding)
    ws = [torch.randn(cap, K, generator=g, device="cuda") for _ in range(R)]
    rank = torch.randint(-1, R, (n,), generator=g, device="cuda", dtype=torch.int32)
    token = torch.randint(0, cap, (n,), generator=g, device="cuda", dtype=torch.int32)
    k = torch.randint(0, K, (n,), generator=g, device="cuda", dtype=torch.int32)
    rank[0], token[0], k[0] = 1, 0, 0
    token = torch.where(rank < 0, -1, token)
    poison_allocator(n * H * 2)
    kw = dict(weights=ops.Peers.of(ws), pull_k=k, num_topk=K) if weighted else {}
    got = ops.pull_rows(ops.Peers.of(xs), rank, token, **kw)  # [n, H]
    want = torch.zeros(n, H, dtype=BF16, device="cuda")
    for r in range(n):
        s, t = int(rank[r]), int(token[r])
        if s >= 0:
            want[r] = (xs[s][t].float() * ws[s][t, int(k[r])]).to(BF16) if weighted else xs[s][t]
    assert bitwise_equal(got, want), f"seed {seed}"
    if weighted:
        assert torch.signbit(got[0, :8]).all() == (ws[1][0, 0] > 0), "-0·w keeps its sign rule"


def test_pull_rows_bad_entries_give_nan_rows_and_never_read_outside():
    ops = _ops()
    xs = [torch.ones(4, 16, dtype=BF16, device="cuda") for _ in range(2)]
    rank = torch.tensor([0, 2, 1, 0, -1], dtype=torch.int32, device="cuda")  # rank 2 does not exist
    token = torch.tensor([3, 0, 4, -2, -1], dtype=torch.int32, device="cuda")  # rows 4 and -2 do not either
    got = ops.pull_rows(ops.Peers.of(xs), rank, token).cpu()
    assert (got[0] == 1).all() and (got[4] == 0).all() and got[1:4].isnan().all()


@pytest.mark.parametrize("weighted,with_shared", [(True, True), (False, False), (True, False)])
def test_combine_peers_equals_l0_combine(weighted, with_shared):
    ops = _ops()
    seed = fresh_seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    R, cap, H, T, K = 3, 50, 1032, 41, 5  # H: a row tile and a partial one
    ys = [torch.randn(cap, H, generator=g, device="cuda").to(BF16) for _ in range(R)]
    rank = torch.randint(0, R, (T, K), generator=g, device="cuda", dtype=torch.int32)
    row = torch.randint(0, cap, (T, K), generator=g, device="cuda", dtype=torch.int32)
    w = torch.rand(T, K, generator=g, device="cuda") if weighted else None
    shared = torch.randn(T, H, generator=g, device="cuda").to(BF16) if with_shared else None
    poison_allocator(T * H * 2)
    got = ops.combine_peers(ops.Peers.of(ys), rank, row, w, shared)
    y = torch.stack([torch.stack([ys[int(rank[t, j])][int(row[t, j])] for j in range(K)]) for t in range(T)])
    want = reference.combine(y, w if weighted else torch.ones(T, K, device="cuda"), shared)  # [T, H]
    assert bitwise_equal(got, want), f"seed {seed}"
    bad = rank.clone()
    bad[3, 2] = R  # no such rank: token 3 is NaN, the others unchanged
    got_bad = ops.combine_peers(ops.Peers.of(ys), bad, row, w, shared)
    assert got_bad[3].isnan().all() and bitwise_equal(got_bad[4:], got[4:])


def test_peer_ops_name_the_bad_argument():
    ops = _ops()
    ys = ops.Peers.of([torch.zeros(4, 16, dtype=BF16, device="cuda")])
    with pytest.raises(ValueError, match="combine_row"):
        ops.combine_peers(ys, torch.zeros(2, 2, dtype=torch.int32, device="cuda"),
                          torch.zeros(2, 3, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="pull_k"):
        ops.pull_rows(ys, torch.zeros(2, dtype=torch.int32, device="cuda"),
                      torch.zeros(2, dtype=torch.int32, device="cuda"),
                      weights=ops.Peers.of([torch.zeros(4, 1, device="cuda")]))
    with pytest.raises(ValueError, match="buffers\\[1\\]"):
        ops.Peers.of([torch.zeros(4, 16, dtype=BF16, device="cuda"), torch.zeros(5, 16, dtype=BF16, device="cuda")])


@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("block_m", [128, 8])
def test_tables_pull_and_combine_the_single_gpu_rows(R, block_m):
    """Driven by mok.ep_build's tables of every rank (uneven token counts, R = 3 with a rank of no tokens): rank r's
    pulled x rows (and d_out rows, weighted) are the single-GPU gather's rows cut at its experts, and its tokens'
    combine over the peers' rows is the single-GPU combine's: the same bits at every EP degree."""
    ops = _ops()
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    T, E, K, H = 211, 12, 4, 264
    idx = routing.random_routing(T, E, K, generator=gen)[0].cuda()
    w = torch.rand(T, K, generator=gen).cuda()
    x = torch.randn(T, H, generator=gen).to(BF16).cuda()
    split = {1: [T], 2: [150, T - 150], 3: [100, 0, T - 100], 4: [60, 50, 40, T - 150]}[R]
    sched = ops.make_schedule_cuda(idx, E, block_m=block_m)
    tables = [build_tables(idx, split, E, r, "forward", hidden=H, intermediate=64, block_m=block_m, sched=sched)
              for r in range(R)]
    cap = max(split)
    xs = ops.Peers.of([_padded(p, cap) for p in x.split(split)])
    ws = ops.Peers.of([_padded(p, cap) for p in w.split(split)])
    rows = [ops.pull_rows(xs, t["pull_rank"], t["pull_token"]) for t in tables]
    want_x = gather_rows(x, sched)  # the single-GPU dispatch (the kernel's twin: its kernel takes 128-row tiles)
    assert bitwise_equal(torch.cat(rows), want_x), f"x rows, seed {seed}"
    dy = [ops.pull_rows(xs, t["pull_rank"], t["pull_token"], weights=ws, pull_k=t["pull_k"], num_topk=K)
          for t in tables]
    d_out_w = (x.float()[:, None, :] * w[:, :, None]).to(BF16)  # [T, K, H]: L0's dy
    rt = sched.row_to_token[: sched.expert_offsets[-1]]
    want_dy = torch.where((rt >= 0)[:, None], d_out_w[rt.clamp(min=0), sched.row_to_k[: rt.numel()].clamp(min=0)], 0)
    assert bitwise_equal(torch.cat(dy), want_dy.to(BF16)), f"dy rows, seed {seed}"

    y = [torch.randn(r.shape[0], H, generator=gen).to(BF16).cuda() for r in rows]  # each rank's expert outputs
    cap_rows = max(r.shape[0] for r in rows)
    ys = ops.Peers.of([_padded(r, cap_rows) for r in y])
    want = ops.combine_rows(torch.cat(y), sched.route_to_row, w)  # [T, H]
    got = torch.cat([ops.combine_peers(ys, t["combine_rank"], t["combine_row"], ww)
                     for t, ww in zip(tables, w.split(split))])
    assert bitwise_equal(got, want), f"combine, seed {seed}"
