"""The objective registry: one small pure function per ``rl.algo``, mapping prepared log-ratios,
advantages and mask to per-token loss terms (to MINIMISE) plus the objective's own metrics.

``losses.policy_loss`` does everything the objectives share, in one place: input checks, masking
(every masked position is 0 before any arithmetic), the +-20 log-ratio clamp, rollout-correction
weights, aggregation (``aggregate_loss``) and the shared metrics (``ratio_metrics.policy_metrics``).
Adding an objective = one function here, registered with ``@register("<name>")``, + one row in
``moe_lab/config/objective_specs.py`` (its paper clip, traits and knobs; constants.ALGOS, PAPER_CLIP, the trait
tuples and the config fields follow from it; docs/extending.md). A row without a function, or a function
without a row, fails at import. An objective with knobs receives them as one object, ``fn(inputs, params)``
(a frozen dataclass built from the row's ``Knobs``: ``objective_params.params_class``); ``policy_loss`` takes
each as the keyword argument ``<prefix>_<name>`` (e.g. ``sapo_tau_pos``, ``dppo_ratio_cap``), checked against
the declaration, and the run's config field of the same name (``rl.sapo_tau_pos``) feeds it.

| algo | per-token loss term L[i,t] (A = advantage, d = clamped log-ratio, w = exp(d)) | default clip | paper |
|---|---|---|---|
| grpo | -min(w A, clip(w, 1-lo, 1+hi) A) (+ dual clip) | 0.2 / 0.27 | DeepSeekMath / DAPO |
| gspo | the same on s_i = exp(mean_t d) broadcast | 3e-4 / 4e-4 | arXiv:2507.18071 |
| gspo_token | the same on s_it = sg(s_i) w_t / sg(w_t) | 3e-4 / 4e-4 | arXiv:2507.18071 |
| gspo_unnormalized | the same on exp(sum_t d) | 3e-4 / 4e-4 | (ablation) |
| sapo | -f(w) A, f(w) = sigmoid(tau (w - 1)) 4 / tau, tau = tau_pos if A > 0 else tau_neg | (metrics only) | arXiv:2511.20347 |
| cispo | -sg(clip(w, 1-lo, 1+hi)) A logp_new | 1.0 / 0.28 (no lower bound) | arXiv:2506.13585 |
| gmpo | -A_i exp(mean_t c_t), c_t = d_t clipped to [-lo, hi] on A's side only | 0.4 / 0.4 (log space) | arXiv:2507.20673 |
| rspo | gmpo on d_t + log sg(max(gamma_t, floor)) | 0.4 / 0.4 (log space) | arXiv:2510.23027 |
| dppo_tv | -A sg(min(w, cap)) logp_new M, M = 0 where p_new - p_old leaves [-lo, hi] on A's side | 0.15 / 0.15 (TV) | arXiv:2602.04879 |
| dppo_kl | the same with M from the binary KL(p_old, p_new) | 0.05 / 0.05 (KL) | arXiv:2602.04879 |
| luspo | gspo's term times |y_i| | 3e-4 / 4e-4 | arXiv:2602.05261 |
| vespo | -sg(phi(W_i)) A logp_new, W_i = exp(sum_t d), phi(W) = W^k e^(lam (1 - W)) | (metrics only) | arXiv:2602.10693 |

Sequence-level objectives (gmpo, rspo) broadcast the per-sequence term over the response, so
``seq-mean-token-mean`` gives mean_i of it (verl's ``geo_mean`` always takes that mean).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moe_lab.algos.objective_params import (  # noqa: F401 - the defaults are re-exported
    DPPO_RATIO_CAP_DEFAULT, RSPO_FLOOR_DEFAULT, SAPO_TAU_NEG_DEFAULT, SAPO_TAU_POS_DEFAULT, VESPO_SHAPE_DEFAULT,
    DppoParams, NoParams, Objective, ObjectiveRegistry, RspoParams, SapoParams, VespoParams, check_knob)
from moe_lab.algos.ratio_metrics import LOG_RATIO_BOUND, masked_mean
from moe_lab.algos.reductions import SEQ_MEAN, TOKEN_MEAN
from moe_lab.config.constants import BASELINE_ALGO, PAPER_CLIP
from moe_lab.config.objective_specs import OBJECTIVE_SPECS

__all__ = ["ObjectiveInputs", "ObjectiveTerms", "Objective", "ObjectiveRegistry", "OBJECTIVES", "register",
           "SapoParams", "RspoParams", "DppoParams", "VespoParams", "knob_names", "make_params",
           "RSPO_FLOOR_DEFAULT", "SAPO_TAU_POS_DEFAULT", "SAPO_TAU_NEG_DEFAULT", "DPPO_RATIO_CAP_DEFAULT",
           "VESPO_SHAPE_DEFAULT"]


# where an objective whose bounds are no ratio bounds reports clip_frac/*
_GRPO_METRIC_RANGE = PAPER_CLIP[BASELINE_ALGO]


@dataclass(frozen=True)
class ObjectiveInputs:
    """What every objective may read. All (B, T) tensors are 0 at masked positions."""

    d_BT: torch.Tensor  # logp_new - logp_old, clamped to +-LOG_RATIO_BOUND; carries the gradient
    logp_new_BT: torch.Tensor  # carries the gradient
    adv_BT: torch.Tensor  # detached
    keep_BT: torch.Tensor  # bool
    clip_low: float
    clip_high: float
    dual_clip_c: float | None = None
    router_gamma_BT: torch.Tensor | None = None  # 1 at masked positions; None = unchanged router
    logp_old_BT: torch.Tensor | None = None  # detached, 0 at masked positions (DPPO's probabilities)


@dataclass
class ObjectiveTerms:
    """An objective's output. ratio_BT / metric_range feed the shared clip and ratio metrics."""

    loss_BT: torch.Tensor
    ratio_BT: torch.Tensor  # the ratio clip_frac/* is measured on
    clip_active_BT: torch.Tensor  # tokens whose gradient the clip zeroed
    dual_active_BT: torch.Tensor
    seq_clamped_B: torch.Tensor  # sequences whose log-ratio hit the +-20 clamp
    metric_range: tuple[float, float]  # (clip_low, clip_high) of the metrics: range [1 - lo, 1 + hi]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


