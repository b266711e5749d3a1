"""Rollout correction for the training-inference gap: importance weights pi_train / pi_rollout.

``rollout_correction`` maps the trainer's old-policy log-probs and the sampler's log-probs to
detached per-token weights that ``losses.policy_loss(..., is_weights_BT=...)`` multiplies into the
per-token loss terms of any objective. r = exp(logp_old - logp_rollout) (as verl's
``rollout_corr_helper``: ratio = pi_old(train) / pi_rollout, exponent clamped to +-20).

| mode | weight | default bounds | source |
|---|---|---|---|
| none | 1 | - | - |
| tis_token | min(r_t, upper) | upper 2.0 | TIS (Yao et al.), verl `rollout_is=token` |
| tis_seq | min(R_i, upper), R_i = exp(sum_t log r_t), broadcast | upper 2.0 | verl `rollout_is=sequence` |
| mis_token | r_t if r_t <= upper (and >= lower if given) else 0 | upper 2.0, no lower | MIS ("When Speed Kills Stability") |
| mis_seq | R_i if R_i <= upper (and >= lower if given) else 0, broadcast | upper 2.0, no lower | Seq-MIS, idem |
| icepop | r_t if lower <= r_t <= upper else 0 | [0.5, 5.0] | IcePop (Ring-1T report) |

MIS follows the blog's definition rho 1[rho <= C] (upper only); verl's Seq-MIS preset also rejects
R_i < 0.5: pass lower=0.5 for that. Comparisons against the bounds are made in log space on the
unclamped log-ratio (no overflow; the band is closed); weights are 0 at masked positions.
"""

from __future__ import annotations

import math

import torch

from moe_lab.config import constants as C
from moe_lab.config import mode_specs as M
from moe_lab.algos import reductions as R
from moe_lab.algos.ratio_metrics import LOG_RATIO_BOUND, masked_mean

__all__ = ["MODES", "DEFAULT_BOUNDS", "METRIC_KEYS", "resolved_bounds", "rollout_correction"]

# (lower, upper) when the caller passes None, and each mode's level and action: the rows of the torch-free
# moe_lab/config/mode_specs.py (TIS/MIS: verl's rollout_is_threshold 2.0; IcePop: the Ring-1T report's alpha = 0.5, beta = 5).
DEFAULT_BOUNDS = C.ROLLOUT_CORRECTION_BOUNDS
MODES = C.ROLLOUT_CORRECTION_MODES
METRIC_KEYS = ("rollout_corr/weight_mean", "rollout_corr/weight_max", "rollout_corr/truncated_frac",
               "rollout_corr/masked_frac", "rollout_corr/ess")
REDUCTIONS = {"rollout_corr/weight_mean": R.TOKEN_MEAN, "rollout_corr/weight_max": R.MAX,
              "rollout_corr/truncated_frac": R.TOKEN_MEAN, "rollout_corr/masked_frac": R.TOKEN_MEAN,
              "rollout_corr/ess": R.ESS}  # across ranks (moe_lab/algos/reductions.py)


