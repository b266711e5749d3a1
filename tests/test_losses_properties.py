"""Properties the math guarantees (gspo-notes.md "Checks every correct implementation passes"),
over random shapes, lengths and padding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_lab.config.constants import LOSS_AGGS
from moe_lab.algos.losses import policy_loss
from moe_lab.config.constants import PPO_CLIP_ALGOS

FAST = settings(max_examples=20, deadline=None)
CLIP_KEYS = ("clip_frac/out_of_range", "clip_frac/active", "clip_frac/low", "clip_frac/high", "clip_frac/seq")

shapes = st.tuples(st.integers(1, 5), st.integers(1, 8), st.integers(0, 2**31 - 1))


def random_batch(B, T, seed, *, scale=0.3, contiguous=False):
    """float32 log-probs, (B,) advantages and a mask with >= 1 response token per row.

    contiguous: right padding (lengths 1..T); otherwise scattered response tokens (multi-turn)."""
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, T, generator=g)
    new = (old + scale * torch.randn(B, T, generator=g)).requires_grad_(True)
    if contiguous:
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    else:
        mask = torch.rand(B, T, generator=g) < 0.6
        mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True
    adv = torch.randn(B, generator=g)
    return new, old, adv, mask


def loss_and_grad(new, old, adv, mask, **kw):
    new = new.detach().clone().requires_grad_(True)
    loss, metrics = policy_loss(new, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, new)
    return loss, grad, metrics


@FAST
@given(shape=shapes, contiguous=st.booleans(), loss_agg=st.sampled_from(LOSS_AGGS))
def test_identical_policies_ratio_one_nothing_clipped(shape, contiguous, loss_agg):
    new, _, adv, mask = random_batch(*shape, contiguous=contiguous)
    old = new.detach().clone()
    grads = {}
    for algo in PPO_CLIP_ALGOS:
        kw = dict(algo=algo, clip_low=3e-4, clip_high=4e-4, loss_agg=loss_agg)
        loss, grads[algo], m = loss_and_grad(new, old, adv, mask, **kw)
        assert m["ratio/token_mean"].item() == 1.0 and m["ratio/seq_mean"].item() == 1.0
        assert m["ratio/token_var"].item() == 0.0 and m["ratio/seq_var"].item() == 0.0 and m["kl/k3"].item() == 0.0
        assert all(m[key].item() == 0.0 for key in CLIP_KEYS + ("clip_frac/dual", "ratio/extreme_frac"))
    if loss_agg == "seq-mean-token-mean":  # (not gspo_unnormalized: without 1/|y_i| its gradient is |y_i| times larger)
        for algo in ("gspo", "gspo_token"):
            torch.testing.assert_close(grads[algo], grads["grpo"], rtol=1e-6, atol=1e-7)


@FAST
@given(B=st.integers(1, 6), T=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), loss_agg=st.sampled_from(LOSS_AGGS))
def test_one_token_responses_gspo_equals_grpo(B, T, seed, loss_agg):
    new, old, adv, _ = random_batch(B, T, seed, scale=0.5)
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True
    kw = dict(clip_low=0.1, clip_high=0.15, loss_agg=loss_agg, dual_clip_c=2.0)
    loss_grpo, grad_grpo, m_grpo = loss_and_grad(new, old, adv, mask, algo="grpo", **kw)
    for algo in ("gspo", "gspo_token", "gspo_unnormalized"):
        loss, grad, m = loss_and_grad(new, old, adv, mask, algo=algo, **kw)
        torch.testing.assert_close(loss, loss_grpo, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, grad_grpo, rtol=1e-6, atol=1e-7)
        assert all(m[k] == m_grpo[k] for k in CLIP_KEYS)


@FAST
@given(shape=shapes, loss_agg=st.sampled_from(LOSS_AGGS), dual=st.sampled_from([None, 1.2]), per_token=st.booleans())
def test_gspo_token_with_sequence_advantages_equals_gspo(shape, loss_agg, dual, per_token):
    new, old, adv, mask = random_batch(*shape, scale=0.2)
    token_adv = adv.unsqueeze(-1).expand(mask.shape).clone() if per_token else adv
    kw = dict(clip_low=0.02, clip_high=0.03, loss_agg=loss_agg, dual_clip_c=dual)
    loss_seq, grad_seq, m_seq = loss_and_grad(new, old, adv, mask, algo="gspo", **kw)
    loss_tok, grad_tok, m_tok = loss_and_grad(new, old, token_adv, mask, algo="gspo_token", **kw)
    assert torch.equal(loss_tok, loss_seq)  # same value bit for bit: s_it's value is s_i
    assert all(m_tok[k] == m_seq[k] for k in m_seq)
    torch.testing.assert_close(grad_tok, grad_seq, rtol=1e-5, atol=1e-7)


@FAST
@given(shape=shapes, algo=st.sampled_from(PPO_CLIP_ALGOS), loss_agg=st.sampled_from(LOSS_AGGS),
       contiguous=st.booleans())
def test_garbage_in_padding_changes_nothing(shape, algo, loss_agg, contiguous):
    new, old, adv, mask = random_batch(*shape, contiguous=contiguous)
    token_adv = adv.unsqueeze(-1).expand(mask.shape).clone()
    kw = dict(algo=algo, clip_low=0.1, clip_high=0.1, loss_agg=loss_agg, dual_clip_c=1.5)
    loss, grad, metrics = loss_and_grad(new, old, token_adv, mask, **kw)
    garbage = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30, -1e30])
    fill = lambda x: torch.where(mask, x.detach(), garbage[torch.arange(x.numel()) % 5].reshape(x.shape))  # noqa: E731
    for mask_kind in (mask, mask.float(), mask.long()):
        loss2, grad2, metrics2 = loss_and_grad(fill(new), fill(old), fill(token_adv), mask_kind, **kw)
        assert torch.equal(loss2, loss) and torch.equal(grad2, grad)
        assert bool((grad2[~mask] == 0).all()) and bool(torch.isfinite(grad2).all())
        assert all(torch.equal(metrics2[k], metrics[k]) for k in metrics)


@FAST
@given(B=st.integers(1, 5), T=st.integers(1, 64), seed=st.integers(0, 2**31 - 1), shift=st.floats(-0.3, 0.3))
def test_fixed_shift_keeps_s_i_fixed_while_unnormalised_grows(B, T, seed, shift):
    _, old, _, mask = random_batch(B, T, seed, contiguous=True)
    new = old + shift  # every token's log-ratio is `shift`, whatever the response length
    adv = torch.ones(B)
    kw = dict(clip_low=0.5, clip_high=1e9, loss_agg="seq-mean-token-mean")  # no clip reached: loss = -mean s_i
    loss, _, m = loss_and_grad(new, old, adv, mask, algo="gspo", **kw)
    assert loss.item() == pytest.approx(-math.exp(shift), rel=1e-5)
    assert m["ratio/seq_mean"].item() == pytest.approx(math.exp(shift), rel=1e-5)
    assert m["ratio/seq_var"].item() == pytest.approx(0.0, abs=1e-9)
    loss_raw, _, _ = loss_and_grad(new, old, adv, mask, algo="gspo_unnormalized", **kw)
    lengths = mask.sum(-1).tolist()
    expected = -sum(math.exp(min(n * shift, 20.0)) for n in lengths) / B
    assert loss_raw.item() == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("algo", PPO_CLIP_ALGOS)
def test_asymmetric_clip_semantics(algo):
    """One-token sequences so every algo's ratio is exp(d); A > 0 clips above, A < 0 below."""
    lo, hi = 0.1, 0.3
    d = torch.tensor([0.5, -0.5, 0.5, -0.5, 0.05, -0.05])  # ratio ~1.65, ~0.61, ..., inside
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, -2.0])
    old = torch.zeros(6, 1)
    kw = dict(algo=algo, clip_low=lo, clip_high=hi, loss_agg="seq-mean-token-sum")
    loss, grad, m = loss_and_grad(old + d.unsqueeze(-1), old, adv, torch.ones(6, 1), **kw)
    r = d.exp()
    clipped = torch.tensor([True, False, False, True, False, False])  # A>0 & r>1+hi ; A<0 & r<1-lo
    per_seq = torch.where(clipped, -r.clamp(1 - lo, 1 + hi) * adv, -r * adv)
    assert loss.item() == pytest.approx(per_seq.mean().item(), rel=1e-6)
    assert bool((grad[clipped] == 0).all()) and bool((grad[~clipped] != 0).all())
    torch.testing.assert_close(grad[~clipped, 0], (-r * adv)[~clipped] / 6)
    assert m["clip_frac/active"].item() == pytest.approx(2 / 6)
    assert m["clip_frac/out_of_range"].item() == pytest.approx(4 / 6)
    assert m["clip_frac/low"].item() == pytest.approx(2 / 6) and m["clip_frac/high"].item() == pytest.approx(2 / 6)


