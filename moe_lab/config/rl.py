"""The RL settings (``rl.*``), declared section by section: each section a frozen dataclass that declares its
own fields, its docstring the heading of its table in docs/config.md; ``RLConfig`` is their flat union (the keys
stay flat: ``rl.lr``, ``rl.collapse_window``), and ``cfg.rl.section(name)`` hands a part of the trainer its own
section. A new field goes into the section it belongs to; a new section is one class here and one entry of
``RL_SECTIONS``. No torch.

A help text is one short clause (docs/config.md and ``moe-lab config`` print it); the details belong to the module
that implements the field, the reasons for a default to a comment here.
"""

from __future__ import annotations

import moe_lab.config.constants as C
from moe_lab.config.fields import param
from moe_lab.config.objective_specs import OBJECTIVE_SPECS, knob_fields
from moe_lab.config.sections import flat, section


def _with_objective_knobs(after: str):
    """Class decorator (under @section): a float field per objective knob, rl.<prefix>_<name>, with the default,
    help and bounds of its one declaration (moe_lab/config/objective_specs.py), inserted after the field ``after``."""
    def insert(cls: type) -> type:
        if after not in cls.__annotations__:
            raise TypeError(f"{cls.__name__}: no field {after!r} to put the objective knobs after")
        annotations = {}
        for name, tp in cls.__annotations__.items():
            annotations[name] = tp
            if name == after:
                for field_name, knob in knob_fields(OBJECTIVE_SPECS).items():
                    annotations[field_name] = "float"
                    setattr(cls, field_name, param(knob.default, knob.help, **knob.bounds()))
        cls.__annotations__ = annotations
        return cls
    return insert


@section("objective")
@_with_objective_knobs(after="dual_clip_c")
class RLObjective:
    """Policy objective, clip range, knobs, advantages, KL, balancing loss."""

    algo: str = param("grpo", "policy objective (moe_lab/algos/objectives.py)", choices=C.ALGOS)
    # None: the objective's paper_clip, declared in its row of moe_lab/config/objective_specs.py
    clip_low: float | None = param(None, "eps_low; None = the objective's paper value", ge=0.0, lt=1.0)
    clip_high: float | None = param(None, "eps_high; None = the objective's paper value", ge=0.0)
    loss_agg: str = param("seq-mean-token-mean", "token and sequence aggregation (-norm: by the response budget)",
                          choices=C.LOSS_AGGS)
    dual_clip_c: float | None = param(None, "dual-clip bound for negative advantages; None = off", gt=1.0)
    # here: rl.<prefix>_<name>, every objective's own knobs, declared in moe_lab/config/objective_specs.py
    std_normalize: bool = param(True, "divide advantages by the group's std (False: Dr.GRPO)")
    whiten: str = param("group", "scope of the advantage normalisation", choices=C.WHITEN_MODES)
    reward_clip: float | None = param(None, "clamp rewards to [-c, c]; None = off", gt=0.0)
    adv_clip: float | None = param(None, "clamp advantages to [-c, c]; None = off", gt=0.0)
    kl_coef: float = param(0.0, "KL-to-reference coefficient", ge=0.0)  # 0: the GSPO authors' setting
    kl_kind: str = param("k3", "KL estimator", choices=C.KL_KINDS)
    kl_mode: str = param("loss", "KL as a loss term or a reward penalty", choices=C.KL_MODES)
    aux_loss_coef: float = param(0.0, "load-balancing loss coefficient", ge=0.0)


@section("replay")
class RLReplay:
    """Routing Replay and router controls."""

    replay: str = param("none", "Routing Replay (old: R2, rollout: R3, predictive: PR2)", choices=C.REPLAY_MODES)
    replay_gate: float = param(0.0, "gated replay threshold (moe_lab/routing/gate.py); 0 = off", ge=0.0, le=1.0)
    replay_gate_weights: bool = param(False, "also replay the recorded gate weights")
    # emulates non-deterministic forwards, where repeated passes of one model choose other experts (R3 paper)
    router_noise: float = param(0.0, "router-logit noise std in the trainer's forwards", ge=0.0)