_REGISTRY = ObjectiveRegistry(OBJECTIVE_SPECS)
register = _REGISTRY.register


# ---------------------------------------------------------------- the PPO-clip family


def _none_B(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)


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


def _seq_log_ratio_B(d_BT: torch.Tensor, keep_BT: torch.Tensor, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    log_seq_B = d_BT.sum(dim=-1)
    if normalize:
        log_seq_B = log_seq_B / keep_BT.sum(dim=-1)  # geometric mean: GSPO's s_i
    # The mean of clamped d is within the bound already; the unnormalised sum is not (T * 20).
    seq_clamped_B = log_seq_B.detach().abs() > LOG_RATIO_BOUND
    return log_seq_B.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), seq_clamped_B


def _ppo_clip(x: ObjectiveInputs, log_ratio_BT: torch.Tensor, seq_clamped_B: torch.Tensor) -> ObjectiveTerms:
    ratio_BT = torch.exp(log_ratio_BT)
    objective_BT, clip_active_BT, dual_active_BT = _clipped_surrogate(
        ratio_BT, x.adv_BT, x.clip_low, x.clip_high, x.dual_clip_c
    )
    return ObjectiveTerms(-objective_BT, ratio_BT, clip_active_BT, dual_active_BT, seq_clamped_B,
                          (x.clip_low, x.clip_high))


@register("grpo")
def grpo(x: ObjectiveInputs, p: NoParams) -> ObjectiveTerms:
    """PPO clip on the token ratio w = exp(d)."""
    return _ppo_clip(x, x.d_BT, _none_B(x.d_BT))


@register("gspo", sequence_advantage=True)
def gspo(x: ObjectiveInputs, p: NoParams) -> ObjectiveTerms:
    """PPO clip on GSPO's length-normalised sequence ratio s_i, broadcast over the response."""
    log_seq_B, clamped_B = _seq_log_ratio_B(x.d_BT, x.keep_BT, normalize=True)
    return _ppo_clip(x, log_seq_B.unsqueeze(-1).expand_as(x.d_BT), clamped_B)


@register("gspo_unnormalized", sequence_advantage=True)
def gspo_unnormalized(x: ObjectiveInputs, p: NoParams) -> ObjectiveTerms:
    """Ablation: the sequence likelihood ratio exp(sum_t d) without GSPO's 1/|y_i|."""
    log_seq_B, clamped_B = _seq_log_ratio_B(x.d_BT, x.keep_BT, normalize=False)
    return _ppo_clip(x, log_seq_B.unsqueeze(-1).expand_as(x.d_BT), clamped_B)


