"""Rollout-correction weights against hand-computed cases, their metrics, and their wiring in config."""

from __future__ import annotations

import math

import pytest
import torch

from moe_lab.config import ConfigError, from_dict, validate
from moe_lab.algos.rollout_correction import METRIC_KEYS, MODES, rollout_correction

LN = math.log


def batch(ratios, mask=None):
    """logp_old - logp_rollout = log(ratio); garbage where masked."""
    r = torch.tensor(ratios, dtype=torch.float64)
    mask = torch.ones_like(r, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    rollout = -1.5 * torch.ones_like(r)
    old = rollout + torch.log(r)
    old = torch.where(mask, old, float("nan"))
    rollout = torch.where(mask, rollout, float("inf"))
    return old, rollout, mask


def test_tis_token_truncates_at_upper():
    old, rollout, mask = batch([[0.5, 1.0, 3.0, 2.0], [4.0, 1.5, 0.1, 9.0]], [[1, 1, 1, 1], [1, 1, 1, 0]])
    w, m = rollout_correction(old, rollout, mask, mode="tis_token")  # default upper 2.0 (verl)
    expected = torch.tensor([[0.5, 1.0, 2.0, 2.0], [2.0, 1.5, 0.1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    assert m["rollout_corr/truncated_frac"].item() == pytest.approx(2 / 7)  # 3.0 and 4.0; 2.0 is not above
    assert m["rollout_corr/masked_frac"].item() == 0.0
    assert m["rollout_corr/weight_max"].item() == 2.0
    assert m["rollout_corr/weight_mean"].item() == pytest.approx(9.1 / 7)
    s, q = 9.1, 0.25 + 1 + 4 + 4 + 4 + 2.25 + 0.01
    assert m["rollout_corr/ess"].item() == pytest.approx(s * s / (7 * q), rel=1e-6)


def test_tis_seq_uses_the_product_of_the_sequence_ratios():
    old, rollout, mask = batch([[1.2, 1.5, 7.0], [0.5, 0.8, 1.0], [3.0, 0.2, 1.0]], [[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    w, m = rollout_correction(old, rollout, mask, mode="tis_seq", upper=1.5)
    seq = [min(1.2 * 1.5, 1.5), 0.5 * 0.8, 3.0 * 0.2]
    expected = torch.tensor([[seq[0], seq[0], 0.0], [seq[1]] * 3, [seq[2]] * 3], dtype=torch.float64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    assert m["rollout_corr/truncated_frac"].item() == pytest.approx(2 / 8)


def test_mis_token_masks_above_upper_and_keeps_the_ratio_below():
    old, rollout, mask = batch([[0.3, 1.0, 2.5, 1.9]])
    w, m = rollout_correction(old, rollout, mask, mode="mis_token")
    torch.testing.assert_close(w, torch.tensor([[0.3, 1.0, 0.0, 1.9]], dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert m["rollout_corr/masked_frac"].item() == 0.25 and m["rollout_corr/truncated_frac"].item() == 0.0
    w, m = rollout_correction(old, rollout, mask, mode="mis_token", lower=0.5)  # verl's Seq-MIS band, per token
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0, 1.9]], dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert m["rollout_corr/masked_frac"].item() == 0.5


def test_mis_seq_rejects_whole_sequences():
    old, rollout, mask = batch([[1.5, 1.5, 1.0], [1.2, 1.1, 5.0]], [[1, 1, 1], [1, 1, 0]])
    w, m = rollout_correction(old, rollout, mask, mode="mis_seq")  # 2.25 > 2: rejected; 1.32 kept
    expected = torch.tensor([[0.0, 0.0, 0.0], [1.32, 1.32, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    assert m["rollout_corr/masked_frac"].item() == pytest.approx(3 / 5)


def test_icepop_masks_outside_its_band():
    old, rollout, mask = batch([[0.49, 0.51, 1.0, 4.99, 5.01, 3.0]])
    w, m = rollout_correction(old, rollout, mask, mode="icepop")  # Ring-1T: [0.5, 5]
    expected = torch.tensor([[0.0, 0.51, 1.0, 4.99, 0.0, 3.0]], dtype=torch.float64)
    torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-12)
    assert m["rollout_corr/masked_frac"].item() == pytest.approx(2 / 6)
    w, _ = rollout_correction(old, rollout, mask, mode="icepop", lower=0.8, upper=4.0)
    torch.testing.assert_close(w, torch.tensor([[0, 0, 1.0, 0, 0, 3.0]], dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_equal_weights_have_ess_one_and_are_detached(mode):
    old, rollout, mask = batch([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], [[1, 1, 0], [1, 1, 1]])
    old.requires_grad_(True)
    w, m = rollout_correction(old, rollout, mask, mode=mode)
    assert not w.requires_grad and tuple(m) == METRIC_KEYS
    assert m["rollout_corr/ess"].item() == 1.0 and m["rollout_corr/weight_mean"].item() == 1.0
    assert bool((w[~mask] == 0).all()) and bool((w[mask] == 1).all())


def test_ess_of_one_nonzero_weight_is_one_over_n():
    old, rollout, mask = batch([[1.0, 3.0, 3.0, 3.0]])
    _, m = rollout_correction(old, rollout, mask, mode="mis_token")
    assert m["rollout_corr/ess"].item() == pytest.approx(1 / 4)


def test_extreme_ratios_do_not_overflow():
    old = torch.tensor([[0.0, 0.0]], dtype=torch.float32)
    rollout = torch.tensor([[-100.0, 100.0]], dtype=torch.float32)  # r = e^100, e^-100
    w, m = rollout_correction(old, rollout, torch.ones(1, 2), mode="tis_seq")
    assert bool(torch.isfinite(w).all()) and all(math.isfinite(v.item()) for v in m.values())
    w, _ = rollout_correction(old, rollout, torch.ones(1, 2), mode="icepop")
    assert w.tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("kw, match", [
    (dict(mode="tis"), "mode"), (dict(mode="tis_token", upper=0.0), "upper"),
    (dict(mode="tis_token", lower=0.5), "lower"), (dict(mode="icepop", lower=6.0), "lower"),
])
def test_bad_arguments_name_the_field(kw, match):
    old, rollout, mask = batch([[1.0]])
    with pytest.raises(ValueError, match=match):
        rollout_correction(old, rollout, mask, **kw)


@pytest.mark.parametrize("rl, match", [
    ({"rollout_correction": "icepop", "old_logp": "rollout"}, "old_logp"),
    ({"rollout_correction": "tis_seq", "rollout_correction_lower": 0.5}, "rollout_correction_lower"),
    ({"rollout_correction": "icepop", "rollout_correction_lower": 3.0, "rollout_correction_upper": 2.0}, "lower"),
    ({"rollout_correction_upper": 3.0}, "rollout_correction"),
    ({"rollout_correction": "bogus"}, "rl.rollout_correction"),
])
def test_config_refuses_bad_rollout_correction(rl, match):
    with pytest.raises(ConfigError, match=match):
        validate(from_dict({"rl": rl}))
