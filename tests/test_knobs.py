"""The off-policy and precision knobs change what they claim: PPO epochs, lagged rollouts, bf16 training,
the cold start's load balancing, the long-response task; R2 stays on-policy and resume stays exact."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json

import numpy as np
import pandas as pd
import pytest
import torch
from test_train import kill_and_resume, tiny

from moe_lab.rl import step as step_mod
from moe_lab.rl import loop as train_mod
from moe_lab.rl.coldstart import FORMAT_VERSION, cache_key, cold_start, demonstration_batch
from moe_lab.config import ConfigError, validate
from moe_lab.config.constants import MACHINE_ENV
from moe_lab.models import load_model
from moe_lab.rl.optim import build_optimizer
from moe_lab.rl.rollout import forward_logits, token_logprobs
from moe_lab.routing import load_metrics, record
from moe_lab.rl.step import minibatch_indices
from moe_lab.tasks import get_task, load_tokenizer
from moe_lab.rl.loop import train

pytestmark = pytest.mark.filterwarnings("ignore:cold start stopped:RuntimeWarning")


def _rows(run_dir) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "metrics.parquet")


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("override,field", [("rl.epochs=0", "rl.epochs"), ("rl.rollout_lag=-1", "rl.rollout_lag"),
                                            ("rl.train_dtype=float16", "rl.train_dtype"),
                                            ("coldstart.aux_loss_coef=-0.1", "coldstart.aux_loss_coef"),
                                            ("task.name=long_sort", "task.name")])
def test_bad_knob_values_are_refused_naming_the_field(tmp_path, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        tiny(tmp_path, override)


# --------------------------------------------------------------------------- epochs


def test_epochs_times_minibatches_optimizer_steps_per_batch(tmp_path, monkeypatch):
    calls = []

    def counting_optimizer(model, schedule):
        opt = build_optimizer(model, schedule)
        opt.register_step_post_hook(lambda *_: calls.append(1))
        return opt

    monkeypatch.setattr(train_mod, "build_optimizer", counting_optimizer)
    cfg = tiny(tmp_path, "rl.steps=2", "rl.epochs=3", "rl.minibatches=2", "rl.warmup_steps=4")
    train(cfg, tmp_path / "run", run_id="e")
    df = _rows(tmp_path / "run")
    assert len(calls) == len(df) == 2 * 3 * 2
    assert list(df["update"]) == list(range(12))
    assert list(df["epoch"]) == [0, 0, 1, 1, 2, 2] * 2 and list(df["minibatch"]) == [0, 1] * 6
    # the warmup counts optimizer steps, epochs included: lr * (u + 1) / (warmup + 1) until u = warmup
    expected = [cfg.rl.lr * min(1.0, (u + 1) / 5) for u in range(12)]
    assert df["optim/lr"].tolist() == pytest.approx(expected, rel=1e-12)


def test_each_epoch_reshuffles_and_epoch_zero_keeps_the_single_epoch_order():
    first = minibatch_indices(16, 4, seed=3, step=5)
    assert all(torch.equal(a, b) for a, b in zip(first, minibatch_indices(16, 4, 3, 5, epoch=0)))
    perms = [torch.cat(minibatch_indices(16, 4, 3, 5, epoch=e)) for e in range(3)]
    for p in perms:
        assert sorted(p.tolist()) == list(range(16))
    assert not torch.equal(perms[0], perms[1]) and not torch.equal(perms[1], perms[2])


# --------------------------------------------------------------------------- rollout lag


def _spy_on_steps(monkeypatch):
    """Record, per RL step, a copy of the weights at the step's start and the rollout batch it sampled."""
    starts, batches, policies = {}, {}, []
    real_rl_step, real_collect = train_mod.rl_step, step_mod.collect

    def rl_step(trainee, task, cfg, step, *args, **kw):
        starts[step] = copy.deepcopy(trainee.policy.state_dict())
        policies[:] = [trainee.policy]
        return real_rl_step(trainee, task, cfg, step, *args, **kw)

    def collect(policy, rollout_policy, ref_model, task, cfg, step, prompts):
        data = real_collect(policy, rollout_policy, ref_model, task, cfg, step, prompts)
        batches[step] = data.batch
        return data

    monkeypatch.setattr(train_mod, "rl_step", rl_step)
    monkeypatch.setattr(step_mod, "collect", collect)
    return starts, batches, policies