@register("gspo_token")
def gspo_token(x: ObjectiveInputs, p: NoParams) -> ObjectiveTerms:
    """GSPO-token: log s_it = sg[log s_i] + logp_it - sg[logp_it] (value s_i, gradient of token t's logp)."""
    log_seq_B, clamped_B = _seq_log_ratio_B(x.d_BT, x.keep_BT, normalize=True)
    log_ratio_BT = log_seq_B.detach().unsqueeze(-1) + (x.logp_new_BT - x.logp_new_BT.detach())
    return _ppo_clip(x, log_ratio_BT, clamped_B)


# ---------------------------------------------------------------- SAPO


@register("sapo", reductions={"objective/sapo_gate_mean": TOKEN_MEAN})
def sapo(x: ObjectiveInputs, p: SapoParams) -> ObjectiveTerms:
    """SAPO (arXiv:2511.20347): a soft gate instead of the hard clip.

    f(w) = sigmoid(tau (w - 1)) * 4 / tau, L = -f(w) A, with tau = p.tau_pos (rl.sapo_tau_pos) for A > 0
    and p.tau_neg for A <= 0 (as verl: a zero advantage takes tau_neg; its term is 0 anyway).
    df/dw = 4 sigma (1 - sigma) = 1 at w = 1, so on-policy SAPO is the plain policy gradient; the
    metric ``objective/sapo_gate_mean`` is the token mean of that factor (1 = no damping).
    The paper aggregates seq-mean-token-mean (the default); other loss_agg values are honoured.
    """
    # taus built in the log-ratios' dtype: a float32 1.05 would differ from the float64 one by 4e-8.
    tau_BT = torch.where(x.adv_BT > 0, torch.full_like(x.d_BT, p.tau_pos), torch.full_like(x.d_BT, p.tau_neg))
    ratio_BT = torch.exp(x.d_BT)
    sig_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0))
    gate_BT = sig_BT * (4.0 / tau_BT)
    slope_BT = (4.0 * sig_BT * (1.0 - sig_BT)).detach()
    none_BT = torch.zeros_like(x.keep_BT)
    return ObjectiveTerms(-gate_BT * x.adv_BT, ratio_BT, none_BT, none_BT, _none_B(x.d_BT),
                          (x.clip_low, x.clip_high), {"objective/sapo_gate_mean": masked_mean(slope_BT, x.keep_BT)})


# ---------------------------------------------------------------- CISPO


@register("cispo", reductions={"objective/cispo_weight_mean": TOKEN_MEAN})
def cispo(x: ObjectiveInputs, p: NoParams) -> ObjectiveTerms:
    """CISPO (MiniMax-M1, arXiv:2506.13585): L = -sg(clip(w, 1 - lo, 1 + hi)) A logp_new.

    The gradient never flows through the weight: every token keeps sg(w_clipped) A grad logp, none is
    zeroed (clip_frac/active is 0; clip_frac/out_of_range is the share of clipped weights).
    Default range (constants.PAPER_CLIP): clip_low = 1.0, clip_high = 0.28. The paper imposes no lower
    bound on the IS weight ("set eps_low to a large value") and tunes only eps_high, whose value it
    does not publish; any clip_low >= 1 means no lower bound (ratios are >= 0). 0.28 is DAPO's
    clip-higher value (the baseline M1 compares with), also Trinity-RFT's CISPO default. The paper
    aggregates token-mean over the batch; moe_lab's default loss_agg (seq-mean-token-mean) applies
    unless rl.loss_agg says otherwise. As verl, the value uses logp_new itself (not the log-ratio):
    the same gradient, a different constant.
    """
    ratio_BT = torch.exp(x.d_BT)
    weight_BT = ratio_BT.clamp(1.0 - x.clip_low, 1.0 + x.clip_high).detach()
    none_BT = torch.zeros_like(x.keep_BT)
    return ObjectiveTerms(-weight_BT * x.adv_BT * x.logp_new_BT, ratio_BT, none_BT, none_BT, _none_B(x.d_BT),
                          (x.clip_low, x.clip_high),
                          {"objective/cispo_weight_mean": masked_mean(weight_BT, x.keep_BT)})


# ---------------------------------------------------------------- GMPO and RSPO