@section("rollout")
class RLRollout:
    """Rollout numerics and mismatch corrections."""

    rollout_correction: str = param("none", "importance weights pi_train/pi_rollout: truncated (tis) or masked",
                                    choices=C.ROLLOUT_CORRECTION_MODES)
    # None: the mode's default bounds, declared in its row of moe_lab/config/mode_specs.py
    rollout_correction_upper: float | None = param(None, "upper bound; None = the mode's", gt=0.0)
    rollout_correction_lower: float | None = param(None, "lower bound (mask modes); None = the mode's", gt=0.0)
    old_logp: str = param("old_forward", "logp_old from the old policy's forward or the rollout",
                          choices=C.OLD_LOGP_SOURCES)
    rollout_lag: int = param(0, "sample with the policy of this many steps ago (async RL)", ge=0)
    # per_group: any torchrun world size samples the responses of a plain run; sequential: how the committed
    # references sampled, kept so that they re-run bit for bit (docs/guide.md)
    rollout_seeding: str = param("per_group", "per_group: a generator per prompt group; sequential: one per run",
                                 choices=C.ROLLOUT_SEEDINGS)
    temperature: float = param(1.0, "sampling temperature", gt=0.0)
    rollout_router_noise: float = param(0.0, "router-logit noise std in the sampler only", ge=0.0)
    rollout_dtype: str = param("float32", "dtype of the rollout copy (float8: moe_lab/models/numerics.py)",
                               choices=C.ROLLOUT_DTYPES)
    rollout_kernels: str = param("batch_invariant", "rollout reductions; batch_variant*: bits depend on the batch",
                                 choices=C.ROLLOUT_KERNELS)
    train_dtype: str = param("float32", "autocast dtype of the trainer's forwards", choices=C.DTYPES)


@section("bias")
class RLBias:
    """Expert-bias updates during RL (moe_lab/rl/expert_bias.py)."""

    bias_update_rate: float = param(0.0, "expert-bias step per optimizer step; 0 = frozen", ge=0.0)
    bias_counts: str = param("free", "loads under replay: the router's choice (free) or the forced ids",
                             choices=C.BIAS_COUNTS)
    bias_count_dtype: str = param("float32", "dtype of the load counts", choices=C.BIAS_COUNT_DTYPES)


@section("schedule")
class RLSchedule:
    """Steps, batch, updates and the optimizer."""

    steps: int = param(40, "RL steps, one rollout batch each", ge=1)
    prompts_per_step: int = param(16, "prompts per rollout batch (B)", ge=1)
    group_size: int = param(8, "responses per prompt (G)", ge=2)
    minibatches: int = param(4, "optimizer steps per batch and epoch", ge=1)  # 4: the paper's
    epochs: int = param(1, "passes over each rollout batch (PPO epochs)", ge=1)
    # 1e-4: at 1e-3 the sort task collapsed within 5 steps at this scale
    lr: float = param(1e-4, "AdamW learning rate", gt=0.0)
    router_lr_mult: float = param(1.0, "router learning-rate multiplier", gt=0.0)
    warmup_steps: int = param(2, "linear warmup, in optimizer steps", ge=0)
    weight_decay: float = param(0.0, "AdamW weight decay", ge=0.0)
    grad_clip: float = param(1.0, "max global gradient norm; 0 = off", ge=0.0)
    freeze_router: bool = param(False, "router weights get no gradient or update")


@section("collapse")
class RLCollapse:
    """The collapse rules (moe_lab/store/health.py)."""

    collapse_window: int = param(10, "span of the reward and entropy moving averages", ge=1)
    collapse_drop: float = param(0.5, "reward collapse: moving average below this fraction of its best",
                                 gt=0.0, lt=1.0)
    collapse_patience: int = param(5, "steps below collapse_drop before a reward collapse", ge=1)
    collapse_min_best: float = param(0.1, "best moving average that arms the reward rule", ge=0.0)
    collapse_entropy_max: float | None = param(None, "entropy collapse above this many nats; None = off", gt=0.0)
    # False keeps every seed's curve the same length; the hard rules always stop
    stop_on_collapse: bool = param(False, "stop at a soft collapse, not only record it")


@section("cadence")
class RLCadence:
    """How often a run measures, evaluates and checkpoints."""

    # 2: at 1 the extra forward measured +15-20% of a CPU step (docs/metrics.md, ratio/d_route_mean)
    decomp_every: int = param(2, "ratio decomposition on every N-th update; 0 = off", ge=0)
    eval_every: int = param(10, "RL steps between evaluations", ge=1)
    checkpoint_every: int = param(5, "RL steps between checkpoints", ge=1)


RL_SECTIONS = (RLObjective, RLReplay, RLRollout, RLBias, RLSchedule, RLCollapse, RLCadence)
RLConfig = flat("RLConfig", RL_SECTIONS, "The RL settings: flat keys, each declared in one section of "
                "moe_lab/config/rl.py (``section(name)``).", __name__)


def bounds_under(algo: str, name: str) -> dict[str, float | None]:
    """The bounds (ge, gt, le, lt) of rl.<name> under objective ``algo``: the field's own, replaced where the
    objective declares its own (ObjectiveSpec.field_bounds). Validation, docs/config.md and the loss's own
    argument check read them here."""
    meta = RLConfig.__dataclass_fields__[name].metadata
    return {**{k: meta[k] for k in ("ge", "gt", "le", "lt")}, **OBJECTIVE_SPECS[algo].field_bounds().get(name, {})}
