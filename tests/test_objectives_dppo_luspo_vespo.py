"""dppo_tv / dppo_kl against verl's DPPO losses, luspo / vespo against TRL's GRPOTrainer loss types, each
re-implemented here from the published formulas (verl 0.9's compute_policy_loss_dppo_tv / _kl and agg_loss;
TRL's loss_type="luspo" / "vespo"), vectorised in the peers' own order of operations, not calling the
library's code. Plus the properties that define each objective. float64 unless said otherwise."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_lab.config import PAPER_CLIP, ConfigError, RLConfig, from_dict, validate
from moe_lab.config.constants import LOSS_AGGS
from moe_lab.algos.losses import policy_loss
from moe_lab.algos.objectives import DPPO_RATIO_CAP_DEFAULT, VESPO_SHAPE_DEFAULT

FAST = settings(max_examples=25, deadline=None)
TOL = 1e-6  # the brief's bound on |ours - peer| for loss and every gradient entry


def make_batch(B, T, seed, *, scale=0.5, token_adv=False, dtype=torch.float64):
    """Log-probs spread over (0, 1] probabilities (some near 1, where TV and KL masks differ most)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64).clamp_min(1e-4))
    new = (old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True
    adv = torch.randn((B, T) if token_adv else (B,), generator=g, dtype=torch.float64)
    adv = torch.where(torch.rand(adv.shape, generator=g) < 0.1, 0.0, adv)
    return new.to(dtype).requires_grad_(True), old.to(dtype), adv.to(dtype), mask


def grad_of(loss, new):
    return torch.autograd.grad(loss, new)[0]


def close(a, b):
    assert (a - b).abs().max().item() <= TOL, (a, b)


# ---------------------------------------------------------------- verl's DPPO, written from its math


def verl_agg(loss_mat, mask, mode):
    """verl agg_loss, one process (dp_size 1, global counts = local ones)."""
    m = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * m).sum() / m.sum()
    if mode == "seq-mean-token-sum":
        return (loss_mat * m).sum(-1).sum() / (m.sum(-1) > 0).sum()
    if mode == "seq-mean-token-mean":
        seq = (loss_mat * m).sum(-1) / (m.sum(-1) + 1e-8)
        return seq.sum() / (m.sum(-1) > 0).sum()
    return (loss_mat * m).sum() / mask.shape[-1]  # seq-mean-token-sum-norm: sum over sequences / T, no 1/B


def verl_dppo(old, new, adv, mask, mode, *, kind, low, high, cap):
    adv = adv.unsqueeze(-1).expand_as(new) if adv.ndim == 1 else adv
    ratio = torch.exp(torch.clamp(new - old, -20.0, 20.0))
    trunc = torch.clamp(ratio, max=cap).detach()
    p, q = torch.exp(new), torch.exp(old)
    if kind == "tv":
        valid = torch.where(adv > 0, (p - q) <= high, (p - q) >= -low)
    else:
        kl = q * (old - new) + (1 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        valid = torch.where(adv > 0, (kl <= high) | (p <= q), (kl <= low) | (p >= q))
    losses = -adv * trunc * new * valid.detach().to(new.dtype)
    return verl_agg(losses, mask, mode), valid


@FAST
@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000), kind=st.sampled_from(["tv", "kl"]),
       loss_agg=st.sampled_from(LOSS_AGGS), token_adv=st.booleans(),
       bounds=st.sampled_from([None, (0.05, 0.1), (0.3, 0.02), (0.6, 0.6)]), cap=st.sampled_from([None, 1.0, 1.5]))
def test_dppo_equals_verl(B, T, seed, kind, loss_agg, token_adv, bounds, cap):
    algo = f"dppo_{kind}"
    low, high = PAPER_CLIP[algo] if bounds is None else bounds
    cap = DPPO_RATIO_CAP_DEFAULT if cap is None else cap
    new, old, adv, mask = make_batch(B, T, seed, token_adv=token_adv)
    loss, m = policy_loss(new, old, adv, mask, algo=algo, clip_low=low, clip_high=high, loss_agg=loss_agg,
                          dppo_ratio_cap=cap)
    ref, valid = verl_dppo(old, new, adv, mask, loss_agg, kind=kind, low=low, high=high, cap=cap)
    # verl's -norm sums over sequences (no 1/B); ours is the mean over sequences, as for every objective here.
    scale = B if loss_agg == "seq-mean-token-sum-norm" else 1
    close(loss * scale, ref)
    close(grad_of(loss, new) * scale, grad_of(ref, new))
    # clip_frac/active is verl's pg_clipfrac (share of masked-out tokens)
    assert m["clip_frac/active"].item() == pytest.approx((~valid)[mask].double().mean().item(), abs=1e-7)


