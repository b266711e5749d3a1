"""routing_replay_weights=True and TRL's MoE load-balancing loss, observed by the tests' own hooks: the combine
weights the experts receive are the recorded ones; the policy loss then sends the router no gradient; the
balancing loss TRL adds is computed from the router's own top-k (not the replayed experts), logged as
routing/aux_loss and announced at construction."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("trl")

import test_trl_integration as T  # noqa: E402
from trl_spy import old_vs_loss, train  # noqa: E402

from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

from moe_lab.models import moe_layers  # noqa: E402


def routers(model) -> list[torch.Tensor]:
    return [layer.router.weight.detach().clone() for layer in moe_layers(model)]


def test_r2_with_weights_the_experts_receive_the_old_pass_weights(tmp_path):
    t = T.trainer(tmp_path, "qwen3_moe", "old", learning_rate=0.5, routing_replay_weights=True)
    spy = train(t)
    pairs = old_vs_loss(spy, "w")
    assert len(pairs) == 2
    for old_w, used_w, mask in pairs:
        assert torch.equal(old_w[:, mask], used_w[:, mask])  # bit for bit: the recorded fp32 weights
    # the recompute of gradient checkpointing received them too
    for call, (old_w, _, mask) in zip([c for c in spy.calls if c["grad"]], pairs):
        assert torch.equal(old_w[:, mask], spy.LBSK(call, "w", run=1)[:, mask])


def test_r2_without_weights_the_weights_follow_the_current_router(tmp_path):
    """The control: ids replayed, weights recomputed from the moved router differ from the old pass's."""
    spy = train(T.trainer(tmp_path, "qwen3_moe", "old", learning_rate=0.5))
    (old0, used0, mask0), (old1, used1, mask1) = old_vs_loss(spy, "w")
    assert torch.equal(old0[:, mask0], used0[:, mask0])  # same weights before any update
    assert not torch.allclose(old1[:, mask1], used1[:, mask1])


def test_r3_with_weights_the_experts_receive_the_generation_weights(tmp_path):
    t = T.trainer(tmp_path, "qwen3_moe", "rollout", learning_rate=0.5, routing_replay_weights=True)
    spy = train(t)
    losses = [c for c in spy.calls if c["grad"]]
    S = losses[0]["ids"].shape[1]
    gen = [c for c in spy.calls if not c["grad"] and c["ids"].shape[1] != S]
    gen_ids = torch.cat([c["ids"] for c in gen], dim=1)
    gen_w = torch.cat([spy.LBSK(c, "w") for c in gen], dim=2)
    for call in losses:
        rows = T.match_rows(call["ids"][:, :S - 1], gen_ids)
        mask = call["mask"][:, :S - 1].bool()
        assert torch.equal(gen_w[:, rows, :S - 1][:, mask], spy.LBSK(call, "w")[:, :, :S - 1][:, mask])


def length_reward(prompts, completions, **_):
    """Rewards that differ within a group (completion lengths), so the advantages and the policy gradient are not 0."""
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("replay_weights", [True, False])
def test_with_replayed_weights_the_policy_loss_gives_the_router_no_gradient(tmp_path, replay_weights):
    """Balancing loss off: with the weights replayed no gradient reaches the router (none arrives, or only zeros)
    and it never moves; with ids only, the recomputed weights carry the policy gradient to it."""
    t = T.trainer(tmp_path, "qwen3_moe", "old", learning_rate=0.5, routing_replay_weights=replay_weights,
                  router_aux_loss_coef=0.0)
    t.reward_funcs = [length_reward]
    grads, handles = [], []
    for layer in moe_layers(t.model):
        handles.append(layer.router.weight.register_post_accumulate_grad_hook(
            lambda p: grads.append(float(p.grad.abs().sum()))))
    before = routers(t.model)
    t.train()
    for h in handles:
        h.remove()
    assert any(abs(r["reward_std"]) > 0 for r in t.state.log_history if "reward_std" in r)
    moved = [not torch.equal(a, b) for a, b in zip(before, routers(t.model))]
    assert moved == [not replay_weights] * len(moved)
    assert (sum(grads) == 0.0) == replay_weights


@pytest.mark.parametrize("replay_weights,aux_coef,freeze,still", [
    (True, 0.0, False, True),      # weight replay and no balancing loss: nothing reaches the router
    (True, None, True, True),      # weight replay, balancing loss on, router frozen
    (True, None, False, False),    # weight replay alone: the balancing loss moves the router
    (False, 0.0, False, False),    # ids only: the policy loss moves it through the recomputed weights
    (False, None, False, False)])
