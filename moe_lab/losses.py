"""Policy objectives: GRPO (token ratio), GSPO (sequence ratio), GSPO-token, and the KL estimators.

Everything is a pure tensor function. ``policy_loss`` returns the loss to MINIMISE (= minus the
clipped surrogate objective) and a dict of detached metrics. Switching algorithm changes one thing,
the ratio (``_log_ratio_BT``); the clipped surrogate, dual clip, aggregation and metrics are shared.

Conventions checked against the peers (verl ``compute_policy_loss_vanilla`` /
``compute_policy_loss_gspo`` / ``agg_loss``, ROLL ``importance_sampling: seq``, TRL GRPO):
- loss_BT = -min(r A, clip(r, 1-clip_low, 1+clip_high) A); dual clip (A < 0):
  loss_BT = min(loss_BT, -c A), i.e. objective max(objective, c A).
- GSPO: the per-token term uses the sequence ratio s_i broadcast over the response, then the
  chosen token aggregation applies (seq-mean-token-mean gives mean_i of the paper's per-sequence term).
- seq-mean-token-sum-norm = mean_i sum_t / norm_len (verl and TRL's dr_grpo; ROLL sums over i).
Deliberate differences, reachable only with extreme inputs: the token log-ratio is clamped to +-20
for every algorithm (verl clamps GRPO's the same, but GSPO's log s_it to <= 10); k3 is not
value-clamped to [-10, 10] as in verl (its exponent is clamped to +-20 against overflow).
"""

from __future__ import annotations

import math

import torch

from moe_lab.ratio_metrics import LOG_RATIO_BOUND, k3_from_log_ratio, masked_mean, masked_var, policy_metrics

__all__ = [
    "ALGOS",
    "LOSS_AGGS",
    "KL_KINDS",
    "masked_mean",
    "masked_var",
    "aggregate_loss",
    "kl_penalty",
    "policy_loss",
]

ALGOS = ("grpo", "gspo", "gspo_token", "gspo_unnormalized")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")


# ---------------------------------------------------------------- validation (before any work)


def _shape(x) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_logp(name: str, x, shape: tuple[int, ...] | None) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or (shape is not None and tuple(x.shape) != shape):
        want = "a 2-D tensor (B, T)" if shape is None else f"a tensor of shape {shape}"
        raise ValueError(f"{name} must be {want}, got {_shape(x)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor (log-probs), got dtype {x.dtype}")