def _teacher_forced_logp(model, weights, batch) -> torch.Tensor:
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = forward_logits(model, batch.input_ids_BS, batch.attention_mask_BS).logits
    return token_logprobs(logits, batch.input_ids_BS)


def test_rollout_lag_samples_with_the_weights_of_k_steps_earlier(tmp_path, monkeypatch):
    starts, batches, policies = _spy_on_steps(monkeypatch)
    lag = 2
    cfg = tiny(tmp_path, "rl.steps=4", f"rl.rollout_lag={lag}", "rl.lr=0.01", "rl.warmup_steps=0")
    train(cfg, tmp_path / "run", run_id="lag")
    probe = copy.deepcopy(policies[0])
    for t, batch in batches.items():
        mask = batch.response_mask_BT
        source = max(0, t - lag)  # before step k the oldest weights are the initial ones
        lagged = _teacher_forced_logp(probe, starts[source], batch)
        torch.testing.assert_close(batch.logp_rollout_BT[mask], lagged[mask], atol=2e-5, rtol=0)
        if t > lag:  # the policy moved since: the current weights would give other log-probs
            current = _teacher_forced_logp(probe, starts[t], batch)
            assert (batch.logp_rollout_BT[mask] - current[mask]).abs().max() > 1e-3
    # the mismatch columns measure the lag: ~0 while the rollout holds the current weights (step 0), > 0 after
    k3 = _rows(tmp_path / "run").groupby("step")["mismatch/k3"].first()
    assert k3[0] < 1e-9 and (k3[1:] > 100 * max(k3[0], 1e-12)).all(), k3.tolist()


# --------------------------------------------------------------------------- bf16 training


def test_bf16_training_keeps_fp32_master_weights_and_moves_them(tmp_path, monkeypatch):
    starts, _, policies = _spy_on_steps(monkeypatch)
    train(tiny(tmp_path, "rl.steps=1", "rl.train_dtype=bfloat16"), tmp_path / "bf16", run_id="b")
    policy = policies[0]
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    moved = [n for n, p in policy.state_dict().items() if not torch.equal(p, starts[0][n])]
    assert moved, "no weight changed"
    train(tiny(tmp_path, "rl.steps=1"), tmp_path / "fp32", run_id="f")
    # the old-policy forward ran in bf16: it differs from the fp32 sampler, where fp32 training does not
    k3_bf16 = _rows(tmp_path / "bf16")["mismatch/k3"].iloc[0]
    k3_fp32 = _rows(tmp_path / "fp32")["mismatch/k3"].iloc[0]
    assert k3_bf16 > 0 and k3_bf16 > 100 * k3_fp32, (k3_bf16, k3_fp32)


# --------------------------------------------------------------------------- R2 stays on-policy


# Router noise emulates a non-deterministic forward: the update draws its own noise, so R2 forces the old
# experts but their gate weights come from differently noised logits, and the ratio is 1 only up to that
# (~1e-4 at noise 0.1). Every other knob leaves the first update exactly on-policy.
@pytest.mark.parametrize("knob,ratio_tol", [("rl.epochs=2", 1e-6), ("rl.rollout_lag=1", 1e-6),
                                            ("rl.train_dtype=bfloat16", 1e-6), ("rl.router_noise=0.1", 1e-3)])
def test_r2_first_update_of_every_batch_is_on_policy_under_every_knob(tmp_path, knob, ratio_tol):
    cfg = tiny(tmp_path, "rl.replay=old", "rl.steps=3", "rl.lr=0.01", knob)
    train(cfg, tmp_path / "run", run_id="r")
    df = _rows(tmp_path / "run")
    first = df[(df["epoch"] == 0) & (df["minibatch"] == 0)]
    assert len(first) == 3
    assert (first["routing/expert_change"] == 0.0).all()
    assert first["ratio/token_mean"].tolist() == pytest.approx([1.0] * 3, abs=ratio_tol)
    assert first["ratio/token_var"].tolist() == pytest.approx([0.0] * 3, abs=ratio_tol ** 2)
    assert (first["clip_frac/out_of_range"] == 0.0).all()


