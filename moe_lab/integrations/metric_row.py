"""The metric row of a trainer integration: moe_lab's routing, ratio and mismatch metrics of its loss steps,
from moe_lab's own functions, combined over microbatches and ranks as moe_lab declares each one.

Not TRL-specific. Each ``*_part`` takes one loss forward's tensors and returns ``{metric name: float}`` under
the names of docs/metrics.md. ``MetricRow`` keeps every microbatch's parts with its sequence and token counts
until the trainer logs, then gathers them from every rank and combines them in one go (token means by tokens,
variances by the law of total variance, ...: ``moe_lab.rl.dp_split``), and names the per-layer columns
``routing/layer_<i>/<metric>`` with i the DECODER layer index (moe_lab's functions count MoE layers).
"""

from __future__ import annotations

import re

import torch

from moe_lab.algos import reductions as R
from moe_lab.algos.ratio_metrics import LOG_RATIO_BOUND, masked_mean, masked_var, rollout_mismatch
from moe_lab.rl.dp_split import combine_metrics, reduction_of, reductions
from moe_lab.routing import Trace, expert_change, router_shift, routing_confidence, routing_metrics

# the logged names this module makes that moe_lab's own tables spell otherwise (routing/confidence_l<i>)
REDUCTIONS = {"routing/layer_*/confidence": R.TOKEN_MEAN}
_PER_LAYER = re.compile(r"^routing/(?:layer_(\d+)/(.+)|(confidence)_l(\d+))$")

Tensor = torch.Tensor


def routing_part(ref: Trace | None, used: Trace, free: Trace, mask_BS: Tensor,
                 new_logp_at_ref_LBSK: Tensor | None) -> dict[str, float]:
    """routing/* of one loss forward. ``ref``: the routing that produced the old log-probs (None on-policy,
    where TRL keeps none); ``used``: what the forward ran (with the router's log-probs of those ids);
    ``free``: the router's own choice; ``new_logp_at_ref_LBSK``: the current router's log-probs at ref's ids."""
    out = routing_confidence(used, mask_BS) if used.router_logp_LBTK is not None else {}
    if ref is None:
        return out
    # ids only: under routing_replay_weights ``used`` carries the forced weights, so a gate drift against the
    # reference would read 0 by construction (and exist in that configuration only)
    out.update(routing_metrics(ref.indices, used.indices, mask_BS))
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


def decoder_names(metrics: dict[str, float], layer_idx: list[int]) -> dict[str, float]:
    """Per-layer columns renamed ``routing/layer_<decoder index>/<metric>``: moe_lab's functions number MoE
    layers 0..L-1 (``layer_<l>/...``, ``confidence_l<l>``); ``layer_idx[l]`` is MoE layer l's decoder layer."""
    out = {}
    for key, value in metrics.items():
        m = _PER_LAYER.match(key)
        if m is None:
            out[key] = value
        elif m.group(1) is not None:
            out[f"routing/layer_{layer_idx[int(m.group(1))]}/{m.group(2)}"] = value
        else:
            out[f"routing/layer_{layer_idx[int(m.group(4))]}/{m.group(3)}"] = value
    return out


def _closure(key: str, table: dict) -> set[str]:
    """``key`` and the metrics its reduction needs (a variance needs its mean, a share its two parts)."""
    kind, out = reduction_of(key, table), {key}
    if isinstance(kind, tuple):
        for dep in kind[1:]:
            if dep not in (R.TOKEN_MEAN, R.SEQ_MEAN):
                out |= _closure(dep, table)
    return out


def combine_parts(parts: list[tuple[dict, float, float]]) -> dict[str, float]:
    """[(metrics, n_seq, n_tok)] of disjoint parts (microbatches, ranks) -> one dict, each key combined over
    the parts that have it (a column made only on some steps, such as ``ratio/routing_share``, is combined
    over those steps) as its reduction declares."""
    table, out = reductions(), {}
    keys = dict.fromkeys(k for p in parts for k in p[0])
    for key in keys:
        need = _closure(key, table)
        sub = [({k: p[k] for k in need}, s, t) for p, s, t in parts if need <= p.keys()]
        if sub:
            out[key] = combine_metrics(sub)[key]
    return out


class MetricRow:
    """The metric parts of the loss steps since the last log (explicit per-trainer state, no global)."""

    def __init__(self, layer_idx: list[int]):
        self.layer_idx = list(layer_idx)
        self.parts: list[tuple[dict, float, float]] = []

    def add(self, metrics: dict[str, float], n_seq: int, n_tok: int) -> None:
        self.parts.append((dict(metrics), float(n_seq), float(n_tok)))

    def take(self, gather_object) -> dict[str, float]:
        """Every rank's parts (``gather_object``: accelerate's, called on every rank) combined and renamed;
        emptied. One process, one microbatch: its own values unchanged."""
        parts, self.parts = self.parts, []
        everyone = list(gather_object(parts))
        return decoder_names(combine_parts(everyone), self.layer_idx) if everyone else {}