def _check_mask(mask_BT, shape: tuple[int, ...], allow_empty_rows: bool) -> None:
    if not isinstance(mask_BT, torch.Tensor) or tuple(mask_BT.shape) != shape:
        raise ValueError(f"mask_BT must be a tensor of shape {shape}, got {_shape(mask_BT)}")
    if mask_BT.is_complex():
        raise ValueError(f"mask_BT must be bool or 0/1 int/float, got dtype {mask_BT.dtype}")
    if mask_BT.dtype != torch.bool and not bool(((mask_BT == 0) | (mask_BT == 1)).all()):
        raise ValueError("mask_BT must hold only 0 and 1 (bool or 0/1 int/float); got other values")
    if shape[0] == 0:
        raise ValueError("mask_BT has no rows: the batch is empty (allowed: B >= 1)")
    if not allow_empty_rows:
        empty = (mask_BT.bool().sum(dim=-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"mask_BT rows {empty[:8]} have no response token (allowed: >= 1 per row)")


def _check_options(algo, loss_agg, clip_low, clip_high, dual_clip_c, norm_len) -> None:
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if not (isinstance(clip_low, (int, float)) and 0.0 <= clip_low < 1.0):
        raise ValueError(f"clip_low must be a float with 0 <= clip_low < 1, got {clip_low!r}")
    if not (isinstance(clip_high, (int, float)) and 0.0 <= clip_high < math.inf):
        raise ValueError(f"clip_high must be a finite float >= 0, got {clip_high!r}")
    if dual_clip_c is not None and not (isinstance(dual_clip_c, (int, float)) and 1.0 < dual_clip_c < math.inf):
        raise ValueError(f"dual_clip_c must be None or a finite float > 1, got {dual_clip_c!r}")
    if norm_len is not None and not (isinstance(norm_len, (int, float)) and 0 < norm_len < math.inf):
        raise ValueError(f"norm_len must be None or a finite number > 0, got {norm_len!r}")


def _check_advantages(advantages, mask_BT: torch.Tensor, algo: str) -> None:
    B, T = mask_BT.shape
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in ((B,), (B, T)):
        raise ValueError(f"advantages must have shape ({B},) or ({B}, {T}), got {_shape(advantages)}")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating tensor, got dtype {advantages.dtype}")
    if advantages.ndim == 2 and algo in ("gspo", "gspo_unnormalized"):
        keep_BT = mask_BT.bool()
        high_B = torch.where(keep_BT, advantages, -math.inf).amax(dim=-1)
        low_B = torch.where(keep_BT, advantages, math.inf).amin(dim=-1)
        if not bool((high_B == low_B).all()):
            raise ValueError(
                f"advantages vary within a response, which algo={algo!r} cannot use (one ratio per "
                "sequence needs one advantage per sequence): pass (B,) advantages, or use algo='gspo_token'"
            )


# ---------------------------------------------------------------- building blocks


def aggregate_loss(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, loss_agg: str, *, norm_len: float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar over the response tokens (masked positions ignored).

    token-mean: sum(L M) / sum(M);  seq-mean-token-mean: mean_i sum_t L M / |y_i|;
    seq-mean-token-sum: mean_i sum_t L M;  seq-mean-token-sum-norm: mean_i sum_t L M / norm_len
    (norm_len defaults to T; pass the fixed max response length so the scale never drifts).
    """
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if tuple(loss_BT.shape) != tuple(mask_BT.shape) or loss_BT.ndim != 2:
        raise ValueError(
            f"loss_BT and mask_BT must have the same (B, T) shape, got {_shape(loss_BT)} and {_shape(mask_BT)}"
        )
    if norm_len is not None and not (isinstance(norm_len, (int, float)) and 0 < norm_len < math.inf):
        raise ValueError(f"norm_len must be None or a finite number > 0, got {norm_len!r}")
    keep_BT = mask_BT.bool()
    loss_BT = torch.where(keep_BT, loss_BT, torch.zeros_like(loss_BT))
    if loss_agg == "token-mean":
        return loss_BT.sum() / keep_BT.sum()
    seq_B = loss_BT.sum(dim=-1)
    if loss_agg == "seq-mean-token-mean":
        seq_B = seq_B / keep_BT.sum(dim=-1)
    elif loss_agg == "seq-mean-token-sum-norm":
        seq_B = seq_B / (loss_BT.shape[-1] if norm_len is None else norm_len)
    return seq_B.mean()


def kl_penalty(logp_BT: torch.Tensor, logp_ref_BT: torch.Tensor, mask_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, 0 at masked positions.

    k1 = logp - ref;  k2 = (logp - ref)^2 / 2;  k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman).
    Differentiable wrt both inputs: ``masked_mean`` it as a loss term, or subtract it from rewards.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    _check_logp("logp_BT", logp_BT, None)
    _check_logp("logp_ref_BT", logp_ref_BT, tuple(logp_BT.shape))
    _check_mask(mask_BT, tuple(logp_BT.shape), allow_empty_rows=True)
    dtype = torch.promote_types(torch.promote_types(logp_BT.dtype, logp_ref_BT.dtype), torch.float32)
    keep_BT = mask_BT.bool()
    zero = torch.zeros((), dtype=dtype, device=logp_BT.device)
    delta_BT = torch.where(keep_BT, logp_ref_BT.to(dtype), zero) - torch.where(keep_BT, logp_BT.to(dtype), zero)
    if kind == "k1":
        kl_BT = -delta_BT
    elif kind == "k2":
        kl_BT = 0.5 * delta_BT.square()
    else:
        kl_BT = k3_from_log_ratio(delta_BT)
    return torch.where(keep_BT, kl_BT, zero)


def _log_ratio_BT(
    d_BT: torch.Tensor, logp_new_BT: torch.Tensor, mask_BT: torch.Tensor, algo: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ONE place where the algorithms differ: the log of the ratio each token's term is clipped on.

    Returns (log_ratio_BT, seq_clamped_B). d_BT is already clamped and 0 at masked positions.
    """
    if algo == "grpo":
        return d_BT, torch.zeros(d_BT.shape[0], dtype=torch.bool, device=d_BT.device)
    log_seq_B = d_BT.sum(dim=-1)
    if algo != "gspo_unnormalized":
        log_seq_B = log_seq_B / mask_BT.sum(dim=-1)  # geometric mean: the paper's s_i
    # The mean of clamped d is within the bound already; the unnormalised sum is not (T * 20).
    seq_clamped_B = log_seq_B.detach().abs() > LOG_RATIO_BOUND
    log_seq_B = log_seq_B.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if algo == "gspo_token":
        # log s_it = sg[log s_i] + logp_it - sg[logp_it]: value s_i, gradient of token t's own logp.
        return log_seq_B.detach().unsqueeze(-1) + (logp_new_BT - logp_new_BT.detach()), seq_clamped_B
    return log_seq_B.unsqueeze(-1).expand_as(d_BT), seq_clamped_B


def _clipped_surrogate(
    ratio_BT: torch.Tensor, adv_BT: torch.Tensor, clip_low: float, clip_high: float, dual_clip_c: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token objective (to MAXIMISE) and the flags of where clip / dual clip zeroed the gradient."""
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high) * adv_BT
    objective_BT = torch.minimum(unclipped_BT, clipped_BT)
    clip_active_BT = (clipped_BT < unclipped_BT).detach()
    dual_active_BT = torch.zeros_like(clip_active_BT)
    if dual_clip_c is not None:
        negative_BT = adv_BT < 0
        bound_BT = dual_clip_c * adv_BT  # for A < 0 the objective may not fall below c A
        dual_active_BT = (negative_BT & (bound_BT > objective_BT)).detach()
        objective_BT = torch.where(negative_BT, torch.maximum(objective_BT, bound_BT), objective_BT)
    return objective_BT, clip_active_BT, dual_active_BT


def _token_advantages(advantages: torch.Tensor, keep_BT: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    adv = advantages.detach().to(dtype)
    adv_BT = adv.unsqueeze(-1).expand(keep_BT.shape) if adv.ndim == 1 else adv
    return torch.where(keep_BT, adv_BT, torch.zeros((), dtype=dtype, device=adv.device))


def _masked_inputs(logp_new_BT, logp_old_BT, advantages, mask_BT):
    """(logp_new, logp_old, adv_BT, keep_BT) in at least fp32, every masked position set to 0."""
    # Log ratios in (at least) fp32: bf16 log-probs differ in the 3rd digit, ratios need more.
    dtype = torch.promote_types(torch.promote_types(logp_new_BT.dtype, logp_old_BT.dtype), torch.float32)
    keep_BT = mask_BT.bool()
    zero = torch.zeros((), dtype=dtype, device=logp_new_BT.device)
    # torch.where BEFORE any arithmetic: garbage at masked positions never reaches a product,
    # and where's backward gives those positions an exact 0 gradient.
    logp_new_BT = torch.where(keep_BT, logp_new_BT.to(dtype), zero)
    logp_old_BT = torch.where(keep_BT, logp_old_BT.detach().to(dtype), zero)
    return logp_new_BT, logp_old_BT, _token_advantages(advantages, keep_BT, dtype), keep_BT


# ---------------------------------------------------------------- the objective


def policy_loss(
    logp_new_BT: torch.Tensor,
    logp_old_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    algo: str,
    clip_low: float,
    clip_high: float,
    loss_agg: str = "seq-mean-token-mean",
    dual_clip_c: float | None = None,
    norm_len: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy loss (to minimise) and its metrics (see docs/metrics.md).

    logp_new_BT carries the gradient; logp_old_BT and advantages are treated as constants.
    advantages: (B,) per sequence or (B, T) per token (for gspo / gspo_unnormalized it must be
    constant over each response). mask_BT: 1 on response tokens; every row needs one. Masked
    positions may hold anything (NaN, inf): they change neither loss, gradient nor metrics.
    norm_len is used by seq-mean-token-sum-norm only (default T).
    """
    _check_options(algo, loss_agg, clip_low, clip_high, dual_clip_c, norm_len)
    _check_logp("logp_new_BT", logp_new_BT, None)
    shape = tuple(logp_new_BT.shape)
    _check_logp("logp_old_BT", logp_old_BT, shape)
    _check_mask(mask_BT, shape, allow_empty_rows=False)
    _check_advantages(advantages, mask_BT, algo)

    logp_new_BT, logp_old_BT, adv_BT, keep_BT = _masked_inputs(logp_new_BT, logp_old_BT, advantages, mask_BT)
    raw_d_BT = logp_new_BT - logp_old_BT
    token_clamped_BT = raw_d_BT.detach().abs() > LOG_RATIO_BOUND
    # Clamp before exp: exp(88) overflows fp32. +-20 (as verl) is far outside any clip range, so
    # the clamp only changes tokens whose probability moved by a factor > 4.8e8.
    d_BT = raw_d_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    log_ratio_BT, seq_clamped_B = _log_ratio_BT(d_BT, logp_new_BT, keep_BT, algo)
    ratio_BT = torch.exp(log_ratio_BT)

    objective_BT, clip_active_BT, dual_active_BT = _clipped_surrogate(
        ratio_BT, adv_BT, clip_low, clip_high, dual_clip_c
    )
    loss = aggregate_loss(-objective_BT, keep_BT, loss_agg, norm_len=norm_len)
    metrics = policy_metrics(
        d_BT,
        ratio_BT,
        keep_BT,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_active_BT=clip_active_BT,
        dual_active_BT=dual_active_BT,
        clamped_BT=token_clamped_BT | seq_clamped_B.unsqueeze(-1),
    )
    return loss, metrics
