"""Metric checks that can fail: the golden metrics recomputed one token at a time, the ±20 log-ratio clamp,
the direction of the mismatch k3 estimate, and which routing is the reference and which the latent one."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_lab.algos.losses import policy_loss

GOLDEN = Path(__file__).parent / "golden" / "losses_golden.json"


def _cases():
    return json.loads(GOLDEN.read_text())["cases"]


def _loop_metrics(new, old, mask, algo: str) -> dict[str, float]:
    """docs/metrics.md's definitions, one token at a time in float64, independent of ratio_metrics.py."""
    B, T = len(mask), len(mask[0])
    d = [(i, t, max(-20.0, min(20.0, new[i][t] - old[i][t]))) for i in range(B) for t in range(T) if mask[i][t]]
    w = [math.exp(x) for _, _, x in d]
    n = len(d)
    mean_w, mean_d = sum(w) / n, sum(x for *_, x in d) / n
    seqs = []
    for i in range(B):
        ds = [x for j, _, x in d if j == i]
        if ds:
            seqs.append(math.exp(sum(ds) / len(ds)))
    mean_s = sum(seqs) / len(seqs)
    return {
        "ratio/token_mean": mean_w,
        "ratio/token_var": sum((x - mean_w) ** 2 for x in w) / n,
        "ratio/logratio_var": sum((x - mean_d) ** 2 for *_, x in d) / n,
        "ratio/seq_mean": mean_s,
        "ratio/seq_var": sum((s - mean_s) ** 2 for s in seqs) / len(seqs),
        "ratio/extreme_frac": sum(abs(x) > math.log(2.0) for *_, x in d) / n,
        "kl/k3": sum(math.exp(x) - x - 1 for *_, x in d) / n,
    }


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c["id"])
def test_golden_metrics_agree_with_the_loop_reference(case):
    ref = _loop_metrics(case["logp_new"], case["logp_old"], case["mask"], case["kwargs"]["algo"])
    for name, value in ref.items():
        assert case["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def _clip_out_of_range_loop(new, old, mask, lo, hi) -> float:
    toks = [(new[i][t] - old[i][t]) for i in range(len(mask)) for t in range(len(mask[0])) if mask[i][t]]
    return sum(not (1 - lo <= math.exp(x) <= 1 + hi) for x in toks) / len(toks)


@pytest.mark.parametrize("case", [c for c in _cases() if c["kwargs"]["algo"] == "grpo"], ids=lambda c: c["id"])
def test_golden_grpo_clip_fraction_agrees_with_the_loop_reference(case):
    kw = case["kwargs"]
    want = _clip_out_of_range_loop(case["logp_new"], case["logp_old"], case["mask"], kw["clip_low"], kw["clip_high"])
    assert case["metrics"]["clip_frac/out_of_range"] == pytest.approx(want, abs=1e-6)


# --------------------------------------------------------------------------- the ±20 clamp


def _one_token_loss(d_extreme: float, algo: str = "grpo"):
    new = torch.tensor([[d_extreme, 0.1, -0.2, 0.05]], dtype=torch.float32, requires_grad=True)
    old = torch.zeros(1, 4)
    adv = torch.tensor([-1.0])  # negative: min() keeps r*A, so the loss grows with the ratio (no clip caps it)
    return policy_loss(new, old, adv, torch.ones(1, 4, dtype=torch.bool), algo=algo, clip_low=0.2, clip_high=0.2)


def test_log_ratio_clamp_at_20_is_reached_and_counted():
    loss25, m25 = _one_token_loss(25.0)
    loss20, m20 = _one_token_loss(20.0)
    loss19, m19 = _one_token_loss(19.0)
    assert m25["ratio/clamped_frac"].item() == pytest.approx(0.25)  # one token of four
    assert m20["ratio/clamped_frac"].item() == 0.0 and m19["ratio/clamped_frac"].item() == 0.0
    assert loss25.item() == loss20.item()  # clamped to exp(20), not exp(25)
    assert loss19.item() < loss20.item() and math.isfinite(loss25.item())
    assert m25["ratio/token_mean"].item() == pytest.approx((math.exp(20) + math.exp(0.1) + math.exp(-0.2)
                                                             + math.exp(0.05)) / 4, rel=1e-5)


def test_clamp_keeps_a_finite_gradient_where_exp_would_overflow():
    loss, metrics = _one_token_loss(200.0)  # exp(200) overflows float32
    loss.backward()
    assert math.isfinite(loss.item()) and metrics["ratio/clamped_frac"].item() == pytest.approx(0.25)


# --------------------------------------------------------------------------- mismatch k3 direction


def test_mismatch_k3_estimates_kl_rollout_to_train_not_the_reverse():
    """Samples come from the rollout policy: the mean of exp(-δ) + δ - 1 must converge to KL(rollout || train)."""
    from moe_lab.rl.collect import _mismatch_metrics

    p_roll = torch.tensor([0.9, 0.05, 0.03, 0.02], dtype=torch.float64)
    p_train = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    kl_roll_train = float((p_roll * (p_roll / p_train).log()).sum())
    kl_train_roll = float((p_train * (p_train / p_roll).log()).sum())
    assert abs(kl_roll_train - kl_train_roll) > 0.1  # the two directions are far apart here
    gen = torch.Generator().manual_seed(0)
    x_BT = torch.multinomial(p_roll, 400_000, replacement=True, generator=gen).view(400, 1000)
    batch = SimpleNamespace(response_mask_BT=torch.ones_like(x_BT, dtype=torch.bool), trace=None,
                            logp_rollout_BT=p_roll.log()[x_BT].float())
    got = _mismatch_metrics(batch, p_train.log()[x_BT].float(), None)["mismatch/k3"]
    assert got == pytest.approx(kl_roll_train, abs=0.02)
    assert abs(got - kl_train_roll) > 0.1


# --------------------------------------------------------------------------- reference vs latent routing


def test_routing_row_measures_used_and_latent_against_the_reference():
    from moe_lab.rl.step import _routing_row
    from moe_lab.routing.trace import Trace

    ids_ref = torch.tensor([[[[0, 1], [2, 3]]]], dtype=torch.uint8)   # (L=1, B=1, S=2, K=2)
    ids_used = ids_ref.clone()
    ids_latent = torch.tensor([[[[0, 1], [2, 4]]]], dtype=torch.uint8)  # one expert of one token moved
    mk = lambda ids: Trace(ids, num_experts=8, family="qwen3_moe")  # noqa: E731
    mask = torch.tensor([[False, True]])  # only the second position is a response token
    ref, used, latent = mk(ids_ref), mk(ids_used), mk(ids_latent)
    row = _routing_row(ref, used, latent, mask)
    assert row["routing/expert_change"] == 0.0  # the forced routing is the reference's
    assert row["routing/expert_change_latent"] == pytest.approx(0.5)  # 1 of the 2 experts of the response token
    swapped = _routing_row(ref, latent, used, mask)
    assert swapped["routing/expert_change"] == pytest.approx(0.5) and swapped["routing/expert_change_latent"] == 0.0
