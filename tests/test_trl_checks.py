"""What MoEGRPOTrainer refuses before TRL's __init__ runs (beta > 0 where TRL could not build its reference model,
or where the policy would score it; output_router_logits=True, on which transformers' generate() fails) and what
its construction line says about output_router_logits=False, which TRL's balancing loss does not follow."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("trl")

import test_trl_integration as T  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from moe_lab.integrations.trl import MoEGRPOConfig, MoEGRPOTrainer  # noqa: E402


def no_trl_init(monkeypatch):
    def built(*a, **k):
        raise AssertionError("GRPOTrainer.__init__ ran")

    monkeypatch.setattr(GRPOTrainer, "__init__", built)


def test_plain_trl_with_beta_and_a_model_built_in_memory_fails_on_the_repo_id(tmp_path):
    """Why the check below exists: TRL loads the reference from config._name_or_path, empty here."""
    kw = T.config_kwargs(tmp_path, "none", beta=0.1)
    kw.pop("routing_replay")
    with pytest.raises(Exception, match="Repo id must use alphanumeric"):
        GRPOTrainer(model=T.tiny_model("qwen3_moe"), reward_funcs=T.reward, args=GRPOConfig(**kw),
                    train_dataset=T.dataset(), processing_class=T.TOKENIZER)


def test_beta_with_a_model_built_in_memory_is_refused_in_one_line_before_trl(tmp_path, monkeypatch):
    no_trl_init(monkeypatch)
    with pytest.raises(ValueError, match=r"beta=0.1 needs a reference model.*save_pretrained.*or pass beta=0.0") as e:
        MoEGRPOTrainer(model=T.tiny_model("qwen3_moe"), reward_funcs=T.reward,
                       args=MoEGRPOConfig(**T.config_kwargs(tmp_path, "none", beta=0.1)))
    assert "\n" not in str(e.value)


def test_beta_with_peft_is_refused_in_one_line_before_trl(tmp_path, monkeypatch):
    from peft import LoraConfig

    no_trl_init(monkeypatch)
    model = T.tiny_model("qwen3_moe")
    model.config._name_or_path = str(tmp_path)  # not the reason: PEFT is
    with pytest.raises(ValueError, match="beta=0.1 with a PEFT model scores the reference") as e:
        MoEGRPOTrainer(model=model, reward_funcs=T.reward, args=MoEGRPOConfig(**T.config_kwargs(tmp_path, "none",
                                                                                                beta=0.1)),
                       peft_config=LoraConfig(r=2, target_modules=["q_proj"]))
    assert "\n" not in str(e.value)


def test_output_router_logits_false_is_said_not_to_turn_the_balancing_loss_off(tmp_path, caplog):
    model = T.tiny_model("qwen3_moe")
    assert model.config.output_router_logits is False  # transformers' default for the MoE configs
    with caplog.at_level(logging.INFO, logger="moe_lab.integrations.trl"):
        t = MoEGRPOTrainer(model=model, reward_funcs=T.reward,
                           args=MoEGRPOConfig(**T.config_kwargs(tmp_path, "none", max_steps=1)),
                           train_dataset=T.dataset(), processing_class=T.TOKENIZER)
    said = [r.getMessage() for r in caplog.records if "load-balancing loss" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0]
    assert "output_router_logits=False does not turn it off" in said[0]
    t.train()
    assert t.state.log_history[0]["aux_loss"] > 0  # TRL's balancing loss is on all the same


def test_output_router_logits_true_fails_in_generate_and_is_refused_in_one_line_before_trl(tmp_path, monkeypatch):
    model = T.tiny_model("qwen3_moe")
    model.config.output_router_logits = True
    ids = torch.tensor([[0, 1, 5, 6], [1, 5, 6, 7]])
    with pytest.raises(RuntimeError, match="size of tensor"):  # transformers' own generate(), left-padded rows
        model.generate(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=3, do_sample=False)
    no_trl_init(monkeypatch)
    with pytest.raises(ValueError, match="output_router_logits=True in the model config makes transformers' "
                                         "generate.. fail") as e:
        MoEGRPOTrainer(model=model, reward_funcs=T.reward, args=MoEGRPOConfig(**T.config_kwargs(tmp_path, "none")))
    assert "\n" not in str(e.value)
