"""A run's health per RL step and the rules that call it collapsed (pure Python: no torch, no pandas).

A run is summarised by one observation per RL step (its rollout's mean reward, its updates' mean policy
entropy, whether every update's loss and gradient were finite). Rules, checked in this order every step:

- ``non_finite`` (hard): a loss or gradient norm is NaN/inf. The run stops: its weights are garbage.
- ``zero_reward`` (hard): ``reward/mean`` exactly 0 for ZERO_REWARD_STEPS consecutive steps: every
  advantage is 0 from then on, so further steps only burn time. The run stops (moe_lab's original rule).
- ``reward_drop`` (soft): the reward's exponential moving average (span ``rl.collapse_window``, alpha =
  2 / (span + 1), started at the first value) stays below ``rl.collapse_drop`` x its running best for
  ``rl.collapse_patience`` consecutive steps, once that best has reached ``rl.collapse_min_best`` (a run
  that never learned cannot collapse from its best). The moving average, not the raw value, because one
  rollout batch's mean reward is noisy (B*G responses; prompts differ every step).
- ``entropy`` (soft, off by default): the policy entropy's moving average (same span) exceeds
  ``rl.collapse_entropy_max`` nats: the policy has dissolved into near-uniform sampling (the failure mode
  that precedes gibberish in GRPO collapses). No entropy-collapse-to-0 rule: on these deterministic tasks a
  confident, correct policy has entropy near 0 too, so low entropy is not a failure by itself.

A run a rule stops ends with manifest status ``collapsed``: finished and final like ``done`` (moe_lab/store/runlog.py).
A soft rule marks the run collapsed but lets it continue (curves of every seed stay the same length and
comparable) unless ``rl.stop_on_collapse``. ``collapsed_at`` is the step at which the first rule fired
(detection, not onset: what an online monitor can know), ``collapse_rule`` its name. The state is a pure
function of the per-step observations, so a resumed run recomputes it from its committed rows (``replay``)
and needs no extra checkpoint state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from moe_lab.config.fields import hints
from moe_lab.config.rl import RLCollapse

ZERO_REWARD_STEPS = 5
HARD_COLLAPSE_RULES = ("non_finite", "zero_reward")
SOFT_COLLAPSE_RULES = ("reward_drop", "entropy")
COLLAPSE_RULES = (*HARD_COLLAPSE_RULES, *SOFT_COLLAPSE_RULES)


# The rules' parameters are the collapse section's fields rl.collapse_<name> (RLCollapse, moe_lab/config/rl.py: their
# one declaration, with type, default and bounds), named <name> here. The section's stop_on_collapse is no rule's
# parameter: it says what the loop does when a soft rule fires (stop_reason's argument).
CONFIG_PREFIX = "collapse_"


class _Rules:
    """What CollapseParams adds to its fields."""

    @property
    def alpha(self) -> float:
        return 2.0 / (self.window + 1.0)

    @classmethod
    def from_config(cls, rl) -> CollapseParams:
        """From an RLConfig, its collapse section, or a mapping of rl keys (a run folder's config.yaml); missing
        keys keep the defaults, so a config written before a field existed is judged by its default."""
        get = rl.get if isinstance(rl, Mapping) else lambda k, d: getattr(rl, k, d)
        return cls(**{f.name: get(CONFIG_PREFIX + f.name, f.default) for f in dataclasses.fields(cls)})


CollapseParams = dataclasses.make_dataclass(
    "CollapseParams",
    [(f.name.removeprefix(CONFIG_PREFIX), hints(RLCollapse)[f.name], dataclasses.field(default=f.default))
     for f in dataclasses.fields(RLCollapse) if f.name.startswith(CONFIG_PREFIX)],
    bases=(_Rules,), frozen=True)
CollapseParams.__module__ = __name__  # pickled by reference, like a class declared here
CollapseParams.__doc__ = "The collapse rules' parameters: the collapse section's rl.collapse_* fields, unprefixed."


@dataclass(frozen=True)
class StepObservation:
    step: int
    reward: float
    entropy: float = math.nan
    finite: bool = True
    detail: str = ""  # where the non-finite value was (for the stop reason)


@dataclass(frozen=True)
class HealthState:
    steps_seen: int = 0
    reward_ema: float = math.nan
    best_ema: float = -math.inf
    below_steps: int = 0  # consecutive steps with reward_ema < drop * best_ema (best armed)
    zero_steps: int = 0  # consecutive steps with reward exactly 0
    entropy_ema: float = math.nan
    fired: str = ""  # the rule that fired at the latest step ("" = none)
    collapsed_at: int | None = None
    collapse_rule: str = ""

    def manifest(self) -> dict:
        return {"collapsed_at": self.collapsed_at, "collapse_rule": self.collapse_rule or None}


def _ema(prev: float, value: float, alpha: float) -> float:
    if not math.isfinite(value):
        return prev
    return value if math.isnan(prev) else prev + alpha * (value - prev)


def advance(state: HealthState, params: CollapseParams, obs: StepObservation) -> HealthState:
    """The state after one more RL step."""
    ema = _ema(state.reward_ema, obs.reward, params.alpha)
    best = max(state.best_ema, ema) if math.isfinite(ema) else state.best_ema
    armed = best >= params.min_best
    below = state.below_steps + 1 if armed and ema < params.drop * best else 0
    zero = state.zero_steps + 1 if obs.reward == 0 else 0
    entropy_ema = _ema(state.entropy_ema, obs.entropy, params.alpha)
    fired = ("non_finite" if not obs.finite else
             "zero_reward" if zero >= ZERO_REWARD_STEPS else
             "reward_drop" if below >= params.patience else
             "entropy" if params.entropy_max is not None and entropy_ema > params.entropy_max else "")
    first = state.collapsed_at is None and fired
    return dataclasses.replace(
        state, steps_seen=state.steps_seen + 1, reward_ema=ema, best_ema=best, below_steps=below, zero_steps=zero,
        entropy_ema=entropy_ema, fired=fired, collapsed_at=obs.step if first else state.collapsed_at,
        collapse_rule=fired if first else state.collapse_rule)


def observe(rows: list[Mapping]) -> StepObservation:
    """One RL step's observation from its minibatch rows (as logged: reward/mean is the rollout's, shared by
    every row of the step; policy/entropy is per update)."""
    # A table without loss/grad columns (an old or hand-made one) has nothing non-finite to report.
    bad = [r for r in rows if not math.isfinite(r.get("loss", 0.0)) or not math.isfinite(r.get("optim/grad_norm", 0.0))]
    entropies = [float(r["policy/entropy"]) for r in rows if r.get("policy/entropy") is not None]
    entropies = [e for e in entropies if math.isfinite(e)]
    return StepObservation(step=int(rows[0]["step"]), reward=float(rows[0]["reward/mean"]),
                           entropy=sum(entropies) / len(entropies) if entropies else math.nan, finite=not bad,
                           detail=f"step {bad[0]['step']} minibatch {bad[0]['minibatch']}" if bad else "")


def steps_of(rows: Iterable[Mapping]) -> list[list[Mapping]]:
    """Rows grouped by consecutive step (the order they were logged in)."""
    groups: list[list[Mapping]] = []
    for r in rows:
        if groups and groups[-1][0]["step"] == r["step"]:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def replay(params: CollapseParams, rows: Iterable[Mapping]) -> HealthState:
    """The state after the logged rows of a run (a resume, or the manifest of a finished run)."""
    state = HealthState()
    for group in steps_of(rows):
        state = advance(state, params, observe(group))
    return state


def trace(params: CollapseParams, observations: Iterable[StepObservation]) -> list[HealthState]:
    """The state after each observation (for plots and tests of the rules)."""
    states, state = [], HealthState()
    for obs in observations:
        state = advance(state, params, obs)
        states.append(state)
    return states


# How each stop reason begins: run_folder reads a collapse from a manifest written before the 'collapsed' status by
# these words, so they are written here once.
NON_FINITE_REASON, REWARD_REASON, ENTROPY_REASON = "non-finite loss or gradient", "reward collapsed", "entropy exploded"
STOP_REASON_PREFIXES = (NON_FINITE_REASON, REWARD_REASON, ENTROPY_REASON)


def stop_reason(state: HealthState, obs: StepObservation, params: CollapseParams, stop_on_collapse: bool) -> str:
    """Why the run must stop after this step, or '' to go on: a hard rule always stops, a soft one only
    with stop_on_collapse."""
    rule = state.fired
    if not rule or (rule in SOFT_COLLAPSE_RULES and not stop_on_collapse):
        return ""
    if rule == "non_finite":
        return f"{NON_FINITE_REASON} at {obs.detail}"
    if rule == "zero_reward":
        return f"{REWARD_REASON}: exactly 0 for {ZERO_REWARD_STEPS} consecutive steps"
    if rule == "reward_drop":
        return (f"{REWARD_REASON} at step {obs.step}: moving average {state.reward_ema:.3g} below "
                f"{params.drop:g} x its best {state.best_ema:.3g} for {params.patience} steps")
    return f"{ENTROPY_REASON} at step {obs.step}: moving average {state.entropy_ema:.3g} > {params.entropy_max:g} nats"
