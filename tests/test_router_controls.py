"""The router controls of the science issue: ``model.norm_topk_prob`` turns renormalisation off where the family
has the switch, and ``optim/router_grad_norm`` (step.router_grad_norm) measures whether the policy loss reaches
the router: at top-1 with renormalised gate weights every token's weight is p/p = 1, so it does not."""

from __future__ import annotations

import pytest
import torch

from moe_lab.config import ConfigError, ModelConfig, RunConfig, validate
from moe_lab.models import build_model
from moe_lab.rl.step import router_grad_norm

FAMILIES_WITH_SWITCH = ["qwen3_moe", "olmoe", "deepseek_v3"]


def _router_grad(family: str, norm: bool | None, top_k: int = 1) -> float:
    cfg = ModelConfig(family=family, num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, num_experts=8,
                      top_k=top_k, moe_intermediate_size=16, intermediate_size=32, norm_topk_prob=norm)
    model = build_model(cfg, vocab_size=24).train()
    ids = torch.randint(3, 24, (2, 7), generator=torch.Generator().manual_seed(0))
    logp = model(input_ids=ids).logits.log_softmax(-1)
    (-logp[:, :-1].gather(-1, ids[:, 1:, None]).mean()).backward()  # a next-token loss through every router
    return router_grad_norm(model)


@pytest.mark.parametrize("family", FAMILIES_WITH_SWITCH)
def test_top1_router_gets_gradient_only_without_renormalisation(family):
    renormalised, probability = _router_grad(family, True), _router_grad(family, False)
    # p/p = 1 is constant: its gradient is 0 up to rounding (~1e-10 seen), four orders below the gate's
    assert probability > 1e-5 and renormalised < 1e-4 * probability, (renormalised, probability)


def test_top2_renormalised_router_gets_gradient():
    # two weights p_i / (p_i + p_j): not constant, so the router learns
    assert _router_grad("qwen3_moe", True, top_k=2) > 1e4 * _router_grad("qwen3_moe", True, top_k=1)


def test_no_gradient_anywhere_is_zero_not_an_error():
    model = build_model(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1), vocab_size=24)
    assert router_grad_norm(model) == 0.0


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_families_that_always_renormalise_refuse_the_switch(family):
    cfg = RunConfig()
    cfg.model.family, cfg.model.norm_topk_prob = family, False
    with pytest.raises(ConfigError, match=r"model\.norm_topk_prob=False: .* always renormalises"):
        validate(cfg)
