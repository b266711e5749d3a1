"""One RL step, the same for every algorithm: rollout → rewards → old policy → minibatch updates.

The algorithm (``rl.algo``) is only an argument of ``policy_loss``; Routing Replay (``rl.replay``) only
chooses which trace, if any, the update forwards are forced to follow. Nothing else branches.
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from dataclasses import dataclass

import torch

from moe_lab import constants as C
from moe_lab.algos.advantages import group_advantages
from moe_lab.config import RunConfig, resolved_clip
from moe_lab.algos.losses import kl_penalty, masked_mean, policy_loss
from moe_lab.rl.optim import set_lr
from moe_lab.algos.ratio_metrics import nan_decomposition, ratio_decomposition
from moe_lab.algos.rollout_correction import rollout_correction
from moe_lab.rl.rollout import RolloutBatch, forward_logits, generate, token_entropy, token_logprobs
from moe_lab.routing import (RouterLogp, Trace, first_divergence, load_metrics, record, replay, router_gamma,
                             router_logp_probe, router_shift, routing_confidence, routing_metrics, specialization)
from moe_lab.routing import predictor

LN2 = math.log(2.0)
DECOMP_SALT = 2_000_003  # noise generator of the decomposition's counterfactual forward: no training stream


@dataclass
class StepData:
    """Everything the minibatch updates of one step read; fixed before the first update."""

    batch: RolloutBatch
    rewards_B: torch.Tensor
    adv_B: torch.Tensor
    logp_old_BT: torch.Tensor
    old_trace: Trace | None  # routing that produced logp_old: the reference of routing/expert_change
    forced_trace: Trace | None  # what replay forces in the updates (None: free routing)
    batch_metrics: dict[str, float]
    norm_len: int  # fixed length for seq-mean-token-sum-norm: the task's response budget, not the batch's T
    is_weights_BT: torch.Tensor | None = None  # rollout-correction weights (rl.rollout_correction); None = off


def _noise_gen(seed: int, step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + salt)


# rl.rollout_router_noise's own stream, far from the trainer's salts (0, 1 + update index, 999_983 + ...).
# The prompts' crc32 joins the seed: the data-parallel path collects group by group, and each group must
# draw its own noise (the same for any world size), not a copy of its neighbour's.
ROLLOUT_NOISE_SALT = 1 << 40


def _rollout_noise_gen(cfg: RunConfig, step: int, prompts: list[str]) -> torch.Generator:
    return _noise_gen(cfg.seed, step, ROLLOUT_NOISE_SALT + zlib.crc32("\n".join(prompts).encode("utf-8")))


def train_precision(policy, cfg: RunConfig):
    """Autocast of the trainer's forwards (old-policy pass and updates), as bf16 trainers run them.

    Master weights and optimizer stay fp32 and token_logprobs upcasts the logits, so only the forward's
    matmuls (router logits included) are bf16. float32: a no-op context, bit-identical to no context.
    """
    if cfg.rl.train_dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=policy.device.type, dtype=getattr(torch, cfg.rl.train_dtype))


@torch.no_grad()
def _old_pass(policy, batch: RolloutBatch, cfg: RunConfig, step: int) -> tuple[torch.Tensor, Trace, Trace]:
    """logp_old from a forward of the policy before any update: (logp_old, routing used, router's own choice).

    Free routing is recorded (it is R2's trace). Under R3 this forward already follows the rollout's
    routing, as the updates will: otherwise the first update's ratios would compare two routings and
    be != 1 before the policy moved (we measured token-ratio variance spikes up to 86 from that alone).
    The routing used carries the old router's log-probs of its experts: the reference of routing/router_shift.
    """
    forced = batch.trace if cfg.rl.replay in ("rollout", "predictive") else None
    with _routing_ctx(policy, forced, cfg, _noise_gen(cfg.seed, step, 0), router_logp=True) as handle, \
            train_precision(policy, cfg):
        logits = forward_logits(policy, batch.input_ids_BS, batch.attention_mask_BS).logits
    used, free = (handle, handle) if forced is None else (handle.used.with_router_logp(handle.router_logp_LBTK),
                                                          handle.latent)
    return token_logprobs(logits, batch.input_ids_BS, cfg.rl.temperature), used, free


def _mismatch_metrics(batch: RolloutBatch, logp_old_BT, free_trace) -> dict[str, float]:
    """Rollout-vs-train mismatch: the sampler's log-probs and routing against the trainer's."""
    mask = batch.response_mask_BT
    d_BT = torch.where(mask, batch.logp_rollout_BT - logp_old_BT, torch.zeros_like(logp_old_BT))
    # Samples come from the rollout policy: k3 with r = pi_train / pi_rollout = exp(-d) estimates
    # KL(rollout || train) unbiasedly (Schulman's k3: (r - 1) - log r).
    k3_BT = torch.exp(-d_BT) + d_BT - 1
    out = {"mismatch/k3": float(masked_mean(k3_BT, mask)),
           "mismatch/extreme_frac": float(masked_mean((d_BT.abs() > LN2).float(), mask))}
    if batch.trace is not None and free_trace is not None:
        out["mismatch/expert_change"] = routing_metrics(batch.trace, free_trace, mask, prefix="")["expert_change"]
    return out


def _reward_metrics(rewards_B: torch.Tensor, group_size: int, batch: RolloutBatch) -> dict[str, float]:
    groups = rewards_B.view(-1, group_size)
    return {"reward/mean": float(rewards_B.mean()), "reward/std": float(rewards_B.std(unbiased=False)),
            "reward/zero_var_groups": float((groups.max(-1).values == groups.min(-1).values).float().mean()),
            "response/length_mean": float(batch.response_len_B.float().mean()),
            "response/length_max": float(batch.response_len_B.max())}


def _rollout(rollout_policy, task, cfg: RunConfig, prompts: list[str], step: int = 0) -> tuple[list[str], RolloutBatch]:
    """Stage 1: group_size samples of every prompt, routing recorded (R3's trace); rl.rollout_router_noise
    perturbs the sampler's routing only (an inference engine that routes differently from the trainer)."""
    group_prompts = [p for p in prompts for _ in range(cfg.rl.group_size)]
    noise = cfg.rl.rollout_router_noise
    gen = _rollout_noise_gen(cfg, step, prompts) if noise else None
    batch = generate(rollout_policy, task.tokenizer, group_prompts, max_new_tokens=task.max_new_tokens,
                     temperature=cfg.rl.temperature, record_routing=True, router_noise=noise, noise_generator=gen,
                     predictive=cfg.rl.replay == "predictive")
    return group_prompts, batch


def _rewards(task, group_prompts: list[str], batch: RolloutBatch) -> torch.Tensor:
    """Stage 2: the task's verifiable reward of every completion."""
    return torch.tensor([task.reward(p, c) for p, c in zip(group_prompts, batch.completions)],
                        dtype=torch.float32, device=batch.input_ids_BS.device)


def _old_logp(policy, batch: RolloutBatch, cfg: RunConfig, step: int) -> tuple[torch.Tensor, Trace | None, dict]:
    """Stage 3: (logp_old, the routing that produced it, mismatch metrics): the old-policy forward, or the
    sampler's own log-probs and routing (section 5.4), which have no mismatch to measure."""
    if cfg.rl.old_logp == "rollout":
        return batch.logp_rollout_BT, batch.trace, {}
    logp_old_BT, old_trace, free_trace = _old_pass(policy, batch, cfg, step)
    metrics = _mismatch_metrics(batch, logp_old_BT, free_trace)
    metrics.update(routing_confidence(free_trace, batch.response_mask_BT))
    return logp_old_BT, old_trace, metrics


def _correction(batch: RolloutBatch, logp_old_BT: torch.Tensor, cfg: RunConfig) -> tuple[torch.Tensor | None, dict]:
    """Stage 4: rollout-correction weights pi_train/pi_rollout and their metrics; (None, {}) when off.
    The config refuses a correction with old_logp=rollout (no gap to correct)."""
    rl = cfg.rl
    if rl.rollout_correction == "none":
        return None, {}
    is_weights_BT, corr = rollout_correction(logp_old_BT, batch.logp_rollout_BT, batch.response_mask_BT,
                                             mode=rl.rollout_correction, upper=rl.rollout_correction_upper,
                                             lower=rl.rollout_correction_lower)
    return is_weights_BT, {key: float(value) for key, value in corr.items()}


def _kl_reward(ref_model, batch: RolloutBatch, logp_old_BT: torch.Tensor, rewards_B: torch.Tensor,
               cfg: RunConfig) -> tuple[torch.Tensor, dict]:
    """Stage 5: rewards minus the per-sequence KL to the reference (rl.kl_mode=reward); unchanged otherwise."""
    rl = cfg.rl
    if ref_model is None or rl.kl_coef <= 0 or rl.kl_mode != "reward":
        return rewards_B, {}
    with torch.no_grad():
        ref_BT = token_logprobs(forward_logits(ref_model, batch.input_ids_BS, batch.attention_mask_BS).logits,
                                batch.input_ids_BS, rl.temperature)
    kl_B = (kl_penalty(logp_old_BT, ref_BT, batch.response_mask_BT, rl.kl_kind)).sum(-1)
    return rewards_B - rl.kl_coef * kl_B, {"kl/ref_reward_penalty": float(kl_B.mean())}


def _advantages(rewards_B: torch.Tensor, cfg: RunConfig) -> torch.Tensor:
    """Stage 6: group-normalised advantages of the (possibly KL-penalised) rewards."""
    rl = cfg.rl
    return group_advantages(rewards_B, rl.group_size, std_normalize=rl.std_normalize, reward_clip=rl.reward_clip,
                            adv_clip=rl.adv_clip, whiten=rl.whiten)


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


def collect(policy, rollout_policy, ref_model, task, cfg: RunConfig, step: int, prompts: list[str]) -> StepData:
    """Rollout with routing recorded, rewards, the old-policy pass, rollout correction and advantages."""
    t0 = time.perf_counter()
    group_prompts, batch = _rollout(rollout_policy, task, cfg, prompts, step)
    rewards_B = _rewards(task, group_prompts, batch)
    t1 = time.perf_counter()
    metrics = _reward_metrics(rewards_B, cfg.rl.group_size, batch)
    logp_old_BT, old_trace, mismatch = _old_logp(policy, batch, cfg, step)
    is_weights_BT, corr = _correction(batch, logp_old_BT, cfg)
    rewards_B, kl = _kl_reward(ref_model, batch, logp_old_BT, rewards_B, cfg)
    adv_B = _advantages(rewards_B, cfg)
    metrics.update({**mismatch, **corr, **kl, "perf/rollout_s": t1 - t0, "perf/old_s": time.perf_counter() - t1})
    if old_trace is not None:  # token id at trace column t is input_ids[:, t] (forward_logits drops the last)
        metrics.update(specialization(old_trace, batch.input_ids_BS[:, :old_trace.seq_len], batch.response_mask_BT))
    metrics.update(_task_metrics(task, group_prompts, rewards_B, old_trace, batch.response_mask_BT))
    forced = {"none": None, "old": old_trace, "rollout": batch.trace, "predictive": batch.trace}[cfg.rl.replay]
    return StepData(batch, rewards_B, adv_B, logp_old_BT, old_trace, forced, metrics, task.max_new_tokens,
                    is_weights_BT)


def _routing_ctx(policy, forced: Trace | None, cfg: RunConfig, gen: torch.Generator, router_logp: bool = False):
    if forced is None:
        return record(policy, noise_std=cfg.rl.router_noise, generator=gen, router_logp=router_logp)
    return replay(policy, forced, noise_std=cfg.rl.router_noise, generator=gen, router_logp=router_logp,
                  gate=cfg.rl.replay_gate, weights=cfg.rl.replay_gate_weights)


class RouterShift:
    """Router shift of one update forward against the reference routing's old router log-probs (RSPO).

    ``current`` fills during the forward (a router_logp_probe), so ``gamma_BT()`` is valid once the model
    has run: the loss reads it from the same forward it weights. Computed once, shared by loss and metrics.
    """

    def __init__(self, ref: Trace | None, current: RouterLogp, mask_BT: torch.Tensor):
        self.ref, self.current, self.mask_BT = ref, current, mask_BT
        self._result: tuple[torch.Tensor, dict[str, float]] | None = None

    @property
    def available(self) -> bool:
        return self.ref is not None and self.ref.router_logp_LBTK is not None

    def _shift(self) -> tuple[torch.Tensor, dict[str, float]]:
        if self._result is None:
            self._result = router_shift(self.ref, self.current.at(self.ref.indices), self.mask_BT)
        return self._result

    def gamma_BT(self) -> torch.Tensor | None:
        """exp(-shift) per token (1 off the mask), detached; None without a reference carrying router log-probs."""
        return router_gamma(self._shift()[0]) if self.available else None

    def metrics(self) -> dict[str, float]:
        return self._shift()[1] if self.available else {}


def _routing_row(ref: Trace | None, used: Trace, latent: Trace, mask: torch.Tensor,
                 shift: RouterShift | None = None) -> dict[str, float]:
    """routing/* of one update: change of the routing used, and of the router's own choice, vs ref;
    router shift of the old top-k experts."""
    out = load_metrics(used, mask)
    if ref is not None:
        out.update(routing_metrics(ref, used, mask))
        out["routing/expert_change_latent"] = (out["routing/expert_change"] if latent is used else
                                               routing_metrics(ref, latent, mask, prefix="")["expert_change"])
        out.update(first_divergence(ref, latent, mask))
    if shift is not None:
        out.update(shift.metrics())
    return out


def _loss_terms(policy, ref_model, data: StepData, idx_B: torch.Tensor, cfg: RunConfig,
                shift: RouterShift | None = None) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Forward one minibatch (routing regime already in force): the total loss, its metrics and the
    forward's token log-probs (detached)."""
    rl, b = cfg.rl, data.batch
    ids, attn, mask = b.input_ids_BS[idx_B], b.attention_mask_BS[idx_B], b.response_mask_BT[idx_B]
    out = forward_logits(policy, ids, attn, output_router_logits=rl.aux_loss_coef > 0)
    logp_BT = token_logprobs(out.logits, ids, rl.temperature)
    gamma_BT = shift.gamma_BT() if shift is not None else None  # this forward's router vs the old routing's
    low, high = resolved_clip(rl)
    is_weights_BT = None if data.is_weights_BT is None else data.is_weights_BT[idx_B]
    # router_gamma_BT: RSPO's router-shift weight; every other objective ignores it.
    loss, metrics = policy_loss(logp_BT, data.logp_old_BT[idx_B], data.adv_B[idx_B], mask, algo=rl.algo,
                                clip_low=low, clip_high=high, loss_agg=rl.loss_agg, dual_clip_c=rl.dual_clip_c,
                                norm_len=data.norm_len, sapo_tau_pos=rl.sapo_tau_pos, sapo_tau_neg=rl.sapo_tau_neg,
                                rspo_floor=rl.rspo_floor, router_gamma_BT=gamma_BT, is_weights_BT=is_weights_BT,
                                dppo_ratio_cap=rl.dppo_ratio_cap, vespo_k_pos=rl.vespo_k_pos,
                                vespo_lambda_pos=rl.vespo_lambda_pos, vespo_k_neg=rl.vespo_k_neg,
                                vespo_lambda_neg=rl.vespo_lambda_neg)
    metrics = dict(zip(metrics, torch.stack(list(metrics.values())).tolist()))  # one sync, not one per metric
    if ref_model is not None and rl.kl_coef > 0 and rl.kl_mode == "loss":
        with torch.no_grad():
            ref_BT = token_logprobs(forward_logits(ref_model, ids, attn).logits, ids, rl.temperature)
        kl = masked_mean(kl_penalty(logp_BT, ref_BT, mask, rl.kl_kind), mask)
        loss = loss + rl.kl_coef * kl
        metrics["kl/ref"] = float(kl.detach())
    if rl.aux_loss_coef > 0:
        loss = loss + rl.aux_loss_coef * out.aux_loss
        metrics["routing/aux_loss"] = float(out.aux_loss.detach())
    metrics["policy/entropy"] = float(masked_mean(token_entropy(out.logits, rl.temperature), mask))
    return loss, metrics, logp_BT.detach()


def _backward(policy, loss: torch.Tensor, grad_clip: float) -> float:
    if not torch.isfinite(loss):
        return float("nan")
    loss.backward()
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm))


def _decomp_clip(rl) -> tuple[float, float]:
    """Clip range of ratio/route_clip_exit_frac: the run's for token-ratio clips, else GRPO's paper range."""
    return resolved_clip(rl) if rl.algo in C.TOKEN_CLIP_ALGOS else C.PAPER_CLIP["grpo"]


def _decomposition(policy, data: StepData, idx_B: torch.Tensor, forced: Trace | None, ref: Trace | None,
                   logp_BT: torch.Tensor, cfg: RunConfig, step: int, update_idx: int) -> dict[str, float]:
    """ratio/d_route_*, d_weight_*: the update forward's log-probs plus one no-grad forward under the routing
    it did not use (the reference when it routed freely, the router's own choice when it replayed the
    reference), same weights (before optimizer.step()), same autocast. Its router noise has its own
    generator and fork_rng keeps any global-RNG draw (dropout, jitter) out of the training streams."""
    every = cfg.rl.decomp_every
    if ref is None or every == 0 or (update_idx + 1) % every:  # every N-th update: the N-th, 2N-th, ...
        return nan_decomposition()
    b = data.batch
    ids, attn = b.input_ids_BS[idx_B], b.attention_mask_BS[idx_B]
    gen = _noise_gen(cfg.seed, step, DECOMP_SALT + update_idx)
    cuda = [logp_BT.device] if logp_BT.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda), \
            _routing_ctx(policy, ref if forced is None else None, cfg, gen), train_precision(policy, cfg):
        other_BT = token_logprobs(forward_logits(policy, ids, attn).logits, ids, cfg.rl.temperature)
    free_BT, ref_BT = (logp_BT, other_BT) if forced is None else (other_BT, logp_BT)
    return ratio_decomposition(free_BT, ref_BT, data.logp_old_BT[idx_B], b.response_mask_BT[idx_B],
                               *_decomp_clip(cfg.rl))


