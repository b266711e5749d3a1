"""Expert-bias updates (DeepSeek-V3's aux-loss-free balancing; Megatron-LM ``moe_router_bias_update_rate``):
``coldstart.bias_update_rate`` in the warm-up, ``rl.bias_update_rate`` during RL.

After every optimizer step, per MoE layer: ``b_i += rate * sign(mean_j load_j - load_i)``, load_i = tokens routed
to expert i over that step's update forwards (``routing.bias_counts``; summed over ranks under torchrun, as
Megatron all-reduces them over its data-parallel group); a load equal to the mean gives 0. As in Megatron's
``get_updated_expert_bias``, the mean and the sign are computed in the count dtype and so is ``sign * rate``
(bfloat16 counts: a step of bf16(rate)); the bias keeps its own dtype. The bias is model state, never a
parameter of the optimizer: a buffer (ERNIE-4.5: a Parameter without gradient, which AdamW skips), saved with the
checkpoint, copied to the rollout copy with the weights (moe_lab.rl.loop).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moe_lab.algos import reductions as R
from moe_lab.models import moe_layers
from moe_lab.routing.bias_counts import ExpertCounts, own_choice_LBSK
from moe_lab.routing.metrics import expert_change

Tensor = torch.Tensor
# across ranks: the bias and its step are the same on every rank (counts summed before the update); the bias's
# share of the minibatch's response tokens whose experts change, a token mean (its ratio to
# routing/expert_change_latent is only averaged)
REDUCTIONS = {"routing/bias_abs_mean": R.SAME, "routing/bias_step_abs_mean": R.SAME,
              "routing/bias_expert_change": R.TOKEN_MEAN, "routing/bias_change_share": R.TOKEN_MEAN}


def bias_step(counts_LE: Tensor, rate: float) -> Tensor:
    """rate * sign(mean load - load) per layer and expert, in the counts' dtype (0 where load == mean)."""
    mean_L1 = counts_LE.sum(dim=-1, keepdim=True) / counts_LE.shape[-1]
    return torch.sign(mean_L1 - counts_LE) * rate


class ExpertBias:
    """The correction biases of a model's MoE layers and the loads of the current optimizer step."""

    def __init__(self, model, rate: float, count_dtype: str = "float32"):
        layers = moe_layers(model)
        family = layers[0].family
        if family.bias is None:
            raise ValueError(f"bias_update_rate={rate}: model family {family.name} has no expert correction bias; "
                             "allowed 0")
        self.rate = float(rate)
        self.biases = [layer.family.bias(layer.router) for layer in layers]
        E = self.biases[0].numel()
        self.counts = ExpertCounts(len(layers), E, getattr(torch, count_dtype), self.biases[0].device)

    def count(self, ids_LBSK: Tensor, mask_BS: Tensor) -> None:
        """Add one update forward's routed ids at its real tokens (mask_BS: 1 on prompt and response tokens)."""
        self.counts.add(ids_LBSK, mask_BS)

    @torch.no_grad()
    def update(self) -> dict[str, float]:
        """Apply the rule to the counts of this optimizer step (then reset); mean |bias| and mean |step|."""
        counts_LE = self.counts.take()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts_LE)  # every rank's forwards, as Megatron's all-reduce of the counts
        step_LE = bias_step(counts_LE, self.rate)
        for bias, step_E in zip(self.biases, step_LE):
            bias.add_(step_E.to(bias.dtype).view_as(bias))
        return {"routing/bias_abs_mean": float(torch.stack([b.float().abs().mean() for b in self.biases]).mean()),
                "routing/bias_step_abs_mean": float(step_LE.float().abs().mean())}

    def update_measured(self, model, logits: list, mask_BS: Tensor, expert_change_latent: float | None) -> dict:
        """update(), plus the routing change the bias step alone makes on this forward's scores (router logits
        kept by routing.bias_counts.router_logits): routing/bias_expert_change over mask_BS's positions, and its
        share of routing/expert_change_latent (NaN without one, or when that is 0)."""
        shape = tuple(mask_BS.shape)
        before = own_choice_LBSK(model, logits, shape)
        out = self.update()
        change = expert_change(before, own_choice_LBSK(model, logits, shape), mask_BS)
        total = math.nan if expert_change_latent is None else expert_change_latent
        out["routing/bias_expert_change"] = change
        out["routing/bias_change_share"] = change / total if total and math.isfinite(total) else math.nan
        return out
