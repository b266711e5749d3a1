"""Typed configuration: one dataclass per concern, one documented and validated field each.

Every field is declared with :func:`param`, which carries its help text and its allowed values, so that
validation, the field table in docs/config.md and the command-line overrides all read the same declaration.
Nothing here imports torch or the runner: a config can be checked before any work starts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import yaml

from moe_lab.config import constants as C
from moe_lab.config import checks as config_checks
from moe_lab.config.fields import allowed, check_field, hints, walk
from moe_lab.config.sections import RL_SECTIONS, sectioned, view
from moe_lab.config.errors import ConfigError
from moe_lab.config.objective_specs import OBJECTIVE_SPECS, knob_fields
from moe_lab.config.legacy import LEGACY_VALUES, upgrade_run_config  # noqa: F401  (run folders' configs)
from moe_lab.config.yaml_io import apply_overrides, load_yaml, set_dotted  # noqa: F401 - re-exported: callers read YAML through config


_HASHED = object()  # param(unhashed=...) unset: the field is always part of the cold-start cache key


def param(default: Any, help: str, *, choices: tuple | None = None, ge: float | None = None,
          gt: float | None = None, le: float | None = None, lt: float | None = None, unhashed: Any = _HASHED) -> Any:
    """A dataclass field with its help text and allowed values (read by validate() and the docs). ``unhashed``: the
    value at which the cold-start cache key leaves the field out, the one that cold starts committed before the field
    existed ran with (their keys stay valid): the field's history, not its default."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if unhashed is not _HASHED:
        meta["unhashed"] = unhashed
    if isinstance(default, list):
        meta["is_list"] = True  # choices then constrain every element
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    family: str = param("qwen3_moe", "transformers MoE family of the policy (built with random init)",
                        choices=C.FAMILIES)
    checkpoint: str | None = param(None, "local checkpoint directory to load instead of building from this config "
                                         "(offline: nothing is downloaded)")
    num_layers: int = param(4, "decoder layers (all MoE)", ge=1, le=128)
    hidden_size: int = param(128, "model width", ge=8)
    num_heads: int = param(4, "attention heads; hidden_size must be divisible by it", ge=1)
    num_kv_heads: int = param(2, "key/value heads (GQA); num_heads must be divisible by it", ge=1)
    num_experts: int = param(8, "routed experts per MoE layer", ge=2, le=1024)
    top_k: int = param(2, "experts activated per token. top_k=1: families that renormalise the chosen weights "
                          "(qwen3_moe, mixtral, deepseek_v3, gpt_oss) give each token gate weight 1, so their router "
                          "gets no gradient from the policy loss (only from aux_loss_coef); qwen2_moe and olmoe keep "
                          "the softmax probability (Switch-style) and do", ge=1)
    norm_topk_prob: bool | None = param(None, "renormalise the chosen experts' gate weights to sum to 1: None keeps "
                                              "the family's own choice (qwen3_moe, deepseek_v3: True; qwen2_moe, olmoe: "
                                              "False); False at top_k=1 makes the gate weight the router's probability "
                                              "(Switch-style: the router learns from the policy loss). mixtral and "
                                              "gpt_oss always renormalise: only None there", unhashed=None)
    moe_intermediate_size: int = param(128, "hidden width of one routed expert", ge=1)
    intermediate_size: int = param(256, "hidden width of dense/shared-expert MLPs where the family has them", ge=1)
    shared_expert: bool = param(True, "keep the always-on shared expert of the families that have one (qwen2_moe, "
                                      "deepseek_v3); False removes it (width 0: output exactly 0), so every token's MLP "
                                      "output depends on its routing alone. The other families have none: there it "
                                      "changes nothing", unhashed=True)
    max_positions: int = param(256, "maximum sequence length (prompt + response)", ge=8)
    experts_impl: str = param("grouped_mm", "routed experts' forward: grouped_mm, eager or fused (models/experts.py: "
                                            "within 1e-6 of grouped_mm, not its bits; docs/guide.md says when)",
                              choices=C.EXPERTS_KERNELS)
    device: str = param("cpu", "where the policy runs: cpu, cuda, or auto (cuda when visible). Training is fp32 "
                               "on either; the CUDA path passed scripts/gpu_check.sh's tests on one H200 (results/reference/gpu)",
                        choices=C.DEVICES)
    seed: int = param(0, "seed of the random initialisation", ge=0)


@dataclass
class TaskConfig:
    name: str = param("sort", "task with a verifiable reward",
                      choices=C.TASKS)
    length: int = param(16, "problem size: digits to sort, string length to reverse, digits per addend, or "
                            "letters of long_copy's block (its response writes the block 8 times)", ge=1, le=64)
    partial_credit: bool = param(False, "reward = share of correct answer characters instead of exact match (0/1)")
    eval_size: int = param(128, "held-out evaluation prompts (disjoint from training prompts)", ge=1)
    mixture: list[str] = param([], "sub-tasks of task.name=mixture (>= 2, distinct, single tasks only): each prompt "
                                   "starts with one tag token naming its task (moe_lab/tasks/mixture.py), the reward "
                                   "is the sub-task's, task.length applies to each; empty for a single task",
                               choices=C.SINGLE_TASKS, unhashed=[])


