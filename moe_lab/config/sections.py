"""The sections of ``rl``: which concern each RL setting belongs to, declared once, and a typed view of each.

The keys stay flat (``rl.collapse_window``, not ``rl.collapse.window``): they are the interface of every experiment
file, command-line override and committed ``config.yaml`` (over a thousand), so a section is a declared group of
those fields, not a level of nesting. ``sectioned`` checks at import that every field of the class is in exactly
one section (a new field without one fails before anything runs); ``view(rl, name)`` is that section as a frozen
dataclass, what the trainer hands the part that needs it (the expert-bias updates get ``bias``, the collapse rules
``collapse``); ``moe-lab config`` and docs/config.md list the fields section by section.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

# section -> (what it holds, its fields in declaration order); the objectives' knobs (rl.<prefix>_<name>, from
# moe_lab/config/objective_specs.py) join "objective" where the class declares them.
RL_SECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "objective": ("the policy objective, its clip range and knobs, advantages, KL and the balancing loss",
                  ("algo", "clip_low", "clip_high", "loss_agg", "dual_clip_c", "std_normalize", "whiten",
                   "reward_clip", "adv_clip", "kl_coef", "kl_kind", "kl_mode", "aux_loss_coef")),
    "replay": ("Routing Replay and the router controls of the update forwards",
               ("replay", "replay_gate", "replay_gate_weights", "freeze_router", "router_noise")),
    "rollout": ("rollout numerics and the corrections of the rollout/trainer mismatch",
                ("rollout_correction", "rollout_correction_upper", "rollout_correction_lower", "old_logp",
                 "rollout_lag", "rollout_seeding", "temperature", "rollout_router_noise", "rollout_dtype",
                 "rollout_kernels", "train_dtype")),
    "bias": ("expert-bias updates during RL (DeepSeek-V3)", ("bias_update_rate", "bias_counts", "bias_count_dtype")),
    "schedule": ("steps, batch, updates per batch and the optimizer",
                 ("steps", "prompts_per_step", "group_size", "minibatches", "epochs", "lr", "router_lr_mult",
                  "warmup_steps", "weight_decay", "grad_clip")),
    "collapse": ("the collapse rules (moe_lab/rl/health.py)",
                 ("collapse_window", "collapse_drop", "collapse_patience", "collapse_min_best",
                  "collapse_entropy_max", "stop_on_collapse")),
    "cadence": ("how often a run measures, evaluates and checkpoints", ("decomp_every", "eval_every",
                                                                       "checkpoint_every")),
}


def sectioned(sections: dict[str, tuple[str, tuple[str, ...]]], extra: dict[str, tuple[str, ...]]):
    """Class decorator (above @dataclass): refuse a class whose fields are not each in exactly one section;
    ``extra``: fields the class adds by declaration elsewhere (the objective knobs), by section."""
    def check(cls: type) -> type:
        declared = [(s, f) for s, (_, names) in sections.items() for f in (*names, *extra.get(s, ()))]
        names = [f for _, f in declared]
        fields = {f.name for f in dataclasses.fields(cls)}
        twice = sorted({f for f in names if names.count(f) > 1})
        if twice or set(names) != fields:
            raise TypeError(f"{cls.__name__}: every field in exactly one section of moe_lab/config/sections.py; "
                            f"without one: {sorted(fields - set(names))}, unknown: {sorted(set(names) - fields)}, "
                            f"twice: {twice}")
        cls.SECTION_OF = {f: s for s, f in declared}
        return cls
    return check


@functools.cache
def _view_type(cls: type, name: str) -> type:
    hints = typing.get_type_hints(cls)
    names = [f for f, s in cls.SECTION_OF.items() if s == name]
    return dataclasses.make_dataclass(f"{cls.__name__}_{name}", [(f, hints[f]) for f in names], frozen=True)


def view(obj, name: str):
    """Section ``name`` of a sectioned config object, as a frozen dataclass of its fields' values."""
    cls = type(obj)
    if name not in set(cls.SECTION_OF.values()):
        raise KeyError(f"no section {name!r}; allowed: {', '.join(dict.fromkeys(cls.SECTION_OF.values()))}")
    tp = _view_type(cls, name)
    return tp(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(tp)})
