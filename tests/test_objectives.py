"""The new objectives (sapo, cispo, gmpo, rspo) against loop-by-loop references written from their
papers' formulas, their defining properties, and the registry's wiring (rollout-correction weights,
config names). float64 throughout; masked positions hold garbage."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_lab.config import PAPER_CLIP, RLConfig, ConfigError, from_dict, validate
from moe_lab.config.constants import LOSS_AGGS
from moe_lab.algos.losses import policy_loss
from moe_lab.config.constants import ALGOS
from moe_lab.algos.objectives import OBJECTIVES, RSPO_FLOOR_DEFAULT, SAPO_TAU_NEG_DEFAULT, SAPO_TAU_POS_DEFAULT

FAST = settings(max_examples=12, deadline=None)
NEW = ("sapo", "cispo", "gmpo", "rspo", "dppo_tv", "dppo_kl", "luspo", "vespo")
GARBAGE = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30, -1e30], dtype=torch.float64)


def make_batch(B, T, seed, *, scale=0.4, token_adv=False):
    """float64 log-probs, advantages, mask with >= 1 token per row (scattered), router gamma in (0, 1]."""
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    new = (old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) if token_adv else torch.randn(B, generator=g, dtype=torch.float64)
    adv = torch.where(torch.rand(adv.shape, generator=g) < 0.1, 0.0, adv)  # some exact zeros
    gamma = torch.exp(-0.8 * torch.rand(B, T, generator=g, dtype=torch.float64))  # some below the floor 0.5
    weights = 2.5 * torch.rand(B, T, generator=g, dtype=torch.float64)
    return new, old, adv, mask, gamma, weights


def with_garbage(x, mask):
    fill = GARBAGE[torch.arange(x.numel()) % 5].reshape(x.shape)
    return torch.where(mask, x.detach(), fill)


def grad_of(loss, new):
    (g,) = torch.autograd.grad(loss, new)
    return g


# ---------------------------------------------------------------- loop references (the papers' formulas)


def _adv(adv, i, t):
    return adv[i, t] if adv.ndim == 2 else adv[i]


def reference(new, old, adv, mask, *, algo, clip_low, clip_high, loss_agg="seq-mean-token-mean",
              tau_pos=SAPO_TAU_POS_DEFAULT, tau_neg=SAPO_TAU_NEG_DEFAULT, floor=RSPO_FLOOR_DEFAULT, gamma=None,
              weights=None):
    """Per-token terms one token at a time, then the aggregation, with no vectorised code from the library."""
    B, T = mask.shape
    rows = []  # (sum of token terms, token count) per sequence
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        terms = []
        if algo in ("gmpo", "rspo"):
            # GMPO: prod_t |min(r A, clip(r) A)|^(1/|y|) sgn(A) = A exp(mean_t c_t), c_t clipped on A's side.
            a_i = sum(_adv(adv, i, t) for t in idx) / len(idx)
            cs = []
            for t in idx:
                d = new[i, t] - old[i, t]
                if algo == "rspo" and gamma is not None:
                    d = d + math.log(max(float(gamma[i, t]), floor))
                a = _adv(adv, i, t)
                c = torch.clamp(d, max=clip_high) if a > 0 else torch.clamp(d, min=-clip_low) if a < 0 else d * 0
                cs.append(c)
            seq_term = -a_i * torch.exp(sum(cs) / len(idx))
            if weights is not None:  # geometric mean of the token weights (verl's geo_mean convention)
                seq_term = seq_term * math.exp(sum(math.log(max(float(weights[i, t]), 1e-10)) for t in idx) / len(idx))
            terms = [seq_term for _ in idx]
        else:
            for t in idx:
                a = _adv(adv, i, t)
                r = torch.exp(new[i, t] - old[i, t])
                if algo == "sapo":
                    tau = tau_pos if a > 0 else tau_neg
                    term = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
                else:  # cispo
                    w = torch.clamp(r, 1 - clip_low, 1 + clip_high).detach()
                    term = -w * a * new[i, t]
                if weights is not None:
                    term = term * float(weights[i, t])
                terms.append(term)
        rows.append((sum(terms), len(idx)))
    if loss_agg == "token-mean":
        return sum(s for s, _ in rows) / sum(n for _, n in rows)
    if loss_agg == "seq-mean-token-mean":
        return sum(s / n for s, n in rows) / B
    if loss_agg == "seq-mean-token-sum":
        return sum(s for s, _ in rows) / B
    return sum(s for s, _ in rows) / B / T


CASES = [("sapo", 0.2, 0.27), ("cispo", 1.0, 0.28), ("cispo", 0.1, 0.15), ("gmpo", 0.4, 0.4), ("gmpo", 0.1, 0.2),
         ("rspo", 0.4, 0.4), ("rspo", 0.1, 0.2)]


@FAST
@given(B=st.integers(1, 4), T=st.integers(1, 6), seed=st.integers(0, 10_000), case=st.sampled_from(CASES),
       loss_agg=st.sampled_from(LOSS_AGGS), token_adv=st.booleans(), weighted=st.booleans())
def test_value_and_gradient_match_loop_reference(B, T, seed, case, loss_agg, token_adv, weighted):
    algo, lo, hi = case
    new, old, adv, mask, gamma, weights = make_batch(B, T, seed, token_adv=token_adv)
    kw = dict(algo=algo, clip_low=lo, clip_high=hi, loss_agg=loss_agg)
    extra = dict(sapo_tau_pos=1.0, sapo_tau_neg=1.05, rspo_floor=0.5)
    gamma_in = gamma if algo == "rspo" else None
    w_in = weights if weighted else None
    loss, _ = policy_loss(new, old, adv, mask, router_gamma_BT=gamma_in, is_weights_BT=w_in, **kw, **extra)
    ref = reference(new, old, adv, mask, gamma=gamma_in, weights=w_in, floor=0.5, **kw)
    torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad_of(loss, new), grad_of(ref, new), rtol=1e-9, atol=1e-12)


@FAST
@given(B=st.integers(1, 4), T=st.integers(1, 6), seed=st.integers(0, 10_000), algo=st.sampled_from(ALGOS),
       loss_agg=st.sampled_from(LOSS_AGGS))
def test_garbage_in_masked_positions_changes_nothing(B, T, seed, algo, loss_agg):
    new, old, adv, mask, gamma, weights = make_batch(B, T, seed, token_adv=True)
    if algo in ("gspo", "gspo_unnormalized", "luspo"):  # one advantage per sequence
        adv = adv[:, :1].expand(B, T).clone()
    lo, hi = PAPER_CLIP[algo]
    kw = dict(algo=algo, clip_low=lo, clip_high=hi, loss_agg=loss_agg)
    loss, m = policy_loss(new, old, adv, mask, router_gamma_BT=gamma, is_weights_BT=weights, **kw)
    grad = grad_of(loss, new)
    new2 = with_garbage(new, mask).requires_grad_(True)
    loss2, m2 = policy_loss(new2, with_garbage(old, mask), with_garbage(adv, mask), mask,
                            router_gamma_BT=with_garbage(gamma, mask), is_weights_BT=with_garbage(weights, mask), **kw)
    grad2 = grad_of(loss2, new2)
    assert torch.equal(loss2, loss) and torch.equal(grad2, grad)
    assert bool((grad2[~mask] == 0).all())
    assert m.keys() == m2.keys() and all(torch.equal(m[k], m2[k]) for k in m)


# ---------------------------------------------------------------- defining properties


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.3, 2.0)])
def test_sapo_at_ratio_one_is_the_plain_policy_gradient(loss_agg, taus):
    """f'(1) = 1 whatever tau: at r = 1 SAPO's gradient is -A grad logp under the chosen aggregation."""
    new, _, adv, mask, _, _ = make_batch(4, 7, seed=11, token_adv=True)
    old = new.detach().clone()
    loss, m = policy_loss(new, old, adv, mask, algo="sapo", clip_low=0.2, clip_high=0.27, loss_agg=loss_agg,
                          sapo_tau_pos=taus[0], sapo_tau_neg=taus[1])
    pg = reference(new, old, adv, mask, algo="cispo", clip_low=0.0, clip_high=0.0, loss_agg=loss_agg)  # -A logp
    torch.testing.assert_close(grad_of(loss, new), grad_of(pg, new), rtol=1e-12, atol=1e-14)
    assert m["objective/sapo_gate_mean"].item() == 1.0


def test_sapo_gate_decays_off_policy_instead_of_clipping():
    """Far outside GRPO's range the gradient is small but not zero, and smaller for tau_neg > tau_pos."""
    old = torch.zeros(2, 1, dtype=torch.float64)
    new = torch.tensor([[1.0], [-1.0]], dtype=torch.float64, requires_grad=True)  # r = e (A>0), 1/e (A<0)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, _ = policy_loss(new, old, adv, torch.ones(2, 1, dtype=torch.bool), algo="sapo", clip_low=0.2, clip_high=0.27)
    grad = grad_of(loss, new)
    for row, (r, tau, a) in enumerate([(math.e, 1.0, 1.0), (1 / math.e, 1.05, -1.0)]):
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        assert grad[row, 0].item() == pytest.approx(-a * 4 * s * (1 - s) * r / 2, rel=1e-12)
        assert 0 < abs(grad[row, 0].item()) < abs(a * r / 2)