def update(policy, ref_model, optimizer, data: StepData, idx_B: torch.Tensor, cfg: RunConfig, step: int,
           update_idx: int) -> dict[str, float]:
    """One optimizer step on the minibatch idx_B (indices into the rollout batch); returns its metrics (the
    update's row of the results table)."""
    t0 = time.perf_counter()
    lr = set_lr(optimizer, cfg.rl, update_idx)
    gen = _noise_gen(cfg.seed, step, 1 + update_idx)
    optimizer.zero_grad(set_to_none=True)
    # backward runs inside the routing context: under gradient checkpointing the recomputed forward
    # must see the same forced routing.
    forced = data.forced_trace[idx_B] if data.forced_trace is not None else None
    ref = None if data.old_trace is None else forced if data.old_trace is data.forced_trace else data.old_trace[idx_B]
    mask = data.batch.response_mask_BT[idx_B]
    # the probe only reads router logits (no routing, values or RNG change): router shift for every arm
    ref_ids = ref.indices if ref is not None and ref.router_logp_LBTK is not None else None
    with _routing_ctx(policy, forced, cfg, gen) as handle, router_logp_probe(policy, ref_ids) as current:
        shift = RouterShift(ref, current, mask)
        with train_precision(policy, cfg):
            loss, metrics, logp_BT = _loss_terms(policy, ref_model, data, idx_B, cfg, shift)
        grad_norm = _backward(policy, loss, cfg.rl.grad_clip)
    metrics.update(_decomposition(policy, data, idx_B, forced, ref, logp_BT, cfg, step, update_idx))
    if math.isfinite(grad_norm):
        optimizer.step()
    used, latent = (handle, handle) if forced is None else (handle.used, handle.latent)  # as in _old_pass
    metrics.update(_routing_row(ref, used, latent, mask, shift))
    if forced is not None and cfg.rl.replay_gate > 0:
        metrics["routing/replay_replace_frac"] = handle.replace_frac(mask)
    metrics.update({"loss": float(loss.detach()), "optim/grad_norm": grad_norm, "optim/lr": lr,
                    "perf/update_s": time.perf_counter() - t0})
    return metrics