def _geometric_mean_terms(x: ObjectiveInputs, log_ratio_BT: torch.Tensor) -> ObjectiveTerms:
    """GMPO's sequence term on per-token log-ratios: clip each on the advantage's side, then
    ratio_i = exp(mean_t clipped), L_i = -A_i ratio_i (A_i = masked mean of the token advantages)."""
    sign_BT = torch.sign(x.adv_BT)
    bounded_BT = log_ratio_BT.clamp(-x.clip_low, x.clip_high)
    # A > 0: min(d, clip(d)) clips only above; A < 0: max(d, clip(d)) only below (the paper's
    # sgn(A) min(sgn(A) d, sgn(A) clip(d))); A = 0: 0, its term is 0 whatever the ratio.
    clipped_BT = sign_BT * torch.minimum(sign_BT * log_ratio_BT, sign_BT * bounded_BT)
    count_B = x.keep_BT.sum(dim=-1)
    ratio_B = torch.exp(clipped_BT.sum(dim=-1) / count_B)
    adv_B = x.adv_BT.sum(dim=-1) / count_B
    clip_active_BT = ((clipped_BT != log_ratio_BT) & (sign_BT != 0)).detach()  # this token's gradient is 0
    loss_BT = (-adv_B * ratio_B).unsqueeze(-1).expand_as(x.d_BT)
    lo, hi = 1.0 - math.exp(-x.clip_low), math.exp(x.clip_high) - 1.0  # the log range as ratio bounds
    return ObjectiveTerms(loss_BT, torch.exp(log_ratio_BT), clip_active_BT, torch.zeros_like(clip_active_BT),
                          _none_B(x.d_BT), (lo, hi), {"objective/seq_ratio_mean": ratio_B.detach().mean()})


@register("gmpo", reductions={"objective/seq_ratio_mean": SEQ_MEAN})
def gmpo(x: ObjectiveInputs, p: NoParams) -> ObjectiveTerms:
    """GMPO (arXiv:2507.20673): geometric mean of token ratios clipped in log space, default +-0.4.

    As in the paper (and verl's ``geo_mean``) the clip range is on log(w): [-clip_low, clip_high],
    i.e. w in [e^-0.4, e^0.4]; clip_frac/* report that range.
    """
    return _geometric_mean_terms(x, x.d_BT)


@register("rspo", reductions={"objective/seq_ratio_mean": SEQ_MEAN, "objective/rspo_gamma_mean": TOKEN_MEAN,
                              "objective/rspo_floor_frac": TOKEN_MEAN})
def rspo(x: ObjectiveInputs, p: RspoParams) -> ObjectiveTerms:
    """RSPO (arXiv:2510.23027): GMPO with each token's ratio scaled by sg(max(gamma_t, floor)) BEFORE
    the token clip and the geometric mean; gamma_t = exp(-mean over layers and old top-k experts of
    |log p_router_new - log p_router_old|) comes from the caller (``router_gamma_BT``). Without it
    (None) gamma = 1: the router counts as unchanged and rspo equals gmpo.
    """
    if x.router_gamma_BT is None:
        scaled_BT = x.d_BT
        gamma_BT = torch.ones_like(x.d_BT).detach()
    else:  # policy_loss already set masked positions to 1 (log 1 = 0 adds nothing)
        gamma_BT = x.router_gamma_BT.detach().to(x.d_BT.dtype).clamp_min(p.floor)
        scaled_BT = x.d_BT + torch.log(gamma_BT)
    terms = _geometric_mean_terms(x, scaled_BT)
    raw_BT = gamma_BT if x.router_gamma_BT is None else x.router_gamma_BT.detach().to(x.d_BT.dtype)
    terms.metrics["objective/rspo_gamma_mean"] = masked_mean(gamma_BT, x.keep_BT)
    terms.metrics["objective/rspo_floor_frac"] = masked_mean((raw_BT < p.floor).to(x.d_BT.dtype), x.keep_BT)
    return terms


# ---------------------------------------------------------------- DPPO

_DPPO_REDUCTIONS = {"objective/dppo_divergence_mean": TOKEN_MEAN, "objective/dppo_truncated_frac": TOKEN_MEAN}