def test_dppo_equals_verl_in_float32():
    new, old, adv, mask = make_batch(6, 9, seed=5, dtype=torch.float32)
    for algo in ("dppo_tv", "dppo_kl"):
        low, high = PAPER_CLIP[algo]
        loss, _ = policy_loss(new, old, adv, mask, algo=algo, clip_low=low, clip_high=high, loss_agg="token-mean")
        ref, _ = verl_dppo(old, new, adv, mask, "token-mean", kind=algo[-2:], low=low, high=high, cap=10000.0)
        close(loss, ref)
        close(grad_of(loss, new), grad_of(ref, new))


def test_dppo_tv_masks_by_probability_change_not_by_ratio():
    """The paper's example: a rare token 1e-5 -> 1e-3 (ratio 100) keeps its gradient; 0.99 -> 0.8 with
    A < 0 (ratio 0.81, inside GRPO's range) loses it; 0.5 -> 0.6 with A > 0 (change 0.1 <= 0.15) keeps it."""
    old = torch.log(torch.tensor([[1e-5], [0.99], [0.5]], dtype=torch.float64))
    new = torch.log(torch.tensor([[1e-3], [0.8], [0.6]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    kw = dict(clip_low=0.15, clip_high=0.15, loss_agg="seq-mean-token-sum")
    loss, m = policy_loss(new, old, adv, torch.ones(3, 1), algo="dppo_tv", **kw)
    grad = grad_of(loss, new).squeeze(-1)
    # kept tokens: -A min(w, cap) / B (one token each); the masked one: exactly 0
    torch.testing.assert_close(grad, torch.tensor([-100.0, 0.0, -1.2], dtype=torch.float64) / 3, rtol=1e-12, atol=0)
    assert m["clip_frac/active"].item() == pytest.approx(1 / 3)
    assert m["objective/dppo_divergence_mean"].item() == pytest.approx((0.001 - 1e-5 + 0.19 + 0.1) / 3)
    # GRPO clips the rare token (ratio 100 > 1.27) and keeps the 0.99 -> 0.8 one
    g_grpo = grad_of(policy_loss(new, old, adv, torch.ones(3, 1), algo="grpo", clip_low=0.2, clip_high=0.27,
                                 loss_agg="seq-mean-token-sum")[0], new).squeeze(-1)
    assert g_grpo[0].item() == 0.0 and g_grpo[1].item() != 0.0


def test_dppo_kl_only_blocks_moves_away_on_the_advantage_side():
    """A big drop with A > 0 (moving back) is kept; the same drop with A < 0 is blocked."""
    old = torch.log(torch.tensor([[0.9], [0.9]], dtype=torch.float64))
    new = torch.log(torch.tensor([[0.3], [0.3]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, m = policy_loss(new, old, adv, torch.ones(2, 1), algo="dppo_kl", clip_low=0.05, clip_high=0.05,
                          loss_agg="seq-mean-token-sum")
    grad = grad_of(loss, new).squeeze(-1)
    kl = 0.9 * math.log(0.9 / 0.3) + 0.1 * math.log((0.1 + 1e-8) / (0.7 + 1e-8))
    assert grad[0].item() == pytest.approx(-(0.3 / 0.9) / 2, rel=1e-12) and grad[1].item() == 0.0
    assert m["objective/dppo_divergence_mean"].item() == pytest.approx(kl, rel=1e-6)


@pytest.mark.parametrize("algo", ["dppo_tv", "dppo_kl"])
def test_dppo_on_policy_is_the_plain_policy_gradient_and_the_cap_truncates(algo):
    new, _, adv, mask = make_batch(4, 6, seed=2, token_adv=True)
    old = new.detach().clone()
    loss, m = policy_loss(new, old, adv, mask, algo=algo, clip_low=0.01, clip_high=0.01, loss_agg="token-mean")
    expected = torch.where(mask, -adv / mask.sum(), 0.0)
    torch.testing.assert_close(grad_of(loss, new), expected, rtol=1e-12, atol=1e-15)
    assert m["clip_frac/active"].item() == 0.0
    # ratio 2 everywhere, thresholds wide open: the gradient is -min(2, cap) A / N
    old2 = new.detach() - math.log(2.0)
    for cap, frac in ((1.5, 1.0), (3.0, 0.0)):
        loss, m = policy_loss(new, old2, adv, mask, algo=algo, clip_low=1e6, clip_high=1e6, loss_agg="token-mean",
                              dppo_ratio_cap=cap)
        torch.testing.assert_close(grad_of(loss, new), min(2.0, cap) * expected, rtol=1e-12, atol=1e-15)
        assert m["objective/dppo_truncated_frac"].item() == frac


# ---------------------------------------------------------------- TRL's LUSPO and VESPO


def trl_luspo(new, old, adv, mask, low, high):
    """TRL: importance_sampling_level="sequence" ratio, two-sided PPO min, (per-seq loss * |y_i|).mean()."""
    m = mask.to(new.dtype)
    log_w = ((new - old) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    coef_1 = torch.exp(log_w).unsqueeze(-1)
    coef_2 = torch.clamp(coef_1, 1 - low, 1 + high)
    a = adv.unsqueeze(-1)
    per_seq = -torch.min(coef_1 * a, coef_2 * a)
    return (per_seq * m.sum(1, keepdim=True)).mean()


def trl_vespo(new, old, adv, mask, k_pos, lam_pos, k_neg, lam_neg):
    """TRL: phi(W) = e^lam W^k e^(-lam W) on W = exp(sum_t d) (log W clamped to [log 1e-8, 20]), detached,
    loss = sum(-phi A logp) / (number of tokens), the token-mean over the batch."""
    m = mask.to(new.dtype)
    a = adv.unsqueeze(-1) if adv.ndim == 1 else adv
    with torch.no_grad():
        log_w = torch.clamp((torch.clamp(new - old, -20.0, 20.0) * m).sum(-1, keepdim=True), math.log(1e-8), 20.0)
        w = torch.exp(log_w)
        pos = (a >= 0).expand_as(w.expand_as(a))
        k = torch.where(pos, torch.tensor(k_pos, dtype=w.dtype), torch.tensor(k_neg, dtype=w.dtype))
        lam = torch.where(pos, torch.tensor(lam_pos, dtype=w.dtype), torch.tensor(lam_neg, dtype=w.dtype))
        phi = torch.exp(lam) * w ** k * torch.exp(-lam * w)  # not via log space, unlike both implementations
    return (-phi * a * new * m).sum() / m.sum(), phi


@FAST
@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000), scale=st.sampled_from([1e-4, 0.3]))
def test_luspo_equals_trl(B, T, seed, scale):
    new, old, adv, mask = make_batch(B, T, seed, scale=scale)
    low, high = PAPER_CLIP["luspo"]
    loss, _ = policy_loss(new, old, adv, mask, algo="luspo", clip_low=low, clip_high=high)
    ref = trl_luspo(new, old, adv, mask, low, high)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_of(loss, new), grad_of(ref, new), rtol=1e-10, atol=1e-12)


@FAST
@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000), loss_agg=st.sampled_from(LOSS_AGGS))
def test_luspo_is_gspo_times_the_response_length(B, T, seed, loss_agg):
    """With every response of one length n, LUSPO = n * GSPO under any aggregation's per-sequence weighting."""
    new, old, adv, _ = make_batch(B, T, seed, scale=0.01)
    mask = torch.ones(B, T, dtype=torch.bool)
    kw = dict(clip_low=3e-4, clip_high=4e-4, loss_agg=loss_agg)
    loss_l, m_l = policy_loss(new, old, adv, mask, algo="luspo", **kw)
    loss_g, m_g = policy_loss(new, old, adv, mask, algo="gspo", **kw)
    torch.testing.assert_close(loss_l, T * loss_g, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_of(loss_l, new), T * grad_of(loss_g, new), rtol=1e-12, atol=1e-14)
    assert all(torch.equal(m_l[k], m_g[k]) for k in m_g)


@FAST
@given(B=st.integers(1, 5), T=st.integers(1, 7), seed=st.integers(0, 10_000), token_adv=st.booleans(),
       shape=st.sampled_from([VESPO_SHAPE_DEFAULT, (0.0, 0.5, 1.0, 4.0)]), scale=st.sampled_from([0.05, 0.6]))
def test_vespo_equals_trl(B, T, seed, token_adv, shape, scale):
    new, old, adv, mask = make_batch(B, T, seed, token_adv=token_adv, scale=scale)
    kw = dict(zip(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), shape))
    loss, m = policy_loss(new, old, adv, mask, algo="vespo", clip_low=0.2, clip_high=0.27, loss_agg="token-mean", **kw)
    ref, phi = trl_vespo(new, old, adv, mask, *shape)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_of(loss, new), grad_of(ref, new), rtol=1e-10, atol=1e-12)
    if not token_adv:  # one phi per sequence: TRL's vespo/phi_seq_mean
        assert m["objective/vespo_phi_mean"].item() == pytest.approx(phi.mean().item(), rel=1e-6)


