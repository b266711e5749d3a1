"""One RL step, the same for every algorithm: ``collect`` (moe_lab.rl.collect: rollout → rewards → old
policy) → minibatch updates.

The algorithm (``rl.algo``) is only an argument of ``policy_loss``; Routing Replay (``rl.replay``) only
chooses which trace, if any, the update forwards are forced to follow (``collect.replay_traces``, the one
place that reads which trace). The stateful extras (the expert bias, the PR2 predictor) are the run's step
components (moe_lab/rl/components.py), called at fixed hooks. Nothing else branches. ``rl_step`` takes a
``Trainee`` and runs one step over a batch split: ``SingleProcess`` for a plain run,
``moe_lab.rl.distributed.DataParallel`` under torchrun.
"""

from __future__ import annotations

import math
import time

import torch

from moe_lab.config import constants as C
from moe_lab.algos import reductions as R
from moe_lab.algos.losses import kl_penalty, masked_mean, policy_loss
from moe_lab.algos.objectives import knob_names
from moe_lab.algos.ratio_metrics import nan_decomposition, ratio_decomposition
from moe_lab.config import RunConfig, resolved_clip
from moe_lab.config.rl import RLObjective, RLSchedule
from moe_lab.rl import seeds
from moe_lab.rl.collect import StepData, collect, routing_ctx, train_precision
from moe_lab.rl.components import Trainee, UpdateContext
from moe_lab.rl.groups import group_minibatch_indices
from moe_lab.rl.optim import router_parameters, set_lr
from moe_lab.rl.rollout import forward_logits, token_entropy, token_logprobs
from moe_lab.rl.split import StepSplit
from moe_lab.routing import (RouterLogp, Trace, first_divergence, load_metrics, router_gamma,
                             router_logp_probe, router_shift, routing_metrics)

# across ranks (moe_lab/algos/reductions.py), the metrics of an update made here: the loss and the aux loss are
# per-sequence means (seq-mean aggregations), the KL loss term only averaged (token-mean of a part: not exact)
REDUCTIONS = {
    "kl/ref": R.TOKEN_MEAN, "routing/aux_loss": R.SEQ_MEAN, "routing/expert_change_latent": R.TOKEN_MEAN,
    "routing/replay_replace_frac": R.TOKEN_MEAN, "policy/entropy": R.TOKEN_MEAN, "loss": R.SEQ_MEAN,
    "optim/grad_norm": R.SAME, "optim/router_grad_norm": R.SAME, "optim/lr": R.SAME, "perf/*": R.SLOWEST,
    "step": R.SAME, "epoch": R.SAME, "minibatch": R.SAME, "update": R.SAME,  # a row's keys (rl_step)
}


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


def _loss_terms(policy, ref_model, data: StepData, idx_B: torch.Tensor, objective: RLObjective, temperature: float,
                shift: RouterShift | None = None) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """Forward one minibatch (routing regime already in force): the total loss, its metrics and the
    forward's token log-probs (detached). ``objective``: the run's objective section; ``temperature``: the
    rollout's, at which every log-prob of the step is taken."""
    b = data.batch
    ids, attn, mask = b.input_ids_BS[idx_B], b.attention_mask_BS[idx_B], b.response_mask_BT[idx_B]
    out = forward_logits(policy, ids, attn, output_router_logits=objective.aux_loss_coef > 0)
    logp_BT = token_logprobs(out.logits, ids, temperature)
    gamma_BT = shift.gamma_BT() if shift is not None else None  # this forward's router vs the old routing's
    low, high = resolved_clip(objective)
    is_weights_BT = None if data.is_weights_BT is None else data.is_weights_BT[idx_B]
    # router_gamma_BT: RSPO's router-shift weight; every other objective ignores it.
    # the objective's own knobs: the rl.<prefix>_<field> fields its registry entry declares
    knobs = {name: getattr(objective, name) for name in knob_names(objective.algo)}
    loss, metrics = policy_loss(logp_BT, data.logp_old_BT[idx_B], data.adv_B[idx_B], mask, algo=objective.algo,
                                clip_low=low, clip_high=high, loss_agg=objective.loss_agg,
                                dual_clip_c=objective.dual_clip_c, norm_len=data.norm_len, router_gamma_BT=gamma_BT,
                                is_weights_BT=is_weights_BT, **knobs)
    metrics = dict(zip(metrics, torch.stack(list(metrics.values())).tolist()))  # one sync, not one per metric
    if ref_model is not None and objective.kl_coef > 0 and objective.kl_mode == "loss":
        with torch.no_grad():
            ref_BT = token_logprobs(forward_logits(ref_model, ids, attn).logits, ids, temperature)
        kl = masked_mean(kl_penalty(logp_BT, ref_BT, mask, objective.kl_kind), mask)
        loss = loss + objective.kl_coef * kl
        metrics["kl/ref"] = float(kl.detach())
    if objective.aux_loss_coef > 0:
        loss = loss + objective.aux_loss_coef * out.aux_loss
        metrics["routing/aux_loss"] = float(out.aux_loss.detach())
    metrics["policy/entropy"] = float(masked_mean(token_entropy(out.logits, temperature), mask))
    return loss, metrics, logp_BT.detach()


