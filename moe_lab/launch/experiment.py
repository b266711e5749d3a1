"""Experiment files: a base config, arms, optional sweeps and seeds, expanded into run cells.

An experiment YAML::

    name: paper
    description: ...
    organism: rescue                   # optional: experiments/organisms/rescue.yaml under base (launch/compose.py)
    base: {rl: {steps: 40}}            # RunConfig fields shared by every cell
    arms:                              # arm name -> overrides of base (or a list of arm presets:
      grpo: {rl: {algo: grpo}}         #   arms: [grpo, gspo_r3], launch/compose.py)
      gspo: {rl: {algo: gspo}}
    sweep: {rl.router_lr_mult: [1, 10]}  # optional: every arm x every point (cartesian)
    seeds: [0, 1, 2]
    minutes_2cores: 12                 # optional: runtime measured on 2 cores (`moe-lab list`), where no
                                       # committed reference records it
    endpoints:                         # optional: fixed before the runs; `moe-lab compare` reads them
      primary: {metric: eval/acc_greedy, last_evals: 5}      # (these are the defaults:
      secondary: {metric: reward/mean, last_frac: 0.25}      #  moe_lab/analysis/endpoints.py)

An arm may carry its own list of points under ``_points`` (e.g. clip ranges that differ per algorithm):
``gspo: {rl: {algo: gspo}, _points: [{rl.clip_low: 1e-4, rl.clip_high: 1.3e-4}, ...]}``.

``blocks`` (instead of ``seeds``) runs each value of one field, e.g. ``model.seed`` (a cold start of its own),
with RL seeds of its own; ``contrasts`` declares the pairs of arms `moe-lab compare` tests (launch/design.py);
``describe`` the metrics `moe-lab report` summarises descriptively and ``verdict`` its conclusion (neither
changes a cell).

Instead of a ``sweep``, ``factors`` varies one factor at a time around ``base`` (the stability atlas)::

    factors:
      updates: {"4": {}, "16": {rl.minibatches: 16}}   # level label -> overrides; {} is the base itself
      lag: {"0": {}, "1": {rl.rollout_lag: 1}}

Every arm runs once at the base point (arm label ``<arm>__base``) and once per non-empty level
(``<arm>__<factor>=<level>``); a level of ``{}`` names where the base point sits on that factor's axis,
so the base cells are shared by every factor instead of being run once per factor.
Every cell's config is validated before any cell runs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from moe_lab.config import ConfigError, RunConfig, apply_overrides, from_dict, set_dotted, validate
from moe_lab.launch.compose import compose, merge
from moe_lab.launch.design import blocks_spec, contrasts_spec, describe_spec, verdict_of

TOP_KEYS = ("name", "description", "organism", "base", "arms", "sweep", "factors", "seeds", "blocks", "minutes_2cores",
            "endpoints", "contrasts", "describe", "verdict")
BASE_LABEL = "base"


@dataclass(frozen=True)
class Cell:
    run_id: str
    arm: str
    seed: int
    config: RunConfig


@dataclass(frozen=True)
class EndpointSpec:
    primary_metric: str = "eval/acc_greedy"
    """eval-table column averaged over the last ``last_evals`` scheduled evaluations"""
    last_evals: int = 5
    secondary_metric: str = "reward/mean"
    """metrics-table column averaged over the last ``last_frac`` of the scheduled steps"""
    last_frac: float = 0.25


def endpoint_spec(exp: dict | None) -> EndpointSpec:
    """The ``endpoints:`` block of an experiment (or the defaults), checked: one ConfigError naming the key."""
    block = (exp or {}).get("endpoints")
    if block is None:
        return EndpointSpec()
    if not isinstance(block, dict):
        raise ConfigError(f"endpoints: expected a mapping with keys primary, secondary, got {block!r}")
    unknown = set(block) - {"primary", "secondary", "tertiary"}
    if unknown:
        raise ConfigError(f"endpoints: unknown key(s) {sorted(map(str, unknown))}; allowed: primary, secondary, "
                          "tertiary")
    if block.get("tertiary", "collapse") != "collapse":
        raise ConfigError(f"endpoints.tertiary: allowed 'collapse' (descriptive), got {block['tertiary']!r}")
    p, s = block.get("primary") or {}, block.get("secondary") or {}
    for key, part, allowed in (("primary", p, {"metric", "last_evals"}), ("secondary", s, {"metric", "last_frac"})):
        if not isinstance(part, dict) or set(part) - allowed:
            raise ConfigError(f"endpoints.{key}: expected a mapping with keys {', '.join(sorted(allowed))}, "
                              f"got {part!r}")
    d = EndpointSpec()
    spec = EndpointSpec(str(p.get("metric", d.primary_metric)), p.get("last_evals", d.last_evals),
                        str(s.get("metric", d.secondary_metric)), s.get("last_frac", d.last_frac))
    if isinstance(spec.last_evals, bool) or not isinstance(spec.last_evals, int) or spec.last_evals < 1:
        raise ConfigError(f"endpoints.primary.last_evals: allowed an integer >= 1, got {spec.last_evals!r}")
    if isinstance(spec.last_frac, bool) or not isinstance(spec.last_frac, (int, float)) \
            or not 0 < spec.last_frac <= 1:
        raise ConfigError(f"endpoints.secondary.last_frac: allowed a number in (0, 1], got {spec.last_frac!r}")
    return spec


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _points(spec: dict | None) -> list[dict[str, Any]]:
    """Cartesian product of a {dotted.field: [values]} mapping, as a list of {dotted.field: value}."""
    if not spec:
        return [{}]
    for key, values in spec.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.{key}: expected a non-empty list of values, got {values!r}")
    keys = list(spec)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(spec[k] for k in keys))]


def _label(point: dict[str, Any]) -> str:
    return "".join(f"__{k}={_fmt(v)}" for k, v in point.items())


def _is_seed(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_shape(exp: Any) -> None:
    """The experiment's top-level keys have the types expand() needs; one ConfigError naming the key."""
    if not isinstance(exp, dict):
        raise ConfigError(f"experiment: expected a mapping with keys {', '.join(TOP_KEYS)}, got {type(exp).__name__}")
    unknown = set(exp) - set(TOP_KEYS)
    if unknown:
        raise ConfigError(f"experiment: unknown key(s) {sorted(map(str, unknown))}; allowed: {', '.join(TOP_KEYS)}")
    for key in ("name", "description"):
        if exp.get(key) is not None and not isinstance(exp[key], str):
            raise ConfigError(f"{key}: expected a string, got {exp[key]!r}")
    minutes = exp.get("minutes_2cores")
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or minutes <= 0):
        raise ConfigError(f"minutes_2cores: expected a number of minutes > 0 (measured on 2 cores), got {minutes!r}")
    if exp.get("base") is not None and not isinstance(exp["base"], dict):
        raise ConfigError(f"base: expected a mapping of config fields (e.g. base: {{rl: {{steps: 5}}}}), "
                          f"got {exp['base']!r}")
    arms = exp.get("arms")
    if arms is not None:
        if not isinstance(arms, dict):
            raise ConfigError(f"arms: expected a mapping of arm name -> overrides (e.g. arms: {{grpo: {{rl: "
                              f"{{algo: grpo}}}}}}) or a list of arm presets (arms: [grpo, grpo_r3]), got "
                              f"{type(arms).__name__}")
        for name, spec in arms.items():
            if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
                raise ConfigError(f"arms: arm name {name!r}: allowed a non-empty string without '/' or a leading '.'")
            if spec is not None and not isinstance(spec, dict):
                raise ConfigError(f"arms.{name}: expected a mapping of overrides, got {spec!r}")
            points = (spec or {}).get("_points")
            if points is not None and not (isinstance(points, list) and points
                                           and all(isinstance(p, dict) for p in points)):
                raise ConfigError(f"arms.{name}._points: expected a non-empty list of mappings "
                                  f"{{dotted.field: value}}, got {points!r}")
    sweep = exp.get("sweep")
    if sweep is not None and not isinstance(sweep, dict):
        raise ConfigError(f"sweep: expected a mapping of dotted.field -> list of values, got {sweep!r}")
    endpoint_spec(exp)  # raises on a malformed endpoints block
    blocks_spec(exp)
    contrasts_spec(exp)
    describe_spec(exp)
    verdict_of(exp)
    seeds = exp.get("seeds")
    if seeds is not None and not (isinstance(seeds, list) and seeds and all(map(_is_seed, seeds))):
        raise ConfigError(f"seeds: expected a non-empty list of integers >= 0 (e.g. seeds: [0, 1, 2]), got {seeds!r}")