def test_vespo_kernel_is_one_on_policy_and_peaks_at_k_over_lambda():
    new, _, adv, mask = make_batch(3, 5, seed=4)
    loss, m = policy_loss(new, new.detach().clone(), adv, mask, algo="vespo", clip_low=0.2, clip_high=0.27,
                          loss_agg="token-mean")
    torch.testing.assert_close(grad_of(loss, new), torch.where(mask, -adv.unsqueeze(-1) / mask.sum(), 0.0),
                               rtol=1e-12, atol=1e-15)
    assert m["objective/vespo_phi_mean"].item() == 1.0
    # one token, A > 0, (k, lambda) = (2, 3): phi(W) largest at W = 2/3, smaller on both sides
    old = torch.zeros(1, 1, dtype=torch.float64)
    phis = []
    for w in (0.4, 2 / 3, 1.0, 1.5):
        _, m = policy_loss(torch.full((1, 1), math.log(w), dtype=torch.float64), old, torch.ones(1, dtype=torch.float64),
                           torch.ones(1, 1), algo="vespo", clip_low=0.2, clip_high=0.27)
        phis.append(m["objective/vespo_phi_mean"].item())
    assert phis[1] == max(phis) and phis[1] == pytest.approx(math.exp(3.0) * (2 / 3) ** 2 * math.exp(-3.0 * 2 / 3), rel=1e-6)


