"""moe_lab's routing, ratio and mismatch metrics of one TRL loss step, from moe_lab's own functions.

Each function takes the step's tensors and returns ``{metric name: float}`` under the names of
docs/metrics.md; ``combine`` reduces the ranks' dicts as each metric declares (moe_lab.rl.dp_split).
"""

from __future__ import annotations

import torch

from moe_lab.algos.ratio_metrics import LOG_RATIO_BOUND, masked_mean, masked_var, rollout_mismatch
from moe_lab.rl.dp_split import combine_metrics
from moe_lab.routing import Trace, expert_change, router_shift, routing_confidence, routing_metrics

Tensor = torch.Tensor


def routing_part(ref: Trace | None, used: Trace, free: Trace, mask_BS: Tensor,
                 new_logp_at_ref_LBSK: Tensor | None) -> dict[str, float]:
    """routing/* of one loss forward. ``ref``: the routing that produced the old log-probs (None on-policy,
    where TRL keeps none); ``used``: what the forward ran (with the router's log-probs of those ids);
    ``free``: the router's own choice; ``new_logp_at_ref_LBSK``: the current router's log-probs at ref's ids."""
    out = routing_confidence(used, mask_BS) if used.router_logp_LBTK is not None else {}
    if ref is None:
        return out
    out.update(routing_metrics(ref, used, mask_BS))
    out["routing/expert_change_latent"] = expert_change(ref, free, mask_BS)
    if new_logp_at_ref_LBSK is not None and ref.router_logp_LBTK is not None:
        out.update(router_shift(ref, new_logp_at_ref_LBSK, mask_BS)[1])
    return out


def ratio_part(logp_new_BC: Tensor, logp_old_BC: Tensor, mask_BC: Tensor) -> dict[str, float]:
    """ratio/token_mean and ratio/token_var of w = exp(logp_new - logp_old), the log-ratio clamped to
    +-LOG_RATIO_BOUND before exp as in moe_lab's losses (TRL's on-policy steps: logp_old = logp_new, w = 1)."""
    mask = mask_BC.bool()
    d_BC = (logp_new_BC.detach().float() - logp_old_BC.float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    w_BC = torch.exp(torch.where(mask, d_BC, torch.zeros_like(d_BC)))
    return {"ratio/token_mean": float(masked_mean(w_BC, mask)), "ratio/token_var": float(masked_var(w_BC, mask))}


def mismatch_part(rollout: Trace | None, free: Trace, mask_BS: Tensor, logp_rollout_BC: Tensor | None,
                  logp_train_BC: Tensor, mask_BC: Tensor) -> dict[str, float]:
    """mismatch/*: generation against the trainer's forward of the same weights (TRL's old pass, or on-policy
    the loss forward): log-probs (k3, |d|, the ln 2 / ln 5 tails) and the router's free choice of experts."""
    out = {}
    if logp_rollout_BC is not None:  # vLLM may leave a token's log-prob NaN (unavailable): left out of the mask
        known_BC = torch.isfinite(logp_rollout_BC)
        rollout_BC = torch.where(known_BC, logp_rollout_BC, 0.0).float()
        out.update(rollout_mismatch(rollout_BC, logp_train_BC.detach().float(), mask_BC.bool() & known_BC,
                                    extended=True))
    if rollout is not None:
        out["mismatch/expert_change"] = expert_change(rollout, free, mask_BS)
    return out


def combine(gather_object, metrics: dict[str, float], n_seq: int, n_tok: int) -> dict[str, float]:
    """Every rank's metrics reduced as moe_lab declares them (token means by tokens, variances by the law of
    total variance, ...): ``gather_object`` is accelerate's; one process gets its own dict back unchanged."""
    parts = gather_object([(metrics, float(n_seq), float(n_tok))])
    return combine_metrics(list(parts))