# --------------------------------------------------------------------------- resume


def test_sigkill_resume_reproduces_the_table_with_the_knobs_on(tmp_path):
    cfg = tiny(tmp_path, "rl.steps=8", "rl.checkpoint_every=2", "rl.replay=old", "rl.eval_every=3",
               "rl.epochs=2", "rl.rollout_lag=1", "rl.train_dtype=bfloat16")
    checkpointed = kill_and_resume(cfg, tmp_path)
    assert "lagged.safetensors" in checkpointed, "the lagged rollout weights were not checkpointed"


# --------------------------------------------------------------------------- cold-start load balancing


def test_default_cold_start_keeps_its_cache_key(tmp_path, monkeypatch):
    """Fields added later are hashed only when set: every existing cache entry stays valid."""
    for pin in MACHINE_ENV:  # kernel pins get a key of their own (tested in test_cpu_isa): unpinned here
        monkeypatch.delenv(pin, raising=False)
    cfg = tiny(tmp_path)
    cs, model, task = (dataclasses.asdict(getattr(cfg, s)) for s in ("coldstart", "model", "task"))
    cs.pop("cache_dir"), cs.pop("aux_loss_coef"), cs.pop("bias_update_rate"), model.pop("shared_expert")
    task.pop("mixture")
    model.pop("norm_topk_prob")
    payload = {"format": FORMAT_VERSION, "model": model, "task": task, "coldstart": cs}
    before = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert cache_key(cfg) == before
    for changed in ("coldstart.aux_loss_coef=0.01", "model.shared_expert=false", "model.norm_topk_prob=false"):
        assert cache_key(tiny(tmp_path, changed)) != before, changed
    mix = tiny(tmp_path, "task.name=mixture", "task.mixture=[sort,reverse]")
    assert cache_key(mix) != cache_key(tiny(tmp_path, "task.name=mixture", "task.mixture=[sort,addition]"))


def _imbalance(model_dir, cfg) -> float:
    task = get_task(cfg.task, load_tokenizer(str(model_dir)))
    model = load_model(model_dir)
    rng = np.random.default_rng(123)
    ids, attn, resp = demonstration_batch(task, task.sample_prompts(64, rng))
    with torch.no_grad(), record(model) as trace:
        forward_logits(model, ids, attn)
    return load_metrics(trace, resp)["routing/load_max_violation"]


def test_cold_start_balance_loss_lowers_load_imbalance(tmp_path):
    common = ["coldstart.max_steps=40", "coldstart.target_accuracy=1.0", "coldstart.eval_every=40",
              "coldstart.eval_samples=8", "coldstart.batch_size=32"]
    plain = tiny(tmp_path, *common)
    balanced = tiny(tmp_path, *common, "coldstart.aux_loss_coef=0.01")
    v_plain = _imbalance(cold_start(plain, progress=False), plain)
    v_balanced = _imbalance(cold_start(balanced, progress=False), balanced)
    assert v_balanced < v_plain, (v_balanced, v_plain)


# --------------------------------------------------------------------------- long-response task


def test_long_copy_has_long_responses_and_both_rewards(tmp_path):
    base = tiny(tmp_path)
    cfg = validate(dataclasses.replace(base, task=dataclasses.replace(base.task, name="long_copy", length=16,
                                                                      partial_credit=False)))
    task = get_task(cfg.task)
    assert task.max_new_tokens - 1 >= 128
    prompt = task.sample_prompts(1, np.random.default_rng(0))[0]
    answer = task.answer(prompt)
    assert answer == prompt[:-1] * 8 and len(answer) == 128
    assert task.reward(prompt, answer) == 1.0 and task.reward(prompt, answer[:-1]) == 0.0
    partial = get_task(dataclasses.replace(cfg.task, partial_credit=True))
    assert partial.reward(prompt, answer[:64]) == pytest.approx(0.5)
    assert partial.reward(prompt, answer) == 1.0