def test_the_router_holds_still_only_with_weight_replay_and_no_balancing_loss_or_frozen(
        tmp_path, caplog, replay_weights, aux_coef, freeze, still):
    """The router weights after 2 updates at a large learning rate, and the construction line that says why."""
    with caplog.at_level(logging.INFO, logger="moe_lab.integrations.trl"):
        t = T.trainer(tmp_path, "qwen3_moe", "old", learning_rate=0.5, routing_replay_weights=replay_weights,
                      router_aux_loss_coef=aux_coef, freeze_router=freeze)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert ("still does" in said and "freeze_router=True holds it still" in said) == (
        replay_weights and aux_coef is None and not freeze)
    t.reward_funcs = [length_reward]
    before = routers(t.model)
    t.train()
    assert any(abs(r["reward_std"]) > 0 for r in t.state.log_history if "reward_std" in r)
    moved = [not torch.equal(a, b) for a, b in zip(before, routers(t.model))]
    assert moved == [not still] * len(moved)
    frozen = {id(layer.router.weight) for layer in moe_layers(t.model)}
    optimized = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
    assert bool(frozen & optimized) == (not freeze)  # a frozen router is not in the optimizer (no AdamW state)


def aux_loss(logits: list[torch.Tensor], ids: list[torch.Tensor], mask_N: torch.Tensor, E: int) -> float:
    """transformers' Switch balancing loss E * sum_e f_e P_e over layers, with f_e from the given top-k ids."""
    m = mask_N.float()
    f = sum(torch.zeros(E).scatter_add_(0, i.reshape(-1).long(), m.repeat_interleave(i.shape[-1])) for i in ids)
    p = sum((torch.softmax(x.float(), -1) * m[:, None]).sum(0) for x in logits)
    n = m.sum() * len(logits)
    return float(E * ((f / n) * (p / n)).sum())


def test_the_balancing_loss_sees_the_routers_own_choice_not_the_replayed_experts(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="moe_lab.integrations.trl"):
        t = T.trainer(tmp_path, "qwen3_moe", "old", learning_rate=0.5)
    said = [r.getMessage() for r in caplog.records if "load-balancing loss" in r.getMessage()]
    assert len(said) == 1 and "coefficient 0.001" in said[0] and "router_aux_loss_coef=0.0" in said[0]
    spy = train(t)
    rows = [r for r in t.state.log_history if "routing/aux_loss" in r]
    assert len(rows) == 2
    for call, row in zip([c for c in spy.calls if c["grad"]], rows):
        mask_N = call["mask"].reshape(-1)
        logits = tuple(x[0] for x in call["logits"])  # the router logits the tests' hooks saw
        free = float(load_balancing_loss_func(logits, 4, 2, call["mask"]))  # transformers': top-k of the logits
        assert free == pytest.approx(aux_loss(list(logits), [x[0] for x in call["own"]], mask_N, 4), rel=2e-3)
        assert row["routing/aux_loss"] == pytest.approx(free, rel=1e-5)
        assert row["aux_loss"] == pytest.approx(free, rel=1e-5)  # TRL's own column: the same loss
    # one update later the forced experts differ from the router's choice, and so would a loss on them
    last = [c for c in spy.calls if c["grad"]][1]
    forced = aux_loss([x[0] for x in last["logits"]], [x[0] for x in last["ids_used"]], last["mask"].reshape(-1), 4)
    assert rows[1]["routing/aux_loss"] != pytest.approx(forced, rel=1e-5)


def test_without_the_balancing_loss_it_says_so_and_logs_no_column(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="moe_lab.integrations.trl"):
        t = T.trainer(tmp_path, "qwen3_moe", "old", router_aux_loss_coef=0.0, max_steps=1)
    assert [r.getMessage() for r in caplog.records if "no MoE load-balancing loss" in r.getMessage()]
    t.train()
    assert "routing/aux_loss" not in t.state.log_history[0] and "aux_loss" not in t.state.log_history[0]


@pytest.mark.parametrize("over,says", [
    ({"routing_replay_weights": "yes"}, "routing_replay_weights=.yes.: allowed True or False"),
    ({"routing_replay_weights": True}, "needs routing_replay .old. or .rollout.")])
def test_bad_routing_replay_weights_are_refused_in_one_line(tmp_path, over, says):
    from moe_lab.integrations.trl import MoEGRPOConfig

    with pytest.raises(ValueError, match=says) as err:
        MoEGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, routing_replay="none", **over)
    assert "\n" not in str(err.value)