def test_cispo_gradient_never_flows_through_the_weight():
    """grad = -sg(clip(w)) A / (B |y_i|) per token, also for tokens whose weight was clipped (GRPO zeroes those)."""
    new, old, adv, mask, _, _ = make_batch(5, 6, seed=3, scale=0.6)
    lo, hi = 0.1, 0.15
    loss, m = policy_loss(new, old, adv, mask, algo="cispo", clip_low=lo, clip_high=hi)
    w = torch.exp(new.detach() - old).clamp(1 - lo, 1 + hi)
    expected = torch.where(mask, -w * adv.unsqueeze(-1) / (5 * mask.sum(-1, keepdim=True)), 0.0)
    torch.testing.assert_close(grad_of(loss, new), expected, rtol=1e-12, atol=1e-15)
    assert m["clip_frac/out_of_range"].item() > 0 and m["clip_frac/active"].item() == 0.0


def test_cispo_default_has_no_lower_bound():
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.tensor([[-3.0, 1.0]], dtype=torch.float64, requires_grad=True)  # r = 0.05, 2.7
    lo, hi = PAPER_CLIP["cispo"]
    loss, _ = policy_loss(new, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 2), algo="cispo",
                          clip_low=lo, clip_high=hi, loss_agg="seq-mean-token-sum")
    torch.testing.assert_close(grad_of(loss, new), torch.tensor([[-math.exp(-3.0), -1.28]], dtype=torch.float64))


