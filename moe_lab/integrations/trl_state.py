"""The routing state one MoEGRPOTrainer carries between TRL's hooks, and the batch keys it adds.

Batch-dict keys (all batch-first, rows aligned with ``prompt_ids``; S = P + C columns of the full sequence):
``moe_rollout_ids`` (B, L, S, K) generation's experts, ``moe_rollout_logp`` (B, C) the sampled tokens'
log-probs under generate()'s forwards, ``moe_old_ids`` (B, L, S, K) the experts TRL's old pass ran,
``moe_old_router_logp`` (B, L, S, K) its router's log-probs of them, ``moe_old_free_ids`` the old pass's
own choice (differs from ``moe_old_ids`` under R3 only).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from moe_lab.integrations.trl_routing import RoutingRun, to_batch, to_trace
from moe_lab.routing import Trace

Tensor = torch.Tensor


@dataclass
class LossScope:
    """One loss forward's routing: its inputs, the reference routing (what produced the old log-probs; None
    on-policy), what was forced (None: free routing), the routing run, the router-log-prob probe at the
    reference's ids (free routing only) and the forward's detached log-probs (filled by the forward)."""

    inputs: dict
    ref: Trace | None
    forced: Trace | None
    run: RoutingRun
    probe: object | None = None
    logp_BC: Tensor | None = None


@dataclass
class MoEState:
    """Explicit per-trainer routing state (no module global): the phase TRL is in ("old": its old-policy
    pass), the last generation's (trace, log-probs), the old pass's per-call runs, the ExitStack spanning one
    training_step (forward and backward) and that step's LossScope."""

    phase: str | None = None
    rollout: tuple | None = None
    old_runs: list = field(default_factory=list)
    stack: ExitStack | None = None
    loss: LossScope | None = None
    loss_steps: int = 0


def join_chunks(runs: list[RoutingRun]) -> dict[str, Tensor]:
    """The old pass's per-call routing joined along the batch, batch-first."""
    used = [run.used for run in runs]
    return {"moe_old_ids": torch.cat([to_batch(t.indices) for t in used]),
            "moe_old_router_logp": torch.cat([to_batch(t.router_logp_LBTK) for t in used]),
            "moe_old_free_ids": torch.cat([to_batch(run.free.indices) for run in runs])}


def old_reference(inputs: dict, mode: str, like: dict) -> Trace | None:
    """The routing that produced this batch's old log-probs, which replay forces and routing/* compare to:
    R3 the generation's (with the old pass's router log-probs at those ids when TRL ran one), otherwise the old
    pass's own (None when TRL ran no old pass: on-policy, the loss forward IS the old policy)."""
    logp = inputs.get("moe_old_router_logp")
    if mode == "rollout":
        return to_trace(inputs["moe_rollout_ids"], like, logp)
    if "moe_old_ids" not in inputs:
        return None
    return to_trace(inputs["moe_old_ids"], like, logp)
