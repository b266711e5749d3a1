"""record()/replay() on every family: bit-exact replay, replay provably in force, generate() traces aligned
with teacher forcing, router gradient under replay, gradient checkpointing, noise."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from moe_lab.config import ModelConfig
from moe_lab.models.families import FAMILIES
from moe_lab.models import build_model, moe_layers, position_ids_from_mask
from moe_lab.routing import Trace, check_trace, expert_change, record, replay

TINY = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, num_experts=8, top_k=2,
                   moe_intermediate_size=32, intermediate_size=64, max_positions=64)
VOCAB = 16
ALL = list(FAMILIES)
# Routing shapes every family must record and replay bit-exactly: the default, top-1, and fine-grained
# experts (64 narrow experts, top-1 and top-8).
SHAPES = {"e8k2": {}, "e8k1": dict(top_k=1), "e64k1": dict(num_experts=64, top_k=1),
          "e64k8": dict(num_experts=64, top_k=8)}


def tiny_model(family: str, **overrides):
    return build_model(dataclasses.replace(TINY, family=family, **overrides), VOCAB)


def tokens(B: int = 3, S: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def recorded(model, x, **kwargs) -> tuple[Trace, torch.Tensor]:
    with torch.no_grad(), record(model, **kwargs) as trace:
        logits = model(x).logits
    return trace, logits


def perturb_routers(model, scale: float = 0.5, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.add_(torch.randn(layer.router.weight.shape, generator=gen) * scale)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ALL)
def test_record_is_bit_exact_and_replay_reproduces_logits(family, shape):
    model, x = tiny_model(family, **SHAPES[shape]), tokens()
    cfg = dataclasses.replace(TINY, **SHAPES[shape])
    with torch.no_grad():
        plain = model(x).logits
    trace, logits = recorded(model, x)
    assert torch.equal(logits, plain)  # hooks that only read change nothing
    assert trace.shape == (cfg.num_layers, 3, 7, cfg.top_k) and trace.indices.dtype == torch.uint8
    assert int(trace.indices.max()) < cfg.num_experts
    assert trace.weights.dtype == torch.float32 and trace.family == family
    with torch.no_grad(), replay(model, trace) as handle:
        replayed = model(x).logits
    assert torch.equal(replayed, plain)
    assert torch.equal(handle.latent.indices, trace.indices) and torch.equal(handle.latent.weights, trace.weights)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", ALL)
def test_replay_takes_effect(family, shape):
    model, x = tiny_model(family, **SHAPES[shape]), tokens()
    cfg = dataclasses.replace(TINY, **SHAPES[shape])
    trace, plain = recorded(model, x)
    other, _ = recorded(model, tokens(seed=5))
    scores = torch.rand(*trace.shape[:3], cfg.num_experts, generator=torch.Generator().manual_seed(11))
    rand_ids = scores.argsort(-1)[..., :cfg.top_k].to(torch.uint8)  # k distinct random experts per position
    for forced in (other, Trace(rand_ids, num_experts=cfg.num_experts, family=family)):
        assert expert_change(trace, forced) > 0
        with torch.no_grad(), replay(model, forced) as handle:
            out = model(x).logits
        assert not torch.equal(out, plain)
        # the first MoE layer's input is untouched by forcing, so its router still wants its own choice
        assert torch.equal(handle.latent.indices[0], trace.indices[0])


# top-1 in a family that renormalises the chosen weights: the one weight is exactly 1 whatever the logits
# (model.top_k's help), so the router gets no gradient from the loss; Switch-style families keep p_e.
RENORMALISING = {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_5_moe", "qwen3_next",
                 "minimax_m2", "dots1", "deepseek_v32", "ernie4_5_moe"}


@pytest.mark.parametrize("top_k", [2, 1])
@pytest.mark.parametrize("family", ALL)
def test_perturbed_router_under_replay_keeps_forced_ids_and_gets_gradient(family, top_k):
    model, x = tiny_model(family, top_k=top_k), tokens()
    trace, _ = recorded(model, x)
    perturb_routers(model)
    free, _ = recorded(model, x)
    assert expert_change(trace, free) > 0
    model.zero_grad()
    with replay(model, trace) as handle, record(model) as seen:
        model(x, labels=x).loss.backward()
    assert torch.equal(seen.indices, trace.indices)  # what the experts consumed
    assert torch.equal(handle.latent.indices[0], free.indices[0])  # later layers' inputs differ under forcing
    assert expert_change(trace, handle.latent) > 0
    for layer in moe_layers(model):
        grad = layer.router.weight.grad
        if top_k == 1 and family in RENORMALISING:  # the gate weight is 1 (up to rounding): no gradient
            assert grad is None or float(grad.abs().max()) < 1e-6
        else:
            assert grad is not None and float(grad.abs().max()) > 1e-6


@pytest.mark.parametrize("shape", ["e8k2", "e64k1"])
@pytest.mark.parametrize("family", ALL)
def test_generate_trace_equals_teacher_forced_trace_with_left_padding(family, shape):
    model = tiny_model(family, **SHAPES[shape])
    top_k = SHAPES[shape].get("top_k", TINY.top_k)
    prompt = tokens(B=3, S=6, seed=2)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[0, :3], prompt_mask[1, :1] = 0, 0
    prompt = prompt.masked_fill(prompt_mask == 0, 0)
    torch.manual_seed(0)
    with record(model) as gen_trace:
        seq = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=5, min_new_tokens=5, do_sample=True)
    mask = torch.cat([prompt_mask, torch.ones(3, seq.shape[1] - 6, dtype=prompt_mask.dtype)], dim=1)
    inp, inp_mask = seq[:, :-1], mask[:, :-1]
    with torch.no_grad(), record(model) as tf_trace:
        model(inp, attention_mask=inp_mask, position_ids=position_ids_from_mask(inp_mask))
    assert gen_trace.shape == tf_trace.shape == (TINY.num_layers, 3, seq.shape[1] - 1, top_k)
    real = inp_mask.bool()
    assert torch.equal(gen_trace.indices[:, real], tf_trace.indices[:, real])
    assert expert_change(gen_trace, tf_trace, mask=inp_mask) == 0.0


def test_minibatch_slices_stay_aligned():
    model, x = tiny_model("qwen3_moe"), tokens(B=4)
    trace, _ = recorded(model, x)
    idx_B = torch.tensor([2, 0])
    part, _ = recorded(model, x[idx_B])
    assert torch.equal(trace[idx_B].indices, part.indices)
    with torch.no_grad(), replay(model, trace[idx_B]) as handle:
        model(x[idx_B])
    assert torch.equal(handle.latent.indices, part.indices)
    joined = Trace.cat([trace[:2], trace[2:]])
    assert torch.equal(joined.indices, trace.indices) and torch.equal(joined.weights, trace.weights)


def test_mismatched_traces_are_refused_naming_the_field():
    model, x = tiny_model("qwen3_moe"), tokens()
    trace, _ = recorded(model, x)
    deeper, _ = recorded(tiny_model("qwen3_moe", num_layers=3), x)
    wider_k, _ = recorded(tiny_model("qwen3_moe", top_k=3), x)
    for bad, field in ((deeper, "num_layers: trace 3 vs model 2"), (wider_k, "top_k: trace 3 vs model 2")):
        with pytest.raises(ValueError, match=field):
            with replay(model, bad):
                model(x)
    with pytest.raises(ValueError, match=r"batch shape \(B, S\): trace \(3, 7\) vs batch \(3, 6\)"):
        with torch.no_grad(), replay(model, trace):
            model(x[:, :-1])
    with pytest.raises(ValueError, match="family: trace 'olmoe' vs model 'qwen3_moe'"):
        check_trace(model, recorded(tiny_model("olmoe"), x)[0])


def test_model_without_moe_layers_is_refused():
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="no MoE router of a supported family"):
        record(llama)


def test_replay_refuses_a_path_that_bypasses_the_router():
    model, x = tiny_model("qwen3_moe"), tokens()
    trace, _ = recorded(model, x)
    model.model.layers[1].mlp.forward = lambda hidden_states: torch.zeros_like(hidden_states)  # a fused stand-in
    with pytest.raises(RuntimeError, match=r"did not take effect.*MoE layers \[\(1, 'Qwen3MoeTopKRouter'\)\]"):
        with torch.no_grad(), replay(model, trace):
            model(x)


def test_one_call_per_context():
    model, x = tiny_model("qwen3_moe"), tokens()
    trace, _ = recorded(model, x)
    with pytest.raises(RuntimeError, match="replay\\(\\) covers one forward call"):
        with torch.no_grad(), replay(model, trace):
            model(x)
            model(x)
    with pytest.raises(RuntimeError, match="record\\(\\) covers one forward call or one generate"):
        with torch.no_grad(), record(model):
            model(x)
            model(x)
    with pytest.raises(RuntimeError, match="no call of the model ran"):
        with replay(model, trace):
            pass


def _loss_and_grads(model, x, ctx):
    model.zero_grad()
    with ctx as handle:
        loss = model(x, labels=x).loss
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, handle


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("noise_std", [0.0, 0.5])
def test_gradient_checkpointing_gives_the_same_loss_grads_and_traces(family, noise_std):
    model, x = tiny_model(family), tokens()
    trace, _ = recorded(model, x)
    perturb_routers(model)
    model.train()
    runs = {}
    for checkpointing in (False, True):
        model.activation_checkpointing_enable() if checkpointing else model.activation_checkpointing_disable()
        gen = lambda: dict(noise_std=noise_std, generator=torch.Generator().manual_seed(7))  # noqa: E731
        rep = _loss_and_grads(model, x, replay(model, trace, **gen()))
        rec = _loss_and_grads(model, x, record(model, **gen()))
        runs[checkpointing] = (rep, rec)
    for (loss0, grads0, h0), (loss1, grads1, h1) in zip(runs[False], runs[True]):
        assert torch.equal(loss0, loss1) and grads0.keys() == grads1.keys()
        assert all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    (_, _, rep0), (_, _, rec0) = runs[False]
    (_, _, rep1), (_, _, rec1) = runs[True]
    assert rec1.shape == rec0.shape == trace.shape  # the recompute appended nothing
    assert torch.equal(rec1.indices, rec0.indices) and torch.equal(rep1.latent.indices, rep0.latent.indices)


def test_backward_outside_replay_under_checkpointing_is_refused():
    model, x = tiny_model("qwen3_moe"), tokens()
    trace, _ = recorded(model, x)
    model.train()
    model.activation_checkpointing_enable()  # = the deprecated gradient_checkpointing_enable()
    with pytest.raises(RuntimeError, match="call backward\\(\\) inside the replay\\(\\) context"):
        with replay(model, trace):
            model(x, labels=x)


@pytest.mark.parametrize("family", ALL)
def test_noise_changes_routing_reproducibly(family):
    model, x = tiny_model(family), tokens()
    clean, _ = recorded(model, x)
    zero, _ = recorded(model, x, noise_std=0.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(zero.indices, clean.indices) and torch.equal(zero.weights, clean.weights)
    noisy_a, logits_a = recorded(model, x, noise_std=1.0, generator=torch.Generator().manual_seed(0))
    noisy_b, logits_b = recorded(model, x, noise_std=1.0, generator=torch.Generator().manual_seed(0))
    assert expert_change(clean, noisy_a) > 0
    assert torch.equal(noisy_a.indices, noisy_b.indices) and torch.equal(logits_a, logits_b)
    same_noise = dict(noise_std=1.0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), replay(model, noisy_a, **same_noise) as handle:  # same noise: same weights and logits
        assert torch.equal(model(x).logits, logits_a)
    assert torch.equal(handle.latent.indices, noisy_a.indices)
    with torch.no_grad(), replay(model, noisy_a) as handle:  # no noise: the first router wants its clean choice
        model(x)
    assert torch.equal(handle.latent.indices[0], clean.indices[0])


def test_bad_arguments_are_refused_before_any_work():
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="noise_std=-1.0 is out of range"):
        record(model, noise_std=-1.0)
    with pytest.raises(ValueError, match="generator: expected a torch.Generator"):
        record(model, noise_std=0.1, generator=0)
    with pytest.raises(ValueError, match="trace: expected a moe_lab.routing.Trace"):
        replay(model, torch.zeros(2, 3, 7, 2, dtype=torch.uint8))
    assert not any(layer.router._forward_hooks for layer in moe_layers(model)) and not model._forward_pre_hooks


def test_hooks_are_removed_on_exit_and_on_error():
    model, x = tiny_model("qwen3_moe"), tokens()
    routers = [layer.router for layer in moe_layers(model)]
    count = lambda: (len(model._forward_pre_hooks), [len(r._forward_hooks) for r in routers])  # noqa: E731
    before = count()
    trace, _ = recorded(model, x)
    assert count() == before
    with pytest.raises(ValueError, match="batch shape"):
        with torch.no_grad(), replay(model, trace):
            assert count() != before
            model(x[:2])
    assert count() == before


@pytest.mark.parametrize("bad,message", [(200, "found expert id 200"), (-1, "same expert twice")])
def test_replay_refuses_impossible_ids_before_the_forward(bad, message):
    model = tiny_model("qwen3_moe")
    x = tokens()
    trace, _ = recorded(model, x)
    ids = trace.indices.clone()
    ids[0, 0, 0, 0] = bad if bad >= 0 else ids[0, 0, 0, 1]  # out of range, or a duplicate within the top-k
    forged = Trace(ids, None, num_experts=trace.num_experts, family=trace.family)
    with pytest.raises(ValueError, match=message):
        with replay(model, forged):
            model(x)