def factor_levels(exp: dict) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """The ``factors`` block checked: factor -> [(level label, overrides)] in the order written."""
    spec = exp.get("factors")
    if spec is None:
        return {}
    if exp.get("sweep"):
        raise ConfigError("experiment: 'factors' and 'sweep' exclude each other (one factor at a time, or a grid)")
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"factors: expected a mapping factor -> {{level: overrides}}, got {spec!r}")
    out = {}
    for factor, levels in spec.items():
        if "=" in str(factor) or "__" in str(factor) or str(factor) == BASE_LABEL:
            raise ConfigError(f"factors.{factor}: a factor name may not contain '=' or '__' nor be '{BASE_LABEL}'")
        if not isinstance(levels, dict) or not levels:
            raise ConfigError(f"factors.{factor}: expected a non-empty mapping level -> overrides, got {levels!r}")
        for level, over in levels.items():
            if not isinstance(over, dict):
                raise ConfigError(f"factors.{factor}.{level}: expected a mapping of dotted.field: value, got {over!r}")
        out[str(factor)] = [(str(level), dict(over)) for level, over in levels.items()]
    return out


def _factor_points(exp: dict) -> list[tuple[str, dict[str, Any]]]:
    """(label, overrides) of every distinct point of a one-factor-at-a-time design, the base first."""
    points = [(BASE_LABEL, {})]
    for factor, levels in factor_levels(exp).items():
        points += [(f"{factor}={level}", over) for level, over in levels if over]
    return points


