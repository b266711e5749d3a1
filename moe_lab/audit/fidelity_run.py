"""The model side of `moe-lab fidelity`: the config and weights to measure, then the per-prompt and per-update samples.

Mismatch samples (rollouts and forwards only, no update): per rollout batch of ``rl.prompts_per_step`` prompts,
``collect`` (moe_lab.rl.collect) with free routing samples the rollouts with the config's rollout numerics
(rl.rollout_dtype, rl.rollout_kernels: moe_lab.models.numerics) and runs the trainer's old-policy pass, as every
RL step does; one more forward replays the rollout's routes (R3's old pass: ``routing_ctx`` forced to the
rollout trace). Both forwards score the same sampled tokens, so the k3 pair is measured on the same samples. Each
prompt's group is one unit: its rows carry the mismatch and routing metrics of moe_lab's own functions
(``rollout_mismatch``, ``router_mismatch``) restricted to that group's response tokens.

Update samples (a few RL steps on a copy, the config's cold start untouched): ``rl_step``'s own rows, free routing
(``routing/expert_change`` of update m is the change after m optimizer steps on the same batch) and
``clip_frac/active``, for one algorithm at a time at its paper clip range (GRPO also under R2, the baseline of the
GSPO paper's clip ratio).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_lab.algos.ratio_metrics import rollout_mismatch
from moe_lab.config import ConfigError, RunConfig, apply_overrides, from_dict, load_yaml, validate
from moe_lab.launch.experiment import expand
from moe_lab.config.mode_specs import REPLAY_SPECS
from moe_lab.models import load_model, resolve_device
from moe_lab.rl import checkpoint, seeds
from moe_lab.rl.coldstart import cold_start
from moe_lab.rl.collect import collect, routing_ctx, train_precision
from moe_lab.rl.components import Trainee, installed
from moe_lab.rl.loop import make_rollout_policy
from moe_lab.rl.optim import build_optimizer
from moe_lab.rl.rollout import forward_logits, token_logprobs
from moe_lab.store.run_folder import RunFolder
from moe_lab.store.checkpoint_state import read_state
from moe_lab.rl.step import rl_step
from moe_lab.routing import predictor, router_mismatch
from moe_lab.tasks import get_task, load_tokenizer


@dataclass(frozen=True)
class Source:
    """What `moe-lab fidelity` measures: a config, and the checkpoint of a run (None: the config's cold start)."""

    cfg: RunConfig
    checkpoint: Path | None
    label: str


def resolve(source: str, overrides: list[str]) -> Source:
    """RUN_OR_CONFIG with `moe-lab run`'s FIELD=VALUE overrides, checked before any model is built (ConfigError).

    A run folder (its config.yaml; its checkpoint when it has one); an experiment file (its first cell: first arm,
    first seed or block); a bare RunConfig YAML."""
    path = Path(source).expanduser()
    if path.is_dir():
        folder = RunFolder(path)
        if not folder.config_path.is_file():
            raise ConfigError(f"RUN_OR_CONFIG {source!r}: a folder without {folder.config_path.name}, not a run folder")
        cfg = validate(from_dict(apply_overrides(folder.config(), list(overrides))))
        ckpt = folder.checkpoint_dir
        found = read_state(ckpt) is not None
        label = f"run {path.name}" + (f" with {' '.join(overrides)}" if overrides else "")
        return Source(cfg, ckpt if found else None, label + ("" if found else " (no checkpoint: cold start)"))
    if not path.is_file():
        raise ConfigError(f"RUN_OR_CONFIG {source!r}: no such run folder or YAML file")
    data = load_yaml(str(path))
    exp = {"name": path.stem, "base": data} if data and set(data) <= set(RunConfig.__dataclass_fields__) else data
    cell = expand(exp, overrides=list(overrides))[0]
    with_overrides = f" with {' '.join(overrides)}" if overrides else ""  # the cell's name is the file's, before them
    return Source(cell.config, None, f"{path.name} cell {cell.run_id}{with_overrides} (cold start)")


def measured(cfg: RunConfig, **rl) -> RunConfig:
    """The config the measurements run: free routing, the trainer's own old pass, no correction or KL (the rows
    compare the routings themselves), plus ``rl`` fields."""
    fields = {**dict(replay="none", old_logp="old_forward", rollout_correction="none", kl_coef=0.0, rollout_lag=0),
              **rl}
    return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, **fields))


def load_policy(cfg: RunConfig, ckpt: Path | None):
    """(task, policy): the config's cold start (built and cached if missing), with a run's checkpoint loaded."""
    torch.set_num_threads(cfg.threads)
    model_dir = cold_start(cfg, progress=False)
    task = get_task(cfg.task, load_tokenizer(str(model_dir)))
    policy = load_model(model_dir, experts_impl=cfg.model.experts_impl).to(resolve_device(cfg.model.device))
    if REPLAY_SPECS[cfg.rl.replay].predictor:
        predictor.install(policy)  # a predictive run's checkpoint carries the PR2 heads
    if ckpt is not None:
        checkpoint.load(ckpt, policy, build_optimizer(policy, cfg.rl.section("schedule")))
    policy.train(False)
    return task, policy


