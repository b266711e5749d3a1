"""Masked reductions and the ratio / clip metrics that ``losses.policy_loss`` returns.

Every metric is defined in docs/metrics.md ("Every logged metric"). All are token-weighted over
the response tokens of the minibatch unless the name says ``seq``; variances are population
variances (divide by the count), so one token or one sequence gives 0, never NaN.
"""

from __future__ import annotations

import math

import torch

from moe_lab.algos import reductions as R

__all__ = ["masked_mean", "masked_var", "k3_from_log_ratio", "policy_metrics", "METRIC_KEYS", "DECOMP_KEYS",
           "ratio_decomposition", "nan_decomposition"]

METRIC_KEYS = (
    "clip_frac/out_of_range",
    "clip_frac/active",
    "clip_frac/low",
    "clip_frac/high",
    "clip_frac/dual",
    "clip_frac/seq",
    "ratio/token_mean",
    "ratio/token_var",
    "ratio/logratio_var",
    "ratio/seq_mean",
    "ratio/seq_var",
    "ratio/extreme_frac",
    "ratio/clamped_frac",
    "kl/k3",
)
# across ranks (moe_lab/algos/reductions.py): token means by tokens, sequence ones by sequences; the variances
# exactly by the law of total variance, except logratio_var, only averaged (its mean is not logged)
REDUCTIONS = {
    **{key: R.TOKEN_MEAN for key in METRIC_KEYS},
    "mismatch/abs_diff": R.TOKEN_MEAN, "mismatch/extreme_frac_log5": R.TOKEN_MEAN,  # rollout_mismatch's extras
    "clip_frac/seq": R.SEQ_MEAN,
    "ratio/seq_mean": R.SEQ_MEAN,
    "ratio/token_var": R.variance_of("ratio/token_mean", R.TOKEN_MEAN),
    "ratio/seq_var": R.variance_of("ratio/seq_mean", R.SEQ_MEAN),
}

# |d| > ln 2: the token's probability at least doubled or halved (arXiv:2510.11370's "extreme" token).
EXTREME_LOG_RATIO = math.log(2.0)
# exp(20) ~ 4.9e8: far past any clip range, yet exp(20)**2 (a variance) still fits in float32.
LOG_RATIO_BOUND = 20.0


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where the 0/1 ``mask`` is 1 (all of them, or along ``dim``).

    Masked positions may hold NaN or inf: they are replaced before any arithmetic, so they never
    leak through 0 * NaN. A slice with no unmasked position gives 0 (not NaN).
    """
    keep_BT = mask_BT.bool()
    weight_BT = keep_BT.to(x_BT.dtype)
    total = torch.where(keep_BT, x_BT, torch.zeros_like(x_BT)).sum(dim=dim)
    count = weight_BT.sum(dim=dim)
    return torch.where(count > 0, total / torch.where(count > 0, count, 1.0), torch.zeros_like(total))


def masked_var(x_BT: torch.Tensor, mask_BT: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Population variance of ``x`` over unmasked positions (same masking rules as masked_mean)."""
    keepdim_mean = masked_mean(x_BT, mask_BT, dim=dim)
    centred_BT = x_BT - (keepdim_mean if dim is None else keepdim_mean.unsqueeze(dim))
    return masked_mean(centred_BT.square(), mask_BT, dim=dim)


