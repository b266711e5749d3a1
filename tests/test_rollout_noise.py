"""rl.rollout_router_noise: the sampler routes with noisy logits, the trainer does not (R3's mismatch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_lab.config import ConfigError, ModelConfig, RLConfig, RunConfig, TaskConfig, validate
from moe_lab.models import build_model
from moe_lab.rl.rollout import forward_logits, generate
from moe_lab.routing import expert_change, record
from moe_lab.rl.collect import collect
from moe_lab.rl.seeds import rollout_noise_generator
from moe_lab.tasks import get_task


def setup(rollout_noise: float, **rl):
    cfg = validate(RunConfig(
        model=ModelConfig(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, num_experts=8, top_k=2,
                          moe_intermediate_size=32, intermediate_size=64, max_positions=64),
        task=TaskConfig(name="sort", length=6, eval_size=16),
        rl=RLConfig(prompts_per_step=2, group_size=4, minibatches=2, rollout_router_noise=rollout_noise, **rl)))
    task = get_task(cfg.task)
    policy = build_model(cfg.model, len(task.tokenizer))
    return cfg, task, policy, task.sample_prompts(2, np.random.default_rng(0))


def collected(cfg, task, policy, prompts, step: int = 3, seed: int = 0):
    torch.manual_seed(seed)  # the sampling RNG, as train() seeds it
    return collect(policy, policy, None, task, cfg, step, prompts)


def test_zero_noise_rollout_routes_like_the_trainer():
    data = collected(*setup(0.0))
    assert data.batch_metrics["mismatch/expert_change"] == 0.0  # fp32, same weights: identical routing
    assert data.batch_metrics["mismatch/k3"] == pytest.approx(0.0, abs=1e-10)
    assert torch.equal(data.batch.trace.indices, data.ref_trace.indices)


def test_noise_moves_the_rollout_routing_only():
    cfg, task, policy, prompts = setup(0.5)
    data = collected(cfg, task, policy, prompts)
    assert data.batch_metrics["mismatch/expert_change"] > 0 and data.batch_metrics["mismatch/k3"] > 0
    assert expert_change(data.batch.trace, data.ref_trace, mask=data.batch.attention_mask_BS[:, :-1]) > 0
    # the old pass routes freely and noise-free: a clean forward of the same weights on the same tokens
    with torch.no_grad(), record(policy) as clean:
        forward_logits(policy, data.batch.input_ids_BS, data.batch.attention_mask_BS)
    assert torch.equal(clean.indices, data.ref_trace.indices)
    again = collected(cfg, task, policy, prompts)  # seeded from (run seed, step): reproducible
    assert torch.equal(again.batch.input_ids_BS, data.batch.input_ids_BS)
    assert torch.equal(again.batch.trace.indices, data.batch.trace.indices)
    other_step = collected(cfg, task, policy, prompts, step=4)  # same sampling seed, another step's noise
    assert not torch.equal(other_step.batch.trace.indices, data.batch.trace.indices)


def test_rollout_noise_never_draws_from_the_sampling_rng():
    cfg, task, policy, prompts = setup(0.5)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    gen = torch.Generator().manual_seed(1)
    noisy = generate(policy, task.tokenizer, prompts, max_new_tokens=task.max_new_tokens, greedy=True,
                     record_routing=True, router_noise=0.5, noise_generator=gen)
    assert torch.equal(torch.get_rng_state(), before)  # greedy: only the explicit generator was drawn from
    clean = generate(policy, task.tokenizer, prompts, max_new_tokens=task.max_new_tokens, greedy=True,
                     record_routing=True)
    n = min(noisy.trace.shape[2], clean.trace.shape[2])
    assert not torch.equal(noisy.trace.indices[:, :, :n], clean.trace.indices[:, :, :n])


def test_negative_noise_is_refused():
    with pytest.raises(ConfigError, match="rl.rollout_router_noise=-0.1 is out of range"):
        setup(-0.1)


def test_each_prompt_group_draws_its_own_noise():
    """The data-parallel path collects group by group: equal (seed, step) must not mean equal noise."""
    cfg = setup(0.5)[0]
    draw = lambda step, prompts: torch.randn(8, generator=rollout_noise_generator(cfg.seed, step, prompts))  # noqa: E731
    assert torch.equal(draw(3, ["s1="]), draw(3, ["s1="]))
    assert not torch.equal(draw(3, ["s1="]), draw(3, ["s2="])) and not torch.equal(draw(3, ["s1="]), draw(4, ["s1="]))
