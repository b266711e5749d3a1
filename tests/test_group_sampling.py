"""rl.rollout_seeding=per_group: each prompt group samples from its own generator (moe_lab.rl.groups), in one
batched generate() (moe_lab.rl.rollout.GroupSampler). The launcher-level equality (a plain run equals a 1-rank
torchrun bit for bit) is in test_distributed.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_lab.config import ModelConfig, RLConfig, RunConfig, TaskConfig, validate
from moe_lab.models import build_model
from moe_lab.rl.collect import _rollout
from moe_lab.rl.groups import group_generators
from moe_lab.rl.rollout import GroupSampler
from moe_lab.tasks import get_task


def test_the_exponential_race_samples_the_softmax():
    """argmax_i p_i / E_i with E ~ Exp(1) is a draw from p: 40k draws of three distributions (temperature 0.7)
    match softmax(logits / 0.7) within 4.5 binomial standard errors per token, and no zero-probability token
    is ever drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0], [0.0, 0.0, 0.0, 0.0, 0.0], [5.0, -2.0, 1.0, 0.5, -40.0]])
    n, T = 40_000, 0.7
    sampler = GroupSampler([torch.Generator().manual_seed(7)], group_size=3, temperature=T)
    counts = torch.zeros_like(logits)
    for _ in range(n):
        pick = sampler(None, logits.clone()).argmax(-1)
        counts[torch.arange(3), pick] += 1
    p = torch.softmax(logits.double() / T, -1)
    se = torch.sqrt(p * (1 - p) / n)
    assert ((counts.double() / n - p).abs() <= 4.5 * se + 1e-12).all(), (counts / n, p)
    assert counts[2, 4] == 0  # p ~ 1e-30


def test_a_groups_draws_do_not_depend_on_the_other_groups_in_the_batch():
    """Rows of group j get the same perturbed scores whether the batch holds groups 0..2 or group j alone."""
    scores = torch.randn(6, 11, generator=torch.Generator().manual_seed(0))
    whole = GroupSampler(group_generators(3, 5, 0, 3, torch.device("cpu")), 2, 1.0)(None, scores)
    alone = GroupSampler(group_generators(3, 5, 2, 1, torch.device("cpu")), 2, 1.0)(None, scores[4:6])
    assert torch.equal(whole[4:6], alone)
    other_step = GroupSampler(group_generators(3, 6, 2, 1, torch.device("cpu")), 2, 1.0)(None, scores[4:6])
    assert not torch.equal(alone, other_step)
    with pytest.raises(ValueError, match="GroupSampler: 5 rows, expected 3 groups of 2"):
        GroupSampler(group_generators(3, 5, 0, 3, torch.device("cpu")), 2, 1.0)(None, scores[:5])


def _setup(**rl):
    cfg = validate(RunConfig(
        model=ModelConfig(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, num_experts=8, top_k=2,
                          moe_intermediate_size=32, intermediate_size=64, max_positions=64),
        task=TaskConfig(name="sort", length=6, eval_size=16),
        rl=RLConfig(prompts_per_step=4, group_size=4, minibatches=2, **rl)))
    task = get_task(cfg.task)
    torch.manual_seed(0)
    return cfg, task, build_model(cfg.model, len(task.tokenizer)), task.sample_prompts(4, np.random.default_rng(1))


def _sample(policy, task, cfg, prompts, **where):
    """collect's rollout stage of ``prompts`` with the run's rollout section (``where``: step, first_group)."""
    return _rollout(policy, task, cfg.rl.section("rollout"), prompts, seed=cfg.seed, group_size=cfg.rl.group_size,
                    predictive=False, **where)


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_a_rank_samples_its_groups_as_the_whole_batch_does(noise):
    """Groups 2 and 3 sampled as a rank's share (first_group=2) give the tokens, routing and (to float rounding
    of a smaller batch) log-probs they get in the whole batch; the global generator is never drawn from."""
    cfg, task, policy, prompts = _setup(rollout_router_noise=noise)
    state = torch.get_rng_state()
    _, whole = _sample(policy, task, cfg, prompts, step=3)
    _, share = _sample(policy, task, cfg, prompts[2:], step=3, first_group=2)
    assert torch.equal(torch.get_rng_state(), state)
    rows = slice(8, 16)
    assert whole.completions[rows] == share.completions and len(set(whole.completions)) > 4
    assert torch.equal(whole.response_mask_BT[rows].sum(-1), share.response_mask_BT.sum(-1))
    lp_whole = whole.logp_rollout_BT[rows][whole.response_mask_BT[rows]]
    lp_share = share.logp_rollout_BT[share.response_mask_BT]
    torch.testing.assert_close(lp_whole, lp_share, rtol=1e-5, atol=1e-6)
    _, other = _sample(policy, task, cfg, prompts[2:], step=3, first_group=0)  # other seeds: other samples
    assert other.completions != share.completions


def test_sequential_seeding_draws_the_batch_from_the_global_generator():
    """The legacy mode: the run's global generator, in sequence (two calls after one seeding differ; reseeding
    repeats them), as plain runs sampled before per-group seeding."""
    cfg, task, policy, prompts = _setup(rollout_seeding="sequential")
    torch.manual_seed(5)
    first = _sample(policy, task, cfg, prompts, step=3)[1].completions
    second = _sample(policy, task, cfg, prompts, step=3)[1].completions
    torch.manual_seed(5)
    assert _sample(policy, task, cfg, prompts, step=3)[1].completions == first != second