# ---------------------------------------------------------------- config and argument checks


def test_config_defaults_are_the_sources_and_validate():
    rl = RLConfig()
    assert rl.dppo_ratio_cap == DPPO_RATIO_CAP_DEFAULT == 10000.0
    assert (rl.vespo_k_pos, rl.vespo_lambda_pos, rl.vespo_k_neg, rl.vespo_lambda_neg) == VESPO_SHAPE_DEFAULT
    assert (PAPER_CLIP["dppo_tv"], PAPER_CLIP["dppo_kl"]) == ((0.15, 0.15), (0.05, 0.05))
    for algo in ("dppo_tv", "dppo_kl", "luspo", "vespo"):
        validate(from_dict({"rl": {"algo": algo}}))


@pytest.mark.parametrize("field, value", [("dppo_ratio_cap", 0.5), ("vespo_k_pos", -1.0), ("vespo_lambda_pos", 0.0),
                                          ("vespo_k_neg", float("nan")), ("vespo_lambda_neg", -2.0)])
def test_bad_knobs_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"rl.{field}"):
        validate(from_dict({"rl": {"algo": "vespo", field: value}}))
    new, old, adv, mask = make_batch(2, 3, seed=1)
    with pytest.raises(ValueError, match=field):
        policy_loss(new, old, adv, mask, algo="vespo", clip_low=0.2, clip_high=0.27, **{field: value})


def test_luspo_refuses_advantages_that_vary_within_a_response():
    new, old, adv, mask = make_batch(2, 3, seed=1, token_adv=True)
    with pytest.raises(ValueError, match="advantages vary"):
        policy_loss(new, old, adv, torch.ones(2, 3), algo="luspo", clip_low=3e-4, clip_high=4e-4)
