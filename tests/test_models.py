"""Model building/loading and the family registry: every family's select()/gate_weights() must reproduce its
router bit-exactly, gate weights must come from the dense logits, and bad input must fail early and clearly."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from moe_lab.config import ModelConfig
from moe_lab.models.families import FAMILIES, get_family
from moe_lab.models.families.sigmoid import deepseek_groups
from moe_lab.models import build_model, load_model, moe_layers

TINY = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, num_experts=8, top_k=2,
                   moe_intermediate_size=32, intermediate_size=64, max_positions=64)
VOCAB = 16


def tiny(family: str, **overrides) -> ModelConfig:
    return dataclasses.replace(TINY, family=family, **overrides)


def tokens(B: int = 3, S: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def router_outputs(model, x):
    """(router module, its output) of every MoE layer for one forward."""
    seen = []
    handles = [layer.router.register_forward_hook(lambda mod, inp, out: seen.append((mod, out)))
               for layer in moe_layers(model)]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_build_model_is_tiny_fp32_eval_all_moe_and_seeded(family):
    model = build_model(tiny(family), VOCAB)
    layers = moe_layers(model)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert [layer.layer_idx for layer in layers] == list(range(TINY.num_layers))
    assert all(layer.family.name == family for layer in layers)
    assert all(layer.router.top_k == TINY.top_k and layer.router.num_experts == TINY.num_experts for layer in layers)
    assert model.config._experts_implementation == "grouped_mm"
    rng_before = torch.random.get_rng_state()
    again = build_model(tiny(family), VOCAB)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # building never moves the caller's RNG
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    other = build_model(tiny(family, seed=1), VOCAB)
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


@pytest.mark.parametrize("shape", [{}, dict(top_k=1), dict(num_experts=64, top_k=1), dict(num_experts=64, top_k=8)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_select_and_gate_weights_reproduce_the_router_bit_exactly(family, shape):
    model = build_model(tiny(family, **shape), VOCAB)
    if family == "deepseek_v3":  # a non-zero correction bias exercises "bias affects the choice only"
        for layer in moe_layers(model):
            layer.router.e_score_correction_bias.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    spec = get_family(family)
    for router, (logits_NE, weights_NK, ids_NK) in router_outputs(model, tokens()):
        sel_w, sel_ids = spec.select(router, logits_NE)
        assert torch.equal(sel_ids, ids_NK) and torch.equal(sel_w, weights_NK)
        assert torch.equal(spec.gate_weights(router, logits_NE, ids_NK), weights_NK)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gate_weights_come_from_dense_logits_and_carry_router_gradient(family):
    """Force the experts the router likes least: their weights must still be the family's normalisation of
    the dense scores (not zero) and give the router weight a gradient."""
    model = build_model(tiny(family), VOCAB)
    spec = get_family(family)
    for router, (logits_NE, _, ids_NK) in router_outputs(model, tokens()):
        logits_NE = logits_NE.detach().requires_grad_(True)
        worst_NK = torch.topk(-logits_NE.detach(), router.top_k, dim=-1).indices
        assert not (worst_NK[:, :, None] == ids_NK[:, None, :]).any()
        w_NK = spec.gate_weights(router, logits_NE, worst_NK)
        assert bool((w_NK > 0).all())
        w_NK.pow(2).sum().backward()
        assert logits_NE.grad.gather(1, worst_NK).abs().sum() > 0


def _first(out):
    return out[0] if isinstance(out, tuple) else out  # some blocks also return their router logits


def _moe_blocks(model) -> list:
    """The MLP block of every decoder layer (router, routed experts and any shared expert)."""
    return [layer.mlp for layer in model.model.layers]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_shared_expert_false_leaves_only_the_routed_experts(family):
    """With every routed expert zeroed, a block's output is its shared expert's alone: exactly 0 without one."""
    x = torch.randn(2, 5, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    outs = {}
    for shared in (True, False):
        model = build_model(tiny(family, shared_expert=shared), VOCAB)
        with torch.no_grad():
            for block in _moe_blocks(model):
                for p in block.experts.parameters():
                    p.zero_()
            outs[shared] = [_first(block(x)) for block in _moe_blocks(model)]
    assert all(float(o.abs().max()) == 0.0 for o in outs[False])
    has_shared = family in ("qwen2_moe", "deepseek_v3", "glm4_moe", "qwen3_5_moe", "qwen3_next", "dots1",
                            "deepseek_v32", "ernie4_5_moe")
    assert all((float(o.abs().max()) > 0.0) == has_shared for o in outs[True])
    if not has_shared:  # nothing to remove: the same model either way
        a = build_model(tiny(family, shared_expert=True), VOCAB).state_dict()
        b = build_model(tiny(family, shared_expert=False), VOCAB).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_deepseek_bias_shifts_the_choice_not_the_weights():
    model = build_model(tiny("deepseek_v3"), VOCAB)
    spec = get_family("deepseek_v3")
    router, (logits_NE, _, ids_NK) = router_outputs(model, tokens())[0]
    w_before = spec.gate_weights(router, logits_NE, ids_NK)
    router.e_score_correction_bias[ids_NK[0, 0]] = -10.0  # this expert can never be chosen now
    _, new_ids = spec.select(router, logits_NE)
    assert not (new_ids == ids_NK[0, 0]).any()
    assert torch.equal(spec.gate_weights(router, logits_NE, ids_NK), w_before)
    groups_NK = new_ids // (router.num_experts // router.num_group)  # group-limited top-k
    assert all(len(set(row.tolist())) <= router.topk_group for row in groups_NK)


@pytest.mark.parametrize("E,K", [(2, 1), (3, 2), (4, 4), (8, 2), (8, 6), (12, 3), (64, 8), (60, 4)])
def test_deepseek_groups_are_valid(E, K):
    n_group, topk_group = deepseek_groups(E, K)
    assert E % n_group == 0 and E // n_group >= 2 and 1 <= topk_group <= n_group
    assert topk_group * (E // n_group) >= K  # enough experts in the kept groups for top-k


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_load_model_round_trip_is_bit_exact(family, tmp_path):
    model = build_model(tiny(family, experts_impl="eager"), VOCAB)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_model(tmp_path / "ckpt", experts_impl="eager")
    assert not loaded.training and loaded.config._experts_implementation == "eager"
    with torch.no_grad():
        assert torch.equal(model(tokens()).logits, loaded(tokens()).logits)


def test_load_model_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="not a supported MoE family: allowed .*qwen3_moe"):
        load_model(tmp_path / "llama")
    with pytest.raises(ValueError, match="experts_impl='batched_mm'.*allowed grouped_mm, eager"):
        load_model(tmp_path, experts_impl="batched_mm")


def test_model_without_moe_layers_is_refused_listing_the_families():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="no MoE router of a supported family: allowed " + ", ".join(FAMILIES)):
        moe_layers(llama)


@pytest.mark.parametrize("kwargs,match", [
    (dict(vocab_size=2), "vocab_size=2"),
    (dict(vocab_size=VOCAB, eos_token_id=VOCAB), "eos_token_id=16 is out of range"),
    (dict(vocab_size=VOCAB, cfg=tiny("llama")), "family='llama' is not supported"),
    (dict(vocab_size=VOCAB, cfg=tiny("qwen3_moe", experts_impl="batched_mm")), "experts_impl='batched_mm'"),
    (dict(vocab_size=VOCAB, cfg=tiny("qwen3_moe", top_k=9)), "top_k=9 is out of range"),
])
def test_build_model_rejects_bad_arguments(kwargs, match):
    cfg = kwargs.pop("cfg", tiny("qwen3_moe"))
    with pytest.raises(ValueError, match=match):
        build_model(cfg, **kwargs)
