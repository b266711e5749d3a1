"""Cross-field checks of a run config that concern one feature each (task mixtures, replay options, rollout
correction): ``config.validate`` calls them after every field passed its own check. Like the config, nothing
here imports torch."""

from __future__ import annotations

import moe_lab.config.constants as C
from moe_lab.config.mode_specs import OLD_FORWARD, REPLAY_SPECS, ROLLOUT_CORRECTION_SPECS, names_where
from moe_lab.config.errors import ConfigError


def check_mixture(task) -> None:
    if task.name != "mixture":
        if task.mixture:
            raise ConfigError(f"task.mixture={task.mixture!r} is set but task.name={task.name}; use task.name=mixture "
                              "or leave task.mixture empty")
        return
    if len(set(task.mixture)) < 2 or len(set(task.mixture)) != len(task.mixture):
        raise ConfigError(f"task.mixture={task.mixture!r}: task.name=mixture needs >= 2 distinct tasks of "
                          f"{', '.join(C.SINGLE_TASKS)}")
    if task.eval_size < len(task.mixture):
        raise ConfigError(f"task.eval_size={task.eval_size}: a mixture of {len(task.mixture)} tasks needs "
                          f">= {len(task.mixture)} (each sub-task holds out its share)")


def check_replay_options(rl) -> None:
    """What each rl.replay mode's traits (moe_lab/config/mode_specs.py) allow of the other replay options."""
    spec = REPLAY_SPECS[rl.replay]
    if spec.forces == OLD_FORWARD and rl.old_logp == "rollout":
        raise ConfigError(f"rl.replay='{rl.replay}' needs rl.old_logp='old_forward' (R2 replays the old-policy "
                          "forward's routing); use rl.replay='rollout' with rl.old_logp='rollout'")
    if not spec.replays and (rl.replay_gate > 0 or rl.replay_gate_weights):
        raise ConfigError("rl.replay_gate/replay_gate_weights apply to replayed routing; set rl.replay="
                          f"{names_where(REPLAY_SPECS, lambda s: s.replays)}, or leave them at 0/false")
    if rl.replay_gate > 0 and rl.replay_gate_weights:
        raise ConfigError(f"rl.replay_gate={rl.replay_gate} with rl.replay_gate_weights=true: a replaced expert has no "
                          "recorded weight; use one or the other")
    if spec.predictor and rl.rollout_lag:
        raise ConfigError(f"rl.replay=predictive with rl.rollout_lag={rl.rollout_lag}: the sampler routes by the "
                          "predictor heads of the current step (a lagged copy keeps no old heads); allowed: 0")
    if rl.freeze_router and rl.router_lr_mult != 1.0:
        raise ConfigError(f"rl.router_lr_mult={rl.router_lr_mult} with rl.freeze_router=true: a frozen router has no "
                          "learning rate; leave router_lr_mult at 1.0")


def check_rollout_correction(rl) -> None:
    mode, spec = rl.rollout_correction, ROLLOUT_CORRECTION_SPECS[rl.rollout_correction]
    if not spec.active:
        if rl.rollout_correction_upper is not None or rl.rollout_correction_lower is not None:
            raise ConfigError(f"rl.rollout_correction_upper/lower are set but rl.rollout_correction={mode}; choose a "
                              f"mode ({names_where(ROLLOUT_CORRECTION_SPECS, lambda s: s.active)}) or leave them None")
        return
    if rl.old_logp == "rollout":
        raise ConfigError(f"rl.rollout_correction={mode} needs rl.old_logp='old_forward' (with the rollout's own "
                          "log-probs as logp_old there is no training-inference gap to correct)")
    if not spec.takes_lower and rl.rollout_correction_lower is not None:
        raise ConfigError(f"rl.rollout_correction_lower={rl.rollout_correction_lower}: applies to "
                          f"{names_where(ROLLOUT_CORRECTION_SPECS, lambda s: s.takes_lower)} only, not {mode}; "
                          "leave it None")
    default_low, default_up = spec.bounds
    low = default_low if rl.rollout_correction_lower is None else rl.rollout_correction_lower
    up = default_up if rl.rollout_correction_upper is None else rl.rollout_correction_upper
    if low is not None and not low < up:
        raise ConfigError(f"rl.rollout_correction_lower={low} must be < rl.rollout_correction_upper={up}")


def check_expert_bias(cfg) -> None:
    """Bias updates need a family whose router has a correction bias (a checkpoint's family is checked when it
    loads: moe_lab/rl/expert_bias.py); the count options apply to RL's updates only."""
    rl, family = cfg.rl, cfg.model.family
    for name, rate in (("coldstart.bias_update_rate", cfg.coldstart.bias_update_rate),
                       ("rl.bias_update_rate", rl.bias_update_rate)):
        if rate > 0 and cfg.model.checkpoint is None and family not in C.BIAS_FAMILIES:
            raise ConfigError(f"{name}={rate}: model.family={family} has no expert correction bias; allowed 0, or a "
                              f"family with one ({', '.join(C.BIAS_FAMILIES)})")
    if rl.bias_update_rate == 0 and (rl.bias_counts != "free" or rl.bias_count_dtype != "float32"):
        raise ConfigError(f"rl.bias_counts={rl.bias_counts}/rl.bias_count_dtype={rl.bias_count_dtype} apply to "
                          "expert-bias updates; set rl.bias_update_rate > 0, or leave them at free/float32")


def check_rollout_numerics(rl, family: str) -> None:
    """float8 and batch_variant rollouts emulate the GEMMs of fused experts laid out [E, 2I, H] without bias
    (moe_lab/models/numerics.py); gpt_oss's experts (transposed, biased, clamped activation) are not covered."""
    if (rl.rollout_dtype == "float8" or rl.rollout_kernels != "batch_invariant") and family == "gpt_oss":
        raise ConfigError(f"rl.rollout_dtype={rl.rollout_dtype} / rl.rollout_kernels={rl.rollout_kernels}: not "
                          "emulated for model.family=gpt_oss (biased, transposed experts); allowed there: "
                          "rollout_dtype float32/bfloat16 with rollout_kernels=batch_invariant")
