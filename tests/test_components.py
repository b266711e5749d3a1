"""Step components (moe_lab/rl/components.py): which parts a config builds, the lag queue's window and its
round trip through a checkpoint, and the hooks' order inside a step. Their effect on whole runs (bit-identical
resumes with the bias moving, the predictor's heads, the lagged rollouts) is tested in test_expert_bias,
test_replay_variants and test_knobs."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_train import tiny

from moe_lab.config import ModelConfig, RLConfig
from moe_lab.models import build_model
from moe_lab.rl import checkpoint
from moe_lab.rl.components import BiasUpdates, Components, Component, RolloutLag, RoutePredictor, model_state
from moe_lab.rl.loop import _setup, step_prompts
from moe_lab.rl.step import rl_step

pytestmark = pytest.mark.filterwarnings("ignore:cold start stopped:RuntimeWarning")


def _model():
    cfg = ModelConfig(family="deepseek_v3", num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, num_experts=4,
                      top_k=2, moe_intermediate_size=16, intermediate_size=32)
    return build_model(cfg, vocab_size=16)


@pytest.mark.parametrize("fields, kinds", [
    ({}, []),
    ({"bias_update_rate": 0.01}, [BiasUpdates]),
    ({"replay": "predictive"}, [RoutePredictor]),
    ({"rollout_lag": 2}, [RolloutLag]),
    ({"bias_update_rate": 0.01, "rollout_lag": 1}, [BiasUpdates, RolloutLag]),
])
def test_a_config_builds_the_parts_it_asks_for(fields, kinds):
    assert [type(p) for p in Components.build(dataclasses.replace(RLConfig(), **fields)).parts] == kinds


def _shifted(model, by: float) -> None:
    with torch.no_grad():
        for t in model_state(model).values():
            t.add_(by)


def test_the_lag_queue_samples_the_weights_of_k_steps_ago_and_survives_a_checkpoint(tmp_path):
    """k = 2: the rollout copy of step t takes the weights of the start of step t - 2 (the initial ones while
    t < 2); a checkpoint's queue, resumed into fresh components, gives the same source bit for bit."""
    policy = _model()
    parts = Components.build(dataclasses.replace(RLConfig(), rollout_lag=2))
    starts = []
    for t in range(4):
        starts.append({k: v.detach().clone() for k, v in model_state(policy).items()})
        parts.step_start(policy)
        source = parts.parts[0].rollout_source(model_state(policy))
        expected = starts[max(t - 2, 0)]
        assert all(torch.equal(source[k], expected[k]) for k in expected)
        parts.step_end()
        _shifted(policy, 0.125)  # the step's update
    opt = torch.optim.AdamW(policy.parameters())
    checkpoint.save(tmp_path / "ckpt", policy, opt, {"step": 4}, **parts.saved())
    resumed = Components.build(dataclasses.replace(RLConfig(), rollout_lag=2))
    resumed.resume(tmp_path / "ckpt", "cpu")
    a, b = (p.parts[0].rollout_source(model_state(policy)) for p in (parts, resumed))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], starts[2][k]) for k in starts[2])  # step 4 samples with the start of step 2


class _Spy(Component):
    """Records the hooks a step calls, in order."""

    def __init__(self, calls: list):
        self.calls = calls

    def before_updates(self, policy, data, cfg):
        self.calls.append("before_updates")

    def update_context(self, ctx):
        self.calls.append("update_context")
        return super().update_context(ctx)

    def after_optimizer_step(self, ctx, handle, used, latent, metrics):
        self.calls.append("after_optimizer_step")
        assert "routing/expert_change" in metrics  # the update's routing row is there to read
        return {"spy/updates": 1.0}

    def after_updates(self, policy):
        self.calls.append("after_updates")
        return {"spy/step": 1.0}


def test_a_step_calls_each_hook_at_its_point_and_its_metrics_reach_the_rows(tmp_path):
    cfg = tiny(tmp_path, "rl.replay=old", "rl.minibatches=2", "rl.steps=1")
    task, trainee = _setup(cfg, False)
    calls = []
    trainee = dataclasses.replace(trainee, components=Components((_Spy(calls),)))
    torch.manual_seed(cfg.seed)
    rows = rl_step(trainee, task, cfg, 0, step_prompts(task, cfg, 0))
    assert calls == ["before_updates", "update_context", "after_optimizer_step", "update_context",
                     "after_optimizer_step", "after_updates"]
    assert [r["spy/updates"] for r in rows] == [1.0, 1.0] and all(r["spy/step"] == 1.0 for r in rows)


def test_a_rollout_copy_takes_the_weights_and_every_parts_state():
    """sync_rollout_policy: the weights (cast) from the lag's source, then each part's own state (the heads)."""
    policy = _model()
    parts = Components.build(dataclasses.replace(RLConfig(), replay="predictive"))
    parts.install(policy)
    rollout = copy.deepcopy(policy).to(torch.bfloat16).requires_grad_(False)
    _shifted(policy, 0.25)
    heads = [b for n, b in policy.named_buffers() if n.endswith("pr2_head")]
    assert heads
    for h in heads:
        h.fill_(0.5)
    parts.sync_rollout_policy(policy, rollout)
    want = {**model_state(policy), **{n: b for n, b in policy.named_buffers() if n.endswith("pr2_head")}}
    got = {**model_state(rollout), **{n: b for n, b in rollout.named_buffers() if n.endswith("pr2_head")}}
    assert set(want) == set(got) and all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
