"""Routing metrics on hand-built traces: exact values from the definitions, masks, and agreement with a
direct set-based reference on random traces."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_lab.routing import Trace, expert_change, load_metrics, routing_metrics


def trace_of(ids, weights=None, num_experts=8) -> Trace:
    ids = torch.tensor(ids, dtype=torch.uint8)
    w = None if weights is None else torch.tensor(weights, dtype=torch.float32)
    return Trace(ids, w, num_experts=num_experts, family="qwen3_moe")


# L=2, B=1, S=3, K=2. Layer 0: same set in another order (0 changed), disjoint (1), one shared (1/2).
OLD = [[[[0, 1], [0, 1], [0, 1]]], [[[4, 5], [4, 5], [4, 5]]]]
NEW = [[[[1, 0], [2, 3], [0, 3]]], [[[4, 5], [5, 4], [4, 5]]]]
W_OLD = [[[[0.6, 0.4], [0.5, 0.5], [0.7, 0.3]]], [[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]]]
W_NEW = [[[[0.3, 0.7], [0.5, 0.5], [0.6, 0.4]]], [[[0.5, 0.5], [0.1, 0.9], [0.2, 0.8]]]]


def test_expert_change_exact_values_and_mask():
    old, new = trace_of(OLD), trace_of(NEW)
    assert expert_change(old, new) == pytest.approx((0 + 1 + 0.5 + 0 + 0 + 0) / 6)
    mask = torch.tensor([[True, False, True]])  # the disjoint position is ignored
    assert expert_change(old, new, mask) == pytest.approx((0 + 0.5 + 0 + 0) / 4)
    assert expert_change(old, new, torch.tensor([[1, 0, 1]])) == pytest.approx(0.125)  # 0/1 masks work too
    assert expert_change(old, old) == 0.0
    assert math.isnan(expert_change(old, new, torch.zeros(1, 3, dtype=torch.bool)))


def test_routing_metrics_exact_values():
    old, new = trace_of(OLD, W_OLD), trace_of(NEW, W_NEW)
    m = routing_metrics(old, new)
    assert m["routing/expert_change"] == pytest.approx(0.25)
    assert m["routing/any_change"] == pytest.approx(2 / 3)
    assert m["routing/layer_0/expert_change"] == pytest.approx(1.5 / 3)
    assert m["routing/layer_1/expert_change"] == 0.0
    # experts kept by both, |w_old - w_new| matched by expert id (slot order does not matter):
    # l0 p0: e0 |0.6-0.7|, e1 |0.4-0.3|; l0 p2: e0 |0.7-0.6|;
    # l1 p0: 0, 0; l1 p1: e4 |0.9-0.9|, e5 |0.1-0.1|; l1 p2: 0, 0  -> 9 shared experts
    assert m["routing/gate_drift"] == pytest.approx((0.1 + 0.1 + 0.1) / 9)
    masked = routing_metrics(old, new, torch.tensor([[False, True, True]]), prefix="p/")
    assert masked["p/any_change"] == 1.0 and masked["p/gate_drift"] == pytest.approx(0.1 / 5)
    assert "routing/gate_drift" not in routing_metrics(trace_of(OLD), new)  # needs weights on both sides


def test_load_metrics_exact_values_and_mask():
    # layer 0 spreads 4 positions x 2 slots uniformly over 8 experts; layer 1 sends everything to {0, 1}.
    ids = [[[[0, 1], [2, 3], [4, 5], [6, 7]]], [[[0, 1], [1, 0], [0, 1], [0, 1]]]]
    m = load_metrics(trace_of(ids))
    assert m["routing/layer_0/load_max_violation"] == pytest.approx(0.0)
    assert m["routing/layer_0/load_entropy"] == pytest.approx(1.0)
    assert m["routing/layer_1/load_max_violation"] == pytest.approx(0.5 * 8 - 1)
    assert m["routing/layer_1/load_entropy"] == pytest.approx(math.log(2) / math.log(8))
    assert m["routing/load_max_violation"] == pytest.approx(3.0)
    assert m["routing/load_entropy"] == pytest.approx((1 + math.log(2) / math.log(8)) / 2)
    only_first = load_metrics(trace_of(ids), torch.tensor([[True, False, False, False]]))
    assert only_first["routing/layer_0/load_max_violation"] == pytest.approx(0.5 * 8 - 1)


def test_summary_agrees_with_load_metrics():
    ids = [[[[0, 1], [2, 3], [4, 5], [6, 7]]], [[[0, 1], [1, 0], [0, 1], [0, 1]]]]
    weights = [[[[0.9, 0.1]] * 4], [[[0.6, 0.4]] * 4]]
    trace, mask = trace_of(ids, weights), torch.tensor([[True, True, False, True]])
    frame, m = trace.summary(mask), load_metrics(trace, mask)
    assert frame["tokens"].tolist() == [3, 3]
    assert frame["load_max_violation"].tolist() == pytest.approx(
        [m["routing/layer_0/load_max_violation"], m["routing/layer_1/load_max_violation"]])
    assert frame["load_entropy"].tolist() == pytest.approx(
        [m["routing/layer_0/load_entropy"], m["routing/layer_1/load_entropy"]])
    assert frame["unused_experts"].tolist() == [2, 6]
    assert frame["mean_top_weight"].tolist() == pytest.approx([0.9, 0.6])


def test_bad_inputs_are_refused():
    old = trace_of(OLD)
    with pytest.raises(ValueError, match="shapes .* differ"):
        expert_change(old, trace_of([[[[0, 1]]]]))
    with pytest.raises(ValueError, match="mask: expected shape"):
        expert_change(old, old, torch.ones(2, 3))
    with pytest.raises(ValueError, match="same expert twice"):
        expert_change(old, trace_of([[[[0, 0], [0, 1], [0, 1]]], [[[4, 5], [4, 5], [4, 5]]]]))
    with pytest.raises(ValueError, match="old: expected a Trace or an integer tensor"):
        expert_change(torch.zeros(2, 1, 3, 2), old)


def _reference_change(old_LBSK, new_LBSK, mask_BS):
    """The definition, literally: mean over masked positions, layers and slots of 1 - |K_old ∩ K_new| / k."""
    L, B, S, K = old_LBSK.shape
    vals = [1 - len(set(old_LBSK[l, b, s].tolist()) & set(new_LBSK[l, b, s].tolist())) / K
            for l in range(L) for b in range(B) for s in range(S) if mask_BS[b, s]]
    return sum(vals) / len(vals)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), L=st.integers(1, 3), B=st.integers(1, 3), S=st.integers(1, 5),
       K=st.integers(1, 4))
def test_expert_change_matches_the_set_definition(seed, L, B, S, K):
    gen = torch.Generator().manual_seed(seed)
    E = 6
    old = torch.rand(L, B, S, E, generator=gen).argsort(-1)[..., :K].to(torch.uint8)
    new = torch.rand(L, B, S, E, generator=gen).argsort(-1)[..., :K].to(torch.uint8)
    mask = torch.rand(B, S, generator=gen) < 0.7
    mask[0, 0] = True
    got = expert_change(Trace(old, num_experts=E, family="x"), Trace(new, num_experts=E, family="x"), mask)
    assert got == pytest.approx(_reference_change(old, new, mask))
    assert got == pytest.approx(expert_change(new, old, mask))  # symmetric; raw tensors work too
