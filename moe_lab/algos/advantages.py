"""Group-relative advantages shared by GRPO and GSPO (one scalar advantage per response).

A_i = (r_i - mean_{j in group} r_j) / (std + eps). Conventions chosen here, and why:

- std is the SAMPLE std (Bessel's correction, ``torch.std``'s default): verl's
  ``compute_grpo_outcome_advantage``, TRL's GRPO trainer and ROLL's ``reward_norm`` all use it,
  so advantages match theirs to float rounding. eps is added to the std, not clamped into it,
  for the same reason.
- A group whose rewards are all equal gets exactly 0 (forced with ``torch.where``, because
  ``r - mean`` of equal floats is not always exactly 0 after a rounded mean). A group of size 1
  is degenerate too and gets 0. verl gives a singleton its raw reward instead; we do not,
  because "relative to its group" is then undefined and a raw reward would bias the update.
- ``whiten="batch"`` keeps the per-group baseline (each prompt is its own control) but divides
  by ONE std: that of the group-centred values over the whole batch. Per-group division
  blows up near-degenerate groups (rewards 0, 0, 0, 1e-3 become +-1.5) and erases how much a
  prompt's responses really differ; one batch-wide scale keeps those magnitudes comparable
  across prompts. We use the centred values rather than the raw rewards (ROLL's "batch"
  std), because the raw std mixes in between-prompt difficulty, which the baseline removed.
- ``reward_clip`` clamps the RAW rewards before normalisation (outliers would otherwise set
  the std); ROLL applies its reward_clip after normalisation, which ``adv_clip`` covers here.
"""

from __future__ import annotations

import math

import torch

from moe_lab.config import constants as C

__all__ = ["group_advantages"]



def _check_args(rewards_B, group_size, eps, reward_clip, adv_clip, whiten) -> None:
    if not isinstance(rewards_B, torch.Tensor) or rewards_B.ndim != 1:
        shape = tuple(rewards_B.shape) if isinstance(rewards_B, torch.Tensor) else type(rewards_B).__name__
        raise ValueError(f"rewards_B must be a 1-D tensor (B,), got {shape}")
    if rewards_B.is_complex() or rewards_B.dtype == torch.bool:
        raise ValueError(f"rewards_B must be real numbers, got dtype {rewards_B.dtype}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards_B.numel() == 0 or rewards_B.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must divide the batch: got {rewards_B.numel()} rewards "
            f"(allowed: a positive multiple of group_size)"
        )
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    for name, value in (("reward_clip", reward_clip), ("adv_clip", adv_clip)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name} must be None or a float > 0, got {value!r}")
    if whiten not in C.WHITEN_MODES:
        raise ValueError(f"whiten must be one of {C.WHITEN_MODES}, got {whiten!r}")


def group_advantages(
    rewards_B: torch.Tensor,
    group_size: int,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
    reward_clip: float | None = None,
    adv_clip: float | None = None,
    whiten: str = "group",
) -> torch.Tensor:
    """Advantages (B,) float32 from rewards (B,), laid out as consecutive groups of ``group_size``.

    std_normalize=False gives the mean-only advantage (Dr.GRPO); ``whiten`` then has no effect.
    whiten="group": (r - group mean) / (group std + eps);
    whiten="batch": (r - group mean) / (std over the batch of those centred values + eps).
    adv_clip clamps the result to [-adv_clip, adv_clip].
    """
    _check_args(rewards_B, group_size, eps, reward_clip, adv_clip, whiten)
    rewards_GN = rewards_B.detach().to(torch.float32).reshape(-1, group_size)
    if reward_clip is not None:
        rewards_GN = rewards_GN.clamp(-reward_clip, reward_clip)
    # Exact equality, not a tolerance: any real difference in rewards is signal.
    degenerate_G1 = (rewards_GN.amax(dim=1) == rewards_GN.amin(dim=1)).unsqueeze(1)
    centred_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    centred_GN = torch.where(degenerate_G1, torch.zeros_like(centred_GN), centred_GN)
    adv_GN = centred_GN
    if std_normalize:
        if whiten == "group":
            # std of the rewards themselves, in fp32, in the peers' order of operations (so we match
            # them to rounding); correction=0 only for size-1 groups, degenerate (0) anyway: no NaN.
            std = rewards_GN.std(dim=1, keepdim=True, correction=1 if group_size > 1 else 0)
        else:
            std = centred_GN.std(correction=1 if centred_GN.numel() > 1 else 0)
        denom = std + eps
        # Centred values of 0 stay exactly 0, even where denom is 0 (eps=0, all groups degenerate).
        adv_GN = torch.where(centred_GN == 0, centred_GN, centred_GN / torch.where(denom > 0, denom, 1.0))
    if adv_clip is not None:
        adv_GN = adv_GN.clamp(-adv_clip, adv_clip)
    return adv_GN.reshape(-1)
