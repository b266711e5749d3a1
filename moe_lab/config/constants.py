"""Every enumeration of the project, once, torch-free: config's ``choices=`` and the registries read these.

A registry (``families.FAMILIES``, ``tasks.TASKS``, ...) keeps its own entries; ``tests/test_constants.py``
checks that its keys equal the names here, so adding an entry means adding its name here too (and the config
then accepts it). The objectives' names and traits are derived from their rows in moe_lab/config/objective_specs.py
(``objectives.OBJECTIVES`` registers one function per row); the replay and rollout-correction modes from theirs
in moe_lab/config/mode_specs.py.
"""

from __future__ import annotations

from moe_lab.config.mode_specs import REPLAY_SPECS, ROLLOUT_CORRECTION_SPECS, TOKEN, TRUNCATE
from moe_lab.config.objective_specs import OBJECTIVE_SPECS

# Policy objectives: derived from their one declaration, the rows of moe_lab/config/objective_specs.py (traits
# explained there). PPO_CLIP_ALGOS: a clipped surrogate, dual clip allowed; CLIP_LOW_UNBOUNDED: clip_low may
# reach 1 and beyond; TOKEN_CLIP_ALGOS: the clip acts on the token ratio (ratio/route_clip_exit_frac uses the
# run's range for these, GRPO's paper range for the others); PAPER_CLIP: (clip_low, clip_high) by default.
ALGOS = tuple(OBJECTIVE_SPECS)
PPO_CLIP_ALGOS = tuple(name for name, spec in OBJECTIVE_SPECS.items() if spec.ppo_clip)
CLIP_LOW_UNBOUNDED = tuple(name for name, spec in OBJECTIVE_SPECS.items() if spec.clip_low_unbounded)
TOKEN_CLIP_ALGOS = tuple(name for name, spec in OBJECTIVE_SPECS.items() if spec.token_clip)
PAPER_CLIP = {name: spec.paper_clip for name, spec in OBJECTIVE_SPECS.items()}
# The table's first row (GRPO): the baseline the papers measure the modes and the other objectives against (arm
# preset colours, the analysis's reference arms) and whose paper range the clip metrics of objectives without
# a token-ratio clip use.
BASELINE_ALGO = ALGOS[0]

LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
KL_MODES = ("loss", "reward")
WHITEN_MODES = ("group", "batch")
REPLAY_MODES = tuple(REPLAY_SPECS)  # rows and traits: moe_lab/config/mode_specs.py
NO_REPLAY = next(name for name, spec in REPLAY_SPECS.items() if not spec.replays)  # free routing
OLD_LOGP_SOURCES = ("old_forward", "rollout")
ROLLOUT_SEEDINGS = ("per_group", "sequential")

# Rollout correction (moe_lab/algos/rollout_correction.py): the modes, and (lower, upper) when the config leaves them
# None; rows, traits and the bounds' sources: moe_lab/config/mode_specs.py.
ROLLOUT_CORRECTION_MODES = tuple(ROLLOUT_CORRECTION_SPECS)
NO_CORRECTION = next(name for name, spec in ROLLOUT_CORRECTION_SPECS.items() if not spec.active)  # weights 1
ROLLOUT_CORRECTION_BOUNDS = {name: spec.bounds for name, spec in ROLLOUT_CORRECTION_SPECS.items()}
# check-trace's TIS threshold: the upper bound of the token-level truncation row (TIS; verl's rollout_is_threshold 2.0)
TIS_THRESHOLD = next(spec.upper for spec in ROLLOUT_CORRECTION_SPECS.values()
                     if (spec.level, spec.action) == (TOKEN, TRUNCATE))
# check-trace's outlier threshold of NeMo-RL's seq_mult_prob_error: NeMo-RL's grpo.seq_logprob_error_threshold has no
# default (None: metrics only); 1.5 is the example its config's comment gives
SEQ_ERROR_THRESHOLD = 1.5

# the model.family choices, in the order moe_lab.models.families.FAMILIES lists them (each needs a FamilySpec there)
FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss",
            "glm4_moe", "qwen3_5_moe", "qwen3_next", "minimax_m2", "dots1", "deepseek_v32", "ernie4_5_moe")
# families whose HF config has norm_topk_prob (model.norm_topk_prob may override it); the others always renormalise
NORM_TOPK_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe", "qwen3_next", "dots1",
                      "deepseek_v32")
# families whose router chooses with a per-expert correction bias (DeepSeek-V3's aux-loss-free balancing), the
# ones coldstart/rl.bias_update_rate may update (FamilySpec.bias says where each keeps it)
BIAS_FAMILIES = ("deepseek_v3", "glm4_moe", "minimax_m2", "dots1", "deepseek_v32", "ernie4_5_moe")
# rl.bias_counts: which experts a replayed update forward counts: the router's own choice, or the ids that ran
BIAS_COUNTS = ("free", "replayed")
BIAS_COUNT_DTYPES = ("float32", "bfloat16")  # dtype the expert-bias token counts accumulate in (Megatron #7081)
# The single tasks; "mixture" composes several of them (task.mixture), each prompt tagged with its task.
SINGLE_TASKS = ("sort", "addition", "reverse", "long_addition", "long_copy")
TASKS = (*SINGLE_TASKS, "mixture")
# fused: moe_lab/models/experts.py (no tokens x top-k x hidden temporaries); batched_mm is ~50x slower on CPU: refused
FUSED_EXPERTS = "fused"
EXPERTS_KERNELS = ("grouped_mm", "eager", FUSED_EXPERTS)
DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "bfloat16")
# the rollout copy may also run e4m3-fake-quantised GEMMs in fp32 (moe_lab/models/numerics.py); training may not
ROLLOUT_DTYPES = (*DTYPES, "float8")
# batch_invariant: the platform's own kernels (the default, unchanged); batch_variant: reductions that follow the batch;
# batch_variant_fast: the same on the platform's GEMMs, with its own bits (moe_lab/models/numerics_fast.py)
ROLLOUT_KERNELS = ("batch_invariant", "batch_variant", "batch_variant_fast")

# environment variables that pin the CPU kernels' ISA (ATen, MKL, oneDNN): recorded in manifests as machine.env,
# hashed into the cold-start cache key when set, set by moe-lab run --cpu-isa (moe_lab/launch/isa.py)
MACHINE_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
