"""moe_lab.store.health: collapse rules on synthetic reward traces, resume = uninterrupted, stop reasons."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from moe_lab.store import health
from moe_lab.config import RLConfig

DEFAULTS = health.CollapseParams.from_config(RLConfig())


def observations(rewards, entropies=None, finite=None):
    entropies = [math.nan] * len(rewards) if entropies is None else entropies
    finite = [True] * len(rewards) if finite is None else finite
    return [health.StepObservation(step=t, reward=float(r), entropy=float(e), finite=f)
            for t, (r, e, f) in enumerate(zip(rewards, entropies, finite))]


def final(rewards, params=DEFAULTS, **kw) -> health.HealthState:
    return health.trace(params, observations(rewards, **kw))[-1]


def healthy_trace(seed: int, steps: int = 120) -> np.ndarray:
    """A learning curve 0.3 -> 0.7 with per-step noise of a 128-response batch mean and occasional dips."""
    rng = np.random.default_rng(seed)
    t = np.arange(steps)
    clean = 0.3 + 0.4 * (1 - np.exp(-t / 20))
    dips = np.where(rng.random(steps) < 0.05, -0.25, 0.0)  # a bad batch now and then: one step, not a trend
    return np.clip(clean + 0.08 * rng.standard_normal(steps) + dips, 0.0, 1.0)


def test_params_are_read_from_the_config_its_section_or_a_run_folders_mapping():
    rl = RLConfig(collapse_window=3, collapse_drop=0.2, collapse_patience=2, collapse_min_best=0.0,
                  collapse_entropy_max=4.0)
    expected = health.CollapseParams(window=3, drop=0.2, patience=2, min_best=0.0, entropy_max=4.0)
    assert expected != DEFAULTS
    assert health.CollapseParams.from_config(rl) == health.CollapseParams.from_config(rl.section("collapse")) == \
        health.CollapseParams.from_config(dataclasses.asdict(rl)) == expected
    # a config written before the fields existed (a YAML dict without them) is judged by the defaults
    assert health.CollapseParams.from_config({"algo": "grpo", "collapse_patience": 7}) == \
        dataclasses.replace(DEFAULTS, patience=7)


# A run whose reward rises, then falls to near 0, with the entropy at 2 nats throughout: each collapse setting
# below, set away from its default, changes what the rules decide on it.
RISE_AND_FALL = observations([0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8, 0.8] + [0.05] * 20, entropies=[2.0] * 28)
AWAY_FROM_DEFAULT = {"collapse_window": 3, "collapse_drop": 0.05, "collapse_patience": 2,
                     "collapse_min_best": 0.9, "collapse_entropy_max": 1.0, "stop_on_collapse": True}


def decisions(rl: RLConfig) -> list:
    """Everything the rules decide for RISE_AND_FALL under the collapse section of ``rl``, as the loop reads it."""
    section = rl.section("collapse")
    params = health.CollapseParams.from_config(section)
    states = health.trace(params, RISE_AND_FALL)
    return [(s, health.stop_reason(s, o, params, section.stop_on_collapse)) for s, o in zip(states, RISE_AND_FALL)]


def test_every_collapse_setting_reaches_the_rules():
    """Each field of the collapse section (moe_lab/config/rl.py, the settings' one owner) changes the decisions:
    a field added there that health does not read fails here."""
    section_fields = [f.name for f in dataclasses.fields(RLConfig.SECTIONS["collapse"])]
    assert sorted(AWAY_FROM_DEFAULT) == sorted(section_fields), "give each collapse setting a value here"
    default = decisions(RLConfig())
    assert default[-1][0].collapse_rule == "reward_drop"
    for name, value in AWAY_FROM_DEFAULT.items():
        assert decisions(RLConfig(**{name: value})) != default, f"rl.{name}={value} changes no decision"


@pytest.mark.parametrize("seed", range(12))
def test_noisy_healthy_run_never_collapses(seed):
    state = final(healthy_trace(seed))
    assert state.collapsed_at is None and state.collapse_rule == ""


@pytest.mark.parametrize("seed", range(6))
def test_collapsing_reward_fires_reward_drop_soon_after_the_fall(seed):
    rewards = healthy_trace(seed, steps=60)
    fall = 40
    rewards[fall:] = np.clip(0.05 + 0.03 * np.random.default_rng(seed + 99).standard_normal(20), 0.001, 1)
    state = final(rewards)
    assert state.collapse_rule == "reward_drop"
    # EMA (alpha 2/11) from ~0.7 falls below half its best after ~4-5 steps, then 5 steps of patience
    assert fall + 5 <= state.collapsed_at <= fall + 12


def test_reward_drop_by_hand():
    params = health.CollapseParams(window=1, drop=0.5, patience=2, min_best=0.5)  # alpha 1: EMA = raw value
    states = health.trace(params, observations([0.2, 0.6, 0.29, 0.31, 0.25, 0.2, 0.9]))
    assert [s.below_steps for s in states] == [0, 0, 1, 0, 1, 2, 0]
    assert [s.fired for s in states] == ["", "", "", "", "", "reward_drop", ""]
    assert states[-1].collapsed_at == 5 and states[-1].collapse_rule == "reward_drop"  # recovery keeps the mark


def test_run_that_never_learned_cannot_collapse_from_its_best():
    assert final([0.09, 0.05, 0.02, 0.01, 0.005] * 4).collapsed_at is None  # best EMA < collapse_min_best


def test_zero_reward_is_the_hard_rule_at_the_fifth_zero_step():
    rewards = [0.4, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0]
    states = health.trace(DEFAULTS, observations(rewards))
    assert [s.fired for s in states].index("zero_reward") == 6
    assert states[-1].collapsed_at == 6 and states[-1].collapse_rule == "zero_reward"
    obs = observations(rewards)[-1]
    assert health.stop_reason(states[-1], obs, DEFAULTS, stop_on_collapse=False) == \
        "reward collapsed: exactly 0 for 5 consecutive steps"


def test_non_finite_is_hard_and_named_by_its_minibatch():
    rows = [{"step": 3, "minibatch": 0, "reward/mean": 0.5, "loss": 0.1, "optim/grad_norm": 1.0, "policy/entropy": 1.0},
            {"step": 3, "minibatch": 1, "reward/mean": 0.5, "loss": math.nan, "optim/grad_norm": 1.0,
             "policy/entropy": 3.0}]
    obs = health.observe(rows)
    assert (obs.step, obs.reward, obs.entropy, obs.finite) == (3, 0.5, 2.0, False)
    state = health.advance(health.HealthState(), DEFAULTS, obs)
    assert (state.collapsed_at, state.collapse_rule) == (3, "non_finite")
    assert health.stop_reason(state, obs, DEFAULTS, False) == "non-finite loss or gradient at step 3 minibatch 1"


def test_soft_rule_stops_only_when_asked():
    params = health.CollapseParams(window=1, drop=0.5, patience=1, min_best=0.1)
    obs = observations([0.8, 0.1])
    state = health.trace(params, obs)[-1]
    assert state.fired == "reward_drop"
    assert health.stop_reason(state, obs[-1], params, stop_on_collapse=False) == ""
    assert health.stop_reason(state, obs[-1], params, stop_on_collapse=True).startswith("reward collapsed at step 1")


def test_entropy_rule_off_by_default_and_fires_on_its_moving_average():
    entropies = [0.5, 0.6, 3.0, 3.0, 3.0, 3.0]
    rewards = [0.5] * len(entropies)
    assert final(rewards, entropies=entropies).collapsed_at is None
    params = health.CollapseParams(window=3, entropy_max=2.0)  # alpha 0.5: EMA 0.5, 0.55, 1.775, 2.39
    state = final(rewards, params, entropies=entropies)
    assert (state.collapsed_at, state.collapse_rule) == (3, "entropy")


def test_replay_of_a_prefix_then_advancing_equals_the_uninterrupted_trace():
    # what a resume does: recompute the state from the committed rows, then go on online
    rewards = healthy_trace(3, steps=50)
    rewards[30:] = 0.02
    rows = [{"step": t, "minibatch": m, "reward/mean": r, "loss": 0.1, "optim/grad_norm": 1.0,
             "policy/entropy": 1.0 + 0.1 * m} for t, r in enumerate(rewards) for m in range(2)]
    whole = health.replay(DEFAULTS, rows)
    for cut in (0, 10, 35, 49):
        state = health.replay(DEFAULTS, rows[:2 * cut])
        for group in health.steps_of(rows[2 * cut:]):
            state = health.advance(state, DEFAULTS, health.observe(group))
        assert state == whole
    assert whole.collapse_rule == "reward_drop" and whole.manifest() == {"collapsed_at": whole.collapsed_at,
                                                                         "collapse_rule": "reward_drop"}
    assert health.HealthState().manifest() == {"collapsed_at": None, "collapse_rule": None}