def k3_from_log_ratio(delta_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 = exp(delta) - delta - 1 with delta = log q/p for samples from p: KL(p || q) >= 0.

    Only the exponent is clamped (to +-LOG_RATIO_BOUND, against overflow); the linear term stays exact.
    """
    return torch.exp(delta_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)) - delta_BT - 1.0


@torch.no_grad()
def rollout_mismatch(logp_rollout_BT: torch.Tensor, logp_train_BT: torch.Tensor, mask_BT: torch.Tensor,
                     extended: bool = False) -> dict[str, float]:
    """Rollout-vs-train mismatch of the sampled tokens, ``d = logp_rollout - logp_train`` over the mask.

    ``mismatch/k3``: mean of exp(-d) + d - 1 (Schulman's k3 with r = pi_train / pi_rollout, from the rollout's
    own samples: KL(rollout || train)); ``mismatch/extreme_frac``: share with |d| > ln 2. extended=True adds
    ``mismatch/abs_diff`` (mean |d|) and ``mismatch/extreme_frac_log5`` (share with |d| > ln 5), the figures
    AReaL and slime publish for R3 (docs/metrics.md maps the names). No clamp: d is a mismatch, not a ratio.
    """
    mask = mask_BT.bool()
    d_BT = torch.where(mask, logp_rollout_BT - logp_train_BT, torch.zeros_like(logp_train_BT))
    k3_BT = torch.exp(-d_BT) + d_BT - 1
    out = {"mismatch/k3": float(masked_mean(k3_BT, mask)),
           "mismatch/extreme_frac": float(masked_mean((d_BT.abs() > EXTREME_LOG_RATIO).float(), mask))}
    if extended:
        out["mismatch/abs_diff"] = float(masked_mean(d_BT.abs(), mask))
        out["mismatch/extreme_frac_log5"] = float(masked_mean((d_BT.abs() > math.log(5.0)).float(), mask))
    return out


def _as_metric(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float32).reshape(())


@torch.no_grad()
def policy_metrics(
    d_BT: torch.Tensor,
    ratio_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_active_BT: torch.Tensor,
    dual_active_BT: torch.Tensor,
    clamped_BT: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The metrics dict of ``policy_loss`` (detached 0-dim float32 tensors, keys = METRIC_KEYS).

    d_BT: token log-ratio logp_new - logp_old (already clamped, 0 at masked positions).
    ratio_BT: the ratio the loss clipped (w for GRPO, s_i broadcast for the GSPO variants).
    clip_active_BT / dual_active_BT / clamped_BT: bool flags from the loss computation.
    """
    mask_BT = mask_BT.bool()
    d_BT = torch.where(mask_BT, d_BT.detach(), torch.zeros_like(d_BT))
    ratio_BT = torch.where(mask_BT, ratio_BT.detach(), torch.ones_like(ratio_BT))
    w_BT = torch.exp(d_BT)
    low_BT = ratio_BT < 1.0 - clip_low
    high_BT = ratio_BT > 1.0 + clip_high
    out_BT = (low_BT | high_BT) & mask_BT
    # Always the length-normalised sequence ratio, whatever the algorithm: GRPO and GSPO runs comparable.
    seq_ratio_B = torch.exp(masked_mean(d_BT, mask_BT, dim=-1))
    all_B = torch.ones_like(seq_ratio_B, dtype=torch.bool)
    metrics = {
        "clip_frac/out_of_range": masked_mean(out_BT.float(), mask_BT),
        "clip_frac/active": masked_mean((clip_active_BT | dual_active_BT).float(), mask_BT),
        "clip_frac/low": masked_mean(low_BT.float(), mask_BT),
        "clip_frac/high": masked_mean(high_BT.float(), mask_BT),
        "clip_frac/dual": masked_mean(dual_active_BT.float(), mask_BT),
        "clip_frac/seq": out_BT.any(dim=-1).float().mean(),
        "ratio/token_mean": masked_mean(w_BT, mask_BT),
        "ratio/token_var": masked_var(w_BT, mask_BT),
        "ratio/logratio_var": masked_var(d_BT, mask_BT),
        "ratio/seq_mean": seq_ratio_B.mean(),
        "ratio/seq_var": masked_var(seq_ratio_B, all_B),
        "ratio/extreme_frac": masked_mean((d_BT.abs() > EXTREME_LOG_RATIO).float(), mask_BT),
        "ratio/clamped_frac": masked_mean(clamped_BT.float(), mask_BT),
        # Schulman's k3 with samples from pi_old: an unbiased estimate of KL(pi_old || pi_new).
        "kl/k3": masked_mean(k3_from_log_ratio(d_BT), mask_BT),
    }
    return {key: _as_metric(metrics[key]) for key in METRIC_KEYS}


# ----------------------------------------------------------------------------- routing / weight decomposition

DECOMP_KEYS = ("ratio/d_route_mean", "ratio/d_weight_mean", "ratio/d_route_var", "ratio/d_weight_var", "ratio/d_cov",
               "ratio/routing_share", "ratio/route_extreme_frac", "ratio/route_clip_exit_frac")
# across ranks: the components' variances and covariance exactly (laws of total variance and covariance), the
# share as the ratio of the combined variances
DECOMP_REDUCTIONS = {
    "ratio/d_route_mean": R.TOKEN_MEAN, "ratio/d_weight_mean": R.TOKEN_MEAN,
    "ratio/d_route_var": R.variance_of("ratio/d_route_mean", R.TOKEN_MEAN),
    "ratio/d_weight_var": R.variance_of("ratio/d_weight_mean", R.TOKEN_MEAN),
    "ratio/d_cov": R.covariance_of("ratio/d_route_mean", "ratio/d_weight_mean", R.TOKEN_MEAN),
    "ratio/routing_share": R.share_of("ratio/d_route_var", "ratio/d_weight_var"),
    "ratio/route_extreme_frac": R.TOKEN_MEAN, "ratio/route_clip_exit_frac": R.TOKEN_MEAN,
}


@torch.no_grad()
def ratio_decomposition(logp_free_BT: torch.Tensor, logp_ref_BT: torch.Tensor, logp_old_BT: torch.Tensor,
                        mask_BT: torch.Tensor, clip_low: float, clip_high: float) -> dict[str, float]:
    """Split the token log-ratio of the current weights into a routing and a weight part (docs/metrics.md).

    logp_free_BT = log pi_theta(y | R_theta) (the router's own choice), logp_ref_BT = log pi_theta(y | R_ref)
    (the routing that produced logp_old), logp_old_BT = log pi_old(y | R_ref). d_route = free - ref and
    d_weight = ref - old, so d_route + d_weight is the no-replay log-ratio and d_weight R2's. Token-weighted
    population moments over the mask; routing_share = Var(d_route) / (Var(d_route) + Var(d_weight)) is 0 when
    both variances are 0 (no movement at all: nothing to attribute). All keys of DECOMP_KEYS, as floats.
    """
    mask = mask_BT.bool()
    zero = torch.zeros_like(logp_ref_BT, dtype=torch.float32)
    d_route = torch.where(mask, logp_free_BT.float() - logp_ref_BT.float(), zero)
    d_weight = torch.where(mask, logp_ref_BT.float() - logp_old_BT.float(), zero)
    m_route, m_weight = masked_mean(d_route, mask), masked_mean(d_weight, mask)
    var_route, var_weight = masked_var(d_route, mask), masked_var(d_weight, mask)
    cov = masked_mean((d_route - m_route) * (d_weight - m_weight), mask)
    total = var_route + var_weight
    share = torch.where(total > 0, var_route / torch.where(total > 0, total, 1.0), torch.zeros_like(total))

    def inside(d):  # the clip interval, in log space; the bound keeps exp finite
        w = torch.exp(d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        return (w >= 1.0 - clip_low) & (w <= 1.0 + clip_high)

    exit_BT = inside(d_weight) & ~inside(d_weight + d_route) & mask
    values = torch.stack([m_route, m_weight, var_route, var_weight, cov, share,
                          masked_mean((d_route.abs() > EXTREME_LOG_RATIO).float(), mask),
                          masked_mean(exit_BT.float(), mask)]).tolist()  # one sync
    return dict(zip(DECOMP_KEYS, values))


def nan_decomposition() -> dict[str, float]:
    """The decomposition's columns on an update where it does not run (rl.decomp_every)."""
    return dict.fromkeys(DECOMP_KEYS, math.nan)
