"""routing_confidence, first_divergence and specialization against independent numpy / Python recomputations."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from test_train import tiny

from moe_lab.models import build_model
from moe_lab.rl.rollout import forward_logits
from moe_lab.routing import Trace, first_divergence, record, router_logp_probe, routing_confidence, specialization
from moe_lab.tasks import get_task

L, B, S, K, E = 3, 4, 6, 2, 5


def _random_ids(g: np.random.Generator) -> np.ndarray:
    return np.stack([[[g.permutation(E)[:K] for _ in range(S)] for _ in range(B)] for _ in range(L)])


def _trace(ids: np.ndarray, logp: np.ndarray | None = None) -> Trace:
    return Trace(torch.tensor(ids, dtype=torch.uint8), num_experts=E, family="qwen2_moe",
                 router_logp=None if logp is None else torch.tensor(logp, dtype=torch.float32))


def test_confidence_is_the_softmax_mass_of_the_chosen_experts():
    g = np.random.default_rng(0)
    logits = g.normal(0, 2, (L, B, S, E))
    prob = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    ids = np.argsort(-logits, axis=-1)[..., :K]
    mask = g.random((B, S)) < 0.6
    got = routing_confidence(_trace(ids, np.log(np.take_along_axis(prob, ids, -1))), torch.tensor(mask))
    want_L = [np.sort(prob[l], -1)[..., -K:].sum(-1)[mask].mean() for l in range(L)]
    for l in range(L):
        assert got[f"routing/confidence_l{l}"] == pytest.approx(want_L[l], rel=1e-5)
    assert got["routing/confidence"] == pytest.approx(np.mean(want_L), rel=1e-5)
    assert routing_confidence(_trace(ids), torch.tensor(mask)) == {}  # no router log-probs recorded


def test_recorded_router_logp_is_normalised_over_all_experts(tmp_path):
    """The trace's router_logp is a log-probability over ALL experts (the family's normalisation), so the
    confidence is a probability mass: the dense log-probs of the same forward sum to 1 over E."""
    cfg = tiny(tmp_path)
    task = get_task(cfg.task)
    torch.manual_seed(0)
    model = build_model(cfg.model, len(task.tokenizer))
    ids = torch.randint(0, len(task.tokenizer), (2, 7), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    with torch.no_grad(), record(model, router_logp=True) as trace, router_logp_probe(model) as dense:
        forward_logits(model, ids, attn)
    p_LBSE = dense.logp_LBSE.exp()
    torch.testing.assert_close(p_LBSE.sum(-1), torch.ones(p_LBSE.shape[:-1]), atol=1e-5, rtol=0)
    want = p_LBSE.gather(-1, trace.indices.long()).sum(-1).mean((1, 2))
    got = routing_confidence(trace)
    for l in range(trace.num_layers):
        assert got[f"routing/confidence_l{l}"] == pytest.approx(float(want[l]), rel=1e-5)
    assert 0 < got["routing/confidence"] <= 1


def test_first_divergence_matches_a_loop_over_tokens():
    g = np.random.default_rng(1)
    ref = _random_ids(g)
    new = ref.copy()
    for l in range(L):  # change some tokens' sets at some layers; permute the order of others (not a change)
        change = g.random((B, S)) < 0.25
        new[l][change] = _random_ids(g)[l][change]
        new[l] = np.where((g.random((B, S)) < 0.5)[..., None], new[l][..., ::-1], new[l])
    mask = g.random((B, S)) < 0.8
    firsts = []
    for b in range(B):
        for s in range(S):
            if mask[b, s]:
                changed = [l for l in range(L) if set(ref[l, b, s]) != set(new[l, b, s])]
                firsts.append(changed[0] if changed else "none")
    counts = Counter(firsts)
    got = first_divergence(_trace(ref), _trace(new), torch.tensor(mask))
    for l in range(L):
        assert got[f"routing/first_div_l{l}"] == pytest.approx(counts[l] / len(firsts))
    assert got["routing/first_div_none"] == pytest.approx(counts["none"] / len(firsts))
    assert 0 < counts["none"] < len(firsts) and counts[1] + counts[2] > 0  # several cases exercised
    assert sum(got.values()) == pytest.approx(1.0)


def _numpy_nmi(labels: np.ndarray, ids_BSK: np.ndarray, mask: np.ndarray) -> float:
    joint = Counter()
    n = mask.sum()
    for b, s in zip(*np.nonzero(mask)):
        for e in ids_BSK[b, s]:
            joint[(labels[b, s], e)] += 1 / (len(ids_BSK[b, s]) * n)
    px, pe = Counter(), Counter()
    for (x, e), p in joint.items():
        px[x] += p
        pe[e] += p
    h = lambda d: -sum(p * math.log(p) for p in d.values() if p > 0)  # noqa: E731
    mi = sum(p * math.log(p / (px[x] * pe[e])) for (x, e), p in joint.items() if p > 0)
    return 2 * mi / (h(px) + h(pe)) if h(px) + h(pe) > 0 else 0.0


def test_specialization_matches_numpy_and_its_extremes():
    g = np.random.default_rng(2)
    ids = _random_ids(g)
    labels = g.integers(0, 7, (B, S))
    ids[1, ..., 0] = labels % E  # layer 1 leans on the label: more mutual information than chance
    mask = g.random((B, S)) < 0.8
    got = specialization(_trace(ids), torch.tensor(labels), torch.tensor(mask))
    want = [_numpy_nmi(labels, ids[l], mask) for l in range(L)]
    for l in range(L):
        assert got[f"routing/specialization_l{l}"] == pytest.approx(want[l], rel=1e-9, abs=1e-12)
    assert got["routing/specialization"] == pytest.approx(np.mean(want))
    assert want[1] > want[0]
    # k = 1 and the expert a function of the label and vice versa: NMI 1; one label everywhere: 0
    labels1 = g.integers(0, E, (B, S))
    one = Trace(torch.tensor(labels1[None, ..., None], dtype=torch.uint8), num_experts=E, family="qwen2_moe")
    assert specialization(one, torch.tensor(labels1))["routing/specialization"] == pytest.approx(1.0)
    assert specialization(_trace(ids), torch.zeros(B, S, dtype=torch.long))["routing/specialization"] == 0.0
    # a per-sequence tag (B,) is broadcast over the columns, under its own name
    tags = torch.tensor([0, 1, 0, 1])
    tagged = specialization(_trace(ids), tags, torch.tensor(mask), name="task_specialization")
    assert tagged["routing/task_specialization_l0"] == pytest.approx(
        _numpy_nmi(np.repeat(tags.numpy()[:, None], S, 1), ids[0], mask), rel=1e-9)
