"""group_advantages: degenerate groups, the mean/std property, a loop reference, clipping, errors."""

from __future__ import annotations

import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_lab.algos.advantages import group_advantages
from moe_lab.config.constants import WHITEN_MODES

FAST = settings(max_examples=25, deadline=None)
rewards_st = st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 3.25]), min_size=1, max_size=6)


def reference_advantages(rewards, G, *, std_normalize=True, eps=1e-6, reward_clip=None, adv_clip=None, whiten="group"):
    """Loop reference with statistics.stdev (sample std), the convention the module documents."""
    if reward_clip is not None:
        rewards = [min(max(r, -reward_clip), reward_clip) for r in rewards]
    groups = [rewards[k : k + G] for k in range(0, len(rewards), G)]
    centred = [r - statistics.fmean(g) if len(set(g)) > 1 else 0.0 for g in groups for r in g]
    if std_normalize and whiten == "group":
        stds = [statistics.stdev(g) if len(set(g)) > 1 else 1.0 for g in groups for _ in g]
        out = [c / (s + eps) for c, s in zip(centred, stds)]
    elif std_normalize:
        s = statistics.stdev(centred) if len(centred) > 1 else 0.0
        out = [c / (s + eps) if c != 0 else 0.0 for c in centred]
    else:
        out = centred
    if adv_clip is not None:
        out = [min(max(a, -adv_clip), adv_clip) for a in out]
    return out


@FAST
@given(
    groups=st.lists(rewards_st, min_size=1, max_size=4),
    G=st.integers(1, 6),
    std_normalize=st.booleans(),
    whiten=st.sampled_from(WHITEN_MODES),
    clips=st.sampled_from([(None, None), (0.75, None), (None, 0.9), (2.0, 1.5)]),
)
def test_matches_loop_reference(groups, G, std_normalize, whiten, clips):
    rewards = [r for g in groups for r in (g * G)[:G]]  # len(groups) groups of exactly G
    kw = dict(std_normalize=std_normalize, whiten=whiten, reward_clip=clips[0], adv_clip=clips[1])
    adv = group_advantages(torch.tensor(rewards), G, **kw)
    assert adv.dtype == torch.float32 and adv.shape == (len(rewards),)
    assert adv.tolist() == pytest.approx(reference_advantages(rewards, G, **kw), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("whiten", WHITEN_MODES)
@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, -7.3, 1e-7])
def test_equal_rewards_give_exactly_zero(whiten, std_normalize, value):
    rewards = torch.tensor([value] * 8 + [0.0, 1.0, 1.0, 0.0])  # two degenerate groups, one not
    adv = group_advantages(rewards, 4, std_normalize=std_normalize, whiten=whiten, eps=0.0)
    assert torch.equal(adv[:8], torch.zeros(8))  # exactly 0: not NaN, not 1e-9
    assert bool((adv[8:] != 0).all()) and bool(torch.isfinite(adv).all())


def test_group_of_one_and_all_degenerate_batch_give_zero():
    assert torch.equal(group_advantages(torch.tensor([3.0, -1.0, 2.0]), 1), torch.zeros(3))
    assert torch.equal(group_advantages(torch.ones(6), 3, whiten="batch", eps=0.0), torch.zeros(6))


@FAST
@given(seed=st.integers(0, 2**31 - 1), n_groups=st.integers(1, 5), G=st.integers(2, 8))
def test_zero_mean_and_unit_std_per_group(seed, n_groups, G):
    rewards = torch.randn(n_groups * G, generator=torch.Generator().manual_seed(seed))
    adv = group_advantages(rewards, G, eps=0.0).reshape(n_groups, G)
    # fp32: two near-equal rewards make the centring lose digits, hence 1e-5 and not 1e-7
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(n_groups), rtol=0, atol=1e-5)
    torch.testing.assert_close(adv.std(dim=1), torch.ones(n_groups), rtol=1e-5, atol=0)
    batch = group_advantages(rewards, G, eps=0.0, whiten="batch").reshape(n_groups, G)
    torch.testing.assert_close(batch.mean(dim=1), torch.zeros(n_groups), rtol=0, atol=1e-5)
    assert batch.std().item() == pytest.approx(1.0, rel=1e-5)


def test_batch_whiten_keeps_relative_scale_across_groups():
    rewards = torch.tensor([0.0, 0.0, 0.0, 1e-3, 0.0, 1.0, 0.0, 1.0])
    group = group_advantages(rewards, 4, whiten="group")
    batch = group_advantages(rewards, 4, whiten="batch")
    assert group[:4].abs().max().item() > 1.4  # a 1e-3 difference blown up to ~1.5 (eps takes 0.2%)
    assert batch[:4].abs().max().item() < 0.01 * batch[4:].abs().max().item()


def test_reward_clip_and_adv_clip():
    G = 4
    clipped_in = group_advantages(torch.tensor([0.0, 1.0, 50.0, -50.0]), G, reward_clip=2.0)
    assert torch.equal(clipped_in, group_advantages(torch.tensor([0.0, 1.0, 2.0, -2.0]), G))
    saturated = group_advantages(torch.tensor([11.0, 12.0, 13.0, 14.0]), G, reward_clip=10.0)
    assert torch.equal(saturated, torch.zeros(G))  # all clamped to 10: a degenerate group
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0])
    free = group_advantages(rewards, G)
    capped = group_advantages(rewards, G, adv_clip=1.0)
    assert capped.abs().max().item() == 1.0
    assert torch.equal(capped[free.abs() <= 1.0], free[free.abs() <= 1.0])


def test_mean_only_advantage_is_centred_reward():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    adv = group_advantages(rewards, 3, std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0]))


def test_integer_and_float64_rewards_give_float32():
    assert group_advantages(torch.tensor([0, 1, 1, 0]), 2).dtype == torch.float32
    assert group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), 2).dtype == torch.float32


@pytest.mark.parametrize(
    "args, kwargs, name",
    [
        ((torch.zeros(6), 4), {}, "group_size"),
        ((torch.zeros(6), 0), {}, "group_size"),
        ((torch.zeros(6), 2.0), {}, "group_size"),
        ((torch.zeros(0), 2), {}, "group_size"),
        ((torch.zeros(2, 3), 3), {}, "rewards_B"),
        (([0.0, 1.0], 2), {}, "rewards_B"),
        ((torch.zeros(4), 2), {"whiten": "global"}, "whiten"),
        ((torch.zeros(4), 2), {"eps": -1.0}, "eps"),
        ((torch.zeros(4), 2), {"reward_clip": 0.0}, "reward_clip"),
        ((torch.zeros(4), 2), {"adv_clip": -1.0}, "adv_clip"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        group_advantages(*args, **kwargs)