def minibatch_indices(n: int, minibatches: int, seed: int, step: int, epoch: int = 0) -> list[torch.Tensor]:
    """A seeded shuffle of the rollout batch split into equal minibatches; each epoch has its own order.

    Epoch 0 keeps the salt of single-epoch runs, so rl.epochs=1 draws exactly the permutation it always did.
    """
    perm = torch.randperm(n, generator=_noise_gen(seed, step, 999_983 + epoch * 1_009))
    return list(perm.chunk(minibatches))  # CPU index tensors: valid for CPU and CUDA tensors alike


def updates_per_step(cfg: RunConfig) -> int:
    """Optimizer steps on one rollout batch: the first is on-policy, the other ones are stale."""
    return cfg.rl.epochs * cfg.rl.minibatches


def _schedule(n: int, cfg: RunConfig, step: int, first_update: int):
    """(epoch, minibatch, update index, idx_B) of every update of one step, in order."""
    mb = cfg.rl.minibatches
    for epoch in range(cfg.rl.epochs):
        for m, idx_B in enumerate(minibatch_indices(n, mb, cfg.seed, step, epoch)):
            yield epoch, m, first_update + epoch * mb + m, idx_B


@torch.no_grad()
def _pr2_observe(policy, data: StepData, cfg: RunConfig) -> predictor.Observation:
    """Router inputs and logits before the updates, under the replayed (predicted) rollout routing."""
    b = data.batch
    with replay(policy, data.forced_trace, gate=cfg.rl.replay_gate), predictor.observe(policy, b.response_mask_BT) as observed:
        forward_logits(policy, b.input_ids_BS, b.attention_mask_BS)
    return observed


def rl_step(policy, rollout_policy, ref_model, optimizer, task, cfg: RunConfig, step: int, prompts: list[str],
            first_update: int) -> list[dict]:
    """Collect one rollout batch and run epochs x minibatches updates; one row per update."""
    t0 = time.perf_counter()
    data = collect(policy, rollout_policy, ref_model, task, cfg, step, prompts)
    observed = _pr2_observe(policy, data, cfg) if cfg.rl.replay == "predictive" else None
    rows = []
    n = data.batch.input_ids_BS.shape[0]
    for epoch, m, u, idx_B in _schedule(n, cfg, step, first_update):
        metrics = update(policy, ref_model, optimizer, data, idx_B, cfg, step, u)
        rows.append({"step": step, "epoch": epoch, "minibatch": m, "update": u, **data.batch_metrics, **metrics})
        if not math.isfinite(metrics["loss"]) or not math.isfinite(metrics["optim/grad_norm"]):
            break
    pr2 = {} if observed is None else predictor.fit(policy, observed)  # learn this step's router drift
    wall = time.perf_counter() - t0
    tokens = float(data.batch.response_len_B.sum())
    for r in rows:
        r.update({**pr2, "perf/step_s": wall, "perf/tokens_per_s": tokens / wall})
    return rows
