"""The routing state one MoEGRPOTrainer carries between TRL's hooks, and the batch keys it adds.

Batch-dict keys (all batch-first, rows aligned with ``prompt_ids``; S = P + C columns of the full sequence):
``moe_rollout_ids`` (B, L, S, K) generation's experts, ``moe_rollout_weights`` their combine weights
(routing_replay_weights), ``moe_rollout_router_logp`` the generating router's log-probs of them (HF generate with
metrics), ``moe_rollout_logp`` (B, C) the sampled tokens' log-probs under generate()'s forwards,
``moe_old_ids`` (B, L, S, K) the experts TRL's old pass ran, ``moe_old_weights`` their weights,
``moe_old_router_logp`` its router's log-probs of them, ``moe_old_free_ids`` the old pass's own choice (differs
from ``moe_old_ids`` under R3 only).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from moe_lab.integrations.batch_routing import RoutingRun, fit_columns, fit_width, place_rows, to_batch, to_trace
from moe_lab.config.mode_specs import REPLAY_SPECS, ROLLOUT
from moe_lab.routing import Trace

Tensor = torch.Tensor


@dataclass
class LossScope:
    """One loss forward's routing: its inputs, the reference routing (what produced the old log-probs; None
    on-policy), what was forced (None: free routing), the routing run, the router-log-prob probe at the
    reference's ids (free routing only) and the forward's detached log-probs and aux loss (filled by the forward)."""

    inputs: dict
    ref: Trace | None
    forced: Trace | None
    run: RoutingRun
    probe: object | None = None
    logp_BC: Tensor | None = None
    aux_loss: float | None = None


@dataclass
class Rollout:
    """The last generation's routing: an HF generate() trace (L, B, S-1, K), or an engine's per-sequence routes
    ``rows`` [(L, n_i, K)] of unpadded sequences with their prompt lengths (vLLM), and the sampled tokens'
    log-probs (HF generate only)."""

    trace: Trace | None = None
    rows: list | None = None
    prompt_lens: list | None = None
    logp_BC: Tensor | None = None

    def batch(self, P: int, C: int, weights: bool) -> dict[str, Tensor]:
        """The batch keys over the S = P + C columns of TRL's padded batch."""
        if self.rows is not None:
            return {"moe_rollout_ids": place_rows(self.rows, self.prompt_lens, P, P + C, self.rows[0].dtype)}
        out = {"moe_rollout_ids": fit_columns(to_batch(self.trace.indices), P + C)}
        if weights:
            out["moe_rollout_weights"] = fit_columns(to_batch(self.trace.weights), P + C)
        if self.trace.router_logp_LBTK is not None:
            out["moe_rollout_router_logp"] = fit_columns(to_batch(self.trace.router_logp_LBTK), P + C)
        if self.logp_BC is not None:
            out["moe_rollout_logp"] = fit_width(self.logp_BC.to(out["moe_rollout_ids"].device), C)
        return out


@dataclass
class MoEState:
    """Explicit per-trainer routing state (no module global): the phase TRL is in ("old": its old-policy
    pass), the last generation's Rollout, the old pass's per-call runs, the ExitStack spanning one
    training_step (forward and backward) and that step's LossScope."""

    phase: str | None = None
    rollout: Rollout | None = None
    old_runs: list = field(default_factory=list)
    stack: ExitStack | None = None
    loss: LossScope | None = None
    loss_steps: int = 0


def join_chunks(runs: list[RoutingRun]) -> dict[str, Tensor]:
    """The old pass's per-call routing joined along the batch, batch-first."""
    used = [run.used for run in runs]
    out = {"moe_old_ids": torch.cat([to_batch(t.indices) for t in used]),
           "moe_old_router_logp": torch.cat([to_batch(t.router_logp_LBTK) for t in used]),
           "moe_old_free_ids": torch.cat([to_batch(run.free.indices) for run in runs])}
    if all(t.weights is not None for t in used):
        out["moe_old_weights"] = torch.cat([to_batch(t.weights) for t in used])
    return out


def old_reference(inputs: dict, mode: str, like: dict) -> Trace | None:
    """The routing that produced this batch's old log-probs, which replay forces and routing/* compare to:
    R3 the generation's (with the old pass's router log-probs at those ids when TRL ran one, else the
    generating router's own), otherwise the old pass's own (None when TRL ran no old pass: on-policy, the loss
    forward IS the old policy). Carries the recorded combine weights when they were kept."""
    logp = inputs.get("moe_old_router_logp")
    if REPLAY_SPECS[mode].forces == ROLLOUT:
        logp = inputs.get("moe_rollout_router_logp") if logp is None else logp
        return to_trace(inputs["moe_rollout_ids"], like, logp, inputs.get("moe_rollout_weights"))
    if "moe_old_ids" not in inputs:
        return None
    return to_trace(inputs["moe_old_ids"], like, logp, inputs.get("moe_old_weights"))
