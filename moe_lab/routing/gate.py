"""Gated routing replay (``rl.replay_gate``): keep a replayed expert only while the current router still rates it.

prime-rl PR #2703 ("extend router replay", ``router_replay_score_threshold_ratio``): a replayed expert is kept
only if the trainer router's score on it is at least ``gate`` x the score of the router's own weakest top-k
expert for that token; rejected slots are refilled from the router's own top-k, best first, skipping experts
already kept. We follow that rule:

- score: the family's router score over ALL experts, ``exp(FamilySpec.router_logp)``: the softmax probability
  (Qwen, OLMoE, Mixtral, gpt-oss), or DeepSeek-V3's sigmoid scores normalised over the experts (a ratio of two
  such scores equals the ratio of the raw sigmoids, so the threshold test is the same); fp32, no gradient.
  It is read from the logits the router chooses from (router noise included), so the router's "own top-k"
  is exactly the family's ``select()`` on those logits (``ReplayHandle.latent``).
- kept: score(forced expert) >= gate * min(score of the router's own k experts) ("at least", as the PR).
- refill: the j-th rejected slot (left to right) gets the j-th best of the router's own experts not among the
  kept ones; there are always enough (each rejected slot frees one of the k).

Extremes: gate = 0 keeps every forced expert (the caller skips this module: plain replay, bit for bit).
gate = 1 keeps a forced expert iff it scores at least the router's own k-th; for the softmax families (whose
choice IS the top-k by score) the resulting expert SET equals free routing's set (ties aside), slot order
aside: kept experts keep their slots. DeepSeek-V3 chooses with a correction bias and group limits, so there an
expert scoring above its weakest choice can be kept although the router would not pick it: not the free set.
"""

from __future__ import annotations

import torch
from torch import nn

Tensor = torch.Tensor


@torch.no_grad()
def gated_ids(family, router: nn.Module, logits_NE: Tensor, forced_NK: Tensor, gate: float) -> tuple[Tensor, Tensor]:
    """(ids_NK actually routed, replaced_NK bool): forced ids with the ones the router rates too low replaced."""
    _, own_NK = family.select(router, logits_NE)
    own_NK = own_NK.long()
    score_NE = family.router_logp(logits_NE).exp()
    own_score_NK = score_NE.gather(1, own_NK)
    # the router's own experts, best first (a stable sort: ties keep the family's order)
    order_NK = own_score_NK.argsort(dim=1, descending=True, stable=True)
    own_NK = own_NK.gather(1, order_NK)
    floor_N1 = gate * own_score_NK.min(dim=1, keepdim=True).values
    keep_NK = score_NE.gather(1, forced_NK) >= floor_N1
    # own expert j is free unless some KEPT forced slot already holds it
    taken_NKK = (own_NK.unsqueeze(2) == forced_NK.unsqueeze(1)) & keep_NK.unsqueeze(1)
    free_NK = ~taken_NKK.any(dim=2)
    slot_rank_NK = (~keep_NK).long().cumsum(dim=1) - 1  # j for the j-th rejected slot
    free_rank_NK = free_NK.long().cumsum(dim=1) - 1  # j for the j-th free own expert
    match_NKK = (slot_rank_NK.unsqueeze(2) == free_rank_NK.unsqueeze(1)) & free_NK.unsqueeze(1)
    refill_NK = own_NK.gather(1, match_NKK.float().argmax(dim=2))
    return torch.where(keep_NK, forced_NK, refill_NK), ~keep_NK


def replace_frac(replaced_LBSK: Tensor, mask_BS: Tensor) -> float:
    """Share of replayed (layer, token, slot)s over the masked positions that the gate replaced."""
    m_BS = mask_BS.to(device=replaced_LBSK.device, dtype=torch.float32)
    per_BS = replaced_LBSK.float().mean(dim=(0, 3))
    return float((per_BS * m_BS).sum() / m_BS.sum())