@dataclass
class ColdStartConfig:
    target_accuracy: float = param(0.3, "stop supervised warm-up once sampled accuracy (T=1) reaches this, "
                                        "so RL still has room to improve", ge=0.0, le=1.0)
    max_steps: int = param(3000, "upper bound on supervised steps", ge=0)
    batch_size: int = param(64, "demonstrations per supervised step", ge=1)
    lr: float = param(3e-3, "AdamW learning rate of the warm-up", gt=0.0)
    eval_every: int = param(5, "supervised steps between accuracy checks (sampled accuracy jumps fast: a coarse "
                                "check overshoots the target)", ge=1)
    eval_samples: int = param(128, "prompts sampled for each accuracy check", ge=1)
    aux_loss_coef: float = param(0.0, "router load-balancing loss coefficient of the warm-up (the model's own "
                                      "aux loss), so the router starts balanced like a pretrained MoE's", ge=0.0,
                                  unhashed=0.0)
    bias_update_rate: float = param(0.0, "expert-bias step of the warm-up (DeepSeek-V3's aux-loss-free balancing): "
                                         "after every optimizer step each MoE layer's correction bias moves by "
                                         "rate * sign(mean load - load) (moe_lab/rl/expert_bias.py); 0 = never "
                                         "updated. Families with a bias only (deepseek_v3, glm4_moe, minimax_m2, "
                                         "dots1, deepseek_v32, ernie4_5_moe)", ge=0.0, unhashed=0.0)
    cache_dir: str = param("~/.cache/moe_lab/coldstart", "where warmed-up models are cached, keyed by config hash")


