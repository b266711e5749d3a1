"""policy_loss / kl_penalty / aggregate_loss against an independent loop-based reference, the
golden file, and every bad-input case. Properties over random shapes live in test_losses_properties.py."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_lab.config.constants import LOSS_AGGS
from moe_lab.algos.losses import aggregate_loss, kl_penalty, masked_mean, policy_loss
from moe_lab.algos.ratio_metrics import METRIC_KEYS
from moe_lab.config.constants import PPO_CLIP_ALGOS

GOLDEN = Path(__file__).parent / "golden" / "losses_golden.json"
FAST = settings(max_examples=15, deadline=None)


# ---------------------------------------------------------------- independent reference (loops)


def reference_loss(
    new, old, adv, mask, *, algo, clip_low, clip_high, loss_agg="seq-mean-token-mean", dual_clip_c=None, norm_len=None
):
    """The paper's formulas, one token at a time (no vectorisation shared with the library)."""
    B, T = mask.shape
    seq_sums, seq_lens, total, count = [], [], 0.0, 0
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t] == 1]
        if algo != "grpo":
            log_s = sum(new[i, t] - old[i, t] for t in idx)
            s = torch.exp(log_s / len(idx) if algo != "gspo_unnormalized" else log_s)
        row = 0.0
        for t in idx:
            a = adv[i, t] if adv.ndim == 2 else adv[i]
            if algo == "grpo":
                r = torch.exp(new[i, t] - old[i, t])
            elif algo == "gspo_token":
                r = s.detach() * torch.exp(new[i, t] - new[i, t].detach())
            else:
                r = s
            objective = torch.min(r * a, torch.clamp(r, 1 - clip_low, 1 + clip_high) * a)
            if dual_clip_c is not None and a < 0:
                objective = torch.max(objective, dual_clip_c * a)
            row = row - objective
        seq_sums.append(row)
        seq_lens.append(len(idx))
        total, count = total + row, count + len(idx)
    if loss_agg == "token-mean":
        return total / count
    if loss_agg == "seq-mean-token-mean":
        return sum(x / n for x, n in zip(seq_sums, seq_lens)) / B
    if loss_agg == "seq-mean-token-sum":
        return sum(seq_sums) / B
    return sum(seq_sums) / B / (T if norm_len is None else norm_len)


def reference_metrics(new, old, adv, mask, *, algo, clip_low, clip_high, dual_clip_c=None):
    """Metric definitions of docs/metrics.md, in plain Python floats."""
    B, T = mask.shape
    new = new.detach()
    toks, seq_out, seq_ratios = [], [], []
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t] == 1]
        d = [float(new[i, t] - old[i, t]) for t in idx]
        s_norm = math.exp(sum(d) / len(d))
        s_loss = math.exp(sum(d)) if algo == "gspo_unnormalized" else s_norm
        seq_ratios.append(s_norm)
        outs = []
        for t, d_t in zip(idx, d):
            a = float(adv[i, t] if adv.ndim == 2 else adv[i])
            r = math.exp(d_t) if algo == "grpo" else s_loss
            low, high = r < 1 - clip_low, r > 1 + clip_high
            unclipped, clipped = r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a
            dual = dual_clip_c is not None and a < 0 and dual_clip_c * a > min(unclipped, clipped)
            toks.append(dict(d=d_t, w=math.exp(d_t), low=low, high=high, active=clipped < unclipped or dual, dual=dual))
            outs.append(low or high)
        seq_out.append(any(outs))
    frac = lambda key: sum(tok[key] for tok in toks) / len(toks)  # noqa: E731
    return {
        "clip_frac/out_of_range": sum(tok["low"] or tok["high"] for tok in toks) / len(toks),
        "clip_frac/active": frac("active"),
        "clip_frac/low": frac("low"),
        "clip_frac/high": frac("high"),
        "clip_frac/dual": frac("dual"),
        "clip_frac/seq": sum(seq_out) / B,
        "ratio/token_mean": statistics.fmean(tok["w"] for tok in toks),
        "ratio/token_var": statistics.pvariance([tok["w"] for tok in toks]),
        "ratio/logratio_var": statistics.pvariance([tok["d"] for tok in toks]),
        "ratio/seq_mean": statistics.fmean(seq_ratios),
        "ratio/seq_var": statistics.pvariance(seq_ratios),
        "ratio/extreme_frac": sum(abs(tok["d"]) > math.log(2) for tok in toks) / len(toks),
        "ratio/clamped_frac": 0.0,
        "kl/k3": statistics.fmean(tok["w"] - tok["d"] - 1 for tok in toks),
    }