def _backward(policy, loss: torch.Tensor, grad_clip: float) -> tuple[float, float]:
    """(gradient norm, the routers' part of it), both before clipping (after DDP's all-reduce: global)."""
    if not torch.isfinite(loss):
        return float("nan"), float("nan")
    loss.backward()
    router = router_grad_norm(policy)
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    return float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)), router


def router_grad_norm(policy) -> float:
    """L2 norm of the gradient on every router's weights: whether the router learns from the loss at all
    (top-1 with renormalised gate weights gives it none from the policy loss). 0 when no router has a gradient
    (a frozen router)."""
    grads = [p.grad.detach().float().norm() for p in router_parameters(policy) if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0


def _decomp_clip(objective: RLObjective) -> tuple[float, float]:
    """Clip range of ratio/route_clip_exit_frac: the run's for token-ratio clips, else GRPO's paper range."""
    return resolved_clip(objective) if objective.algo in C.TOKEN_CLIP_ALGOS else C.PAPER_CLIP[C.BASELINE_ALGO]


def _decomposition(ctx: UpdateContext, forced: Trace | None, ref: Trace | None, logp_BT: torch.Tensor,
                   objective: RLObjective) -> dict[str, float]:
    """ratio/d_route_*, d_weight_*: the update forward's log-probs plus one no-grad forward under the routing
    it did not use (the reference when it routed freely, the router's own choice when it replayed the
    reference), same weights (before optimizer.step()), same autocast. Its router noise has its own
    generator and fork_rng keeps any global-RNG draw (dropout, jitter) out of the training streams."""
    cfg, policy, data, idx_B, update_idx = ctx.cfg, ctx.policy, ctx.data, ctx.idx_B, ctx.index
    every = cfg.rl.decomp_every
    if ref is None or every == 0 or (update_idx + 1) % every:  # every N-th update: the N-th, 2N-th, ...
        return nan_decomposition()
    b, rollout = data.batch, cfg.rl.section("rollout")
    ids, attn = b.input_ids_BS[idx_B], b.attention_mask_BS[idx_B]
    gen = seeds.decomposition_generator(cfg.seed, ctx.step, update_idx)
    cuda = [logp_BT.device] if logp_BT.device.type == "cuda" else []
    with torch.no_grad(), torch.random.fork_rng(devices=cuda), \
            routing_ctx(policy, ref if forced is None else None, cfg.rl.section("replay"), gen), \
            train_precision(policy, rollout):
        other_BT = token_logprobs(forward_logits(policy, ids, attn).logits, ids, rollout.temperature)
    free_BT, ref_BT = (logp_BT, other_BT) if forced is None else (other_BT, logp_BT)
    return ratio_decomposition(free_BT, ref_BT, data.logp_old_BT[idx_B], b.response_mask_BT[idx_B],
                               *_decomp_clip(objective))


def update(ctx: UpdateContext) -> dict[str, float]:
    """One optimizer step on the minibatch ctx.idx_B (indices into the rollout batch); returns its metrics (the
    update's row of the results table). ``ctx.components``: the run's stateful extras (moe_lab.rl.components).
    The loss gets the objective section, the routing regime the replay section, the autocast and temperature
    the rollout section, the learning rate and the gradient clip the schedule section."""
    t0 = time.perf_counter()
    policy, optimizer, data, idx_B, cfg, step, update_idx = (ctx.policy, ctx.optimizer, ctx.data, ctx.idx_B, ctx.cfg,
                                                            ctx.step, ctx.index)
    objective, schedule = cfg.rl.section("objective"), cfg.rl.section("schedule")
    replay, rollout = cfg.rl.section("replay"), cfg.rl.section("rollout")
    lr = set_lr(optimizer, schedule, update_idx)
    gen = seeds.update_generator(cfg.seed, step, update_idx)
    optimizer.zero_grad(set_to_none=True)
    # backward runs inside the routing context: under gradient checkpointing the recomputed forward
    # must see the same forced routing.
    # each sliced on its own (under R2 they are one trace: the same values, sliced twice)
    forced = data.forced_trace[idx_B] if data.forced_trace is not None else None
    ref = data.ref_trace[idx_B] if data.ref_trace is not None else None
    mask = data.batch.response_mask_BT[idx_B]
    # the probe only reads router logits (no routing, values or RNG change): router shift for every arm
    ref_ids = ref.indices if ref is not None and ref.router_logp_LBTK is not None else None
    with routing_ctx(policy, forced, replay, gen) as handle, router_logp_probe(policy, ref_ids) as current, \
            ctx.components.update_context(ctx) as handles:
        shift = RouterShift(ref, current, mask)
        with train_precision(policy, rollout):
            loss, metrics, logp_BT = _loss_terms(policy, ctx.ref_model, data, idx_B, objective, rollout.temperature,
                                                 shift)
        grad_norm, router_norm = _backward(policy, loss, schedule.grad_clip)
    metrics.update(_decomposition(ctx, forced, ref, logp_BT, objective))
    if math.isfinite(grad_norm):
        optimizer.step()
    used, latent = (handle, handle) if forced is None else (handle.used, handle.latent)  # as in _old_pass
    metrics.update(_routing_row(ref, used, latent, mask, shift))
    if math.isfinite(grad_norm):  # what moves with the optimizer (the expert bias) steps with it
        metrics.update(ctx.components.after_optimizer_step(ctx, handles, used, latent, metrics))
    if forced is not None and replay.replay_gate > 0:
        metrics["routing/replay_replace_frac"] = handle.replace_frac(mask)
    metrics.update({"loss": float(loss.detach()), "optim/grad_norm": grad_norm, "optim/router_grad_norm": router_norm,
                    "optim/lr": lr,
                    "perf/update_s": time.perf_counter() - t0})
    return metrics


def minibatch_indices(n: int, minibatches: int, seed: int, step: int, epoch: int = 0) -> list[torch.Tensor]:
    """A seeded shuffle of the rollout batch split into equal minibatches; each epoch has its own order.

    Epoch 0 keeps the salt of single-epoch runs, so rl.epochs=1 draws exactly the permutation it always did.
    """
    perm = torch.randperm(n, generator=seeds.shuffle_generator(seed, step, epoch))
    return list(perm.chunk(minibatches))  # CPU index tensors: valid for CPU and CUDA tensors alike


def updates_per_step(schedule: RLSchedule) -> int:
    """Optimizer steps on one rollout batch: the first is on-policy, the other ones are stale."""
    return schedule.epochs * schedule.minibatches


class SingleProcess:
    """The batch split of a plain run: one process holds the whole batch (each prompt group sampled under its
    own seed, as on any rank of a torchrun), and there is nothing to reduce.
    ``moe_lab.rl.distributed.DataParallel`` supplies the same members (moe_lab/rl/split.py: StepSplit, and the
    run-level ones of RunSplit) for a process group."""

    def trained(self, policy):
        """The module the updates run through (DDP's wrapper under torchrun)."""
        return policy

    def collect(self, policy, rollout_policy, ref_model, task, cfg: RunConfig, step: int,
                prompts: list[str]) -> tuple[StepData, dict, float]:
        """The step's data, the batch-level metrics of its rows, and its response tokens (perf/tokens_per_s)."""
        data = collect(policy, rollout_policy, ref_model, task, cfg, step, prompts)
        return data, data.batch_metrics, float(data.batch.response_len_B.sum())

    def schedule(self, data: StepData, cfg: RunConfig, step: int, first_update: int):
        """(epoch, minibatch, update index, idx_B) of every update of one step, in order: the group-local
        minibatches of a torchrun split (so a 1-rank torchrun gives this table bit for bit) where the groups
        split evenly, else (and under the legacy sequential seeding) a seeded shuffle of the whole batch."""
        rl, n = cfg.rl, data.batch.input_ids_BS.shape[0]
        grouped = rl.rollout_seeding == "per_group" and rl.group_size % rl.minibatches == 0
        for epoch in range(rl.epochs):
            indices = (group_minibatch_indices(range(n // rl.group_size), rl.group_size, rl.minibatches, cfg.seed,
                                               step, epoch) if grouped else
                       minibatch_indices(n, rl.minibatches, cfg.seed, step, epoch))
            for m, idx_B in enumerate(indices):
                yield epoch, m, first_update + epoch * rl.minibatches + m, idx_B

    def checked(self, metrics: dict, step: int, update_idx: int, first_update: int) -> dict:
        """An update's metrics as the split sees them (a test hook under torchrun)."""
        return metrics

    def all_finite(self, metrics: dict, device) -> bool:
        """Whether the step's updates may go on: a finite loss and gradient norm (on every process)."""
        return math.isfinite(metrics["loss"]) and math.isfinite(metrics["optim/grad_norm"])

    def reduce(self, updates: list[tuple[tuple, dict, torch.Tensor]], data: StepData) -> list[tuple[tuple, dict]]:
        """[((epoch, minibatch, update), metrics)] of the whole batch from this process's updates."""
        return [(key, metrics) for key, metrics, _ in updates]


def rl_step(trainee: Trainee, task, cfg: RunConfig, step: int, prompts: list[str], *,
            split: StepSplit | None = None) -> list[dict]:
    """Collect one rollout batch and run epochs x minibatches updates over ``split`` (default: the plain
    run's ``SingleProcess``); one row per update, the same on every process. Step ``step``'s first update is the
    run's ``step * updates_per_step(schedule)``-th."""
    split = split or SingleProcess()
    first_update = step * updates_per_step(cfg.rl.section("schedule"))
    policy, parts = trainee.policy, trainee.components
    t0 = time.perf_counter()
    data, batch_metrics, tokens = split.collect(policy, trainee.rollout_policy, trainee.ref_model, task, cfg, step,
                                                prompts)
    parts.before_updates(policy, data, cfg)
    trained, updates = split.trained(policy), []
    for epoch, m, u, idx_B in split.schedule(data, cfg, step, first_update):
        metrics = update(UpdateContext(trained, trainee.ref_model, trainee.optimizer, parts, cfg, data, step, u, idx_B))
        metrics = split.checked(metrics, step, u, first_update)
        updates.append(((epoch, m, u), metrics, idx_B))
        if not split.all_finite(metrics, policy.device):
            break
    reduced = split.reduce(updates, data)
    after = parts.after_updates(policy)  # e.g. PR2 learns this step's router drift
    wall = time.perf_counter() - t0
    return [{"step": step, "epoch": epoch, "minibatch": m, "update": u, **batch_metrics, **metrics, **after,
             "perf/step_s": wall, "perf/tokens_per_s": tokens / wall} for (epoch, m, u), metrics in reduced]
