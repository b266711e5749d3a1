"""Replay variants: gated replay (rl.replay_gate), replayed gate weights (rl.replay_gate_weights) and a frozen
router (rl.freeze_router). Gated ids are checked against a per-token loop over the same forward's router
probabilities; the extremes against plain replay and free routing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_lab.config import ConfigError, apply_overrides, from_dict, load_yaml, validate
from moe_lab.models.families import FAMILIES
from moe_lab.models.families.routers import deepseek_select
from moe_lab.models import moe_layers
from moe_lab.routing import expert_change, predictor, record, replay, router_logp_probe
from moe_lab.rl.step import rl_step
from moe_lab.rl.loop import _setup, step_prompts
from test_routing import perturb_routers, recorded, tiny_model, tokens

ROOT = Path(__file__).resolve().parents[1]
SMOKE = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
# choose by the score the gate compares (not DeepSeek's group-limited, bias-shifted choice)
SOFTMAX = [f for f in FAMILIES if FAMILIES[f].select is not deepseek_select]


def _drifted(family: str):
    """A model whose router moved since the trace was recorded: replayed ids the router no longer wants."""
    model, x = tiny_model(family), tokens(B=4, S=9)
    trace, _ = recorded(model, x)
    perturb_routers(model, scale=1.0)
    return model, x, trace


def _expected_gated(forced_LBSK, own_LBSK, logp_LBSE, gate: float):
    """The rule of routing/gate.py written as a plain loop over (layer, row, column)."""
    out, replaced = forced_LBSK.clone().long(), torch.zeros(forced_LBSK.shape, dtype=torch.bool)
    L, B, S, K = forced_LBSK.shape
    for l in range(L):
        for b in range(B):
            for s in range(S):
                p = logp_LBSE[l, b, s].exp()
                own = sorted(own_LBSK[l, b, s].tolist(), key=lambda e: -float(p[e]))
                floor = gate * p[own].min()  # fp32, as the rule computes it
                forced = forced_LBSK[l, b, s].tolist()
                keep = [bool(p[e] >= floor) for e in forced]
                kept = {e for e, k in zip(forced, keep) if k}
                refill = iter(e for e in own if e not in kept)
                for j, (e, k) in enumerate(zip(forced, keep)):
                    if not k:
                        out[l, b, s, j], replaced[l, b, s, j] = next(refill), True
    return out, replaced


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gate_zero_is_plain_replay_bit_for_bit(family):
    model, x, trace = _drifted(family)
    with torch.no_grad(), replay(model, trace) as plain:
        want = model(x).logits
    with torch.no_grad(), replay(model, trace, gate=0.0) as gated:
        got = model(x).logits
    assert torch.equal(got, want) and gated.used is trace and gated.replace_frac(torch.ones(4, 9)) == 0.0
    assert torch.equal(gated.latent.indices, plain.latent.indices)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("gate", [0.3, 0.8, 1.0])
def test_gated_ids_follow_the_rule_token_by_token(family, gate):
    model, x, trace = _drifted(family)
    with torch.no_grad(), replay(model, trace, gate=gate) as handle, router_logp_probe(model) as probe, \
            record(model) as seen:
        model(x)
    want_ids, want_replaced = _expected_gated(trace.indices, handle.latent.indices, probe.logp_LBSE, gate)
    assert torch.equal(handle.used.indices.long(), want_ids) and torch.equal(seen.indices.long(), want_ids)
    assert torch.equal(handle.replaced_LBSK, want_replaced)
    assert handle.replace_frac(torch.ones(4, 9)) == pytest.approx(want_replaced.float().mean().item())
    if gate == 1.0:
        assert 0 < want_replaced.float().mean() < 1  # the drift is real: some slots replaced, some kept


@pytest.mark.parametrize("family", SOFTMAX)
def test_gate_one_routes_free_routings_expert_set(family):
    model, x, trace = _drifted(family)
    free, free_logits = recorded(model, x)
    assert expert_change(trace, free) > 0
    with torch.no_grad(), replay(model, trace, gate=1.0) as handle:
        logits = model(x).logits
    # the same expert set in every layer (slot order may differ: kept experts keep their slots)
    assert torch.equal(handle.used.indices.sort(-1).values, free.indices.sort(-1).values)
    torch.testing.assert_close(logits, free_logits, rtol=1e-5, atol=1e-5)  # only the combine's sum order differs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replayed_gate_weights_are_the_recorded_ones_and_cut_the_router_gradient(family):
    model, x, trace = _drifted(family)
    model.zero_grad()
    with replay(model, trace, weights=True), record(model) as seen:  # seen: what the experts consumed
        model(x, labels=x).loss.backward()
    assert torch.equal(seen.indices, trace.indices) and torch.equal(seen.weights, trace.weights)
    with torch.no_grad(), replay(model, trace) as _, record(model) as recomputed:
        model(x)
    assert not torch.equal(recomputed.weights, trace.weights)  # without the option they follow the drifted router
    for layer in moe_layers(model):  # the router's only path to the loss was the combine weights
        grad = layer.router.weight.grad
        assert grad is None or not grad.any()
    assert any(p.grad is not None and p.grad.any() for n, p in model.named_parameters() if ".experts." in n)


def test_gate_weights_replay_reproduces_the_recorded_forward():
    model, x = tiny_model("qwen3_moe"), tokens()
    trace, plain = recorded(model, x)
    with torch.no_grad(), replay(model, trace, weights=True):
        assert torch.equal(model(x).logits, plain)


def _cfg(tmp_path: Path, *overrides: str):
    data = apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.steps=2", *overrides])
    return validate(from_dict(data))


def test_freeze_router_keeps_router_weights_and_optimizer_state_untouched(tmp_path):
    cfg = _cfg(tmp_path, "rl.freeze_router=true", "rl.replay=old", "rl.replay_gate=0.5")
    task, trainee = _setup(cfg, False)
    policy, optimizer = trainee.policy, trainee.optimizer
    torch.manual_seed(cfg.seed)  # sampling, as train() seeds it
    start = {n: p.detach().clone() for n, p in policy.named_parameters()}
    routers = {id(p) for layer in moe_layers(policy) for p in layer.router.parameters()}
    for step in range(2):
        rows = rl_step(trainee, task, cfg, step, step_prompts(task, cfg, step))
        assert all(0.0 <= r["routing/replay_replace_frac"] <= 1.0 for r in rows)
    moved = {n for n, p in policy.named_parameters() if not torch.equal(p, start[n])}
    router_names = {n for n, p in policy.named_parameters() if id(p) in routers}
    assert router_names and not (moved & router_names)  # bit-identical routers
    assert moved  # the rest learned
    assert all(id(p) not in routers for p in optimizer.state)  # no AdamW state for them
    assert any(id(p) not in routers for p in optimizer.state)


@pytest.mark.parametrize("overrides, message", [
    (["rl.replay_gate=0.5"], "rl.replay_gate/replay_gate_weights apply to replayed routing"),
    (["rl.replay_gate_weights=true"], "rl.replay_gate/replay_gate_weights apply to replayed routing"),
    (["rl.replay=old", "rl.replay_gate=0.5", "rl.replay_gate_weights=true"], "use one or the other"),
    (["rl.freeze_router=true", "rl.router_lr_mult=10"], "a frozen router has no learning rate"),
    (["rl.replay=rollout", "rl.replay_gate=1.5"], r"rl.replay_gate=1.5 is out of range"),
])
def test_bad_combinations_are_one_line_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        _cfg(tmp_path, *overrides)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- predictive replay (simplified PR²)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_zero_predictor_records_free_routing_bit_for_bit(family):
    model, x = tiny_model(family), tokens()
    trace, logits = recorded(model, x)
    predictor.install(model)
    with torch.no_grad(), predictor.record_predicted(model, router_logp=True) as pred:
        pred_logits = model(x).logits
    assert torch.equal(pred_logits, logits) and torch.equal(pred.indices, trace.indices)
    assert torch.equal(pred.weights, trace.weights)


@pytest.mark.parametrize("family", SOFTMAX)
def test_fitted_predictor_predicts_the_drift_and_routes_closer_to_the_updated_router(family):
    """One router step of drift, observed on some inputs: the refitted head reproduces that drift on them (a
    linear router's drift is linear in its input), and on fresh inputs a rollout routed by the prediction is
    closer to the drifted router's choice than the unpredicted routing."""
    model, x = tiny_model(family), tokens(B=8, S=12)
    predictor.install(model)
    with torch.no_grad(), predictor.observe(model, torch.ones(8, 12, dtype=torch.bool)) as obs:
        model(x)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    perturb_routers(model, scale=1.0)
    fresh = tokens(B=8, S=12, seed=7)
    drifted, _ = recorded(model, fresh)
    metrics = predictor.fit(model, obs)
    assert metrics["pr2/drift_rms"] > 0 and metrics["pr2/pred_err_rms"] == pytest.approx(metrics["pr2/drift_rms"])
    for layer in moe_layers(model):  # in-sample: the head's prediction is the drift it saw
        pos = moe_layers(model).index(layer)
        X = obs.inputs_NH[pos]
        drift = layer.router(X)[0].detach() - obs.logits_NE[pos]
        pred = X @ getattr(layer.router, predictor.HEAD).T
        assert float((pred - drift).norm() / drift.norm()) < 0.05
    with torch.no_grad():  # back to the undrifted router, heads kept: the prediction stands in for the drift
        for n, p in model.named_parameters():
            p.copy_(before[n])
    with torch.no_grad(), predictor.record_predicted(model) as pred:
        model(fresh)
    free, _ = recorded(model, fresh)
    assert expert_change(pred, drifted) < 0.5 * expert_change(free, drifted)


def test_predictive_replay_runs_end_to_end_and_learns_its_heads(tmp_path):
    cfg = _cfg(tmp_path, "rl.replay=predictive", "rl.steps=3", "rl.router_lr_mult=10")
    task, trainee = _setup(cfg, False)
    policy = trainee.policy
    torch.manual_seed(cfg.seed)
    rows = []
    for step in range(3):
        rows += rl_step(trainee, task, cfg, step, step_prompts(task, cfg, step))
    firsts = [r for r in rows if r["minibatch"] == 0]  # each step's first update: before any of its updates
    # from step 1 on the rollout routes by a non-zero head, away from the trainer's own choice ...
    assert all(r["mismatch/expert_change"] > 0 for r in firsts[1:])
    # ... and the old-policy pass and the update replay that same route: exactly on-policy
    assert all(r["routing/expert_change"] == 0.0 for r in firsts)
    assert all(r["ratio/token_mean"] == pytest.approx(1.0, abs=1e-6) for r in firsts)
    assert all(r["ratio/token_var"] == pytest.approx(0.0, abs=1e-10) for r in firsts)
    assert any(r["pr2/drift_rms"] > 0 for r in rows)
    heads = [getattr(layer.router, predictor.HEAD) for layer in moe_layers(policy)]
    assert any(h.any() for h in heads)  # fitted to a real drift
    with pytest.raises(ConfigError, match="rl.replay=predictive with rl.rollout_lag=1"):
        _cfg(tmp_path, "rl.replay=predictive", "rl.rollout_lag=1")


def test_a_bf16_rollout_copy_routes_by_the_current_predictor_heads(tmp_path):
    """The rescue regime samples with a bf16 copy: before each rollout it takes the heads refitted by the last
    step along with the weights, so the sampler's route is the predicted one of the current policy."""
    cfg = _cfg(tmp_path, "rl.replay=predictive", "rl.steps=2", "rl.router_lr_mult=10", "rl.rollout_dtype=bfloat16")
    task, trainee = _setup(cfg, False)
    policy, rollout_policy = trainee.policy, trainee.rollout_policy
    assert rollout_policy is not policy and set(predictor.heads(rollout_policy)) == set(predictor.heads(policy)) != set()
    torch.manual_seed(cfg.seed)
    rl_step(trainee, task, cfg, 0, step_prompts(task, cfg, 0))
    fitted = predictor.heads(policy)
    assert any(h.any() for h in fitted.values())
    assert not any(h.any() for h in predictor.heads(rollout_policy).values())  # not synced yet: still zero
    trainee.components.sync_rollout_policy(policy, rollout_policy)
    for name, head in predictor.heads(rollout_policy).items():
        assert head.dtype == torch.bfloat16 and torch.equal(head, fitted[name].to(torch.bfloat16))
    rows = rl_step(trainee, task, cfg, 1, step_prompts(task, cfg, 1))
    assert rows[0]["mismatch/expert_change"] > 0 and rows[0]["routing/expert_change"] == 0.0
