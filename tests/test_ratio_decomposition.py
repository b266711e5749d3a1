"""The ratio decomposition d_route / d_weight (ratio_metrics.ratio_decomposition and step.update's columns),
checked against independent numpy recomputations and against what the math guarantees at the first update."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from test_train import tiny

from moe_lab.models import build_model
from moe_lab.rl.optim import build_optimizer
from moe_lab.algos.ratio_metrics import DECOMP_KEYS, ratio_decomposition
from moe_lab.rl.rollout import forward_logits, token_logprobs
from moe_lab.routing import record, replay
from moe_lab.rl.components import Components, UpdateContext
from moe_lab.rl.step import collect, minibatch_indices, update
from moe_lab.tasks import get_task


def _update(policy, optimizer, data, idx_B, cfg, index: int) -> dict:
    """step.update of update ``index`` of step 0 on rows idx_B, without step components or a KL reference."""
    return update(UpdateContext(policy, None, optimizer, Components(), cfg, data, 0, index, idx_B))


def _numpy_decomposition(free, ref, old, mask, lo, hi) -> dict[str, float]:
    """docs/metrics.md's definitions over the masked tokens, float64, written without ratio_metrics."""
    m = np.asarray(mask, bool)
    dr = (np.asarray(free, np.float64) - np.asarray(ref, np.float64))[m]
    dw = (np.asarray(ref, np.float64) - np.asarray(old, np.float64))[m]
    vr, vw = dr.var(), dw.var()
    inside = lambda d: (np.exp(d) >= 1 - lo) & (np.exp(d) <= 1 + hi)  # noqa: E731
    return {"ratio/d_route_mean": dr.mean(), "ratio/d_weight_mean": dw.mean(), "ratio/d_route_var": vr,
            "ratio/d_weight_var": vw, "ratio/d_cov": ((dr - dr.mean()) * (dw - dw.mean())).mean(),
            "ratio/routing_share": vr / (vr + vw) if vr + vw > 0 else 0.0,
            "ratio/route_extreme_frac": (np.abs(dr) > math.log(2)).mean(),
            "ratio/route_clip_exit_frac": (inside(dw) & ~inside(dw + dr)).mean()}


def test_decomposition_matches_numpy_on_random_log_probs():
    g = np.random.default_rng(0)
    B, T = 5, 11
    old = g.normal(-2, 1, (B, T))
    ref = old + g.normal(0, 0.1, (B, T))
    free = ref + g.normal(0, 0.5, (B, T)) * (g.random((B, T)) < 0.4)  # routing moves some tokens, far
    mask = g.random((B, T)) < 0.7
    free[~mask] = np.nan  # masked positions never leak into the statistics
    got = ratio_decomposition(*(torch.tensor(x, dtype=torch.float32) for x in (free, ref, old)),
                              torch.tensor(mask), 0.2, 0.27)
    want = _numpy_decomposition(free, ref, old, mask, 0.2, 0.27)
    assert set(got) == set(DECOMP_KEYS)
    assert want["ratio/route_clip_exit_frac"] > 0 and want["ratio/route_extreme_frac"] > 0  # cases exercised
    for key in DECOMP_KEYS:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_routing_share_is_zero_without_any_movement_and_one_for_routing_alone():
    old = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 4, dtype=torch.bool)
    still = ratio_decomposition(old, old, old, mask, 0.2, 0.2)
    assert still["ratio/routing_share"] == 0.0 and not math.isnan(still["ratio/routing_share"])
    moved = ratio_decomposition(old + torch.randn(3, 4, generator=torch.Generator().manual_seed(2)), old, old,
                                mask, 0.2, 0.2)
    assert moved["ratio/routing_share"] == 1.0 and moved["ratio/d_weight_var"] == 0.0


# --------------------------------------------------------------------------- step.update's columns


