"""The expert loads an expert-bias update reads (``rl.bias_update_rate``), and the router logits of the forward
they come from: explicit state, filled per forward, read and reset once per optimizer step.

As Megatron-LM (``local_tokens_per_expert``): every forward of an optimizer step adds its tokens per expert to a
buffer in the count dtype (``+=`` of the forward's integer counts), padding excluded; the update reads the sums
and the buffer starts again at 0. Which ids a replayed forward counts (``rl.bias_counts``): ``free`` = the
router's own top-k on the same scores (``replay(...).latent``), ``replayed`` = the ids that ran
(``replay(...).used``: the forced ones, gated where a gate replaced some). Without replay both are the
recorded choice. In bfloat16 a count above 256 loses integers (Megatron-LM #7081).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from moe_lab.models import moe_layers
from moe_lab.routing.metrics import expert_load_LE

Tensor = torch.Tensor


def counted_ids(mode: str, used, latent) -> Tensor:
    """ids_LBSK a forward counts: ``free`` the router's own choice, ``replayed`` the routing that ran (a Trace
    or a ReplayHandle's traces; the same Trace for both without replay)."""
    if mode not in ("free", "replayed"):
        raise ValueError(f"bias_counts={mode!r}: allowed free, replayed")
    return (latent if mode == "free" else used).indices


class ExpertCounts:
    """Tokens routed to each expert of each MoE layer, summed over the forwards of one optimizer step."""

    def __init__(self, num_layers: int, num_experts: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"count dtype {dtype}: allowed torch.float32, torch.bfloat16")
        self.counts_LE = torch.zeros(num_layers, num_experts, dtype=dtype, device=device)

    def add(self, ids_LBSK: Tensor, mask_BS: Tensor) -> None:
        """Add one forward's (position, slot) assignments at mask_BS's positions (the real tokens)."""
        load_LE = expert_load_LE(ids_LBSK, self.counts_LE.shape[1], mask_BS)  # exact integers in fp32
        # the integer counts added into the count-dtype buffer, as Megatron's buffer += routing_map.sum(0)
        self.counts_LE += load_LE.to(device=self.counts_LE.device, dtype=torch.int64)

    def take(self) -> Tensor:
        """The summed counts (L, E) in the count dtype; the buffer restarts at 0."""
        counts_LE = self.counts_LE.clone()
        self.counts_LE.zero_()
        return counts_LE


@contextmanager
def router_logits(model: nn.Module) -> Iterator[list]:
    """Keep each MoE layer's router logits of the call(s) inside, detached: [logits_NE per layer] (the last call's;
    an activation-checkpointing recompute gives the same ones). Reads only: the forward is unchanged."""
    layers = moe_layers(model)
    kept: list[Tensor | None] = [None] * len(layers)

    def keep(pos: int, module: nn.Module, args: tuple, output: tuple) -> None:
        kept[pos] = output[0].detach()

    handles = [layer.router.register_forward_hook(lambda m, a, o, pos=pos: keep(pos, m, a, o))
               for pos, layer in enumerate(layers)]
    try:
        yield kept
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def own_choice_LBSK(model: nn.Module, logits: list, shape: tuple[int, int]) -> Tensor:
    """Each router's own top-k on ``logits`` (router_logits') with its CURRENT correction bias, ids_LBSK for a
    call of (B, S) = shape: the family's select(), bit-exact with the router's own choice."""
    ids = [layer.family.select(layer.router, logits_NE)[1].reshape(*shape, -1)
           for layer, logits_NE in zip(moe_layers(model), logits)]
    return torch.stack(ids)