def make_batch(B, T, seed, *, dtype=torch.float64, scale=0.3, token_adv=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    new = (old + scale * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_(True)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True  # every row has a token
    shape = (B, T) if token_adv else (B,)
    adv = torch.randn(*shape, generator=g, dtype=dtype)
    return new, old, adv, mask


def grad_of(loss, new):
    (g,) = torch.autograd.grad(loss, new)
    return g


# ---------------------------------------------------------------- against the reference


@FAST
@given(
    B=st.integers(1, 4),
    T=st.integers(1, 6),
    seed=st.integers(0, 10_000),
    algo=st.sampled_from(PPO_CLIP_ALGOS),
    loss_agg=st.sampled_from(LOSS_AGGS),
    dual=st.sampled_from([None, 1.3, 3.0]),
)
def test_loss_and_grad_match_loop_reference(B, T, seed, algo, loss_agg, dual):
    new, old, adv, mask = make_batch(B, T, seed, scale=0.4, token_adv=algo == "gspo_token")
    kw = dict(algo=algo, clip_low=0.1, clip_high=0.15, loss_agg=loss_agg, dual_clip_c=dual)
    loss, metrics = policy_loss(new, old, adv, mask, **kw)
    ref = reference_loss(new, old, adv, mask, **kw)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_of(loss, new), grad_of(ref, new), rtol=1e-10, atol=1e-12)
    del kw["loss_agg"]
    expected = reference_metrics(new, old, adv, mask, **kw)
    for key in METRIC_KEYS:
        assert metrics[key].item() == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("norm_len", [None, 3, 11.5])
def test_seq_mean_token_sum_norm_divides_by_norm_len(norm_len):
    new, old, adv, mask = make_batch(3, 5, seed=7)
    kw = dict(algo="grpo", clip_low=0.2, clip_high=0.27, loss_agg="seq-mean-token-sum-norm", norm_len=norm_len)
    loss, _ = policy_loss(new, old, adv, mask, **kw)
    torch.testing.assert_close(loss, reference_loss(new, old, adv, mask, **kw), rtol=1e-12, atol=0)


def test_float32_inputs_match_float64_reference():
    new, old, adv, mask = make_batch(4, 6, seed=3, scale=0.5)
    kw = dict(algo="gspo", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean")
    loss32, _ = policy_loss(new.detach().float(), old.float(), adv.float(), mask, **kw)
    assert loss32.dtype == torch.float32
    assert loss32.item() == pytest.approx(reference_loss(new, old, adv, mask, **kw).item(), abs=1e-6)


def test_bf16_inputs_are_computed_in_fp32():
    new, old, adv, mask = make_batch(2, 4, seed=5)
    kw = dict(algo="grpo", clip_low=0.2, clip_high=0.2)
    loss, metrics = policy_loss(new.detach().bfloat16(), old.bfloat16(), adv, mask, **kw)
    assert loss.dtype == torch.float32
    assert all(v.dtype == torch.float32 and v.shape == () and not v.requires_grad for v in metrics.values())


def test_metric_keys_exact():
    new, old, adv, mask = make_batch(2, 3, seed=1)
    _, metrics = policy_loss(new, old, adv, mask, algo="gspo", clip_low=0.1, clip_high=0.1)
    assert tuple(metrics) == METRIC_KEYS


# ---------------------------------------------------------------- golden regression file


def _golden_cases():
    return json.loads(GOLDEN.read_text())["cases"]


@pytest.mark.parametrize("case", _golden_cases(), ids=lambda c: c["id"])
def test_golden(case):
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    new = f32(case["logp_new"]).requires_grad_(True)
    old, adv, mask = f32(case["logp_old"]), f32(case["advantages"]), torch.tensor(case["mask"], dtype=torch.bool)
    loss, metrics = policy_loss(new, old, adv, mask, **case["kwargs"])
    assert loss.item() == pytest.approx(case["loss"], abs=1e-6)
    torch.testing.assert_close(grad_of(loss, new), f32(case["grad"]), rtol=0, atol=1e-6)
    assert {k: pytest.approx(v, abs=1e-6) for k, v in case["metrics"].items()} == {
        k: v.item() for k, v in metrics.items()
    }


@pytest.mark.parametrize("case", _golden_cases(), ids=lambda c: c["id"])
def test_golden_agrees_with_loop_reference(case):
    """The golden numbers are the formulas' numbers, not just whatever losses.py said once."""
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    new = f64(case["logp_new"]).requires_grad_(True)
    old, adv, mask = f64(case["logp_old"]), f64(case["advantages"]), torch.tensor(case["mask"], dtype=torch.bool)
    ref = reference_loss(new, old, adv, mask, **case["kwargs"])
    assert ref.item() == pytest.approx(case["loss"], abs=1e-5)
    torch.testing.assert_close(grad_of(ref, new).float(), f64(case["grad"]).float(), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- KL estimators and helpers


def test_kl_penalty_matches_formulas_and_masks():
    logp, ref, _, mask = make_batch(3, 5, seed=11, scale=0.8)
    logp = logp.detach().clone()
    logp[~mask] = float("nan")
    for kind, formula in {
        "k1": lambda a, b: a - b,
        "k2": lambda a, b: 0.5 * (a - b) ** 2,
        "k3": lambda a, b: math.exp(b - a) - (b - a) - 1,
    }.items():
        kl = kl_penalty(logp, ref, mask, kind)
        for i, t in zip(*torch.where(torch.ones_like(mask))):
            want = formula(logp[i, t].item(), ref[i, t].item()) if mask[i, t] else 0.0
            assert kl[i, t].item() == pytest.approx(want, rel=1e-12, abs=1e-15), (kind, i, t)
    assert bool((kl_penalty(logp, ref, mask, "k3") >= 0).all())


def test_kl_penalty_k3_gradient_is_finite_and_zero_when_masked():
    logp, ref, _, mask = make_batch(2, 6, seed=2)
    ref = ref.clone()
    ref[~mask] = float("inf")
    loss = masked_mean(kl_penalty(logp, ref, mask, "k3"), mask)
    g = grad_of(loss, logp)
    assert bool(torch.isfinite(g).all()) and bool((g[~mask] == 0).all())


def test_masked_mean_ignores_garbage_and_empty_rows():
    x = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), float("-inf"), float("nan")]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert masked_mean(x, mask).item() == 2.0
    assert masked_mean(x, mask, dim=-1).tolist() == [2.0, 0.0]


# ---------------------------------------------------------------- bad input: ValueError naming the argument

B_, T_ = 2, 3
_OK = dict(algo="grpo", clip_low=0.2, clip_high=0.2)


def _call(new=None, old=None, adv=None, mask=None, **kw):
    args = dict(
        new=torch.zeros(B_, T_) if new is None else new,
        old=torch.zeros(B_, T_) if old is None else old,
        adv=torch.zeros(B_) if adv is None else adv,
        mask=torch.ones(B_, T_) if mask is None else mask,
    )
    return policy_loss(args["new"], args["old"], args["adv"], args["mask"], **{**_OK, **kw})


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(algo="ppo"), "algo"),
        (dict(loss_agg="sum"), "loss_agg"),
        (dict(clip_low=-0.1), "clip_low"),
        (dict(clip_low=1.0), "clip_low"),
        (dict(clip_low=float("nan")), "clip_low"),
        (dict(clip_high=-0.01), "clip_high"),
        (dict(clip_high=float("inf")), "clip_high"),
        (dict(dual_clip_c=1.0), "dual_clip_c"),
        (dict(dual_clip_c=0.5), "dual_clip_c"),
        (dict(norm_len=0), "norm_len"),
        (dict(new=torch.zeros(B_ * T_)), "logp_new_BT"),
        (dict(new=torch.zeros(B_, T_, dtype=torch.long)), "logp_new_BT"),
        (dict(old=torch.zeros(B_, T_ + 1)), "logp_old_BT"),
        (dict(mask=torch.ones(B_ + 1, T_)), "mask_BT"),
        (dict(mask=torch.full((B_, T_), 2.0)), "mask_BT"),
        (dict(mask=torch.full((B_, T_), 0.5)), "mask_BT"),
        (dict(mask=torch.tensor([[1, 1, 0], [0, 0, 0]])), "mask_BT"),
        (dict(new=torch.zeros(0, T_), old=torch.zeros(0, T_), adv=torch.zeros(0), mask=torch.ones(0, T_)), "mask_BT"),
        (dict(adv=torch.zeros(B_ + 1)), "advantages"),
        (dict(adv=torch.zeros(B_, T_ + 1)), "advantages"),
        (dict(adv=torch.zeros(B_, T_, dtype=torch.long)), "advantages"),
        (dict(adv=torch.arange(B_ * T_, dtype=torch.float32).reshape(B_, T_), algo="gspo"), "gspo_token"),
        (dict(adv=torch.arange(B_ * T_, dtype=torch.float32).reshape(B_, T_), algo="gspo_unnormalized"), "advantages"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        _call(**kwargs)


def test_gspo_accepts_token_advantages_constant_over_response():
    adv = torch.tensor([[1.0, 1.0, float("nan")], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss_bt, _ = _call(adv=adv, mask=mask, algo="gspo")
    loss_b, _ = _call(adv=torch.tensor([1.0, -2.0]), mask=mask, algo="gspo")
    assert torch.equal(loss_bt, loss_b)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), "k4"), "kind"),
        (lambda: kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), "k3"), "logp_ref_BT"),
        (lambda: kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 3), "k3"), "mask_BT"),
        (lambda: kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), torch.full((2, 3), 3), "k3"), "mask_BT"),
        (lambda: aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), "mean"), "loss_agg"),
        (lambda: aggregate_loss(torch.zeros(2, 3), torch.ones(2, 4), "token-mean"), "mask_BT"),
        (lambda: aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), LOSS_AGGS[-1], norm_len=-1), "norm_len"),
    ],
)
def test_bad_input_other_functions(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_numpy_scalar_bounds_are_accepted_and_equal_python_floats():
    import numpy as np

    from moe_lab.algos.losses import policy_loss

    g = torch.Generator().manual_seed(3)
    new, old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    adv, mask = torch.randn(3, generator=g), torch.ones(3, 5, dtype=torch.bool)
    ref, _ = policy_loss(new, old, adv, mask, algo="grpo", clip_low=0.2, clip_high=0.27, dual_clip_c=3.0)
    got, _ = policy_loss(new, old, adv, mask, algo="grpo", clip_low=np.float32(0.2), clip_high=np.float64(0.27),
                         dual_clip_c=np.int64(3))
    assert torch.equal(got, policy_loss(new, old, adv, mask, algo="grpo", clip_low=float(np.float32(0.2)),
                                        clip_high=0.27, dual_clip_c=3.0)[0])
    assert float(got) == pytest.approx(float(ref), rel=1e-6)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(new, old, adv, mask, algo="grpo", clip_low=np.bool_(True), clip_high=0.27)
