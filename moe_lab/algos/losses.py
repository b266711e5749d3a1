"""Policy loss around the objective registry (``moe_lab.algos.objectives``), and the KL estimators.

Everything is a pure tensor function. ``policy_loss`` returns the loss to MINIMISE and a dict of
detached metrics. Switching algorithm changes one thing, the objective function picked from
``OBJECTIVES`` (per-token loss terms + its own metrics); input checks, masking, the +-20 clamp,
rollout-correction weights, aggregation and the shared metrics are here, once.

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
import numbers

import torch

from moe_lab.config import constants as C
from moe_lab.algos.objectives import OBJECTIVES, ObjectiveInputs, ObjectiveTerms, make_params
from moe_lab.algos.ratio_metrics import LOG_RATIO_BOUND, k3_from_log_ratio, masked_mean, masked_var, policy_metrics

__all__ = [
    "masked_mean",
    "masked_var",
    "aggregate_loss",
    "kl_penalty",
    "policy_loss",
]

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


def _real(x) -> bool:
    """A real number of any kind (Python, NumPy scalar), not a bool: what callers pass as bounds."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_options(algo, loss_agg, clip_low, clip_high, dual_clip_c, norm_len) -> None:
    if algo not in OBJECTIVES:
        raise ValueError(f"algo must be one of {C.ALGOS}, got {algo!r}")
    if loss_agg not in C.LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {C.LOSS_AGGS}, got {loss_agg!r}")
    low_max = OBJECTIVES[algo].clip_low_max
    if low_max == math.inf:  # cispo (ratios >= 0: clip_low >= 1 = no lower bound), gmpo/rspo (log space)
        if not (_real(clip_low) and 0.0 <= clip_low < math.inf):
            raise ValueError(f"clip_low must be a finite float >= 0 for algo={algo!r}, got {clip_low!r}")
    elif not (_real(clip_low) and 0.0 <= clip_low < low_max):
        raise ValueError(f"clip_low must be a float with 0 <= clip_low < 1, got {clip_low!r}")
    if dual_clip_c is not None and not OBJECTIVES[algo].dual_clip:
        raise ValueError(f"dual_clip_c applies to the PPO-clip algos {C.PPO_CLIP_ALGOS} only, not algo={algo!r}: "
                         "pass None")
    if not (_real(clip_high) and 0.0 <= clip_high < math.inf):
        raise ValueError(f"clip_high must be a finite float >= 0, got {clip_high!r}")
    if dual_clip_c is not None and not (_real(dual_clip_c) and 1.0 < dual_clip_c < math.inf):
        raise ValueError(f"dual_clip_c must be None or a finite float > 1, got {dual_clip_c!r}")
    if norm_len is not None and not (_real(norm_len) and 0 < norm_len < math.inf):
        raise ValueError(f"norm_len must be None or a finite number > 0, got {norm_len!r}")


def _check_advantages(advantages, mask_BT: torch.Tensor, algo: str) -> None:
    B, T = mask_BT.shape
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in ((B,), (B, T)):
        raise ValueError(f"advantages must have shape ({B},) or ({B}, {T}), got {_shape(advantages)}")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be a floating tensor, got dtype {advantages.dtype}")
    if advantages.ndim == 2 and OBJECTIVES[algo].sequence_advantage:  # gmpo/rspo average them (as verl)
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
    if loss_agg not in C.LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {C.LOSS_AGGS}, got {loss_agg!r}")
    if tuple(loss_BT.shape) != tuple(mask_BT.shape) or loss_BT.ndim != 2:
        raise ValueError(
            f"loss_BT and mask_BT must have the same (B, T) shape, got {_shape(loss_BT)} and {_shape(mask_BT)}"
        )
    if norm_len is not None and not (_real(norm_len) and 0 < norm_len < math.inf):
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
    if kind not in C.KL_KINDS:
        raise ValueError(f"kind must be one of {C.KL_KINDS}, got {kind!r}")
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


def _check_token_weights(name: str, x, shape: tuple[int, ...]) -> None:
    if x is None:
        return
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or not x.is_floating_point():
        raise ValueError(f"{name} must be None or a floating tensor of shape {shape}, got {_shape(x)}")


def _fold_is_weights(w_BT: torch.Tensor, keep_BT: torch.Tensor, sequence_level: bool) -> torch.Tensor:
    """The factor each per-token term is multiplied by: the weight itself, or for an objective with
    one geometric-mean ratio per sequence (gmpo, rspo) the geometric mean of its tokens' weights,
    broadcast, as verl's geo_mean does. A masked-out token (w = 0) enters as log(1e-10) as there
    (verl takes log(w + 1e-10)), so it scales its sequence down by 1e-10^(1/|y_i|) rather than
    dropping it; the floor instead of verl's + 1e-10 keeps weights of 1 exactly 1."""
    if not sequence_level:
        return w_BT
    log_w_BT = torch.where(keep_BT, torch.log(w_BT.clamp_min(1e-10)), torch.zeros_like(w_BT))
    return torch.exp(log_w_BT.sum(dim=-1) / keep_BT.sum(dim=-1)).unsqueeze(-1).expand_as(w_BT)


def _check_tensors(logp_new_BT, logp_old_BT, advantages, mask_BT, algo, router_gamma_BT, is_weights_BT) -> None:
    """policy_loss's tensor checks, before any arithmetic: shapes, dtypes, mask values, advantages."""
    _check_logp("logp_new_BT", logp_new_BT, None)
    shape = tuple(logp_new_BT.shape)
    _check_logp("logp_old_BT", logp_old_BT, shape)
    _check_mask(mask_BT, shape, allow_empty_rows=False)
    _check_advantages(advantages, mask_BT, algo)
    _check_token_weights("router_gamma_BT", router_gamma_BT, shape)
    _check_token_weights("is_weights_BT", is_weights_BT, shape)


