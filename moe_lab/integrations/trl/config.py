"""MoEGRPOConfig: TRL's GRPOConfig plus the fields of Routing Replay and moe_lab's routing metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_lab.integrations.trl.version import require_trl
from moe_lab.config.mode_specs import REPLAY_SPECS, ROLLOUT

require_trl()

from trl import GRPOConfig  # noqa: E402

# the rl.replay modes TRL's loop offers (their rows and traits: moe_lab/config/mode_specs.py)
REPLAY_MODES = tuple(name for name, spec in REPLAY_SPECS.items() if spec.trl)


def replays_rollout(args) -> bool:
    """routing_replay forces the routing recorded while generating (R3): the trait of its row, not its name."""
    return REPLAY_SPECS[args.routing_replay].forces == ROLLOUT


@dataclass
class MoEGRPOConfig(GRPOConfig):
    """GRPOConfig with Routing Replay (``routing_replay``) and moe_lab's routing metrics (``moe_metrics``).

    Every GRPOConfig field keeps its meaning; bad values of the fields below are refused in one line."""

    routing_replay: str = field(default="none", metadata={
        "help": "Routing Replay of the MoE experts: 'none' (routers choose freely; routing is recorded and measured "
                "only), 'old' (R2: every loss forward uses the experts of TRL's old-policy pass; acts only when TRL "
                "computes old log-probs, i.e. off-policy: gradient_accumulation_steps not a multiple of "
                "steps_per_generation * num_iterations), 'rollout' (R3: the old pass and every loss forward use the "
                "experts recorded during generation; with use_vllm=True needs vLLM >= 0.22 in colocate mode, which "
                "returns them).",
        "choices": list(REPLAY_MODES)})
    routing_replay_weights: bool = field(default=False, metadata={
        "help": "With routing_replay 'old' or 'rollout': replay the recorded combine (gate) weights too, not only "
                "the expert ids (moe_lab's rl.replay_gate_weights; prime-rl's Total Router Recall). The combine then "
                "holds constants: the policy loss sends the router no gradient (only TRL's balancing loss does, "
                "when on)."})
    freeze_router: bool = field(default=False, metadata={
        "help": "Freeze every MoE layer's router (requires_grad=False before the optimizer is built: no gradient, "
                "no update, no AdamW state; moe_lab's rl.freeze_router, prime-rl's freeze_moe_router). With "
                "routing_replay_weights=True the policy loss already sends the router no gradient, but TRL's "
                "balancing loss still does when on: this (or router_aux_loss_coef=0.0) holds the router still."})
    moe_metrics: bool = field(default=True, metadata={
        "help": "Log moe_lab's routing and mismatch metrics (routing/*, mismatch/*, ratio/token_var; "
                "docs/metrics.md) in TRL's logs. False: only the routing replay needs runs."})
    moe_decomp_every: int = field(default=0, metadata={
        "help": "Every k-th loss step, split the log-ratio into its routing and weight parts (ratio/routing_share, "
                "ratio/d_*): one extra no-grad forward of the step's batch. 0 = never (the default: it costs about "
                "one old-policy pass). Needs an old pass (off-policy)."})
    moe_position_ids: bool = field(default=True, metadata={
        "help": "Pass position_ids computed from the attention mask in TRL's training forwards, as generate() does: "
                "without them a left-padded prompt is numbered from the padding on, so its log-probs and routing "
                "differ from the generation's. False keeps TRL's forwards untouched."})

    def __post_init__(self):
        super().__post_init__()
        if self.routing_replay not in REPLAY_MODES:
            raise ValueError(f"routing_replay={self.routing_replay!r}: allowed {', '.join(REPLAY_MODES)}")
        for name in ("moe_metrics", "moe_position_ids", "routing_replay_weights", "freeze_router"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: allowed True or False")
        every = self.moe_decomp_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"moe_decomp_every={every!r}: allowed an integer >= 0 (0 = never)")
        if self.routing_replay_weights and not REPLAY_SPECS[self.routing_replay].replays:
            replayed = " or ".join(repr(m) for m in REPLAY_MODES if REPLAY_SPECS[m].replays)
            raise ValueError(f"routing_replay_weights=True replays recorded weights, so it needs routing_replay "
                             f"{replayed}; allowed with routing_replay={self.routing_replay!r}: False")
