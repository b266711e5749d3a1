"""Resuming a MoEGRPOTrainer run from a Trainer checkpoint: the experts (which transformers 5 saves one per expert)
come back as they were saved, bit for bit, with every other weight; plain TRL's resume (transformers' Trainer)
leaves them at the weights the model was built with; a checkpoint that lacks an expert is refused in one line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import test_trl_integration as T  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_trl_replay_weights import length_reward  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from moe_lab.integrations.trl import MoEGRPOConfig, MoEGRPOTrainer  # noqa: E402

STEPS = 2  # the checkpoint is written at the last step: a resume from it trains no further step


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(tmp_path, family: str, trainer_cls=MoEGRPOTrainer, resume: str | None = None):
    """(initial weights, weights after train()) of a tiny model built the same way every time."""
    kw = T.config_kwargs(tmp_path / "out", "none", learning_rate=0.05, max_steps=STEPS, save_strategy="steps",
                         save_steps=STEPS)
    if trainer_cls is GRPOTrainer:
        kw.pop("routing_replay")
    args = (MoEGRPOConfig if trainer_cls is MoEGRPOTrainer else GRPOConfig)(**kw)
    torch.manual_seed(0)
    model = T.tiny_model(family)
    init = weights(model)
    trainer = trainer_cls(model=model, reward_funcs=length_reward, args=args, train_dataset=T.dataset(),
                          processing_class=T.TOKENIZER)
    trainer.train(resume_from_checkpoint=resume)
    return init, weights(model)


def experts(names) -> list[str]:
    return [k for k in names if ".experts." in k]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One trained-and-saved run per family, shared by the tests below (each trains 2 steps)."""
    out = {}

    def get(family):
        if family not in out:
            tmp = tmp_path_factory.mktemp(family)
            init, saved = run(tmp, family)
            out[family] = (tmp, init, saved, str(tmp / "out" / f"checkpoint-{STEPS}"))
        return out[family]
    return get


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_a_resumed_run_holds_the_saved_experts_bit_for_bit(tmp_path, trained, family):
    _, init, saved, ckpt = trained(family)
    on_disk = load_file(f"{ckpt}/model.safetensors")
    assert experts(saved) and not set(experts(saved)) <= set(on_disk)  # the experts are written in another layout
    moved = [k for k in experts(saved) if not torch.equal(saved[k], init[k])]
    assert moved  # training moved the experts: equal-to-init and equal-to-saved are told apart
    _, resumed = run(tmp_path, family, resume=ckpt)
    assert resumed.keys() == saved.keys()
    assert [k for k in saved if not torch.equal(resumed[k], saved[k])] == []


def test_plain_trl_resume_leaves_the_experts_at_their_initial_weights(tmp_path, trained):
    """transformers 5.24's Trainer (under TRL's GRPOTrainer) resumes every weight but the experts; if this test
    fails, transformers has fixed its resume: update docs/trl.md (and the override may go)."""
    _, init, saved, ckpt = trained("qwen3_moe")
    _, resumed = run(tmp_path, "qwen3_moe", GRPOTrainer, resume=ckpt)
    moved = [k for k in experts(saved) if not torch.equal(saved[k], init[k])]
    assert moved and all(torch.equal(resumed[k], init[k]) for k in experts(saved))
    assert all(torch.equal(resumed[k], saved[k]) for k in saved if ".experts." not in k)


def test_a_checkpoint_without_an_expert_is_refused_in_one_line(tmp_path, trained):
    import shutil

    _, _, _, ckpt = trained("qwen3_moe")
    broken = tmp_path / "checkpoint-2"
    shutil.copytree(ckpt, broken)
    tensors = load_file(broken / "model.safetensors")
    gone = next(k for k in tensors if ".experts.0." in k)
    save_file({k: v for k, v in tensors.items() if k != gone}, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="cannot resume from .*checkpoint-2/model.safetensors") as err:
        run(tmp_path, "qwen3_moe", resume=str(broken))
    assert "\n" not in str(err.value)


def test_a_run_resumed_midway_ends_where_the_uninterrupted_run_ends(tmp_path):
    """R2 with metrics, 4 steps saving at 2: resuming at 2 gives the uninterrupted run's weights bit for bit and the
    same logged losses and routing metrics (optimizer, scheduler and RNG come from the checkpoint, the experts too)."""
    def four_steps(out, resume=None):
        kw = T.config_kwargs(out, "old", learning_rate=0.05, max_steps=4, save_strategy="steps", save_steps=2)
        torch.manual_seed(0)
        model = T.tiny_model("qwen3_moe")
        trainer = MoEGRPOTrainer(model=model, reward_funcs=length_reward, args=MoEGRPOConfig(**kw),
                                 train_dataset=T.dataset(), processing_class=T.TOKENIZER)
        trainer.train(resume_from_checkpoint=resume)
        rows = [{k: v for k, v in r.items() if k == "loss" or k.startswith("routing/")}
                for r in trainer.state.log_history if "loss" in r]
        return weights(model), rows

    whole, whole_rows = four_steps(tmp_path / "a")
    resumed, resumed_rows = four_steps(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-2"))
    assert [k for k in whole if not torch.equal(whole[k], resumed[k])] == []
    assert len(whole_rows) == 4 and resumed_rows == whole_rows
    assert any(r["routing/expert_change_latent"] > 0 for r in whole_rows[2:])  # routing moved after the resume