def _dppo_terms(x: ObjectiveInputs, p: DppoParams, keep_grad_BT: torch.Tensor,
                divergence_BT: torch.Tensor) -> ObjectiveTerms:
    """DPPO's shared term: L = -A sg(min(w, cap)) logp_new on the tokens the divergence mask keeps."""
    ratio_BT = torch.exp(x.d_BT)
    weight_BT = ratio_BT.clamp(max=p.ratio_cap).detach()
    # A multiplication by the 0/1 mask (not a where): a masked token keeps its loss value 0 * term, as verl.
    loss_BT = -x.adv_BT * weight_BT * x.logp_new_BT * keep_grad_BT.to(x.d_BT.dtype)
    dropped_BT = ~keep_grad_BT & x.keep_BT
    truncated_BT = (ratio_BT.detach() > p.ratio_cap) & keep_grad_BT
    low, high = _GRPO_METRIC_RANGE  # the thresholds are not ratio bounds: clip_frac/low|high on GRPO's range
    return ObjectiveTerms(loss_BT, ratio_BT, dropped_BT, torch.zeros_like(dropped_BT), _none_B(x.d_BT), (low, high),
                          {"objective/dppo_divergence_mean": masked_mean(divergence_BT.detach(), x.keep_BT),
                           "objective/dppo_truncated_frac": masked_mean(truncated_BT.to(x.d_BT.dtype), x.keep_BT)})


@register("dppo_tv", reductions=_DPPO_REDUCTIONS)
def dppo_tv(x: ObjectiveInputs, p: DppoParams) -> ObjectiveTerms:
    """DPPO-Binary-TV (arXiv:2602.04879): PPO's ratio mask replaced by one on the sampled token's
    probability change p_new - p_old (the binary total-variation estimate): a token with A > 0 keeps its
    gradient while p_new - p_old <= clip_high, one with A <= 0 while p_new - p_old >= -clip_low; the
    others get none. Kept tokens get sg(min(w, dppo_ratio_cap)) A grad logp_new: truncated IS (verl's
    clip_ratio_c) instead of a dual clip. Checked equal to verl's compute_policy_loss_dppo_tv (tests).
    ``objective/dppo_divergence_mean`` = token mean of |p_new - p_old|; clip_frac/active = masked tokens.
    """
    p_new_BT, p_old_BT = torch.exp(x.logp_new_BT.detach()), torch.exp(x.logp_old_BT)
    change_BT = p_new_BT - p_old_BT
    keep_grad_BT = torch.where(x.adv_BT > 0, change_BT <= x.clip_high, change_BT >= -x.clip_low) & x.keep_BT
    return _dppo_terms(x, p, keep_grad_BT, change_BT.abs())


@register("dppo_kl", reductions=_DPPO_REDUCTIONS)
def dppo_kl(x: ObjectiveInputs, p: DppoParams) -> ObjectiveTerms:
    """DPPO-Binary-KL (arXiv:2602.04879): as dppo_tv with the binary KL(Bern(p_old) || Bern(p_new))
    = p_old log(p_old / p_new) + (1 - p_old) log((1 - p_old) / (1 - p_new)) as the divergence; the mask
    only stops a move away on the advantage's side (A > 0: p_new > p_old and KL > clip_high; A <= 0:
    p_new < p_old and KL > clip_low). The 1 - p terms carry verl's + 1e-8 (p = 1 would give log 0).
    """
    # p <= 1 for log-probs; a positive "log-prob" (no distribution) counts as 1, keeping the log finite.
    p_new_BT, p_old_BT = torch.exp(x.logp_new_BT.detach()).clamp(max=1.0), torch.exp(x.logp_old_BT).clamp(max=1.0)
    eps = 1e-8
    kl_BT = p_old_BT * (x.logp_old_BT - x.logp_new_BT.detach()) \
        + (1.0 - p_old_BT) * (torch.log(1.0 - p_old_BT + eps) - torch.log(1.0 - p_new_BT + eps))
    up_BT, down_BT = p_new_BT > p_old_BT, p_new_BT < p_old_BT
    blocked_BT = torch.where(x.adv_BT > 0, up_BT & (kl_BT > x.clip_high), down_BT & (kl_BT > x.clip_low))
    return _dppo_terms(x, p, ~blocked_BT & x.keep_BT, kl_BT)


# ---------------------------------------------------------------- LUSPO and VESPO