@FAST
@given(shape=shapes, algo=st.sampled_from(PPO_CLIP_ALGOS), c=st.floats(1.05, 4.0))
def test_dual_clip_bounds_negative_advantage_loss(shape, algo, c):
    new, old, adv, mask = random_batch(*shape, scale=1.5)
    adv = -adv.abs() - 0.1  # all negative
    kw = dict(algo=algo, clip_low=0.2, clip_high=0.2, loss_agg="seq-mean-token-mean")
    loss_plain, _, m_plain = loss_and_grad(new, old, adv, mask, **kw)
    loss, grad, m = loss_and_grad(new, old, adv, mask, dual_clip_c=c, **kw)
    # per token the loss is min(plain, -c A) <= -c A = c |A|; so the mean is bounded too
    assert loss.item() <= c * adv.abs().max().item() + 1e-6
    assert loss.item() <= loss_plain.item() + 1e-6
    # dual-active tokens (A < 0, r > c) are never clip-active (that needs r < 1 - clip_low): the shares add up
    active, dual = m["clip_frac/active"].item(), m["clip_frac/dual"].item()
    assert active == pytest.approx(m_plain["clip_frac/active"].item() + dual)
    if dual == 1.0:
        assert bool((grad == 0).all())
    positive = policy_loss(new, old, adv.abs(), mask, dual_clip_c=c, **kw)[0]
    assert torch.equal(positive, policy_loss(new, old, adv.abs(), mask, **kw)[0])  # A > 0: no effect
