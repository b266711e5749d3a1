"""model.experts_impl=fused (moe_lab/models/experts.py) on every family: within 1e-6 relative of grouped_mm on logits
and gradients, routes recorded and replayed bit-exactly, the same bits run after run, one set of bits whichever
gather/combine strategy the batch size picks, and a checkpoint that loads with it."""

import dataclasses

import pytest
import torch

from moe_lab.config import constants as C
from moe_lab.config import ModelConfig
from moe_lab.models import build_model, load_model, moe_layers
from moe_lab.models import experts as experts_module
from moe_lab.models.families import FAMILIES
from moe_lab.routing import record, replay

TINY = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, num_experts=64, top_k=8,
                   moe_intermediate_size=16, intermediate_size=64, max_positions=64)
VOCAB = 16
ALL = list(FAMILIES)
TOL = 1e-6


def model_of(family: str, impl: str, **overrides):
    return build_model(dataclasses.replace(TINY, family=family, experts_impl=impl, **overrides), VOCAB)


def tokens(B: int = 3, S: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, x, ctx=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        loss = model(x, labels=x).loss
    else:
        with ctx:
            loss = model(x, labels=x).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def moe_param(name: str) -> bool:
    return ".mlp.experts." in name or ".mlp.gate." in name or ".mlp.router." in name


def test_fused_is_a_registered_choice():
    assert C.FUSED_EXPERTS in C.EXPERTS_KERNELS
    model = model_of("qwen3_moe", C.FUSED_EXPERTS)
    assert model.config._experts_implementation == C.FUSED_EXPERTS


@pytest.mark.parametrize("family", ALL)
def test_fused_agrees_with_grouped_mm_on_logits_and_gradients(family):
    x = tokens()
    fused, grouped = model_of(family, "fused"), model_of(family, "grouped_mm")
    assert all(torch.equal(a, b) for a, b in zip(fused.state_dict().values(), grouped.state_dict().values()))
    with torch.no_grad():
        logits_f, logits_g = fused(x).logits, grouped(x).logits
    assert rel(logits_f, logits_g) < TOL
    (loss_f, grads_f), (loss_g, grads_g) = loss_and_grads(fused, x), loss_and_grads(grouped, x)
    assert grads_f.keys() == grads_g.keys() and any(moe_param(n) for n in grads_g)
    assert abs(float(loss_f - loss_g)) <= TOL * abs(float(loss_g))
    flat_f, flat_g = (torch.cat([g[n].flatten() for n in sorted(g)]) for g in (grads_f, grads_g))
    assert rel(flat_f, flat_g) < TOL
    for name in filter(moe_param, grads_g):  # the experts' own weights and the routers, tensor by tensor
        assert rel(grads_f[name], grads_g[name]) < TOL, name


@pytest.mark.parametrize("shape", [dict(), dict(num_experts=8, top_k=2), dict(num_experts=8, top_k=1)])
@pytest.mark.parametrize("family", ALL)
def test_fused_records_and_replays_bit_exactly(family, shape):
    model, x = model_of(family, "fused", **shape), tokens()
    with torch.no_grad():
        plain = model(x).logits
        with record(model) as trace:
            logits = model(x).logits
        assert torch.equal(logits, plain)  # hooks that only read change nothing
        with replay(model, trace) as handle:
            replayed = model(x).logits
    assert torch.equal(replayed, plain)
    assert torch.equal(handle.latent.indices, trace.indices) and torch.equal(handle.latent.weights, trace.weights)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "minimax_m2"])
def test_fused_training_under_replay_consumes_the_forced_routes(family):
    model, x = model_of(family, "fused"), tokens()
    with torch.no_grad(), record(model) as trace:
        model(x)
    with torch.no_grad():
        for layer in moe_layers(model):  # the router now wants other experts
            layer.router.weight.add_(torch.randn(layer.router.weight.shape,
                                                 generator=torch.Generator().manual_seed(1)) * 0.5)
    with replay(model, trace), record(model) as seen:
        loss_and_grads(model, x)
    assert torch.equal(seen.indices, trace.indices)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_fused_gives_the_same_bits_run_after_run(family):
    x = tokens()
    runs = []
    for _ in range(2):
        model = model_of(family, "fused")
        with torch.no_grad():
            logits = model(x).logits
        runs.append((logits, *loss_and_grads(model, x)))
    (logits0, loss0, grads0), (logits1, loss1, grads1) = runs
    assert torch.equal(logits0, logits1) and torch.equal(loss0, loss1)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_small_and_large_batch_strategies_give_the_same_bits(family, dtype, monkeypatch):
    model, x = model_of(family, "fused").to(dtype), tokens(B=4, S=9)
    with torch.no_grad():
        once = model(x).logits
    monkeypatch.setattr(experts_module, "SMALL_SLOTS_X_HIDDEN", 0)  # gather and combine expert by expert
    with torch.no_grad():
        per_expert = model(x).logits
    assert torch.equal(once, per_expert)


def test_a_checkpoint_loads_with_the_fused_path(tmp_path):
    model, x = model_of("qwen3_moe", "grouped_mm"), tokens()
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_model(tmp_path / "ckpt", experts_impl="fused")
    assert loaded.config._experts_implementation == "fused"
    with torch.no_grad():
        assert rel(loaded(x).logits, model(x).logits) < TOL