@FAST
@given(B=st.integers(1, 5), T=st.integers(1, 8), seed=st.integers(0, 10_000))
def test_gmpo_equals_gspo_sequence_ratio_when_nothing_is_clipped(B, T, seed):
    new, old, adv, mask, _, _ = make_batch(B, T, seed, scale=0.2)
    adv = torch.where(adv == 0, 0.5, adv)  # (a zero advantage's GMPO ratio is 1 by convention: its term is 0)
    loss_g, m_g = policy_loss(new, old, adv, mask, algo="gmpo", clip_low=50.0, clip_high=50.0)
    loss_s, m_s = policy_loss(new, old, adv, mask, algo="gspo", clip_low=0.999, clip_high=1e9)
    s_B = torch.exp(((new - old) * mask).sum(-1) / mask.sum(-1))
    torch.testing.assert_close(loss_g, -(adv * s_B).mean(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss_g, loss_s, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_of(loss_g, new), grad_of(loss_s, new), rtol=1e-10, atol=1e-14)
    assert m_g["objective/seq_ratio_mean"].item() == pytest.approx(m_s["ratio/seq_mean"].item(), rel=1e-6)
    assert m_g["clip_frac/active"].item() == 0.0


def test_gmpo_clips_only_on_the_advantage_side():
    old = torch.zeros(4, 1, dtype=torch.float64)
    d = torch.tensor([[0.6], [-0.6], [0.6], [-0.6]], dtype=torch.float64)
    new = (old + d).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    loss, m = policy_loss(new, old, adv, torch.ones(4, 1), algo="gmpo", clip_low=0.4, clip_high=0.4,
                          loss_agg="seq-mean-token-sum")
    clipped = torch.tensor([True, False, False, True])
    c = torch.where(clipped, d.squeeze(-1).clamp(-0.4, 0.4), d.squeeze(-1))
    assert loss.item() == pytest.approx((-adv * c.exp()).mean().item(), rel=1e-12)
    grad = grad_of(loss, new).squeeze(-1)
    assert bool((grad[clipped] == 0).all()) and bool((grad[~clipped] != 0).all())
    assert m["clip_frac/active"].item() == 0.5
    assert m["clip_frac/out_of_range"].item() == 1.0  # all four ratios are outside [e^-0.4, e^0.4]


@FAST
@given(B=st.integers(1, 5), T=st.integers(1, 8), seed=st.integers(0, 10_000), loss_agg=st.sampled_from(LOSS_AGGS))
def test_rspo_with_unchanged_router_equals_gmpo(B, T, seed, loss_agg):
    new, old, adv, mask, _, weights = make_batch(B, T, seed)
    kw = dict(clip_low=0.4, clip_high=0.4, loss_agg=loss_agg, is_weights_BT=weights)
    loss_g, m_g = policy_loss(new, old, adv, mask, algo="gmpo", **kw)
    grad_g = grad_of(loss_g, new)
    for gamma in (None, torch.ones(B, T, dtype=torch.float64)):
        loss_r, m_r = policy_loss(new, old, adv, mask, algo="rspo", router_gamma_BT=gamma, **kw)
        assert torch.equal(loss_r, loss_g) and torch.equal(grad_of(loss_r, new), grad_g)
        assert all(torch.equal(m_r[k], m_g[k]) for k in m_g)
        assert m_r["objective/rspo_gamma_mean"].item() == 1.0 and m_r["objective/rspo_floor_frac"].item() == 0.0


def test_rspo_gamma_is_floored_and_carries_no_gradient():
    old = torch.zeros(1, 2, dtype=torch.float64)
    new = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    gamma = torch.tensor([[0.9, 0.1]], dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(new, old, torch.ones(1, dtype=torch.float64), torch.ones(1, 2), algo="rspo",
                          clip_low=0.4, clip_high=0.4, rspo_floor=0.5, router_gamma_BT=gamma)
    assert loss.item() == pytest.approx(-math.sqrt(0.9 * 0.5), rel=1e-12)  # geometric mean of the scaled ratios
    assert m["objective/rspo_floor_frac"].item() == 0.5
    assert m["objective/rspo_gamma_mean"].item() == pytest.approx(0.7)
    assert torch.autograd.grad(loss, gamma, allow_unused=True)[0] is None


# ---------------------------------------------------------------- rollout-correction weights in the loss


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_is_weights_of_ones_change_nothing(algo, loss_agg):
    new, old, adv, mask, gamma, _ = make_batch(4, 6, seed=9)
    lo, hi = PAPER_CLIP[algo]
    kw = dict(algo=algo, clip_low=lo, clip_high=hi, loss_agg=loss_agg)
    loss, m = policy_loss(new, old, adv, mask, **kw)
    loss1, m1 = policy_loss(new, old, adv, mask, is_weights_BT=torch.ones_like(old), **kw)
    assert torch.equal(loss1, loss) and torch.equal(grad_of(loss1, new), grad_of(loss, new))
    assert all(torch.equal(m[k], m1[k]) for k in m)


def test_is_weights_scale_the_per_token_terms_of_the_ppo_family():
    new, old, adv, mask, _, weights = make_batch(3, 5, seed=2)
    kw = dict(algo="grpo", clip_low=0.2, clip_high=0.27, loss_agg="token-mean")
    loss, _ = policy_loss(new, old, adv, mask, is_weights_BT=weights, **kw)
    r = torch.exp(new - old)
    a = adv.unsqueeze(-1)
    term = -torch.minimum(r * a, r.clamp(0.8, 1.27) * a) * weights
    torch.testing.assert_close(loss, term[mask].sum() / mask.sum(), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- registry and config


def test_registry_config_and_paper_defaults_agree():
    choices = dict((f.name, f) for f in __import__("dataclasses").fields(RLConfig))["algo"].metadata["choices"]
    assert tuple(choices) == tuple(OBJECTIVES) == ALGOS
    assert set(PAPER_CLIP) == set(OBJECTIVES)
    rl = RLConfig()
    assert (rl.sapo_tau_pos, rl.sapo_tau_neg, rl.rspo_floor) == (
        SAPO_TAU_POS_DEFAULT, SAPO_TAU_NEG_DEFAULT, RSPO_FLOOR_DEFAULT)
    for algo in NEW:
        validate(from_dict({"rl": {"algo": algo}}))


def test_policy_loss_refuses_an_unknown_knob():
    new, old, adv, mask, _, _ = make_batch(2, 3, seed=1)
    with pytest.raises(TypeError, match="sapo_tau"):
        policy_loss(new, old, adv, mask, algo="sapo", clip_low=0.2, clip_high=0.2, sapo_tau=1.0)


@pytest.mark.parametrize("algo", NEW)
def test_dual_clip_is_refused_outside_the_ppo_family(algo):
    new, old, adv, mask, _, _ = make_batch(2, 3, seed=1)
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_loss(new, old, adv, mask, algo=algo, clip_low=0.2, clip_high=0.2, dual_clip_c=2.0)
    with pytest.raises(ConfigError, match="rl.dual_clip_c"):
        validate(from_dict({"rl": {"algo": algo, "dual_clip_c": 2.0}}))


@pytest.mark.parametrize("kw, match", [
    (dict(sapo_tau_pos=0.0), "sapo_tau_pos"), (dict(sapo_tau_neg=float("inf")), "sapo_tau_neg"),
    (dict(rspo_floor=1.5), "rspo_floor"), (dict(router_gamma_BT=torch.ones(3)), "router_gamma_BT"),
    (dict(is_weights_BT=torch.ones(2, 2)), "is_weights_BT"),
])
def test_bad_objective_params_name_the_field(kw, match):
    new, old, adv, mask, _, _ = make_batch(2, 3, seed=1)
    with pytest.raises(ValueError, match=match):
        policy_loss(new, old, adv, mask, algo="rspo", clip_low=0.4, clip_high=0.4, **kw)
