"""Engine-vs-trainer mismatch of sampled tokens, under the names each stack logs it (docs/traces.md, "The
mismatch report").

Inputs are padded [B, T] tensors over the completion tokens: ``logp_engine_BT`` (the sampler's log-probs),
``logp_trainer_BT`` (the trainer's log-probs of the same tokens) and ``mask_BT`` (1 on real tokens). The tokens
were sampled by the engine, so every estimator is of KL(engine || trainer) = E_engine[log p_engine - log
p_trainer], with ``d = logp_trainer - logp_engine`` = log r, r = p_trainer / p_engine (verl's ``log_ratio``):

  k1 = -d,  k2 = d^2 / 2,  k3 = r - 1 - log r = exp(d) - 1 - d   (Schulman's estimators; k1, k3 unbiased)

Every function is pure tensor math, in float64, with no clamp except the ones the named stack applies.
"""

from __future__ import annotations

import math

import torch

from moe_lab.config import constants as C
from moe_lab.algos.ratio_metrics import EXTREME_LOG_RATIO, LOG_RATIO_BOUND, k3_from_log_ratio, masked_mean

__all__ = ["token_mismatch", "seq_mult_prob_error", "verl_offpolicy", "verl_tis", "SEQ_ERROR_THRESHOLD"]

Tensor = torch.Tensor
SEQ_ERROR_THRESHOLD = C.SEQ_ERROR_THRESHOLD  # the outlier threshold of seq_mult_prob_error (moe_lab/config/constants.py)


