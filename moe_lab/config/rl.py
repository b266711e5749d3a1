"""The RL settings (``rl.*``), declared section by section: each section a frozen dataclass that declares its
own fields, its docstring the heading of its table in docs/config.md; ``RLConfig`` is their flat union (the keys
stay flat: ``rl.lr``, ``rl.collapse_window``), and ``cfg.rl.section(name)`` hands a part of the trainer its own
section. A new field goes into the section it belongs to; a new section is one class here and one entry of
``RL_SECTIONS``. No torch.
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
    """The policy objective, its clip range and knobs, advantages, KL and the balancing loss."""

    algo: str = param("grpo", "policy objective (formulas: moe_lab/algos/objectives.py)",
                      choices=C.ALGOS)
    clip_low: float | None = param(None, "eps_low; None = the paper's (GRPO 0.2, GSPO/LUSPO 3e-4, CISPO 1.0 = no lower "
                                         "bound, GMPO/RSPO 0.4 in log space, DPPO thresholds TV 0.15 / KL 0.05; "
                                         "SAPO/VESPO: metrics only, GRPO's)", ge=0.0, lt=1.0)
    clip_high: float | None = param(None, "eps_high; None = the paper's (GRPO 0.27, GSPO/LUSPO 4e-4, CISPO 0.28, "
                                          "GMPO/RSPO 0.4 in log space, DPPO TV 0.15 / KL 0.05)", ge=0.0)
    loss_agg: str = param("seq-mean-token-mean", "loss aggregation over tokens and sequences; -norm divides each "
                                                 "sequence's token sum by the task's fixed response budget",
                          choices=C.LOSS_AGGS)
    dual_clip_c: float | None = param(None, "dual-clip bound c (> 1) for negative advantages (grpo and gspo variants); "
                                            "None = off", gt=1.0)
    # here: rl.<prefix>_<name>, every objective's own knobs, declared in moe_lab/config/objective_specs.py
    std_normalize: bool = param(True, "divide group-centred rewards by their std (False = Dr.GRPO mean-only)")
    whiten: str = param("group", "normalisation scope of advantages", choices=C.WHITEN_MODES)
    reward_clip: float | None = param(None, "clamp rewards to [-c, c]; None = off", gt=0.0)
    adv_clip: float | None = param(None, "clamp advantages to [-c, c]; None = off", gt=0.0)
    kl_coef: float = param(0.0, "KL-to-reference coefficient (the GSPO authors use 0)", ge=0.0)
    kl_kind: str = param("k3", "KL estimator", choices=C.KL_KINDS)
    kl_mode: str = param("loss", "KL as a loss term or as a per-token reward penalty", choices=C.KL_MODES)
    aux_loss_coef: float = param(0.0, "router load-balancing loss coefficient during RL (default off)", ge=0.0)


@section("replay")
class RLReplay:
    """Routing Replay and the router controls of the update forwards."""

    replay: str = param("none", "Routing Replay: none, old (R2: old-policy routing, the paper's), "
                                "rollout (R3: routing recorded during generation), predictive (R3 of a rollout routed "
                                "by a learned prediction of the next step's router, a simplified PR2: "
                                "moe_lab/routing/predictor.py)", choices=C.REPLAY_MODES)
    replay_gate: float = param(0.0, "gated replay (prime-rl PR #2703): a replayed expert whose current router score "
                                    "(softmax prob; DeepSeek: sigmoid score) is below gate x the router's own weakest "
                                    "top-k score is replaced by the router's best expert not kept; 0 = plain replay, "
                                    "1 = keep only experts the router would pick itself", ge=0.0, le=1.0)
    replay_gate_weights: bool = param(False, "replay the recorded combine (gate) weights too, not only the expert ids "
                                             "(prime-rl PR #3523): the router then gets no gradient from the combine")
    router_noise: float = param(0.0, "std of Gaussian noise added to router logits in the old-policy and update "
                                     "forwards: emulates non-deterministic forwards, where repeated passes of one "
                                     "model choose different experts (R3 paper, arXiv:2510.11370)", ge=0.0)


@section("rollout")
class RLRollout:
    """Rollout numerics and the corrections of the rollout/trainer mismatch."""

    rollout_correction: str = param("none", "importance weights pi_train/pi_rollout against the rollout mismatch: "
                                            "truncate (tis), mask (mis) or IcePop's two-sided mask",
                                    choices=C.ROLLOUT_CORRECTION_MODES)
    rollout_correction_upper: float | None = param(None, "upper bound of the rollout-correction ratio; None = the mode's "
                                                         "(tis/mis 2.0 as verl, icepop 5.0)", gt=0.0)
    rollout_correction_lower: float | None = param(None, "lower bound (mis, icepop only); None = the mode's (mis none, "
                                                         "icepop 0.5)", gt=0.0)
    old_logp: str = param("old_forward", "source of logp_old: a forward pass of the old policy, or the rollout's own "
                                          "log-probs (the paper's section 5.4 option)", choices=C.OLD_LOGP_SOURCES)
    rollout_lag: int = param(0, "rollouts sampled by the policy of this many steps earlier (asynchronous RL); "
                                "logp_old and R2's trace still come from the current policy", ge=0)
    rollout_seeding: str = param("per_group", "how rollouts draw their random numbers: per_group samples each "
                                              "prompt group under its own seed (seed, step, prompt index), so a "
                                              "plain run and any torchrun world size sample the same responses; "
                                              "sequential (plain runs only) samples the whole batch from one "
                                              "run-long generator: the committed references' sampling, kept so that they re-run bit for bit",
                                 choices=C.ROLLOUT_SEEDINGS)
    temperature: float = param(1.0, "sampling temperature of the rollout", gt=0.0)
    rollout_router_noise: float = param(0.0, "std of Gaussian noise added to router logits in the sampler's "
                                             "generation forwards only (an inference engine that routes "
                                             "differently from the trainer, R3's setting), not in evaluation; "
                                             "its own generator seeded from (seed, step, prompts), never the "
                                             "sampling RNG", ge=0.0)
    rollout_dtype: str = param("float32", "dtype of the rollout copy of the policy; bfloat16 creates a real "
                                          "rollout-vs-train mismatch; float8: fp32 copy whose non-router linears "
                                          "and experts run e4m3 fake-quantised weights and activations with "
                                          "blockwise scales, GEMM outputs in bf16 (moe_lab/models/numerics.py)", choices=C.ROLLOUT_DTYPES)
    rollout_kernels: str = param("batch_invariant", "reductions of the rollout copy: batch_invariant = the "
                                                    "platform's kernels; batch_variant = split-K GEMMs and an MoE "
                                                    "combine order that follow the batch, so a sequence gets other "
                                                    "bits in another batch (a non-batch-invariant inference engine); "
                                                    "batch_variant_fast = the same on the platform's GEMMs, with its "
                                                    "own bits (models/numerics_fast.py)",
                                 choices=C.ROLLOUT_KERNELS)
    train_dtype: str = param("float32", "autocast dtype of the old-policy and update forwards; master weights, "
                                        "optimizer and log-probs stay fp32 (with rollout_dtype: every pairing)",
                             choices=C.DTYPES)


@section("bias")
class RLBias:
    """Expert-bias updates during RL (DeepSeek-V3)."""

    bias_update_rate: float = param(0.0, "expert-bias step during RL: after every optimizer step each MoE layer's "
                                         "correction bias moves by rate * sign(mean load - load), the loads counted "
                                         "over that step's update forwards (DeepSeek-V3; Megatron-LM "
                                         "moe_router_bias_update_rate); 0 = frozen (NeMo-RL, slime). Families with a "
                                         "bias only, as coldstart.bias_update_rate", ge=0.0)
    bias_counts: str = param("free", "the expert loads of rl.bias_update_rate under replay: free counts the experts "
                                     "the router itself would choose (its own top-k on the same scores), replayed "
                                     "the ids that ran (the forced ones; verl). Equal without replay",
                             choices=C.BIAS_COUNTS)
    bias_count_dtype: str = param("float32", "dtype the expert loads of rl.bias_update_rate accumulate and are "
                                             "compared in; bfloat16 loses integers above 256 (Megatron-LM #7081's "
                                             "sign flip)", choices=C.BIAS_COUNT_DTYPES)


@section("schedule")
class RLSchedule:
    """Steps, batch, updates per batch and the optimizer (which weights it moves, at what rate)."""

    steps: int = param(40, "RL steps (one rollout batch each)", ge=1)
    prompts_per_step: int = param(16, "prompts per rollout batch (B)", ge=1)
    group_size: int = param(8, "responses per prompt (G)", ge=2)
    minibatches: int = param(4, "optimizer steps per rollout batch and epoch (the paper uses 4)", ge=1)
    epochs: int = param(1, "passes over each rollout batch (PPO epochs), each in its own seeded order; "
                           "epochs * minibatches - 1 updates per batch are off-policy (staleness)", ge=1)
    lr: float = param(1e-4, "AdamW learning rate (1e-3 collapses the sort task within 5 steps at this scale)", gt=0.0)
    router_lr_mult: float = param(1.0, "learning-rate multiplier of the router weights (volatility knob)", gt=0.0)
    warmup_steps: int = param(2, "linear learning-rate warmup in optimizer steps", ge=0)
    weight_decay: float = param(0.0, "AdamW weight decay", ge=0.0)
    grad_clip: float = param(1.0, "max global gradient norm; 0 = off", ge=0.0)
    freeze_router: bool = param(False, "router weights get no gradient, no optimizer update and no AdamW state "
                                       "(prime-rl freeze_moe_router); optim/grad_norm then excludes them")


@section("collapse")
class RLCollapse:
    """The collapse rules (moe_lab/store/health.py)."""

    collapse_window: int = param(10, "span of the moving averages (alpha = 2/(span+1)) of reward and entropy that "
                                     "the soft collapse rules watch (moe_lab/store/health.py)", ge=1)
    collapse_drop: float = param(0.5, "soft reward collapse: the reward's moving average stays below this "
                                      "fraction of its running best for rl.collapse_patience steps", gt=0.0, lt=1.0)
    collapse_patience: int = param(5, "consecutive steps below rl.collapse_drop x best before a "
                                      "soft reward collapse is called", ge=1)
    collapse_min_best: float = param(0.1, "the soft reward rule arms once the running best of the moving "
                                          "average reaches this reward (a run that never learned cannot collapse)",
                                     ge=0.0)
    collapse_entropy_max: float | None = param(None, "soft entropy collapse: the policy entropy's moving average "
                                                     "above this many nats; None = off", gt=0.0)
    stop_on_collapse: bool = param(False, "stop a run at a soft collapse (False: record collapsed_at and continue, "
                                          "so curves stay comparable); non-finite values and 5 steps of reward "
                                          "exactly 0 always stop")


@section("cadence")
class RLCadence:
    """How often a run measures, evaluates and checkpoints."""

    decomp_every: int = param(2, "ratio decomposition (ratio/d_route_* etc.: one extra no-grad forward of the "
                                 "minibatch, ~ one old-policy pass) on every N-th update (global update index u with "
                                 "(u + 1) % N == 0; NaN columns on the others); 1 = every update, 0 = off. Default 2: "
                                 "at 1 it measured +15-20% of a step on CPU", ge=0)
    eval_every: int = param(10, "RL steps between evaluations (greedy and sampled accuracy)", ge=1)
    checkpoint_every: int = param(5, "RL steps between resumable checkpoints", ge=1)


RL_SECTIONS = (RLObjective, RLReplay, RLRollout, RLBias, RLSchedule, RLCollapse, RLCadence)
RLConfig = flat("RLConfig", RL_SECTIONS, "The RL settings: flat keys, each declared in one section of "
                "moe_lab/config/rl.py (``section(name)``).", __name__)