def resolved_bounds(mode: str, upper: float | None = None, lower: float | None = None) -> tuple[float | None, float | None]:
    """(lower, upper) in force: the caller's, else the mode's default; checked, one line per error."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    spec = M.ROLLOUT_CORRECTION_SPECS[mode]
    default_lower, default_upper = spec.bounds
    for name, value in (("upper", upper), ("lower", lower)):
        if value is not None and not (isinstance(value, (int, float)) and 0.0 < value < math.inf):
            raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")
    if not spec.active:
        return None, None
    if lower is not None and not spec.takes_lower:
        raise ValueError(f"lower applies to {M.names_where(M.ROLLOUT_CORRECTION_SPECS, lambda s: s.takes_lower)} "
                         f"only, not mode={mode!r}: pass None")
    lower = default_lower if lower is None else lower
    upper = default_upper if upper is None else upper
    if lower is not None and not lower < upper:
        raise ValueError(f"lower must be < upper, got lower={lower!r}, upper={upper!r}")
    return lower, upper


def _check(logp_old_BT, logp_rollout_BT, mask_BT) -> None:
    for name, x in (("logp_old_BT", logp_old_BT), ("logp_rollout_BT", logp_rollout_BT)):
        if not isinstance(x, torch.Tensor) or x.ndim != 2 or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating 2-D tensor (B, T), got {getattr(x, 'shape', type(x))}")
    shape = tuple(logp_old_BT.shape)
    if tuple(logp_rollout_BT.shape) != shape:
        raise ValueError(f"logp_rollout_BT must have shape {shape}, got {tuple(logp_rollout_BT.shape)}")
    if not isinstance(mask_BT, torch.Tensor) or tuple(mask_BT.shape) != shape:
        raise ValueError(f"mask_BT must be a tensor of shape {shape}, got {getattr(mask_BT, 'shape', type(mask_BT))}")


@torch.no_grad()
def rollout_correction(
    logp_old_BT: torch.Tensor,
    logp_rollout_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str = "none",
    upper: float | None = None,
    lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached weights (B, T) (0 at masked positions) and their metrics (docs/metrics.md).

    Metrics (token-weighted over response tokens, sequence weights counted once per token):
    weight mean and max, share of tokens truncated (tis) or masked (mis, icepop), and the
    effective sample size ESS = (sum w)^2 / (n sum w^2) (1 for equal weights, 1/n for one weight).
    """
    lower, upper = resolved_bounds(mode, upper, lower)
    spec = M.ROLLOUT_CORRECTION_SPECS[mode]
    _check(logp_old_BT, logp_rollout_BT, mask_BT)
    dtype = torch.promote_types(torch.promote_types(logp_old_BT.dtype, logp_rollout_BT.dtype), torch.float32)
    keep_BT = mask_BT.bool()
    zero = torch.zeros((), dtype=dtype, device=logp_old_BT.device)
    # where BEFORE subtracting: garbage at masked positions never enters a sum.
    log_r_BT = torch.where(keep_BT, logp_old_BT.to(dtype), zero) - torch.where(keep_BT, logp_rollout_BT.to(dtype), zero)
    if spec.level == M.SEQUENCE:
        log_r_BT = log_r_BT.sum(dim=-1, keepdim=True).expand_as(log_r_BT)
    ratio_BT = torch.exp(log_r_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    truncated_BT = torch.zeros_like(keep_BT)
    dropped_BT = torch.zeros_like(keep_BT)
    if not spec.active:
        weights_BT = torch.ones_like(ratio_BT)
    elif spec.action == M.TRUNCATE:
        truncated_BT = log_r_BT > math.log(upper)
        weights_BT = ratio_BT.clamp(max=upper)
    else:  # M.MASK (mis_*, icepop): reject instead of truncating
        dropped_BT = log_r_BT > math.log(upper)
        if lower is not None:
            dropped_BT = dropped_BT | (log_r_BT < math.log(lower))
        weights_BT = torch.where(dropped_BT, zero, ratio_BT)
    weights_BT = torch.where(keep_BT, weights_BT, zero)
    return weights_BT, _metrics(weights_BT, keep_BT, truncated_BT & keep_BT, dropped_BT & keep_BT)


def _metrics(w_BT, keep_BT, truncated_BT, dropped_BT) -> dict[str, torch.Tensor]:
    n = keep_BT.sum().to(w_BT.dtype)
    total, square = w_BT.sum(), w_BT.square().sum()
    ess = torch.where(square > 0, total.square() / (n * torch.where(square > 0, square, 1.0)), 0.0)
    w_max = torch.where(keep_BT, w_BT, torch.full((), -math.inf, dtype=w_BT.dtype)).max()
    values = {
        "rollout_corr/weight_mean": masked_mean(w_BT, keep_BT),
        "rollout_corr/weight_max": w_max if bool(keep_BT.any()) else torch.zeros((), dtype=w_BT.dtype),
        "rollout_corr/truncated_frac": masked_mean(truncated_BT.to(w_BT.dtype), keep_BT),
        "rollout_corr/masked_frac": masked_mean(dropped_BT.to(w_BT.dtype), keep_BT),
        "rollout_corr/ess": ess,
    }
    return {key: values[key].to(torch.float32).reshape(()) for key in METRIC_KEYS}
