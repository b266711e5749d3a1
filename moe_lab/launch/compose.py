"""Experiments composed from named parts: an organism (the model, task, cold start and rollout numerics an
experiment runs on) declared once in ``experiments/organisms/NAME.yaml``, and arm presets named after the objective
table and the replay and rollout-correction modes. Torch-free.

An experiment names them::

    organism: rescue                   # experiments/organisms/rescue.yaml's config under base (base wins);
                                       # or a path to an organism file of your own (organism: my/org.yaml)
    base: {rl: {steps: 150}}
    arms: [grpo, grpo_r2, grpo_r3, gspo]   # presets; or a mapping, where a preset's entry may be left empty

``compose(exp)`` returns the experiment in its explicit form (base with the organism merged in, arms as a mapping of
overrides, no ``organism`` key): what ``expand`` reads and the runner writes into a results folder, so a results
folder never needs the organism files to be read. It is idempotent, and the explicit form of a file without
``organism`` or presets is the file itself.

**Arm presets**: ``<objective>[_<replay>][_<correction>]``, one per row of OBJECTIVE_SPECS x REPLAY_SPECS x
ROLLOUT_CORRECTION_SPECS (objective_specs.py, mode_specs.py): the replay suffix is the mode's label lower-cased
(``r2``: rl.replay=old, ``r3``: rollout, ``pr2``: predictive), the correction's likewise (``tis``: tis_token,
``tis_seq``, ``mis``, ``mis_seq``, ``icepop``). ``grpo_r3`` = {rl: {algo: grpo, replay: rollout,
rollout_correction: none}}; its label, "GRPO + R3 replay", is built from the same rows. A mapping entry that
carries overrides is used as written (no preset merged under it): what the file says is what runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from moe_lab.config.constants import BASELINE_ALGO
from moe_lab.config.errors import ConfigError
from moe_lab.config.mode_specs import REPLAY_SPECS, ROLLOUT_CORRECTION_SPECS
from moe_lab.config.objective_specs import OBJECTIVE_SPECS
from moe_lab.config.yaml_io import load_yaml

ORGANISMS = "moe_lab.experiments"  # the package of the built-in experiments; organisms sit in its organisms/
ORGANISM_DIR = "organisms"
ORGANISM_KEYS = ("name", "description", "config")
# What an organism may fix: what the model is and how it is warmed up and sampled, not how RL trains it.
ORGANISM_SECTIONS = {"model", "task", "coldstart", "rl"}
ORGANISM_RL_FIELDS = {"rollout_dtype", "rollout_kernels"}


@dataclass(frozen=True)
class ArmPreset:
    name: str
    label: str
    """e.g. "GRPO + R3 replay": the objective's label, then the replay's and the correction's"""
    overrides: dict
    color: str | None
    """its colour in figures (``preset_color``), None where the objective declares none"""


def _suffix(label: str) -> str:
    return "_" + label.lower().replace("-", "_") if label else ""


def _mix(colors: list[str]) -> str:
    """The mean of "#RRGGBB" colours, channel by channel."""
    channels = [[int(c[i:i + 2], 16) for i in (1, 3, 5)] for c in colors]
    return "#" + "".join(f"{round(sum(ch) / len(ch)):02X}" for ch in zip(*channels))


def preset_color(algo: str, replay: str, correction: str) -> str | None:
    """A preset's colour from the three tables: the objective's own without a mode; with modes, their hue (mixed
    when there are two). The papers compare the modes on GRPO (the baseline, the objective table's first row), so
    its presets show the mode's hue as it is and another objective's is mixed half with the objective's colour."""
    obj = OBJECTIVE_SPECS[algo]
    modes = [c for c in (REPLAY_SPECS[replay].color, ROLLOUT_CORRECTION_SPECS[correction].color) if c]
    if obj.color is None or not modes:
        return obj.color
    hue = _mix(modes)
    return hue if algo == BASELINE_ALGO else _mix([hue, obj.color])


def preset_name(algo: str, replay: str, correction: str) -> str:
    """The preset of an objective, replay and correction: 'grpo_r3' (module docstring)."""
    return algo + _suffix(REPLAY_SPECS[replay].label) + _suffix(ROLLOUT_CORRECTION_SPECS[correction].label)


