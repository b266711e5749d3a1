"""The first half of an RL step: rollout → rewards → old policy → rollout correction → advantages, into the
StepData the minibatch updates read (``moe_lab.rl.step``).

Routing Replay (``rl.replay``) is decided here, once: ``replay_traces`` maps the mode to the routing the
trainer's forwards follow and the reference they are measured against.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from moe_lab.algos import reductions as R
from moe_lab.algos.advantages import group_advantages
from moe_lab.algos.losses import kl_penalty
from moe_lab.algos.ratio_metrics import rollout_mismatch
from moe_lab.algos.rollout_correction import rollout_correction
from moe_lab.config import RunConfig
from moe_lab.config.rl import RLObjective, RLReplay, RLRollout
from moe_lab.config.mode_specs import OLD_FORWARD, REPLAY_SPECS, ROLLOUT, ROLLOUT_CORRECTION_SPECS
from moe_lab.rl import seeds
from moe_lab.rl.groups import group_generators, join_batches
from moe_lab.rl.rollout import GroupSampler, RolloutBatch, forward_logits, generate, token_logprobs
from moe_lab.routing import Trace, record, replay, router_mismatch, routing_confidence, specialization

# across ranks (moe_lab/algos/reductions.py), the metrics made here: rewards and lengths per sequence (a
# sub-task's mean reward too, weighted by the part's sequences: exact when the parts hold equal shares of it)
REDUCTIONS = {
    "reward/mean": R.SEQ_MEAN, "reward/std": R.std_of("reward/mean", R.SEQ_MEAN), "reward/zero_var_groups": R.SEQ_MEAN,
    "reward/mean_*": R.SEQ_MEAN, "response/length_mean": R.SEQ_MEAN, "response/length_max": R.MAX,
    "mismatch/k3": R.TOKEN_MEAN, "mismatch/extreme_frac": R.TOKEN_MEAN, "mismatch/expert_change": R.TOKEN_MEAN,
    "mismatch/router_change": R.TOKEN_MEAN, "mismatch/any_change": R.TOKEN_MEAN,
    "mismatch/routers_per_token": R.TOKEN_MEAN, "mismatch/layer_*/router_change": R.TOKEN_MEAN,
    "kl/ref_reward_penalty": R.SEQ_MEAN, "perf/rollout_s": R.SLOWEST, "perf/old_s": R.SLOWEST,
}


@dataclass
class StepData:
    """Everything the minibatch updates of one step read; fixed before the first update."""

    batch: RolloutBatch
    rewards_B: torch.Tensor
    adv_B: torch.Tensor
    logp_old_BT: torch.Tensor
    ref_trace: Trace | None  # routing that produced logp_old: the reference of routing/* (replay_traces)
    forced_trace: Trace | None  # what replay forces in the updates (None: free routing; replay_traces)
    batch_metrics: dict[str, float]
    norm_len: int  # fixed length for seq-mean-token-sum-norm: the task's response budget, not the batch's T
    is_weights_BT: torch.Tensor | None = None  # rollout-correction weights (rl.rollout_correction); None = off


def replay_traces(mode: str, rollout_trace: Trace | None, old_trace: Trace | None) -> tuple[Trace | None, Trace | None]:
    """Routing Replay, decided here only: ``(forced, reference)`` of rl.replay = ``mode``.

    forced: the routing the trainer's forwards follow, the mode's ``forces`` trait (moe_lab/config/mode_specs.py; none:
    free; old = R2: the old-policy forward's; rollout = R3 and predictive: the sampler's, predicted or not).
    reference: the routing that produced logp_old, which routing/* compare against. Before the old-policy
    forward (``old_trace=None``) it gives that forward's own forcing: R3 already follows the rollout there, R2's
    trace is what the forward records.
    """
    forced = {None: None, OLD_FORWARD: old_trace, ROLLOUT: rollout_trace}[REPLAY_SPECS[mode].forces]
    return forced, old_trace


def train_precision(policy, rollout: RLRollout):
    """Autocast of the trainer's forwards (old-policy pass and updates), as bf16 trainers run them
    (``rollout.train_dtype``).

    Master weights and optimizer stay fp32 and token_logprobs upcasts the logits, so only the forward's
    matmuls (router logits included) are bf16. float32: a no-op context, bit-identical to no context.
    """
    if rollout.train_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=policy.device.type, dtype=getattr(torch, rollout.train_dtype))


@torch.no_grad()
def _old_pass(policy, batch: RolloutBatch, replay: RLReplay, rollout: RLRollout, seed: int,
              step: int) -> tuple[torch.Tensor, Trace, Trace]:
    """logp_old from a forward of the policy before any update: (logp_old, routing used, router's own choice).

    Free routing is recorded (it is R2's trace). Under R3 this forward already follows the rollout's
    routing, as the updates will: otherwise the first update's ratios would compare two routings and
    be != 1 before the policy moved (we measured token-ratio variance spikes up to 86 from that alone).
    The routing used carries the old router's log-probs of its experts: the reference of routing/router_shift.
    """
    forced, _ = replay_traces(replay.replay, batch.trace, None)
    with routing_ctx(policy, forced, replay, seeds.old_pass_generator(seed, step), router_logp=True) as handle, \
            train_precision(policy, rollout):
        logits = forward_logits(policy, batch.input_ids_BS, batch.attention_mask_BS).logits
    used, free = (handle, handle) if forced is None else (handle.used.with_router_logp(handle.router_logp_LBTK),
                                                          handle.latent)
    return token_logprobs(logits, batch.input_ids_BS, rollout.temperature), used, free


def _mismatch_metrics(batch: RolloutBatch, logp_old_BT, free_trace) -> dict[str, float]:
    """Rollout-vs-train mismatch, the R3 paper's table: the sampler's log-probs and routing against the trainer's
    (k3, extreme tokens; activated experts, routers and tokens whose top-k differs, per layer too)."""
    mask = batch.response_mask_BT
    out = rollout_mismatch(batch.logp_rollout_BT, logp_old_BT, mask)
    if batch.trace is not None and free_trace is not None:
        out.update({f"mismatch/{key}": value for key, value in router_mismatch(batch.trace, free_trace, mask).items()})
    return out


def _reward_metrics(rewards_B: torch.Tensor, group_size: int, batch: RolloutBatch) -> dict[str, float]:
    groups = rewards_B.view(-1, group_size)
    return {"reward/mean": float(rewards_B.mean()), "reward/std": float(rewards_B.std(unbiased=False)),
            "reward/zero_var_groups": float((groups.max(-1).values == groups.min(-1).values).float().mean()),
            "response/length_mean": float(batch.response_len_B.float().mean()),
            "response/length_max": float(batch.response_len_B.max())}


def _rollout(rollout_policy, task, rollout: RLRollout, prompts: list[str], *, seed: int, group_size: int,
             predictive: bool, step: int = 0, first_group: int = 0) -> tuple[list[str], RolloutBatch]:
    """Stage 1: group_size samples of every prompt, routing recorded (R3's trace); rollout_router_noise
    perturbs the sampler's routing only (an inference engine that routes differently from the trainer).
    per_group seeding (moe_lab.rl.groups): group j samples from its own generator (first_group + j: its index in
    the step's batch); sequential: the whole batch from the run's global generator. ``predictive``: the sampler
    routes by the PR2 heads (the replay mode's ``predictor`` trait)."""

    def sample(chunk: list[str], gens: list[torch.Generator] | None) -> RolloutBatch:
        noise_gen = seeds.rollout_noise_generator(seed, step, chunk) if rollout.rollout_router_noise else None
        sampler = None if gens is None else GroupSampler(gens, group_size, rollout.temperature)
        return generate(rollout_policy, task.tokenizer, [p for p in chunk for _ in range(group_size)],
                        max_new_tokens=task.max_new_tokens, temperature=rollout.temperature, record_routing=True,
                        router_noise=rollout.rollout_router_noise, noise_generator=noise_gen,
                        predictive=predictive, sampler=sampler)

    group_prompts = [p for p in prompts for _ in range(group_size)]
    if rollout.rollout_seeding == "sequential":
        return group_prompts, sample(prompts, None)
    gens = group_generators(seed, step, first_group, len(prompts), rollout_policy.device)
    if not rollout.rollout_router_noise:
        return group_prompts, sample(prompts, gens)
    # the noise generator is seeded per collect() call: one call per group keeps each group's draws its own
    parts = [sample([prompt], [gen]) for prompt, gen in zip(prompts, gens)]
    return group_prompts, join_batches(parts, task.tokenizer.pad_token_id)


def _rewards(task, group_prompts: list[str], batch: RolloutBatch) -> torch.Tensor:
    """Stage 2: the task's verifiable reward of every completion."""
    return torch.tensor([task.reward(p, c) for p, c in zip(group_prompts, batch.completions)],
                        dtype=torch.float32, device=batch.input_ids_BS.device)


def _old_logp(policy, batch: RolloutBatch, replay: RLReplay, rollout: RLRollout, seed: int,
              step: int) -> tuple[torch.Tensor, Trace | None, dict]:
    """Stage 3: (logp_old, the routing that produced it, mismatch metrics): the old-policy forward, or the
    sampler's own log-probs and routing (section 5.4), which have no mismatch to measure."""
    if rollout.old_logp == "rollout":
        return batch.logp_rollout_BT, batch.trace, {}
    logp_old_BT, old_trace, free_trace = _old_pass(policy, batch, replay, rollout, seed, step)
    metrics = _mismatch_metrics(batch, logp_old_BT, free_trace)
    metrics.update(routing_confidence(free_trace, batch.response_mask_BT))
    return logp_old_BT, old_trace, metrics


def _correction(batch: RolloutBatch, logp_old_BT: torch.Tensor,
                rollout: RLRollout) -> tuple[torch.Tensor | None, dict]:
    """Stage 4: rollout-correction weights pi_train/pi_rollout and their metrics; (None, {}) when off.
    The config refuses a correction with old_logp=rollout (no gap to correct)."""
    if not ROLLOUT_CORRECTION_SPECS[rollout.rollout_correction].active:
        return None, {}
    is_weights_BT, corr = rollout_correction(logp_old_BT, batch.logp_rollout_BT, batch.response_mask_BT,
                                             mode=rollout.rollout_correction, upper=rollout.rollout_correction_upper,
                                             lower=rollout.rollout_correction_lower)
    return is_weights_BT, {key: float(value) for key, value in corr.items()}


def _kl_reward(ref_model, batch: RolloutBatch, logp_old_BT: torch.Tensor, rewards_B: torch.Tensor,
               objective: RLObjective, temperature: float) -> tuple[torch.Tensor, dict]:
    """Stage 5: rewards minus the per-sequence KL to the reference (kl_mode=reward); unchanged otherwise.
    ``temperature``: the rollout's, at which the reference's log-probs are taken."""
    if ref_model is None or objective.kl_coef <= 0 or objective.kl_mode != "reward":
        return rewards_B, {}
    with torch.no_grad():
        ref_BT = token_logprobs(forward_logits(ref_model, batch.input_ids_BS, batch.attention_mask_BS).logits,
                                batch.input_ids_BS, temperature)
    kl_B = (kl_penalty(logp_old_BT, ref_BT, batch.response_mask_BT, objective.kl_kind)).sum(-1)
    return rewards_B - objective.kl_coef * kl_B, {"kl/ref_reward_penalty": float(kl_B.mean())}


def _advantages(rewards_B: torch.Tensor, objective: RLObjective, group_size: int) -> torch.Tensor:
    """Stage 6: group-normalised advantages of the (possibly KL-penalised) rewards."""
    return group_advantages(rewards_B, group_size, std_normalize=objective.std_normalize,
                            reward_clip=objective.reward_clip, adv_clip=objective.adv_clip, whiten=objective.whiten)


def _task_metrics(task, group_prompts: list[str], rewards_B: torch.Tensor, old_trace: Trace | None,
                  mask_BT: torch.Tensor) -> dict[str, float]:
    """A task mixture's per-sub-task mean reward (before any KL penalty) and how far its experts specialise
    by task (NMI of the sequence's task tag and the chosen experts); nothing for a single task."""
    if not hasattr(task, "task_ids"):
        return {}
    ids_B = torch.tensor(task.task_ids(group_prompts), device=rewards_B.device)
    out = {f"reward/mean_{sub.name}": float(rewards_B[ids_B == i].mean()) if bool((ids_B == i).any()) else math.nan
           for i, sub in enumerate(task.subtasks)}
    if old_trace is not None:
        out.update(specialization(old_trace, ids_B, mask_BT, name="task_specialization"))
    return out


def collect(policy, rollout_policy, ref_model, task, cfg: RunConfig, step: int, prompts: list[str],
            first_group: int = 0) -> StepData:
    """Rollout with routing recorded, rewards, the old-policy pass, rollout correction and advantages.
    ``first_group``: the index of prompts[0] in the step's batch (a rank's share of it under torchrun).
    Each stage gets the sections it reads."""
    objective, replay, rollout = cfg.rl.section("objective"), cfg.rl.section("replay"), cfg.rl.section("rollout")
    group_size = cfg.rl.group_size
    t0 = time.perf_counter()
    group_prompts, batch = _rollout(rollout_policy, task, rollout, prompts, seed=cfg.seed, group_size=group_size,
                                    predictive=REPLAY_SPECS[replay.replay].predictor, step=step,
                                    first_group=first_group)
    rewards_B = _rewards(task, group_prompts, batch)
    t1 = time.perf_counter()
    metrics = _reward_metrics(rewards_B, group_size, batch)
    logp_old_BT, old_trace, mismatch = _old_logp(policy, batch, replay, rollout, cfg.seed, step)
    is_weights_BT, corr = _correction(batch, logp_old_BT, rollout)
    rewards_B, kl = _kl_reward(ref_model, batch, logp_old_BT, rewards_B, objective, rollout.temperature)
    adv_B = _advantages(rewards_B, objective, group_size)
    metrics.update({**mismatch, **corr, **kl, "perf/rollout_s": t1 - t0, "perf/old_s": time.perf_counter() - t1})
    if old_trace is not None:  # token id at trace column t is input_ids[:, t] (forward_logits drops the last)
        metrics.update(specialization(old_trace, batch.input_ids_BS[:, :old_trace.seq_len], batch.response_mask_BT))
    metrics.update(_task_metrics(task, group_prompts, rewards_B, old_trace, batch.response_mask_BT))
    forced, ref = replay_traces(replay.replay, batch.trace, old_trace)
    return StepData(batch, rewards_B, adv_B, logp_old_BT, ref, forced, metrics, task.max_new_tokens,
                    is_weights_BT)


def routing_ctx(policy, forced: Trace | None, replay_section: RLReplay, gen: torch.Generator,
                router_logp: bool = False):
    """The routing regime of a trainer's forward: free (recorded) without ``forced``, else ``forced`` replayed,
    gated as ``replay_section`` says; router noise from ``gen`` in both."""
    if forced is None:
        return record(policy, noise_std=replay_section.router_noise, generator=gen, router_logp=router_logp)
    return replay(policy, forced, noise_std=replay_section.router_noise, generator=gen, router_logp=router_logp,
                  gate=replay_section.replay_gate, weights=replay_section.replay_gate_weights)
