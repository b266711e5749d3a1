"""Every enumeration of the project, once, torch-free: config's ``choices=`` and the registries read these.

A registry (``objectives.OBJECTIVES``, ``families.FAMILIES``, ``tasks.TASKS``, ...) keeps its own entries;
``tests/test_constants.py`` checks that its keys equal the names here, so adding an entry means adding
its name here too (and the config then accepts it).
"""

from __future__ import annotations

# Policy objectives (moe_lab/algos/objectives.py). PPO_CLIP_ALGOS: a clipped surrogate on a token or sequence
# ratio, dual clip allowed; the algorithms the clipped-surrogate properties and the golden file hold for.
PPO_CLIP_ALGOS = ("grpo", "gspo", "gspo_token", "gspo_unnormalized")
ALGOS = (*PPO_CLIP_ALGOS, "sapo", "cispo", "gmpo", "rspo", "dppo_tv", "dppo_kl", "luspo", "vespo")
# clip_low may reach 1 and beyond: CISPO's IS weight has no lower bound, GMPO/RSPO clip the log ratio,
# DPPO's bounds are divergence thresholds (a TV threshold >= 1 or any KL one is simply never reached).
CLIP_LOW_UNBOUNDED = ("cispo", "gmpo", "rspo", "dppo_tv", "dppo_kl")

# The default clip range (clip_low, clip_high) of each objective. CISPO: no lower bound on its IS weight
# (clip_low 1.0: ratio >= 0) and DAPO's 0.28 above, the paper publishing none; GMPO/RSPO: +-0.4 on the LOG
# ratio; SAPO and VESPO have no clip (GRPO's range for clip_frac/*). DPPO (arXiv:2602.04879): thresholds on
# the divergence estimate, not the ratio: TV 0.15 / 0.15 and binary KL 0.05 / 0.05, the values of the authors'
# run script (verl examples/dppo_trainer/run_qwen30b_dppo.sh, Stable-RL). LUSPO (arXiv:2602.05261) is GSPO
# with a length factor: GSPO's range.
PAPER_CLIP = {"grpo": (0.2, 0.27), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "gspo_unnormalized": (3e-4, 4e-4),
              "sapo": (0.2, 0.27), "cispo": (1.0, 0.28), "gmpo": (0.4, 0.4), "rspo": (0.4, 0.4),
              "dppo_tv": (0.15, 0.15), "dppo_kl": (0.05, 0.05), "luspo": (3e-4, 4e-4), "vespo": (0.2, 0.27)}
# Objectives whose clip acts on the token ratio w_t: ratio/route_clip_exit_frac uses the run's clip range for
# these and GRPO's paper range for the others (sequence-level ratios, log-space clips, DPPO's divergence
# thresholds, VESPO's kernel).
TOKEN_CLIP_ALGOS = ("grpo", "sapo", "cispo")

LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
KL_MODES = ("loss", "reward")
WHITEN_MODES = ("group", "batch")
REPLAY_MODES = ("none", "old", "rollout", "predictive")
OLD_LOGP_SOURCES = ("old_forward", "rollout")
ROLLOUT_SEEDINGS = ("per_group", "sequential")

# Rollout correction (moe_lab/algos/rollout_correction.py): (lower, upper) when the config leaves them None.
# TIS/MIS: verl's rollout_is_threshold 2.0; IcePop: the Ring-1T report's alpha = 0.5, beta = 5.
ROLLOUT_CORRECTION_BOUNDS = {"none": (None, None), "tis_token": (None, 2.0), "tis_seq": (None, 2.0),
                             "mis_token": (None, 2.0), "mis_seq": (None, 2.0), "icepop": (0.5, 5.0)}
ROLLOUT_CORRECTION_MODES = tuple(ROLLOUT_CORRECTION_BOUNDS)

FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss",
            # added since (moe_lab/models/families_2026.py)
            "glm4_moe", "qwen3_5_moe", "qwen3_next", "minimax_m2", "dots1", "deepseek_v32", "ernie4_5_moe")
# families whose HF config has norm_topk_prob (model.norm_topk_prob may override it); the others always renormalise
NORM_TOPK_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "glm4_moe", "qwen3_next", "dots1",
                      "deepseek_v32")
# The single tasks; "mixture" composes several of them (task.mixture), each prompt tagged with its task.
SINGLE_TASKS = ("sort", "addition", "reverse", "long_addition", "long_copy")
TASKS = (*SINGLE_TASKS, "mixture")
EXPERTS_KERNELS = ("grouped_mm", "eager")
DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "bfloat16")
# the rollout copy may also run e4m3-fake-quantised GEMMs in fp32 (moe_lab/models/numerics.py); training may not
ROLLOUT_DTYPES = (*DTYPES, "float8")
# batch_invariant: the platform's own kernels (the default, unchanged); batch_variant: reductions that follow the batch
ROLLOUT_KERNELS = ("batch_invariant", "batch_variant")

# environment variables that pin the CPU kernels' ISA (ATen, MKL, oneDNN): recorded in manifests as machine.env,
# hashed into the cold-start cache key when set, set by moe-lab run --cpu-isa (moe_lab/launch/isa.py)
MACHINE_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
