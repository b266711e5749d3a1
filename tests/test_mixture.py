"""task.name=mixture: tagged prompts, rewards by tag, disjoint held-out split, shared vocabulary, cold start."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from moe_lab.config import constants as C
from moe_lab.rl.coldstart import META_FILE, cold_start, demonstration_batch, sft_step
from moe_lab.config import ColdStartConfig, ConfigError, ModelConfig, RunConfig, TaskConfig, apply_overrides, \
    from_dict, validate
from moe_lab.models import build_model
from moe_lab.tasks import TAGS, VOCAB, encode_response, get_task, is_eval_prompt
from moe_lab.tasks.mixture import SINGLE
from moe_lab.tasks.tokenizer import UNK

MIX = ["sort", "reverse", "addition"]


def mixture(names=MIX, **kw):
    return get_task(TaskConfig(name="mixture", mixture=list(names), **{"length": 4, "eval_size": 30, **kw}))


def single(name: str, **kw):
    return get_task(TaskConfig(name=name, **{"length": 4, "eval_size": 30, **kw}))


# ----------------------------------------------------------------------------- config


def test_registry_tags_and_constants_agree():
    assert set(SINGLE) == set(TAGS) == set(C.SINGLE_TASKS) and "mixture" in C.TASKS
    assert len(set(TAGS.values())) == len(TAGS)


@pytest.mark.parametrize("overrides,match", [
    (["task.mixture=[sort,reverse]"], "task.mixture=.*is set but task.name=sort"),
    (["task.name=mixture"], "needs >= 2 distinct tasks"),
    (["task.name=mixture", "task.mixture=[sort]"], "needs >= 2 distinct tasks"),
    (["task.name=mixture", "task.mixture=[sort,sort]"], "needs >= 2 distinct tasks"),
    (["task.name=mixture", "task.mixture=[sort,mixture]"], "'mixture' is not allowed: allowed a list of sort"),
    (["task.name=mixture", "task.mixture=[sort,division]"], "'division' is not allowed"),
    (["task.name=mixture", "task.mixture=sort"], "task.mixture: expected list"),
    (["task.name=mixture", "task.mixture=[sort,reverse,addition]", "task.eval_size=2"], "task.eval_size=2"),
])
def test_bad_mixtures_are_refused_naming_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(from_dict(apply_overrides({}, overrides)))


def test_a_mixture_override_parses_to_a_list():
    cfg = validate(from_dict(apply_overrides({}, ["task.name=mixture", "task.mixture=[sort,long_copy]"])))
    assert cfg.task.mixture == ["sort", "long_copy"]


# ----------------------------------------------------------------------------- prompts and rewards


def test_rewards_by_hand_follow_the_tag():
    t, tp = mixture(), mixture(partial_credit=True)
    for prompt, completion, exact, partial in [("s3141=", "1134", 1.0, 1.0), ("s3141=", "1143", 0.0, 0.5),
                                               ("rabch=", "hcba", 1.0, 1.0), ("rabch=", "abch", 0.0, 0.0),
                                               ("p0047+0085=", "00132", 1.0, 1.0), ("p0047+0085=", "00131", 0.0, 0.8)]:
        assert (t.reward(prompt, completion), tp.reward(prompt, completion)) == (exact, pytest.approx(partial))
    with pytest.raises(ValueError, match="prompt='k3141=': expected a task tag first"):
        t.reward("k3141=", "1134")  # long_copy's tag, not in this mixture
    with pytest.raises(ValueError, match="prompt="):
        t.reward("sabch=", "abch")  # the sort tag on a reverse problem


def test_every_prompt_delegates_to_its_sub_task():
    t = mixture(partial_credit=True)
    rng = np.random.default_rng(0)
    prompts = t.sample_prompts(300, rng) + t.eval_prompts()
    ids = t.task_ids(prompts)
    for prompt, i in zip(prompts, ids):
        sub = single(MIX[i], partial_credit=True)
        assert prompt[0] == TAGS[MIX[i]] and t.demonstration(prompt) == sub.demonstration(prompt[1:])
        assert t.reward(prompt, t.demonstration(prompt)) == 1.0
        wrong = sub.demonstration(prompt[1:])[::-1] + "0"
        assert t.reward(prompt, wrong) == sub.reward(prompt[1:], wrong)
    counts = Counter(ids[:300])
    assert set(counts) == {0, 1, 2} and min(counts.values()) > 60  # uniform over 3 sub-tasks (seeded draw)


def test_sampling_is_seeded():
    t = mixture()
    first = t.sample_prompts(40, np.random.default_rng(7))
    assert first == t.sample_prompts(40, np.random.default_rng(7)) != t.sample_prompts(40, np.random.default_rng(8))


def test_eval_is_held_out_fixed_balanced_and_interleaved():
    t = mixture()
    evals = t.eval_prompts()
    assert len(evals) == len(set(evals)) == 30 and evals == mixture(partial_credit=True).eval_prompts()
    assert all(is_eval_prompt(p[1:]) for p in evals)  # the untagged prompt is in its task's held-out bucket
    assert t.task_ids(evals[:6]) == [0, 1, 2, 0, 1, 2]  # any prefix stays balanced
    for i, name in enumerate(MIX):  # the sub-task's own eval list, tagged: the same held-out set as alone
        assert [p[1:] for p in evals if t.task_ids([p])[0] == i] == single(name, eval_size=10).eval_prompts()
    train = t.sample_prompts(3000, np.random.default_rng(9))
    assert not any(is_eval_prompt(p[1:]) for p in train) and not set(train) & set(evals)


def test_eval_size_splits_with_the_remainder_first():
    t = mixture(eval_size=31)
    assert Counter(t.task_ids(t.eval_prompts())) == {0: 11, 1: 10, 2: 10}


# ----------------------------------------------------------------------------- lengths and vocabulary


@pytest.mark.parametrize("names", [MIX, ["long_copy", "long_addition", "sort"]])
def test_budgets_cover_every_sub_task(names):
    t = mixture(names)
    prompts = t.sample_prompts(60, np.random.default_rng(4))
    assert max(len(encode_response(t.tokenizer, t.demonstration(p))) for p in prompts) == t.max_new_tokens
    assert max(len(t.tokenizer(p)["input_ids"]) for p in prompts) == t.prompt_tokens
    assert t.max_new_tokens == max(single(n).max_new_tokens for n in names)
    assert t.prompt_tokens == 1 + max(single(n).prompt_tokens for n in names)  # + the tag token


def test_vocabulary_is_the_shared_one_and_covers_every_sub_task():
    t = mixture(list(C.SINGLE_TASKS))
    assert t.tokenizer.get_vocab() == VOCAB  # unchanged: every single task keeps its tokenisation
    unk = t.tokenizer.convert_tokens_to_ids(UNK)
    for p in t.sample_prompts(100, np.random.default_rng(5)):
        ids = t.tokenizer(p)["input_ids"] + encode_response(t.tokenizer, t.demonstration(p))
        assert unk not in ids
        assert t.tokenizer.convert_ids_to_tokens(ids[1]) == p[0]  # the tag is one token right after BOS
    written = set("".join(t.demonstration(p) + p[1:] for p in t.sample_prompts(300, np.random.default_rng(6))))
    assert not written & set(TAGS.values())  # no task writes a tag character: it marks the task alone


# ----------------------------------------------------------------------------- cold start


def _cfg(tmp_path, **cs) -> RunConfig:
    model = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, num_experts=4, top_k=2,
                        moe_intermediate_size=32, intermediate_size=64, max_positions=64)
    task = TaskConfig(name="mixture", mixture=MIX, length=4, eval_size=30)
    coldstart = ColdStartConfig(**{"max_steps": 3, "batch_size": 12, "eval_every": 2, "eval_samples": 6,
                                   "target_accuracy": 1.0, "cache_dir": str(tmp_path / "cache"), **cs})
    return validate(RunConfig(model=model, task=task, coldstart=coldstart))


def test_demonstration_batch_mixes_lengths_correctly(tmp_path):
    t = get_task(_cfg(tmp_path).task)
    prompts = t.eval_prompts()[:6]
    ids_BS, mask_BS, resp_BT = demonstration_batch(t, prompts)
    for b, p in enumerate(prompts):  # each row: its own prompt, left-padded, then its own demonstration
        want = t.tokenizer(p)["input_ids"] + encode_response(t.tokenizer, t.demonstration(p))
        assert ids_BS[b][mask_BS[b].bool()].tolist() == want
        assert int(resp_BT[b].sum()) == len(encode_response(t.tokenizer, t.demonstration(p)))


@pytest.mark.filterwarnings("ignore:cold start stopped:RuntimeWarning")
def test_cold_start_learns_the_mixture(tmp_path):
    cfg = _cfg(tmp_path)
    t = get_task(cfg.task)
    model = build_model(cfg.model, len(t.tokenizer))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.coldstart.lr)
    prompts = t.eval_prompts()[:12]  # four of each sub-task
    losses = [sft_step(model, opt, t, prompts) for _ in range(10)]
    assert losses[-1] < losses[0]
    path = cold_start(cfg, cache=False, progress=False)  # sampled-accuracy checks generate on the mixture
    info = json.loads((path / META_FILE).read_text())
    assert info["steps"] == 3 and info["task"] == "mixture" and len(info["history"]) >= 2


def test_task_metrics_split_the_reward_by_sub_task_and_measure_task_specialization():
    from moe_lab.routing import Trace
    from moe_lab.rl.collect import _task_metrics

    task = mixture()
    prompts = [p for i in range(3) for p in task._tagged(i, ["1234"] * 2)]  # two prompts of each sub-task
    rewards_B = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.25, 0.75])
    mask_BT = torch.ones(6, 3, dtype=torch.bool)
    # one layer: sub-task i always routes to expert i, so routing tells the task exactly (NMI 1)
    ids_LBTK = torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.uint8).view(1, 6, 1, 1).expand(1, 6, 3, 1).contiguous()
    trace = Trace(indices=ids_LBTK, num_experts=4, family="qwen3_moe")
    out = _task_metrics(task, prompts, rewards_B, trace, mask_BT)
    assert out["reward/mean_sort"] == 0.5 and out["reward/mean_reverse"] == 0.5 and out["reward/mean_addition"] == 0.5
    assert out["routing/task_specialization_l0"] == pytest.approx(1.0)
    blind = Trace(indices=torch.zeros_like(ids_LBTK), num_experts=4, family="qwen3_moe")  # one expert for everything: NMI 0
    assert _task_metrics(task, prompts, rewards_B, blind, mask_BT)["routing/task_specialization"] == 0.0
    assert _task_metrics(single("sort"), prompts[:2], rewards_B[:2], trace, mask_BT) == {}
