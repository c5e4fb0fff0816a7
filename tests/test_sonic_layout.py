"""bench.sonic's conversions on the CPU: the arrays it hands SonicMoE, fed to a pure-torch model of what
`sonicmoe.moe_general_routing_inputs` computes with them, give mok's routed-experts function, forward and gradients.

The model follows SonicMoE 0.1.2.post1's code path, not mok's formula: routes grouped by expert (bincount, offsets,
gather index), QuACK's gated GEMM against w1.permute(2, 1, 0) with gate = preact[:, ::2] and up = preact[:, 1::2],
the down GEMM against w2.permute(2, 1, 0), and the per-token sum of score·y over the run of routes that
searchsorted(token_idx, t) delimits (why token_idx must be sorted). A wrong interleave, a concatenated [gate; up],
or unsorted token indices make it disagree with the plain per-route formula."""

import torch
import torch.nn.functional as F

from bench import sonic

T, H, I, E, K = 7, 8, 4, 3, 2


def sonic_model(x, scores, token_idx, expert_idx, w1, w2):
    """What SonicMoE computes from its arguments (documented semantics; fp64 here)."""
    assert w1.shape[0] % 2 == 0 and w1.shape[1] == x.shape[1] and w2.shape[1] == w1.shape[0] // 2
    n_exp = w2.shape[-1]
    TK = scores.shape[0]
    # router metadata: routes grouped by expert (any order inside a group), gather index of their tokens
    order = torch.argsort(expert_idx, stable=True)
    offsets = F.pad(torch.bincount(expert_idx, minlength=n_exp).cumsum(0), (1, 0))
    x_gather_idx = token_idx[order].long()
    position = torch.empty(TK, dtype=torch.long)
    position[order] = torch.arange(TK)  # s_reverse_scatter_idx: route -> row of the grouped layout
    # up projection + SwiGLU (QuACK gemm_gated, interleaved layout), then down projection, expert by expert
    B1, B2 = w1.permute(2, 1, 0), w2.permute(2, 1, 0)  # (E, H, 2I), (E, I, H)
    y = []
    for e in range(n_exp):
        rows = x[x_gather_idx[offsets[e]:offsets[e + 1]]]
        preact = rows @ B1[e]
        a = F.silu(preact[:, ::2]) * preact[:, 1::2]
        y.append(a @ B2[e])
    y = torch.cat(y)
    # per-token sum over the run of routes searchsorted delimits: correct only when token_idx is sorted
    starts = torch.searchsorted(token_idx, torch.arange(x.shape[0] + 1, dtype=token_idx.dtype))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for r in range(starts[t], starts[t + 1]):
            out[t] = out[t] + scores[r] * y[position[r]]
    return out


def plain(x, topk_idx, topk_weights, w_gate, w_up, w_down):
    """mok's DESIGN formula, route by route."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = topk_idx[t, k]
            h = F.silu(x[t] @ w_gate[e].T) * (x[t] @ w_up[e].T)
            out[t] = out[t] + topk_weights[t, k] * (h @ w_down[e].T)
    return out


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    topk_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # distinct experts per token
    topk_idx[0] = torch.tensor([2, 1])  # a token listing a higher expert first
    return dict(x=torch.randn(T, H, generator=g, **f64), topk_idx=topk_idx,
                topk_weights=torch.rand(T, K, generator=g, **f64),
                w_gate=torch.randn(E, I, H, generator=g, **f64), w_up=torch.randn(E, I, H, generator=g, **f64),
                w_down=torch.randn(E, H, I, generator=g, **f64))


def through_sonic(p, c_fc):
    """The model on what bench.sonic hands SonicMoE, with leaves like SonicPeer's."""
    x = p["x"].clone().requires_grad_()
    tw = p["topk_weights"].clone().requires_grad_()
    c_fc = c_fc.clone().requires_grad_()
    c_proj = p["w_down"].clone().requires_grad_()
    scores, token_idx, expert_idx = sonic.flat_routes(p["topk_idx"], tw)
    w1, w2 = sonic.sonic_weights(c_fc, c_proj)
    return sonic_model(x, scores, token_idx, expert_idx, w1, w2), (x, tw, c_fc, c_proj)


