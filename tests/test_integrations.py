"""mok.integrations: Hugging Face transformers' and torchtitan's MoE blocks with their experts swapped for mok.moe,
checked against the same blocks running their own code: the output and every gradient (x and each parameter: the
router's through the routing weights, the experts', the shared experts'), on 7 tokens (odd) over 16 experts with 2
routes each, so at least 2 experts get no token. Their routers decide in both runs (the same ids), so the two differ
only in the experts' arithmetic.

Tolerance: TOLERANCES["bf16_vs_l0"] (1e-2, Σ|Δ|/Σ|ref|), DESIGN §10's bound between two bf16 computations of the
layer. Both sides are bf16 GEMMs with fp32 accumulation; the clients round more (the routing-weight product and the
sum over k in bf16; torchtitan's SwiGLU in bf16), mok rounds once per DESIGN §3. Measured (CPU, torch 2.13): 1.3e-3
to 6e-3 on every tensor; against an fp64 run of HF's own loop on the same blocks mok was at 3e-3 to 6e-3 and HF's bf16
at 4.5e-3 to 6.5e-3. mok takes bf16 only (DESIGN §3) and casts an fp32 model's experts to bf16 at the call; the fp32
block compared here is torchtitan's, whose GroupedExperts casts to bf16 too, so both sides run bf16 experts inside fp32.

Skipped without transformers (>= 5) or torchtitan (>= 0.3, which imports triton); `pip install -e .[integrations]`.
"""

import copy

import pytest
import torch

from mok.testing import TOLERANCES, rel_err

HIDDEN, INTERMEDIATE, NUM_EXPERTS, NUM_TOPK, NUM_TOKENS = 64, 96, 16, 2, 7  # T·K = 14 < E: >= 2 empty experts
TOL = TOLERANCES["bf16_vs_l0"]
BACKENDS = ["reference", "torch", pytest.param("fused", marks=[pytest.mark.gpu, pytest.mark.sm90])]


def _device(backend: str) -> str:
    return "cuda" if backend == "fused" else "cpu"


def _randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter ~ N(0, 0.1²) from `seed` (their initializers leave some at zero or empty)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module


def _forward_backward(block: torch.nn.Module, x: torch.Tensor) -> tuple:
    """(out, x.grad, {name: param.grad}) of block(x) under a fixed, non-uniform upstream gradient."""
    x = x.clone().requires_grad_()
    out = block(x)
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype))
    return out.detach(), x.grad, {name: p.grad for name, p in block.named_parameters()}


def _check_swap_matches(block, swap, backend, dtype, routes_of):
    """block (the client's) against a deep copy with its experts swapped: out, d_x, every parameter's gradient."""
    device = _device(backend)
    block = _randomize(block).to(device, dtype)
    swapped = copy.deepcopy(block)
    assert swap(swapped, backend=backend)
    x = (torch.randn(1, NUM_TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.5).to(device, dtype)
    used = torch.unique(routes_of(block, x))
    assert used.numel() < NUM_EXPERTS  # the irregular case: experts with no token
    (out, d_x, grads), (ref_out, ref_d_x, ref_grads) = _forward_backward(swapped, x), _forward_backward(block, x)
    assert out.dtype == ref_out.dtype == dtype and out.shape == ref_out.shape
    assert rel_err(out, ref_out) <= TOL
    assert rel_err(d_x, ref_d_x) <= TOL
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert grads[name] is not None and grads[name].dtype == ref.dtype, name
        assert rel_err(grads[name], ref) <= TOL, name


# --- Hugging Face transformers ------------------------------------------------------------------------------------


def _transformers():
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip(f"mok.integrations.hf needs transformers >= 5 (3D expert weights), got {transformers.__version__}")
    return transformers


def _hf_block(model: str):
    """A Qwen3-MoE or Mixtral sparse MoE block (router + experts) from a small config, nothing downloaded, its experts
    running the model file's own loop ("eager"; the whole-model test below runs HF's default, grouped_mm)."""
    transformers = _transformers()
    if model == "qwen3":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        return Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=NUM_EXPERTS,
            num_experts_per_tok=NUM_TOPK, norm_topk_prob=True, experts_implementation="eager"))
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    return MixtralSparseMoeBlock(transformers.MixtralConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=NUM_EXPERTS,
        num_experts_per_tok=NUM_TOPK, experts_implementation="eager"))


def _hf_routes(block, x):
    return block.gate(x.reshape(-1, HIDDEN))[2]  # (logits, weights, ids): the router's top-k ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["qwen3", "mixtral"])
def test_hf_block_matches_its_own_experts(model, backend):
    """Qwen3-MoE (bf16 routing weights, normalized) and Mixtral (fp32 weights), bf16 blocks."""
    from mok.integrations import hf
    _check_swap_matches(_hf_block(model), hf.swap_experts, backend, torch.bfloat16, _hf_routes)


