"""One RL step, the same for every algorithm: rollout → rewards → old policy → minibatch updates.

The algorithm (``rl.algo``) is only an argument of ``policy_loss``; Routing Replay (``rl.replay``) only
chooses which trace, if any, the update forwards are forced to follow. Nothing else branches.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from moe_lab.advantages import group_advantages
from moe_lab.config import RunConfig, resolved_clip
from moe_lab.losses import kl_penalty, masked_mean, policy_loss
from moe_lab.optim import set_lr
from moe_lab.rollout_correction import rollout_correction
from moe_lab.rollout import RolloutBatch, forward_logits, generate, token_entropy, token_logprobs
from moe_lab.routing import (RouterLogp, Trace, load_metrics, record, replay, router_gamma, router_logp_probe,
                             router_shift, routing_metrics)

LN2 = math.log(2.0)


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
    forced = batch.trace if cfg.rl.replay == "rollout" else None
    with _routing_ctx(policy, forced, cfg, _noise_gen(cfg.seed, step, 0), router_logp=True) as handle, \
            train_precision(policy, cfg):
        logits = forward_logits(policy, batch.input_ids_BS, batch.attention_mask_BS).logits
    used, free = (handle, handle) if forced is None else (forced.with_router_logp(handle.router_logp_LBTK),
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


def collect(policy, rollout_policy, ref_model, task, cfg: RunConfig, step: int, prompts: list[str]) -> StepData:
    """Rollout with routing recorded, rewards and advantages, then the old-policy pass."""
    rl = cfg.rl
    t0 = time.perf_counter()
    group_prompts = [p for p in prompts for _ in range(rl.group_size)]
    batch = generate(rollout_policy, task.tokenizer, group_prompts, max_new_tokens=task.max_new_tokens,
                     temperature=rl.temperature, record_routing=True)
    rewards_B = torch.tensor([task.reward(p, c) for p, c in zip(group_prompts, batch.completions)],
                             dtype=torch.float32, device=batch.input_ids_BS.device)
    t1 = time.perf_counter()
    metrics = _reward_metrics(rewards_B, rl.group_size, batch)
    if rl.old_logp == "old_forward":
        logp_old_BT, old_trace, free_trace = _old_pass(policy, batch, cfg, step)
        metrics.update(_mismatch_metrics(batch, logp_old_BT, free_trace))
    else:  # section 5.4: the sampler's log-probs and routing stand in for the old policy's
        logp_old_BT, old_trace = batch.logp_rollout_BT, batch.trace
    is_weights_BT = None
    if rl.rollout_correction != "none":  # config refuses it with old_logp=rollout (no gap to correct)
        is_weights_BT, corr = rollout_correction(logp_old_BT, batch.logp_rollout_BT, batch.response_mask_BT,
                                                 mode=rl.rollout_correction, upper=rl.rollout_correction_upper,
                                                 lower=rl.rollout_correction_lower)
        metrics.update({key: float(value) for key, value in corr.items()})
    if ref_model is not None and rl.kl_coef > 0 and rl.kl_mode == "reward":
        with torch.no_grad():
            ref_BT = token_logprobs(forward_logits(ref_model, batch.input_ids_BS, batch.attention_mask_BS).logits,
                                    batch.input_ids_BS, rl.temperature)
        kl_B = (kl_penalty(logp_old_BT, ref_BT, batch.response_mask_BT, rl.kl_kind)).sum(-1)
        rewards_B = rewards_B - rl.kl_coef * kl_B
        metrics["kl/ref_reward_penalty"] = float(kl_B.mean())
    adv_B = group_advantages(rewards_B, rl.group_size, std_normalize=rl.std_normalize, reward_clip=rl.reward_clip,
                             adv_clip=rl.adv_clip, whiten=rl.whiten)
    metrics.update({"perf/rollout_s": t1 - t0, "perf/old_s": time.perf_counter() - t1})
    forced = {"none": None, "old": old_trace, "rollout": batch.trace}[rl.replay]
    return StepData(batch, rewards_B, adv_B, logp_old_BT, old_trace, forced, metrics, task.max_new_tokens,
                    is_weights_BT)


def _routing_ctx(policy, forced: Trace | None, cfg: RunConfig, gen: torch.Generator, router_logp: bool = False):
    if forced is None:
        return record(policy, noise_std=cfg.rl.router_noise, generator=gen, router_logp=router_logp)
    return replay(policy, forced, noise_std=cfg.rl.router_noise, generator=gen, router_logp=router_logp)


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
    if shift is not None:
        out.update(shift.metrics())
    return out


def _loss_terms(policy, ref_model, data: StepData, rows, cfg: RunConfig,
                shift: RouterShift | None = None) -> tuple[torch.Tensor, dict]:
    """Forward one minibatch (routing regime already in force) and return the total loss and its metrics."""
    rl, b = cfg.rl, data.batch
    ids, attn, mask = b.input_ids_BS[rows], b.attention_mask_BS[rows], b.response_mask_BT[rows]
    out = forward_logits(policy, ids, attn, output_router_logits=rl.aux_loss_coef > 0)
    logp_BT = token_logprobs(out.logits, ids, rl.temperature)
    gamma_BT = shift.gamma_BT() if shift is not None else None  # this forward's router vs the old routing's
    low, high = resolved_clip(rl)
    is_weights_BT = None if data.is_weights_BT is None else data.is_weights_BT[rows]
    # router_gamma_BT: RSPO's router-shift weight; every other objective ignores it.
    loss, metrics = policy_loss(logp_BT, data.logp_old_BT[rows], data.adv_B[rows], mask, algo=rl.algo,
                                clip_low=low, clip_high=high, loss_agg=rl.loss_agg, dual_clip_c=rl.dual_clip_c,
                                norm_len=data.norm_len, sapo_tau_pos=rl.sapo_tau_pos, sapo_tau_neg=rl.sapo_tau_neg,
                                rspo_floor=rl.rspo_floor, router_gamma_BT=gamma_BT, is_weights_BT=is_weights_BT)
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
    return loss, metrics


def _backward(policy, loss: torch.Tensor, grad_clip: float) -> float:
    if not torch.isfinite(loss):
        return float("nan")
    loss.backward()
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm))


def update(policy, ref_model, optimizer, data: StepData, rows: torch.Tensor, cfg: RunConfig, step: int,
           update_idx: int) -> dict[str, float]:
    """One optimizer step on one minibatch; returns its metrics (the row of the results table)."""
    t0 = time.perf_counter()
    lr = set_lr(optimizer, cfg.rl, update_idx)
    gen = _noise_gen(cfg.seed, step, 1 + update_idx)
    optimizer.zero_grad(set_to_none=True)
    # backward runs inside the routing context: under gradient checkpointing the recomputed forward
    # must see the same forced routing.
    forced = data.forced_trace[rows] if data.forced_trace is not None else None
    ref = None if data.old_trace is None else forced if data.old_trace is data.forced_trace else data.old_trace[rows]
    mask = data.batch.response_mask_BT[rows]
    # the probe only reads router logits (no routing, values or RNG change): router shift for every arm
    ref_ids = ref.indices if ref is not None and ref.router_logp_LBTK is not None else None
    with _routing_ctx(policy, forced, cfg, gen) as handle, router_logp_probe(policy, ref_ids) as current:
        shift = RouterShift(ref, current, mask)
        with train_precision(policy, cfg):
            loss, metrics = _loss_terms(policy, ref_model, data, rows, cfg, shift)
        grad_norm = _backward(policy, loss, cfg.rl.grad_clip)
    if math.isfinite(grad_norm):
        optimizer.step()
    used, latent = (handle, handle) if forced is None else (forced, handle.latent)  # as in _old_pass
    metrics.update(_routing_row(ref, used, latent, mask, shift))
    metrics.update({"loss": float(loss.detach()), "optim/grad_norm": grad_norm, "optim/lr": lr,
                    "perf/update_s": time.perf_counter() - t0})
    return metrics


def minibatch_rows(n: int, minibatches: int, seed: int, step: int, epoch: int = 0) -> list[torch.Tensor]:
    """A seeded shuffle of the rollout batch split into equal minibatches; each epoch has its own order.

    Epoch 0 keeps the salt of single-epoch runs, so rl.epochs=1 draws exactly the permutation it always did.
    """
    perm = torch.randperm(n, generator=_noise_gen(seed, step, 999_983 + epoch * 1_009))
    return list(perm.chunk(minibatches))  # CPU index tensors: valid for CPU and CUDA tensors alike


def updates_per_step(cfg: RunConfig) -> int:
    """Optimizer steps on one rollout batch: the first is on-policy, the other ones are stale."""
    return cfg.rl.epochs * cfg.rl.minibatches


def _schedule(n: int, cfg: RunConfig, step: int, first_update: int):
    """(epoch, minibatch, update index, rows) of every update of one step, in order."""
    mb = cfg.rl.minibatches
    for epoch in range(cfg.rl.epochs):
        for m, idx in enumerate(minibatch_rows(n, mb, cfg.seed, step, epoch)):
            yield epoch, m, first_update + epoch * mb + m, idx


def rl_step(policy, rollout_policy, ref_model, optimizer, task, cfg: RunConfig, step: int, prompts: list[str],
            first_update: int) -> list[dict]:
    """Collect one rollout batch and run epochs x minibatches updates; one row per update."""
    t0 = time.perf_counter()
    data = collect(policy, rollout_policy, ref_model, task, cfg, step, prompts)
    rows = []
    n = data.batch.input_ids_BS.shape[0]
    for epoch, m, u, idx in _schedule(n, cfg, step, first_update):
        metrics = update(policy, ref_model, optimizer, data, idx, cfg, step, u)
        rows.append({"step": step, "epoch": epoch, "minibatch": m, "update": u, **data.batch_metrics, **metrics})
        if not math.isfinite(metrics["loss"]) or not math.isfinite(metrics["optim/grad_norm"]):
            break
    wall = time.perf_counter() - t0
    tokens = float(data.batch.response_len_B.sum())
    for r in rows:
        r.update({"perf/step_s": wall, "perf/tokens_per_s": tokens / wall})
    return rows