def _batches(task, cfg: RunConfig, n_prompts: int):
    """(batch index, prompts) of n_prompts prompts in rollout batches of rl.prompts_per_step, each drawn as an
    RL step of that index draws its prompts."""
    per = cfg.rl.prompts_per_step
    for i, start in enumerate(range(0, n_prompts, per)):
        yield i, task.sample_prompts(min(per, n_prompts - start), seeds.prompt_rng(cfg.seed, i))


def _group_mask(mask_BT: torch.Tensor, g: int, group_size: int) -> torch.Tensor:
    out = torch.zeros_like(mask_BT)
    out[g * group_size:(g + 1) * group_size] = mask_BT[g * group_size:(g + 1) * group_size]
    return out


@torch.no_grad()
def replayed_logp(policy, batch, cfg: RunConfig, step: int) -> torch.Tensor:
    """The trainer's log-probs of the rollout's tokens with the rollout's routes replayed (R3's old pass)."""
    gen = seeds.old_pass_generator(cfg.seed, step)
    with routing_ctx(policy, batch.trace, cfg.rl.section("replay"), gen), \
            train_precision(policy, cfg.rl.section("rollout")):
        logits = forward_logits(policy, batch.input_ids_BS, batch.attention_mask_BS).logits
    return token_logprobs(logits, batch.input_ids_BS, cfg.rl.temperature)


def mismatch_samples(policy, task, cfg: RunConfig, n_prompts: int) -> list[dict]:
    """One row per prompt (its group of rl.group_size rollouts): k3 free and replayed, the |δ| tails, the
    rollout/trainer routing disagreement; moe_lab's own metric functions on the group's response tokens."""
    cfg = measured(cfg)
    rollout_policy = make_rollout_policy(policy, cfg.rl)
    G, rows = cfg.rl.group_size, []
    for step, prompts in _batches(task, cfg, n_prompts):
        data = collect(policy, rollout_policy, None, task, cfg, step, prompts)
        batch = data.batch
        logp_r3_BT = replayed_logp(policy, batch, cfg, step)
        for g in range(len(prompts)):
            mask = _group_mask(batch.response_mask_BT, g, G)
            free = rollout_mismatch(batch.logp_rollout_BT, data.logp_old_BT, mask, extended=True)
            replayed = rollout_mismatch(batch.logp_rollout_BT, logp_r3_BT, mask)
            routing = router_mismatch(batch.trace, data.ref_trace, mask)
            rows.append({"tokens": int(mask.sum()), "k3": free["mismatch/k3"], "k3_replayed": replayed["mismatch/k3"],
                         "extreme_ln2": free["mismatch/extreme_frac"],
                         "extreme_ln5": free["mismatch/extreme_frac_log5"], "abs_diff": free["mismatch/abs_diff"],
                         "router_change": routing["router_change"], "any_change": routing["any_change"],
                         "length": int(mask.sum()) / G,
                         "layers": batch.trace.num_layers})
    return rows


def dense_control(cfg: RunConfig) -> RunConfig:
    """The dense control of matched depth and active width: the same family, layers and attention, with
    num_experts = top_k = 2 and experts of half the active width (2 x width/2 = top_k x moe_intermediate_size):
    every expert runs on every token, so no discrete routing decision exists (the config allows no fewer than
    2 experts; the gate weights still vary continuously, as a gated dense MLP)."""
    active = cfg.model.top_k * cfg.model.moe_intermediate_size
    if active % 2:
        raise ConfigError(f"dense control: top_k x moe_intermediate_size = {active} must be even (2 experts of half)")
    model = dataclasses.replace(cfg.model, num_experts=2, top_k=2, moe_intermediate_size=active // 2)
    return validate(dataclasses.replace(cfg, model=model))


def bf16_numerics(cfg: RunConfig) -> RunConfig:
    """The config with bf16 on both sides: the rollout copy and the trainer's forwards (rollout kernels kept)."""
    return dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, rollout_dtype="bfloat16", train_dtype="bfloat16"))


def update_samples(policy, task, cfg: RunConfig, algo: str, steps: int, replay: str = "none") -> list[dict]:
    """rl_step's rows of ``steps`` RL steps of ``algo`` (its paper clip range; free routing, or ``replay``) on a
    copy of policy; each row's ``index``: the optimizer steps before it on its rollout batch."""
    cfg = measured(cfg, algo=algo, replay=replay, clip_low=None, clip_high=None, decomp_every=0,
                   bias_update_rate=0.0)
    validate(cfg)
    trained = copy.deepcopy(policy)
    optimizer, parts = build_optimizer(trained, cfg.rl.section("schedule")), installed(trained, cfg.rl)
    rows = []
    for step in range(steps):
        rollout_policy = make_rollout_policy(trained, cfg.rl)  # the sampler takes the updated weights each step
        prompts = task.sample_prompts(cfg.rl.prompts_per_step, seeds.prompt_rng(cfg.seed, step))
        done = rl_step(Trainee(trained, rollout_policy, None, optimizer, parts), task, cfg, step, prompts)
        rows += [{**r, "index": i} for i, r in enumerate(done)]
    return rows