def test_hf_model_swap_shares_parameters_and_trains():
    """A 2-layer Qwen3-MoE causal LM in fp32: both layers swapped in place, the same Parameters and state_dict keys,
    an optimizer made before the swap steps the expert weights, and the loss is the model's own within bf16."""
    transformers = _transformers()
    from mok.integrations import hf
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=INTERMEDIATE,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=NUM_TOPK))
    params, keys = list(model.parameters()), list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(2))
    ref_loss = model(input_ids=ids, labels=ids).loss.item()
    assert hf.swap_experts(model, backend="reference") == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all(a is b for a, b in zip(params, model.parameters())) and list(model.state_dict()) == keys
    experts = model.model.layers[1].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    loss = model(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - ref_loss) <= TOL * ref_loss
    loss.backward()
    opt.step()
    assert experts.gate_up_proj.grad.abs().sum() > 0 and not torch.equal(experts.gate_up_proj, before)


def test_hf_swap_names_what_it_cannot_run():
    transformers = _transformers()
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from mok.integrations import hf
    with pytest.raises(ValueError, match=r"model: expected a transformers >= 5 model .* got Linear with MoE-like"):
        hf.swap_experts(torch.nn.Linear(4, 4))
    gpt_oss = GptOssMLP(transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4))
    with pytest.raises(ValueError, match=r"model\.experts: expected experts mok computes exactly .* GptOssExperts "
                                         r"with expert biases"):
        hf.swap_experts(gpt_oss)
    assert "forward" not in vars(gpt_oss.experts)  # nothing swapped
    with pytest.raises(ValueError, match="backend: expected 'auto' or one of"):
        hf.swap_experts(_hf_block("qwen3"), backend="triton")


# --- torchtitan ---------------------------------------------------------------------------------------------------


def _torchtitan_block(shared: bool):
    """torchtitan's MoE: softmax router with normalized top-k (Qwen3's) and no shared expert, or a sigmoid router,
    unnormalized, route_scale 2.5, with a shared expert (DeepSeek-V3's kind)."""
    moe = pytest.importorskip("torchtitan.models.common.moe")  # skips with triton missing too: torchtitan imports it
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    def linear(n_in, n_out):
        return Linear.Config(in_features=n_in, out_features=n_out)

    return moe.MoE.Config(
        num_experts=NUM_EXPERTS,
        router=moe.TokenChoiceTopKRouter.Config(
            num_experts=NUM_EXPERTS, gate=linear(HIDDEN, NUM_EXPERTS), top_k=NUM_TOPK,
            score_func="sigmoid" if shared else "softmax", route_norm=not shared, route_scale=2.5 if shared else 1.0),
        routed_experts=moe.RoutedExperts.Config(
            inner_experts=moe.GroupedExperts.Config(dim=HIDDEN, hidden_dim=INTERMEDIATE, num_experts=NUM_EXPERTS),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=NUM_EXPERTS, top_k=NUM_TOPK)),
        shared_experts=FeedForward.Config(w1=linear(HIDDEN, INTERMEDIATE), w2=linear(INTERMEDIATE, HIDDEN),
                                          w3=linear(HIDDEN, INTERMEDIATE)) if shared else None,
    ).build()


def _torchtitan_routes(block, x):
    return block.router(x, block.expert_bias_E)[1]  # (scores, ids, all scores)


@pytest.mark.filterwarnings("ignore:In CPU autocast")  # their router asks for an fp32 autocast, a no-op on the CPU
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared, dtype", [(False, torch.bfloat16), (True, torch.float32)], ids=["bf16", "fp32-shared"])
def test_torchtitan_block_matches_its_own_experts(shared, dtype, backend):
    from mok.integrations import torchtitan as tt
    _check_swap_matches(_torchtitan_block(shared), tt.swap_experts, backend, dtype, _torchtitan_routes)


def test_torchtitan_swap_names_what_it_cannot_run():
    block = _torchtitan_block(shared=False)
    from torchtitan.models.common.moe import GroupedExperts

    from mok.integrations import torchtitan as tt

    class ScaledExperts(GroupedExperts):  # e.g. a low-precision converter's _grouped_mm
        pass

    with pytest.raises(ValueError, match=r"model: expected a torchtitan model .* got Linear with MoE-like"):
        tt.swap_experts(torch.nn.Linear(4, 4))
    inner = block.routed_experts.inner_experts
    inner.__class__ = ScaledExperts
    with pytest.raises(ValueError, match=r"model\.routed_experts: .* inner_experts of class ScaledExperts"):
        tt.swap_experts(block)
    inner.__class__ = GroupedExperts
    assert tt.swap_experts(block, precision="bf16") == ["routed_experts"]
    with pytest.raises(ValueError, match="precision: expected one of"):
        tt.swap_experts(block, precision="fp8")
