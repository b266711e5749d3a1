"""LoRA (peft) with MoEGRPOTrainer: R2 and R3 observed by the tests' own hooks on the BASE model, which is what
PeftModel.generate and the PeftModel's forwards call; the metrics logged; the adapter (only) trained."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
peft = pytest.importorskip("peft")

import test_trl_integration as T  # noqa: E402
from trl_spy import old_vs_loss, train  # noqa: E402

from moe_lab.integrations.trl import MoEGRPOConfig, MoEGRPOTrainer  # noqa: E402

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def lora_trainer(tmp_path, mode: str, wrap_first: bool, **over):
    kw = T.config_kwargs(tmp_path, mode, **{"learning_rate": 0.5, **over})  # LoRA's small updates need a large lr
    torch.manual_seed(0)
    model, extra = T.tiny_model("qwen3_moe"), {}
    if wrap_first:  # the user wraps: get_peft_model(model, LoraConfig(...))
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    else:  # TRL wraps: peft_config=
        extra["peft_config"] = peft.LoraConfig(**LORA)
    return MoEGRPOTrainer(model=model, reward_funcs=T.reward, args=MoEGRPOConfig(**kw), train_dataset=T.dataset(),
                          processing_class=T.TOKENIZER, **extra)


def lora_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("wrap_first", [True, False], ids=["get_peft_model", "peft_config"])
def test_lora_r2_runs_the_old_pass_experts_and_logs_the_metrics(tmp_path, wrap_first):
    t = lora_trainer(tmp_path, "old", wrap_first)
    base = t.model.get_base_model()
    before = lora_state(t.model)
    spy = train(t, base)
    pairs = old_vs_loss(spy)
    assert len(pairs) == 2
    for old, used, mask in pairs:
        assert torch.equal(old[:, mask], used[:, mask])
    rows = [r for r in t.state.log_history if "routing/expert_change_latent" in r]
    assert len(rows) == 2 and rows[1]["routing/expert_change_latent"] > 0  # the adapter moved the routers' choice
    assert all(0 < r["routing/confidence"] <= 1 and "mismatch/k3" in r for r in rows)
    after = lora_state(t.model)
    assert before and any(not torch.equal(before[n], after[n]) for n in before)  # the adapter trained


def test_lora_r3_runs_the_generation_experts(tmp_path):
    t = lora_trainer(tmp_path, "rollout", wrap_first=True)
    spy = train(t, t.model.get_base_model())
    gen = [c for c in spy.calls if not c["grad"] and c["ids"].shape[1] != [c for c in spy.calls if c["grad"]][0]
           ["ids"].shape[1]]
    assert sum(c["ids"].shape[1] > 1 for c in gen) == 1  # one generate(): its prefill, then one column per step
    gen_ids = torch.cat([c["ids"] for c in gen], dim=1)
    gen_LBSK = torch.cat([spy.LBSK(c, "ids_used") for c in gen], dim=2)
    losses = [c for c in spy.calls if c["grad"]]
    assert len(losses) == 2
    for call in losses:
        S = call["ids"].shape[1]
        rows = T.match_rows(call["ids"][:, :S - 1], gen_ids)
        used = spy.LBSK(call, "ids_used")[:, :, :S - 1]
        mask = call["mask"][:, :S - 1].bool()
        assert torch.equal(gen_LBSK[:, rows, :S - 1][:, mask], used[:, mask])
    assert "routing/router_shift" in t.state.log_history[0]
