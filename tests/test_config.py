"""Config validation: every bad field fails before any work, with a message naming it and what is allowed."""

from __future__ import annotations

import pytest

from moe_lab.config import (ConfigError, RunConfig, apply_overrides, dump_yaml, field_table, from_dict,
                            resolved_clip, validate)
import yaml

BAD = [
    ({"rl": {"algo": "ppo"}}, "rl.algo", "grpo, gspo, gspo_token, gspo_unnormalized"),
    ({"rl": {"replay": "always"}}, "rl.replay", "none, old, rollout"),
    ({"rl": {"clip_low": 1.5}}, "rl.clip_low", "< 1.0"),
    ({"rl": {"clip_high": -0.1}}, "rl.clip_high", ">= 0.0"),
    ({"rl": {"dual_clip_c": 1.0}}, "rl.dual_clip_c", "> 1.0"),
    ({"rl": {"group_size": 1}}, "rl.group_size", ">= 2"),
    ({"rl": {"minibatches": 3}}, "rl.minibatches", "must divide"),
    ({"rl": {"loss_agg": "sum"}}, "rl.loss_agg", "token-mean"),
    ({"rl": {"lr": 0}}, "rl.lr", "> 0.0"),
    ({"rl": {"replay": "old", "old_logp": "rollout"}}, "rl.replay", "old_forward"),
    ({"rl": {"rollout_dtype": "float16"}}, "rl.rollout_dtype", "bfloat16"),
    ({"model": {"family": "llama"}}, "model.family", "qwen3_moe"),
    ({"model": {"top_k": 9}}, "model.top_k", "num_experts=8"),
    ({"model": {"num_heads": 3}}, "model.num_heads", "divisible"),
    ({"model": {"experts_impl": "batched_mm"}}, "model.experts_impl", "grouped_mm, eager"),
    ({"task": {"name": "chess"}}, "task.name", "sort"),
    ({"coldstart": {"target_accuracy": 1.5}}, "coldstart.target_accuracy", "<= 1.0"),
    ({"rl": {"steps": "ten"}}, "rl.steps", "expected"),
    ({"rl": {"steps": True}}, "rl.steps", "expected"),
    ({"rl": {"clip_high": float("inf")}}, "rl.clip_high", "finite"),
    ({"rl": {"lr": float("nan")}}, "rl.lr", "finite"),
]


@pytest.mark.parametrize("data,field,allowed", BAD, ids=[b[1] for b in BAD])
def test_bad_field_names_field_and_allowed_values(data, field, allowed):
    with pytest.raises(ConfigError) as err:
        validate(from_dict(data))
    assert field in str(err.value) and allowed in str(err.value)


def test_unknown_field_lists_allowed_ones():
    with pytest.raises(ConfigError, match=r"rl\.algoo: unknown field; allowed: .*algo"):
        from_dict({"rl": {"algoo": "gspo"}})


def test_defaults_are_valid_and_clip_follows_the_paper():
    cfg = validate(RunConfig())
    assert resolved_clip(cfg.rl) == (0.2, 0.27)
    assert resolved_clip(from_dict({"rl": {"algo": "gspo"}}).rl) == (3e-4, 4e-4)
    assert resolved_clip(from_dict({"rl": {"algo": "gspo", "clip_low": 1e-3}}).rl) == (1e-3, 4e-4)


def test_yaml_round_trip_is_identity():
    cfg = from_dict({"rl": {"algo": "gspo_token", "replay": "rollout", "old_logp": "rollout"}, "seed": 3})
    again = from_dict(yaml.safe_load(dump_yaml(cfg)))
    assert again == cfg


def test_overrides_parse_numbers_and_sections():
    data = apply_overrides({}, ["rl.clip_low=1e-4", "rl.algo=gspo", "model.num_layers=2", "rl.dual_clip_c=null"])
    cfg = validate(from_dict(data))
    assert cfg.rl.clip_low == 1e-4 and cfg.rl.algo == "gspo" and cfg.model.num_layers == 2 and cfg.rl.dual_clip_c is None
    with pytest.raises(ConfigError, match="section.field=value"):
        apply_overrides({}, ["rl.algo"])


def test_field_table_documents_every_field():
    rows = field_table()
    names = [r[0] for r in rows]
    assert "rl.algo" in names and "model.family" in names and "seed" in names
    assert all(r[3] for r in rows), "every field needs a help text"