def _clamped_log_ratio(logp_new_BT: torch.Tensor, logp_old_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_BT, clamped_BT): the token log-ratio clamped to +-LOG_RATIO_BOUND, and the tokens whose log-ratio the clamp changed."""
    raw_d_BT = logp_new_BT - logp_old_BT
    token_clamped_BT = raw_d_BT.detach().abs() > LOG_RATIO_BOUND
    # Clamp before exp: exp(88) overflows fp32. +-20 (as verl) is far outside any clip range, so
    # the clamp only changes tokens whose probability moved by a factor > 4.8e8.
    return raw_d_BT.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), token_clamped_BT


def _is_weighted(loss_BT: torch.Tensor, is_weights_BT: torch.Tensor | None, keep_BT: torch.Tensor,
                 sequence_level: bool, dtype: torch.dtype) -> torch.Tensor:
    """The per-token terms times the rollout-correction weights (cast to the log-ratio's ``dtype``, folded
    per ``_fold_is_weights``)."""
    if is_weights_BT is None:  # no multiplication at all: the default path stays bit-identical
        return loss_BT
    w_BT = torch.where(keep_BT, is_weights_BT.detach().to(dtype), torch.zeros((), dtype=dtype))
    return loss_BT * _fold_is_weights(w_BT, keep_BT, sequence_level)


def _loss_metrics(terms: ObjectiveTerms, d_BT: torch.Tensor, keep_BT: torch.Tensor,
                  token_clamped_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """The shared ratio / clip metrics (policy_metrics) and the objective's own, detached fp32 scalars."""
    metric_low, metric_high = terms.metric_range
    metrics = policy_metrics(
        d_BT,
        terms.ratio_BT,
        keep_BT,
        clip_low=metric_low,
        clip_high=metric_high,
        clip_active_BT=terms.clip_active_BT,
        dual_active_BT=terms.dual_active_BT,
        clamped_BT=token_clamped_BT | terms.seq_clamped_B.unsqueeze(-1),
    )
    metrics.update({key: value.detach().to(torch.float32).reshape(()) for key, value in terms.metrics.items()})
    return metrics


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
    router_gamma_BT: torch.Tensor | None = None,
    is_weights_BT: torch.Tensor | None = None,
    **knobs: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss (to minimise) of objective ``algo`` and its metrics (see docs/metrics.md).

    logp_new_BT carries the gradient; logp_old_BT, advantages, router_gamma_BT and is_weights_BT
    are treated as constants. advantages: (B,) per sequence or (B, T) per token (for gspo /
    gspo_unnormalized it must be constant over each response). mask_BT: 1 on response tokens; every
    row needs one. Masked positions may hold anything (NaN, inf): they change neither loss, gradient
    nor metrics. norm_len is used by seq-mean-token-sum-norm only (default T).
    knobs: each objective's own parameters as ``<prefix>_<field>`` keyword arguments (``sapo_tau_pos``,
    ``rspo_floor``, ``dppo_ratio_cap``, ``vespo_k_pos``...; declared with defaults and bounds in
    ``moe_lab/config/objective_specs.py``). router_gamma_BT: RSPO's per-token router-shift ratio (None = 1: unchanged
    router). is_weights_BT: rollout-correction weights
    (``rollout_correction.rollout_correction``), multiplied into the per-token terms before the
    aggregation (for gmpo/rspo folded per sequence as a geometric mean, see ``_fold_is_weights``).
    For dppo_tv / dppo_kl clip_low / clip_high are the divergence thresholds (verl's clip_ratio_low / high).
    """
    _check_options(algo, loss_agg, clip_low, clip_high, dual_clip_c, norm_len)
    params = make_params(algo, knobs)
    clip_low, clip_high = float(clip_low), float(clip_high)  # plain floats, as the knobs
    dual_clip_c = None if dual_clip_c is None else float(dual_clip_c)
    norm_len = None if norm_len is None else float(norm_len)
    _check_tensors(logp_new_BT, logp_old_BT, advantages, mask_BT, algo, router_gamma_BT, is_weights_BT)

    logp_new_BT, logp_old_BT, adv_BT, keep_BT = _masked_inputs(logp_new_BT, logp_old_BT, advantages, mask_BT)
    d_BT, token_clamped_BT = _clamped_log_ratio(logp_new_BT, logp_old_BT)
    dtype = d_BT.dtype
    if router_gamma_BT is not None:
        router_gamma_BT = torch.where(keep_BT, router_gamma_BT.detach().to(dtype), torch.ones((), dtype=dtype))
    objective = OBJECTIVES[algo]
    terms = objective.fn(ObjectiveInputs(d_BT, logp_new_BT, adv_BT, keep_BT, clip_low, clip_high, dual_clip_c,
                                         router_gamma_BT=router_gamma_BT, logp_old_BT=logp_old_BT), params)
    loss_BT = _is_weighted(terms.loss_BT, is_weights_BT, keep_BT, objective.sequence_level, dtype)
    loss = aggregate_loss(loss_BT, keep_BT, loss_agg, norm_len=norm_len)
    return loss, _loss_metrics(terms, d_BT, keep_BT, token_clamped_BT)