def expand(exp: dict, *, overrides: list[str] = (), arms: list[str] | None = None,
           seeds: list[int] | None = None) -> list[Cell]:
    """All cells of an experiment (its organism and arm presets composed first: launch/compose.py), validated;
    command-line overrides apply to every cell, last."""
    exp = compose(exp)
    check_shape(exp)
    if seeds is not None and not (seeds and all(map(_is_seed, seeds))):
        raise ConfigError(f"--seeds: expected integers >= 0, got {seeds!r}")
    all_arms = exp.get("arms") or {"default": {}}
    if arms:
        missing = [a for a in arms if a not in all_arms]
        if missing:
            raise ConfigError(f"--arms: unknown arm(s) {missing}; allowed: {', '.join(all_arms)}")
        all_arms = {a: all_arms[a] for a in arms}
    blocks = blocks_spec(exp)
    # (block value, seed) per cell; without blocks the block value is None and no field is set
    plain = seeds if seeds is not None else exp.get("seeds", [0])
    runs = blocks.cells(seeds) if blocks else [(None, s) for s in plain]
    if blocks and not runs:
        raise ConfigError(f"--seeds: none of {seeds} is a seed of blocks.seeds")
    cells = []
    for arm, arm_spec in all_arms.items():
        arm_spec = dict(arm_spec or {})
        arm_points = arm_spec.pop("_points", None) or [{}]
        if exp.get("factors") is not None:
            labelled = [(f"__{label}", {**p, **q}) for p in arm_points for label, q in _factor_points(exp)]
        else:
            labelled = [(_label(pt), pt) for pt in (merge(p, q) for p in arm_points for q in _points(exp.get("sweep")))]
        for label, point in labelled:
            data = apply_overrides(merge(exp.get("base") or {}, arm_spec), [])
            for key, value in point.items():
                set_dotted(data, key, value)
            arm_name = arm + label
            for value, seed in runs:
                data["seed"] = seed
                if blocks:
                    set_dotted(data, blocks.field, value)
                cfg = from_dict(apply_overrides(data, list(overrides)))
                validate(cfg)
                cells.append(Cell(f"{arm_name}-s{cfg.seed}", arm_name, cfg.seed, cfg))
    ids = [c.run_id for c in cells]
    if len(set(ids)) != len(ids):
        raise ConfigError("experiment: two cells share a run id; give arms distinct names")
    return cells