def _log_ratio(logp_engine_BT: Tensor, logp_trainer_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    keep = mask_BT.bool()
    zero = torch.zeros((), dtype=torch.float64)
    d = torch.where(keep, logp_trainer_BT.double(), zero) - torch.where(keep, logp_engine_BT.double(), zero)
    return d, keep


def token_mismatch(logp_engine_BT: Tensor, logp_trainer_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """k1, k2, k3 of KL(engine || trainer), mean and max |d|, the share of tokens with |d| > ln 2 (AReaL's
    "extreme" tokens) and with r outside [1/2, 2] (the same tokens, r's band rather than d's: reported under
    both names), token-weighted over the mask."""
    d, keep = _log_ratio(logp_engine_BT, logp_trainer_BT, mask_BT)
    r = torch.exp(d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    absd = torch.where(keep, d.abs(), torch.zeros_like(d))
    return {"tokens": int(keep.sum()),
            "k1": float(masked_mean(-d, keep)),
            "k2": float(masked_mean(d.square() / 2, keep)),
            "k3": float(masked_mean(k3_from_log_ratio(d), keep)),
            "abs_delta_mean": float(masked_mean(absd, keep)),
            "abs_delta_max": float(absd.max()) if bool(keep.any()) else 0.0,
            "abs_delta_above_ln2": float(masked_mean((absd > EXTREME_LOG_RATIO).double(), keep)),
            "ratio_outside_half_two": float(masked_mean(((r < 0.5) | (r > 2.0)).double(), keep))}


def seq_mult_prob_error(logp_engine_BT: Tensor, logp_trainer_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """NeMo-RL's per-sequence ``seq_mult_prob_error`` (``compute_and_apply_seq_logprob_error_masking``,
    nemo_rl/algorithms/grpo.py): the mean over the sequence's tokens of exp(|gen - prev|), i.e.
    (exp(|d| * mask) * mask).sum(-1) / mask.sum(-1); [B], only for sequences with a token (NeMo-RL leaves the
    others out of its statistics)."""
    d, keep = _log_ratio(logp_engine_BT, logp_trainer_BT, mask_BT)
    m = keep.double()
    denom = m.sum(-1)
    num = (torch.exp(d.abs() * m) * m).sum(-1)
    return (num / denom.clamp(min=1))[denom > 0]


def verl_offpolicy(logp_engine_BT: Tensor, logp_trainer_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """verl's off-policy diagnostics (``compute_offpolicy_metrics``, verl/trainer/ppo/rollout_corr_helper.py)
    with ``old_log_prob`` = the trainer's and ``rollout_log_prob`` = the engine's, under the names verl logs
    (prefix ``rollout_corr/``). Token means over all tokens of the batch; perplexities per sequence, then the
    batch mean; chi-squared with verl's exponent clamp (+-20)."""
    d, keep = _log_ratio(logp_engine_BT, logp_trainer_BT, mask_BT)
    train, roll = logp_trainer_BT.double(), logp_engine_BT.double()
    seqs = keep.any(-1)  # verl's batch means run over every row; a row without tokens is not in our batch
    mean_train = masked_mean(train, keep, dim=-1)[seqs]
    mean_roll = masked_mean(roll, keep, dim=-1)[seqs]
    log_ppl_diff = mean_roll - mean_train
    rho = torch.exp(d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    seq_sum = torch.where(keep, d, torch.zeros_like(d)).sum(-1)[seqs].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    out = {"training_ppl": torch.exp(-mean_train).mean(), "training_log_ppl": (-mean_train).mean(),
           "kl": masked_mean(roll - train, keep), "k3_kl": masked_mean(torch.exp(d) - d - 1, keep),
           "rollout_ppl": torch.exp(-mean_roll).mean(), "rollout_log_ppl": (-mean_roll).mean(),
           "log_ppl_diff": log_ppl_diff.mean(), "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
           "log_ppl_diff_max": log_ppl_diff.max(), "log_ppl_diff_min": log_ppl_diff.min(),
           "ppl_ratio": torch.exp(log_ppl_diff).mean(),
           "chi2_token": masked_mean(rho.square(), keep) - 1.0,
           "chi2_seq": torch.exp(2.0 * seq_sum).mean() - 1.0}
    return {f"rollout_corr/{k}": float(v) for k, v in out.items()}


def verl_tis(logp_engine_BT: Tensor, logp_trainer_BT: Tensor, mask_BT: Tensor,
             threshold: float = 2.0) -> dict[str, dict[str, float]]:
    """What verl 0.9's rollout correction would do at ``threshold`` C, under verl's metric names, per option:
    ``rollout_is`` (TIS, ``compute_rollout_correction_weights``) truncates weights above C:
    ``rollout_is_ratio_fraction_high`` is the share of tokens (``token``) or of sequences (``sequence``)
    truncated, ``..._low`` the share below 1/C. ``rollout_rs`` (rejection, ``compute_rollout_rejection_mask``)
    with the k1 options and threshold "C" (lower bound 1/C) masks where k1 = -log r (clamped to +-20 per token)
    leaves [ln 1/C, ln C]: per token (``token_k1``) or summed over the sequence (``seq_sum_k1``);
    ``rollout_rs_<option>_masked_fraction`` is the share of tokens masked, ``..._seq_masked_fraction`` the
    share of sequences with a token masked."""
    if not (isinstance(threshold, (int, float)) and 1.0 < threshold < math.inf):
        raise ValueError(f"threshold={threshold!r}; allowed a finite number > 1")
    d, keep = _log_ratio(logp_engine_BT, logp_trainer_BT, mask_BT)
    seqs = keep.any(-1)
    hi = math.log(threshold)
    d_safe = d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    w = torch.exp(d_safe)
    seq_d = torch.where(keep, d, torch.zeros_like(d)).sum(-1)[seqs]  # TIS: the unclamped sum, compared in log space
    out_tok = keep & (d_safe.abs() > hi)
    out_seq = torch.where(keep, d_safe, torch.zeros_like(d)).sum(-1)[seqs].abs() > hi  # RS: sum of clamped k1
    out = {"rollout_is=token": {"rollout_is_ratio_fraction_high": masked_mean((w > threshold).double(), keep),
                                "rollout_is_ratio_fraction_low": masked_mean((w < 1 / threshold).double(), keep)},
           "rollout_is=sequence": {"rollout_is_ratio_fraction_high": (seq_d > hi).double().mean(),
                                   "rollout_is_ratio_fraction_low": (seq_d < -hi).double().mean()}}
    for option, tokens in (("token_k1", out_tok), ("seq_sum_k1", _broadcast(out_seq, keep, seqs).bool() & keep)):
        out[f"rollout_rs={option}"] = {f"rollout_rs_{option}_masked_fraction": masked_mean(tokens.double(), keep),
                                       f"rollout_rs_{option}_seq_masked_fraction": tokens.any(-1)[seqs].double().mean()}
    return {level: {f"rollout_corr/{k}": float(v) for k, v in d.items()} for level, d in out.items()}


def _broadcast(per_seq: Tensor, keep: Tensor, seqs: Tensor) -> Tensor:
    """A per-sequence flag (over the sequences with tokens) spread over their tokens, [B, T] float64."""
    full = torch.zeros(keep.shape[0], dtype=torch.float64)
    full[seqs] = per_seq.double()
    return full[:, None].expand_as(keep)
