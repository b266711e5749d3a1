"""Typed configuration: one dataclass per concern, one documented and validated field each.

Every field is declared once with ``param`` (fields.py), which carries its help text and its allowed values, so
that validation, docs/config.md (``moe-lab config``) and the command-line overrides all read the same
declaration. Here: model, task, coldstart, the run, validation and YAML; rl.py: the ``rl`` fields, one class per
section; objective_specs.py and mode_specs.py: one row per objective and per mode, which bound fields and derive
constants.py's tuples. Nothing here imports torch or the runner: a config is checked before any work starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

import moe_lab.config.constants as C
import moe_lab.config.checks as config_checks
from moe_lab.config.fields import allowed, check_field, hints, param, walk
from moe_lab.config.errors import ConfigError
from moe_lab.config.objective_specs import OBJECTIVE_SPECS
from moe_lab.config.legacy import LEGACY_VALUES, upgrade_run_config  # noqa: F401  (run folders' configs)
from moe_lab.config.rl import RL_SECTIONS, RLConfig, bounds_under  # noqa: F401  (the rl settings, by section)
from moe_lab.config.yaml_io import apply_overrides, load_yaml, set_dotted  # noqa: F401 - re-exported: callers read YAML through config


@dataclass
class ModelConfig:
    family: str = param("qwen3_moe", "transformers MoE family (random weights)", choices=C.FAMILIES)
    checkpoint: str | None = param(None, "local checkpoint to load (nothing is downloaded)")
    num_layers: int = param(4, "decoder layers, all MoE", ge=1, le=128)
    hidden_size: int = param(128, "model width", ge=8)
    num_heads: int = param(4, "attention heads; must divide hidden_size", ge=1)
    num_kv_heads: int = param(2, "key/value heads (GQA); must divide num_heads", ge=1)
    num_experts: int = param(8, "routed experts per MoE layer", ge=2, le=1024)
    # top_k=1: where the chosen weights are renormalised (norm_topk_prob) each token's gate weight is 1, so the
    # router gets no gradient from the policy loss (only from aux_loss_coef); Switch-style families keep the
    # softmax probability and learn
    top_k: int = param(2, "experts activated per token", ge=1)
    norm_topk_prob: bool | None = param(None, "renormalise the chosen gate weights; None = the family's", unhashed=None)
    moe_intermediate_size: int = param(128, "width of one routed expert", ge=1)
    intermediate_size: int = param(256, "width of dense and shared-expert MLPs", ge=1)
    # False: every token's MLP output depends on its routing alone
    shared_expert: bool = param(True, "keep the family's shared expert, if any", unhashed=True)
    max_positions: int = param(256, "maximum prompt + response length", ge=8)
    experts_impl: str = param("grouped_mm", "routed experts' forward (docs/guide.md says which)",
                              choices=C.EXPERTS_KERNELS)
    device: str = param("cpu", "where the policy runs (auto: cuda when visible)", choices=C.DEVICES)
    seed: int = param(0, "seed of the random initialisation", ge=0)


@dataclass
class TaskConfig:
    name: str = param("sort", "task with a verifiable reward", choices=C.TASKS)
    length: int = param(16, "problem size: digits or letters per problem", ge=1, le=64)
    partial_credit: bool = param(False, "reward = share of correct characters")
    eval_size: int = param(128, "held-out evaluation prompts", ge=1)
    mixture: list[str] = param([], "sub-tasks of task.name=mixture (moe_lab/tasks/mixture.py)",
                               choices=C.SINGLE_TASKS, unhashed=[])


@dataclass
class ColdStartConfig:
    # sampled accuracy (T=1), low so that RL still has room to improve
    target_accuracy: float = param(0.3, "stop the warm-up at this sampled accuracy", ge=0.0, le=1.0)
    max_steps: int = param(3000, "upper bound on supervised steps", ge=0)
    batch_size: int = param(64, "demonstrations per supervised step", ge=1)
    lr: float = param(3e-3, "AdamW learning rate of the warm-up", gt=0.0)
    # sampled accuracy jumps fast: a coarser check overshoots the target
    eval_every: int = param(5, "supervised steps between accuracy checks", ge=1)
    eval_samples: int = param(128, "prompts per accuracy check", ge=1)
    # > 0: the router starts balanced, like a pretrained MoE's
    aux_loss_coef: float = param(0.0, "load-balancing loss coefficient of the warm-up", ge=0.0,
                                 unhashed=0.0)
    bias_update_rate: float = param(0.0, "expert-bias step of the warm-up; 0 = frozen",
                                    ge=0.0, unhashed=0.0)
    cache_dir: str = param("~/.cache/moe_lab/coldstart", "cache of warmed-up models")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    coldstart: ColdStartConfig = field(default_factory=ColdStartConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    seed: int = param(0, "seed of the RL run (cold start: model.seed)", ge=0)
    threads: int = param(1, "torch threads of one run", ge=1)


# The defaults a config's None clip and correction bounds resolve to (resolved_clip below), importable beside it.
PAPER_CLIP = C.PAPER_CLIP
ROLLOUT_CORRECTION_BOUNDS = C.ROLLOUT_CORRECTION_BOUNDS


def resolved_clip(rl: RLConfig) -> tuple[float, float]:
    """The clip range in force: the config's, or the paper's default for the algorithm."""
    low, high = PAPER_CLIP[rl.algo]
    return (low if rl.clip_low is None else rl.clip_low, high if rl.clip_high is None else rl.clip_high)


# --------------------------------------------------------------------------- validation


# rl fields whose bounds some objective declares in place of the field's own (objective_specs: field_bounds)
_OBJECTIVE_BOUNDED = {name for spec in OBJECTIVE_SPECS.values() for name in spec.field_bounds()}


def validate(cfg: RunConfig) -> RunConfig:
    """Check every field, then the cross-field checks; raise ConfigError naming the first bad field."""
    spec = OBJECTIVE_SPECS.get(cfg.rl.algo)  # an unknown algo fails its own check, before the fields it bounds
    for name, value, tp, meta in walk(cfg):
        if spec and name.startswith("rl.") and name[3:] in _OBJECTIVE_BOUNDED:
            check_field(name, value, tp, {**meta, **bounds_under(cfg.rl.algo, name[3:])}, f" for rl.algo={cfg.rl.algo}")
        else:
            check_field(name, value, tp, meta)
    m, rl = cfg.model, cfg.rl
    if m.top_k > m.num_experts:
        raise ConfigError(f"model.top_k={m.top_k} is out of range: allowed 1 <= top_k <= model.num_experts={m.num_experts}")
    if m.norm_topk_prob is not None and m.family not in C.NORM_TOPK_FAMILIES:
        raise ConfigError(f"model.norm_topk_prob={m.norm_topk_prob}: {m.family} always renormalises; allowed None, or "
                          f"a family with the switch ({', '.join(C.NORM_TOPK_FAMILIES)})")
    if m.hidden_size % m.num_heads or m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads={m.num_heads}: hidden_size ({m.hidden_size}) must be divisible by num_heads "
                          f"and num_heads by num_kv_heads ({m.num_kv_heads})")
    batch = rl.prompts_per_step * rl.group_size
    if batch % rl.minibatches:
        raise ConfigError(f"rl.minibatches={rl.minibatches}: must divide prompts_per_step*group_size={batch}")
    config_checks.check_replay_options(rl)
    config_checks.check_expert_bias(cfg)
    if rl.dual_clip_c is not None and rl.algo not in C.PPO_CLIP_ALGOS:
        raise ConfigError(f"rl.dual_clip_c={rl.dual_clip_c}: applies to grpo and the gspo variants only, not "
                          f"rl.algo={rl.algo}; leave it None")
    config_checks.check_rollout_correction(rl)
    config_checks.check_mixture(cfg.task)
    config_checks.check_rollout_numerics(rl, m.family)
    return cfg


# --------------------------------------------------------------------------- dict / YAML / overrides


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(data: dict | None, cls: type = RunConfig, prefix: str = "") -> Any:
    """Build a dataclass from a (YAML) dict; unknown keys are errors that name the allowed ones."""
    data = dict(data or {})
    field_hints = hints(cls)
    kwargs = {}
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown field; allowed: {', '.join(sorted(names))}")
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = field_hints[f.name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(data[f.name], dict):
                raise ConfigError(f"{prefix}{f.name}: expected a mapping of fields, got {data[f.name]!r}")
            kwargs[f.name] = from_dict(data[f.name], tp, f"{prefix}{f.name}.")
        else:
            kwargs[f.name] = data[f.name]
    return cls(**kwargs)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def field_table(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(name, default, allowed, help) for every field: docs/config.md's config table is generated from this."""
    rows = []
    field_hints = hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(field_hints[f.name]):
            rows += field_table(field_hints[f.name], f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((f"{prefix}{f.name}", repr(default), _allowed(f"{prefix}{f.name}", dict(f.metadata)),
                     f.metadata.get("help", "")))
    return rows


def _allowed(name: str, meta: dict) -> str:
    """The field's allowed values, then those of the objectives that declare their own bounds for it."""
    own = allowed(meta)
    if not name.startswith("rl."):
        return own
    by_bounds: dict[str, list[str]] = {}
    for algo, spec in OBJECTIVE_SPECS.items():
        if name[3:] in spec.field_bounds():
            by_bounds.setdefault(allowed({**meta, **bounds_under(algo, name[3:])}), []).append(algo)
    return "; ".join([own, *(f"{', '.join(algos)}: {text}" for text, algos in by_bounds.items())])