def _with_objective_knobs(after: str):
    """Class decorator (under @dataclass): a float field per objective knob, rl.<prefix>_<name>, with the default,
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


@sectioned(RL_SECTIONS, extra={"objective": tuple(knob_fields(OBJECTIVE_SPECS))})
@dataclass
@_with_objective_knobs(after="dual_clip_c")
class RLConfig:
    """The RL settings: flat keys, each in one section of moe_lab/config/sections.py (``section(name)``)."""
    algo: str = param("grpo", "policy objective (formulas: moe_lab/algos/objectives.py)",
                      choices=C.ALGOS)
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
    freeze_router: bool = param(False, "router weights get no gradient, no optimizer update and no AdamW state "
                                       "(prime-rl freeze_moe_router); optim/grad_norm then excludes them")
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
    rollout_correction: str = param("none", "importance weights pi_train/pi_rollout against the rollout mismatch: "
                                            "truncate (tis), mask (mis) or IcePop's two-sided mask",
                                    choices=C.ROLLOUT_CORRECTION_MODES)
    rollout_correction_upper: float | None = param(None, "upper bound of the rollout-correction ratio; None = the mode's "
                                                         "(tis/mis 2.0 as verl, icepop 5.0)", gt=0.0)
    rollout_correction_lower: float | None = param(None, "lower bound (mis, icepop only); None = the mode's (mis none, "
                                                         "icepop 0.5)", gt=0.0)
    old_logp: str = param("old_forward", "source of logp_old: a forward pass of the old policy, or the rollout's own "
                                          "log-probs (the paper's section 5.4 option)", choices=C.OLD_LOGP_SOURCES)
    steps: int = param(40, "RL steps (one rollout batch each)", ge=1)
    prompts_per_step: int = param(16, "prompts per rollout batch (B)", ge=1)
    group_size: int = param(8, "responses per prompt (G)", ge=2)
    minibatches: int = param(4, "optimizer steps per rollout batch and epoch (the paper uses 4)", ge=1)
    epochs: int = param(1, "passes over each rollout batch (PPO epochs), each in its own seeded order; "
                           "epochs * minibatches - 1 updates per batch are off-policy (staleness)", ge=1)
    rollout_lag: int = param(0, "rollouts sampled by the policy of this many steps earlier (asynchronous RL); "
                                "logp_old and R2's trace still come from the current policy", ge=0)
    rollout_seeding: str = param("per_group", "how rollouts draw their random numbers: per_group samples each "
                                              "prompt group under its own seed (seed, step, prompt index), so a "
                                              "plain run and any torchrun world size sample the same responses; "
                                              "sequential (plain runs only) samples the whole batch from one "
                                              "run-long generator: the committed references' sampling, kept so that they re-run bit for bit",
                                 choices=C.ROLLOUT_SEEDINGS)
    temperature: float = param(1.0, "sampling temperature of the rollout", gt=0.0)
    lr: float = param(1e-4, "AdamW learning rate (1e-3 collapses the sort task within 5 steps at this scale)", gt=0.0)
    router_lr_mult: float = param(1.0, "learning-rate multiplier of the router weights (volatility knob)", gt=0.0)
    warmup_steps: int = param(2, "linear learning-rate warmup in optimizer steps", ge=0)
    weight_decay: float = param(0.0, "AdamW weight decay", ge=0.0)
    grad_clip: float = param(1.0, "max global gradient norm; 0 = off", ge=0.0)
    std_normalize: bool = param(True, "divide group-centred rewards by their std (False = Dr.GRPO mean-only)")
    whiten: str = param("group", "normalisation scope of advantages", choices=C.WHITEN_MODES)
    reward_clip: float | None = param(None, "clamp rewards to [-c, c]; None = off", gt=0.0)
    adv_clip: float | None = param(None, "clamp advantages to [-c, c]; None = off", gt=0.0)
    kl_coef: float = param(0.0, "KL-to-reference coefficient (the GSPO authors use 0)", ge=0.0)
    kl_kind: str = param("k3", "KL estimator", choices=C.KL_KINDS)
    kl_mode: str = param("loss", "KL as a loss term or as a per-token reward penalty", choices=C.KL_MODES)
    aux_loss_coef: float = param(0.0, "router load-balancing loss coefficient during RL (default off)", ge=0.0)
    rollout_router_noise: float = param(0.0, "std of Gaussian noise added to router logits in the sampler's "
                                             "generation forwards only (an inference engine that routes "
                                             "differently from the trainer, R3's setting), not in evaluation; "
                                             "its own generator seeded from (seed, step, prompts), never the "
                                             "sampling RNG", ge=0.0)
    router_noise: float = param(0.0, "std of Gaussian noise added to router logits in the old-policy and update "
                                     "forwards: emulates non-deterministic forwards, where repeated passes of one "
                                     "model choose different experts (R3 paper, arXiv:2510.11370)", ge=0.0)
    rollout_dtype: str = param("float32", "dtype of the rollout copy of the policy; bfloat16 creates a real "
                                          "rollout-vs-train mismatch; float8: fp32 copy whose non-router linears "
                                          "and experts run e4m3 fake-quantised weights and activations with "
                                          "blockwise scales, GEMM outputs in bf16 (moe_lab/models/numerics.py)", choices=C.ROLLOUT_DTYPES)
    rollout_kernels: str = param("batch_invariant", "reductions of the rollout copy: batch_invariant = the "
                                                    "platform's kernels; batch_variant = split-K GEMMs and an MoE "
                                                    "combine order that follow the batch, so a sequence gets other "
                                                    "bits in another batch (a non-batch-invariant inference engine)",
                                 choices=C.ROLLOUT_KERNELS)
    train_dtype: str = param("float32", "autocast dtype of the old-policy and update forwards; master weights, "
                                        "optimizer and log-probs stay fp32 (with rollout_dtype: every pairing)",
                             choices=C.DTYPES)
    decomp_every: int = param(2, "ratio decomposition (ratio/d_route_* etc.: one extra no-grad forward of the "
                                 "minibatch, ~ one old-policy pass) on every N-th update (global update index u with "
                                 "(u + 1) % N == 0; NaN columns on the others); 1 = every update, 0 = off. Default 2: "
                                 "at 1 it measured +15-20% of a step on CPU", ge=0)
    eval_every: int = param(10, "RL steps between evaluations (greedy and sampled accuracy)", ge=1)
    checkpoint_every: int = param(5, "RL steps between resumable checkpoints", ge=1)
    collapse_window: int = param(10, "span of the moving averages (alpha = 2/(span+1)) of reward and entropy that "
                                     "the soft collapse rules watch (moe_lab/rl/health.py)", ge=1)
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

    def section(self, name: str):
        """Section ``name`` of these settings as a frozen dataclass: what the trainer hands the part reading it."""
        return view(self, name)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    coldstart: ColdStartConfig = field(default_factory=ColdStartConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    seed: int = param(0, "seed of the RL run (sampling, minibatch order); the cold start has its own in model.seed",
                      ge=0)
    threads: int = param(1, "torch intra-op threads of one run (parallel runs share the cores)", ge=1)


# The defaults a config's None clip and correction bounds resolve to (resolved_clip below), importable beside it.
PAPER_CLIP = C.PAPER_CLIP
ROLLOUT_CORRECTION_BOUNDS = C.ROLLOUT_CORRECTION_BOUNDS


def resolved_clip(rl: RLConfig) -> tuple[float, float]:
    """The clip range in force: the config's, or the paper's default for the algorithm."""
    low, high = PAPER_CLIP[rl.algo]
    return (low if rl.clip_low is None else rl.clip_low, high if rl.clip_high is None else rl.clip_high)


# --------------------------------------------------------------------------- validation


def validate(cfg: RunConfig) -> RunConfig:
    """Check every field, then the cross-field checks; raise ConfigError naming the first bad field."""
    for name, value, tp, meta in walk(cfg):
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
    low, high = resolved_clip(rl)
    if not (0.0 <= low < (1.0 if rl.algo not in C.CLIP_LOW_UNBOUNDED else math.inf) and high >= 0.0):
        raise ConfigError(f"rl.clip_low/clip_high=({low}, {high}) out of range: allowed 0 <= clip_low < 1, clip_high >= 0")
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
        rows.append((f"{prefix}{f.name}", repr(default), allowed(dict(f.metadata)), f.metadata.get("help", "")))
    return rows