def preset_label(algo: str, replay: str, correction: str) -> str:
    """Its label, from the tables' labels: 'GRPO + R3 replay', 'GSPO + TIS'."""
    r, c = REPLAY_SPECS[replay].label, ROLLOUT_CORRECTION_SPECS[correction].label
    return OBJECTIVE_SPECS[algo].label + (f" + {r} replay" if r else "") + (f" + {c}" if c else "")


@functools.cache
def arm_presets() -> dict[str, ArmPreset]:
    """Every preset name -> its preset (module docstring), derived from the three tables."""
    out = {}
    for algo in OBJECTIVE_SPECS:
        for replay in REPLAY_SPECS:
            for corr in ROLLOUT_CORRECTION_SPECS:
                name = preset_name(algo, replay, corr)
                out[name] = ArmPreset(name, preset_label(algo, replay, corr),
                                      {"rl": {"algo": algo, "replay": replay, "rollout_correction": corr}},
                                      preset_color(algo, replay, corr))
    return out


def organism_names() -> list[str]:
    folder = resources.files(ORGANISMS).joinpath(ORGANISM_DIR)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _organism_file(name: Any):
    """(the organism's file, how errors name it): a built-in name, or a path to a YAML file of your own."""
    if isinstance(name, str) and name.endswith((".yaml", ".yml")):
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"organism: {name!r}: no such file")
        return path, name
    names = organism_names()
    if not isinstance(name, str) or name not in names:
        raise ConfigError(f"organism: {name!r}: no such organism; allowed: {', '.join(names)}, or a path to a "
                          "YAML file")
    return resources.files(ORGANISMS).joinpath(ORGANISM_DIR, f"{name}.yaml"), f"experiments/{ORGANISM_DIR}/{name}.yaml"


def load_organism(name: Any) -> dict:
    """The organism's config (a partial RunConfig mapping), checked: one ConfigError naming the file or key."""
    path, where = _organism_file(name)
    data = load_yaml(str(path))
    stem = Path(str(path)).name.rsplit(".", 1)[0]
    if not isinstance(data, dict) or set(data) != set(ORGANISM_KEYS) or data["name"] != stem:
        raise ConfigError(f"{where}: expected keys {', '.join(ORGANISM_KEYS)}, with name: {stem} (the file's name)")
    config = data["config"]
    if not isinstance(config, dict) or not set(config) <= ORGANISM_SECTIONS \
            or not all(isinstance(v, dict) for v in config.values()):
        raise ConfigError(f"{where}: config: expected sections among {', '.join(sorted(ORGANISM_SECTIONS))}")
    extra = set(config.get("rl", {})) - ORGANISM_RL_FIELDS
    if extra:
        raise ConfigError(f"{where}: config.rl: an organism fixes only {', '.join(sorted(ORGANISM_RL_FIELDS))} "
                          f"(the rollout's numerics), got {sorted(extra)}")
    return config


def merge(a: dict, b: dict) -> dict:
    """``a`` with ``b`` merged in, recursively: b wins on every key it sets."""
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _arms(arms: Any) -> Any:
    presets = arm_presets()
    if isinstance(arms, list):
        unknown = [a for a in arms if not isinstance(a, str) or a not in presets]
        if unknown:
            raise ConfigError(f"arms: {unknown[0]!r} is no arm preset (<objective>[_r2|_r3|_pr2][_tis|_icepop|...], "
                              "e.g. grpo_r3); give it overrides in the mapping form instead")
        if len(set(arms)) != len(arms):
            raise ConfigError("arms: an arm preset is listed twice")
        return {a: presets[a].overrides for a in arms}
    if isinstance(arms, dict):  # an empty entry of a preset's name takes the preset; the rest stay as written
        return {a: (presets[a].overrides if spec is None and a in presets else spec) for a, spec in arms.items()}
    return arms


def compose(exp: Any) -> Any:
    """The experiment's explicit form (module docstring); anything not a mapping is returned for the shape check."""
    if not isinstance(exp, dict):
        return exp
    out = dict(exp)
    organism = out.pop("organism", None)
    if organism is not None:
        base = out.get("base")
        if base is not None and not isinstance(base, dict):
            raise ConfigError(f"base: expected a mapping of config fields, got {base!r}")
        out["base"] = merge(load_organism(organism), base or {})
    if "arms" in out:
        out["arms"] = _arms(out["arms"])
    return out