def test_routes_sorted_int32_and_scores_a_view():
    p = problem()
    tw = p["topk_weights"].float()
    scores, token_idx, expert_idx = sonic.flat_routes(p["topk_idx"], tw)
    assert token_idx.dtype == expert_idx.dtype == torch.int32 and scores.dtype == torch.float32
    assert bool((token_idx[1:] >= token_idx[:-1]).all())
    assert scores.data_ptr() == tw.data_ptr()  # a view: the router gradient lands in topk_weights
    assert torch.equal(expert_idx.view(T, K).long(), p["topk_idx"]) and torch.equal(token_idx.view(T, K)[:, 0].long(),
                                                                                     torch.arange(T))


def test_weight_views_have_sonicmoes_strides():
    """w1 (2I, H, E) and w2 (H, I, E), both with stride order (2, 0, 1): E outermost, the last-but-one dim inner."""
    p = problem()
    w1, w2 = sonic.sonic_weights(sonic.interleave_gate_up(p["w_gate"], p["w_up"]), p["w_down"])
    assert w1.shape == (2 * I, H, E) and w1.stride() == (H, 1, 2 * I * H)
    assert w2.shape == (H, I, E) and w2.stride() == (I, 1, H * I)


def test_interleave_round_trip():
    p = problem()
    c_fc = sonic.interleave_gate_up(p["w_gate"], p["w_up"])
    assert c_fc.is_contiguous() and torch.equal(c_fc[:, 4], p["w_gate"][:, 2]) and torch.equal(c_fc[:, 5],
                                                                                                p["w_up"][:, 2])
    gate, up = sonic.split_gate_up(c_fc)
    assert torch.equal(gate, p["w_gate"]) and torch.equal(up, p["w_up"])


def test_forward_and_gradients_match_the_plain_formula():
    p = problem()
    out, (x, tw, c_fc, c_proj) = through_sonic(p, sonic.interleave_gate_up(p["w_gate"], p["w_up"]))
    ref_leaves = [p[n].clone().requires_grad_() for n in ("x", "topk_weights", "w_gate", "w_up", "w_down")]
    ref = plain(ref_leaves[0], p["topk_idx"], *ref_leaves[1:])
    torch.testing.assert_close(out, ref)
    d_out = torch.randn(T, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dx, dtw, dc_fc, dc_proj = torch.autograd.grad(out, (x, tw, c_fc, c_proj), d_out)
    d_gate, d_up = sonic.split_gate_up(dc_fc)  # how the benchmark reads d_w_gate, d_w_up back
    for got, want in zip((dx, dtw, d_gate, d_up, dc_proj), torch.autograd.grad(ref, ref_leaves, d_out)):
        torch.testing.assert_close(got, want)


def test_wrong_layouts_disagree():
    """The model is sensitive to what is checked: swapped gate/up, [gate; up] concatenated, unsorted tokens."""
    p = problem()
    ref = plain(p["x"], p["topk_idx"], p["topk_weights"], p["w_gate"], p["w_up"], p["w_down"])
    for c_fc in (sonic.interleave_gate_up(p["w_up"], p["w_gate"]), torch.cat([p["w_gate"], p["w_up"]], dim=1)):
        out, _ = through_sonic(p, c_fc)
        assert not torch.allclose(out, ref)
    w1, w2 = sonic.sonic_weights(sonic.interleave_gate_up(p["w_gate"], p["w_up"]), p["w_down"])
    scores, token_idx, expert_idx = sonic.flat_routes(p["topk_idx"], p["topk_weights"])
    perm = torch.randperm(T * K, generator=torch.Generator().manual_seed(2))
    out = sonic_model(p["x"], scores[perm], token_idx[perm], expert_idx[perm], w1, w2)
    assert not torch.allclose(out, ref)