def _setup(tmp_path, *overrides):
    cfg = tiny(tmp_path, "rl.router_noise=0.0", "rl.decomp_every=1", *overrides)
    task = get_task(cfg.task)
    torch.manual_seed(0)
    policy = build_model(cfg.model, len(task.tokenizer))
    prompts = task.sample_prompts(cfg.rl.prompts_per_step, np.random.default_rng(0))
    data = collect(policy, policy, None, task, cfg, 0, prompts)
    return cfg, policy, data


def _perturb(policy, scale: float) -> None:
    """Move the weights (routers included) away from the old policy's, seeded."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if p.numel() > 1 else 1.0))


def test_r2_logged_d_route_equals_an_independent_free_routing_recomputation(tmp_path):
    cfg, policy, data = _setup(tmp_path, "rl.replay=old", "rl.minibatches=1")
    _perturb(policy, 0.3)
    probe = copy.deepcopy(policy)  # the weights the update's forwards see (before its optimizer step)
    idx_B = minibatch_indices(data.batch.input_ids_BS.shape[0], 1, cfg.seed, 0)[0]
    row = _update(policy, build_optimizer(policy, cfg.rl.section("schedule")), data, idx_B, cfg, 0)
    b = data.batch
    ids, attn, mask = b.input_ids_BS[idx_B], b.attention_mask_BS[idx_B], b.response_mask_BT[idx_B]
    with torch.no_grad():
        with record(probe) as free_trace:
            free = token_logprobs(forward_logits(probe, ids, attn).logits, ids)
        with replay(probe, data.ref_trace[idx_B]):
            ref = token_logprobs(forward_logits(probe, ids, attn).logits, ids)
    assert (free_trace.indices != data.ref_trace[idx_B].indices).any(), "the perturbation moved no routing"
    want = _numpy_decomposition(free.numpy(), ref.numpy(), data.logp_old_BT[idx_B].numpy(), mask.numpy(), 0.2, 0.27)
    assert want["ratio/d_route_var"] > 1e-6  # routing moved the log-probs: the test can tell terms apart
    for key in DECOMP_KEYS:
        assert row[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    # R2's loss ratio is exactly the weight term
    assert row["ratio/d_weight_var"] == pytest.approx(row["ratio/logratio_var"], rel=1e-5)


def test_grpo_log_ratio_is_the_sum_of_both_terms(tmp_path):
    cfg, policy, data = _setup(tmp_path, "rl.minibatches=1")
    _perturb(policy, 0.3)
    idx_B = minibatch_indices(data.batch.input_ids_BS.shape[0], 1, cfg.seed, 0)[0]
    row = _update(policy, build_optimizer(policy, cfg.rl.section("schedule")), data, idx_B, cfg, 0)
    total = row["ratio/d_route_var"] + row["ratio/d_weight_var"] + 2 * row["ratio/d_cov"]
    assert row["ratio/d_route_var"] > 1e-6
    assert total == pytest.approx(row["ratio/logratio_var"], rel=1e-4)


@pytest.mark.parametrize("replay_mode", ["none", "rollout"])
def test_first_update_of_one_update_per_batch_has_no_weight_term(tmp_path, replay_mode):
    """Old pass and first update run the same fp32 weights on the same routing: d_weight is exactly 0 (GRPO:
    both route freely and noiselessly; R3: both replay the rollout's trace). d_route compares the router's own
    choice with the reference: under GRPO the reference IS that choice (exactly 0); under R3 it is the rollout's
    KV-cache routing, which only ties broken differently could change (not guaranteed 0, so not asserted)."""
    cfg, policy, data = _setup(tmp_path, f"rl.replay={replay_mode}", "rl.minibatches=1", "rl.epochs=1",
                               "rl.rollout_dtype=float32")
    idx_B = minibatch_indices(data.batch.input_ids_BS.shape[0], 1, cfg.seed, 0)[0]
    row = _update(policy, build_optimizer(policy, cfg.rl.section("schedule")), data, idx_B, cfg, 0)
    assert row["ratio/d_weight_mean"] == 0.0 and row["ratio/d_weight_var"] == 0.0
    if replay_mode == "none":
        assert row["ratio/d_route_mean"] == 0.0 and row["ratio/d_route_var"] == 0.0
        assert row["routing/first_div_none"] == 1.0


def test_decomp_every_leaves_nan_on_skipped_updates_and_changes_nothing_else(tmp_path):
    rows = {}
    for every in (1, 0, 3):
        cfg, policy, data = _setup(tmp_path, "rl.minibatches=2", f"rl.decomp_every={every}", "rl.router_noise=0.1")
        opt = build_optimizer(policy, cfg.rl.section("schedule"))
        n = data.batch.input_ids_BS.shape[0]
        rows[every] = [_update(policy, opt, data, idx, cfg, u)
                       for u, idx in enumerate(minibatch_indices(n, 2, cfg.seed, 0))]
    assert all(math.isnan(r["ratio/d_route_var"]) for r in rows[0])
    # every 3rd update: u = 2, 5, ... (u + 1 divisible by 3); updates 0 and 1 of this step have none
    assert all(math.isnan(r["ratio/d_route_var"]) for r in rows[3])
    rows[3] = [_update(policy, opt, data, idx, cfg, u)
               for u, idx in zip((2, 4), minibatch_indices(data.batch.input_ids_BS.shape[0], 2, cfg.seed, 0))]
    assert not math.isnan(rows[3][0]["ratio/d_route_var"]) and math.isnan(rows[3][1]["ratio/d_route_var"])
    for on, off in zip(rows[1], rows[0]):  # the extra forward changes no other column
        for key, value in off.items():
            if not key.startswith(("perf/", "ratio/d_", "ratio/routing_share", "ratio/route_")):
                assert value == on[key] or (math.isnan(value) and math.isnan(on[key])), key


def test_data_parallel_combination_gives_the_whole_batch_decomposition():
    """dp_split.combine_metrics: means by tokens, variances and the covariance by the law of total
    (co)variance, routing_share from the combined variances: equal to the decomposition of the whole batch."""
    from moe_lab.rl.dp_split import combine_metrics

    g = torch.Generator().manual_seed(3)
    old = torch.randn(6, 9, generator=g)
    ref = old + 0.2 * torch.randn(6, 9, generator=g)
    free = ref + 0.5 * torch.randn(6, 9, generator=g) + 0.3 * (ref - old)  # correlated: d_cov != 0
    mask = torch.rand(6, 9, generator=g) > 0.3
    whole = ratio_decomposition(free, ref, old, mask, 0.2, 0.27)
    parts = [(ratio_decomposition(free[p], ref[p], old[p], mask[p], 0.2, 0.27), 1.0, float(mask[p].sum()))
             for p in (slice(0, 1), slice(1, 4), slice(4, 6))]
    out = combine_metrics(parts)
    assert abs(whole["ratio/d_cov"]) > 1e-3
    for key in DECOMP_KEYS:
        assert out[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("replay_mode", ["none", "old"])
def test_activation_checkpointing_leaves_the_row_unchanged(tmp_path, replay_mode):
    """The counterfactual forward is no-grad: under activation checkpointing nothing is recomputed for it,
    and the update's own recompute still follows the update's routing; every column (noise on) is the same."""
    rows = {}
    for checkpointing in (False, True):
        cfg, policy, data = _setup(tmp_path, f"rl.replay={replay_mode}", "rl.minibatches=1", "rl.router_noise=0.1")
        _perturb(policy, 0.3)
        policy.train()
        policy.activation_checkpointing_enable() if checkpointing else policy.activation_checkpointing_disable()
        idx_B = minibatch_indices(data.batch.input_ids_BS.shape[0], 1, cfg.seed, 0)[0]
        rows[checkpointing] = _update(policy, build_optimizer(policy, cfg.rl.section("schedule")), data, idx_B, cfg, 0)
    assert rows[False]["ratio/d_route_var"] > 0
    for key, value in rows[False].items():
        if not key.startswith("perf/"):
            assert rows[True][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