@register("luspo", sequence_advantage=True)
def luspo(x: ObjectiveInputs, p: NoParams) -> ObjectiveTerms:
    """LUSPO (arXiv:2602.05261): GSPO's clipped sequence term scaled by the response length |y_i|, undoing
    the length bias of GSPO's 1/|y_i| mean (its gradient per token no longer shrinks with length).
    The factor goes into the broadcast term, so the default ``seq-mean-token-mean`` gives
    mean_i |y_i| L_i^GSPO, TRL's ``loss_type="luspo"`` (with importance_sampling_level="sequence");
    other loss_agg values multiply the factor into their own weighting (token-mean: |y_i|^2 / sum|y|).
    Dual clip is not offered (TRL's two-sided ``delta`` is a different bound).
    """
    terms = gspo(x, NoParams())
    terms.loss_BT = terms.loss_BT * x.keep_BT.sum(dim=-1, keepdim=True).to(x.d_BT.dtype)
    return terms


@register("vespo", reductions={"objective/vespo_phi_mean": SEQ_MEAN})
def vespo(x: ObjectiveInputs, p: VespoParams) -> ObjectiveTerms:
    """VESPO (arXiv:2602.10693): a smooth kernel on the UNnormalised sequence ratio W_i = exp(sum_t d):
    phi(W) = W^k exp(lam (1 - W)) (phi(1) = 1, peak at W = k / lam), L = -sg(phi(W_i)) A logp_new;
    (k, lam) = (p.k_pos, p.lambda_pos) for A >= 0, (p.k_neg, p.lambda_neg) for A < 0 (TRL's split).
    As TRL's ``loss_type="vespo"``: log W clamped to [log 1e-8, 20] (TRL's bounds), phi computed in log
    space. Differences from TRL: TRL puts the vLLM rollout IS ratio inside W, here rollout-correction
    weights multiply the term like every objective's; TRL divides the token sum by the batch's token count
    (rl.loss_agg=token-mean here), the default here is seq-mean-token-mean. The paper's own kernel
    parameters and aggregation are not in what we could read (its abstract): TRL's defaults are used.
    ``objective/vespo_phi_mean`` = mean over sequences of phi (TRL's vespo/phi_seq_mean).
    """
    k_pos, lam_pos, k_neg, lam_neg = p.k_pos, p.lambda_pos, p.k_neg, p.lambda_neg
    log_w_B = x.d_BT.sum(dim=-1)
    low = math.log(1e-8)
    seq_clamped_B = (log_w_B.detach() < low) | (log_w_B.detach() > LOG_RATIO_BOUND)
    log_w_BT = log_w_B.detach().clamp(low, LOG_RATIO_BOUND).unsqueeze(-1).expand_as(x.d_BT)
    nonneg_BT = x.adv_BT >= 0
    k_BT = torch.where(nonneg_BT, torch.full_like(x.d_BT, k_pos), torch.full_like(x.d_BT, k_neg))
    lam_BT = torch.where(nonneg_BT, torch.full_like(x.d_BT, lam_pos), torch.full_like(x.d_BT, lam_neg))
    phi_BT = torch.exp(lam_BT + k_BT * log_w_BT - lam_BT * torch.exp(log_w_BT))
    none_BT = torch.zeros_like(x.keep_BT)
    phi_B = masked_mean(phi_BT, x.keep_BT, dim=-1)
    return ObjectiveTerms(-phi_BT * x.adv_BT * x.logp_new_BT, torch.exp(x.d_BT), none_BT, none_BT, seq_clamped_B,
                          (x.clip_low, x.clip_high), {"objective/vespo_phi_mean": phi_B.mean()})


OBJECTIVES: dict[str, Objective] = _REGISTRY.complete()


def knob_names(algo: str) -> list[str]:
    """The keyword arguments of policy_loss (and rl.* config fields) of ``algo``'s own parameters."""
    knobs = OBJECTIVES[algo].spec.knobs
    return [] if knobs is None else list(knobs.fields())


def make_params(algo: str, knobs: dict[str, Any]):
    """``algo``'s parameter object from ``<prefix>_<field>`` keyword arguments (defaults for those not given).

    Knobs of the other objectives are checked against their declarations too, then ignored; an unknown
    keyword is an error naming it."""
    declared = {name: f for a, obj in OBJECTIVES.items()
                for name, f in zip(knob_names(a), dataclasses.fields(obj.params))}
    own = dict(zip(knob_names(algo), dataclasses.fields(OBJECTIVES[algo].params)))
    values = {}
    for name, value in knobs.items():
        if name not in declared:
            raise TypeError(f"policy_loss() got an unexpected keyword argument {name!r}; objective knobs: "
                            f"{', '.join(declared)}")
        checked = check_knob(name, value, dict(declared[name].metadata))
        if name in own:
            values[own[name].name] = checked
    return OBJECTIVES[algo].params(**values)
