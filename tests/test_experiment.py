"""Experiment grids expand exactly as written, and every shipped experiment file is valid."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_lab.config import ConfigError, load_yaml
from moe_lab.launch.experiment import expand

EXPERIMENTS = sorted(Path(__file__).resolve().parents[1].joinpath("experiments").glob("*.yaml"))


def test_arms_times_sweep_times_seeds():
    exp = {"base": {"rl": {"steps": 2}},
           "arms": {"grpo": {"rl": {"algo": "grpo"}}, "gspo": {"rl": {"algo": "gspo"}}},
           "sweep": {"rl.router_lr_mult": [1.0, 10.0], "rl.rollout_dtype": ["float32", "bfloat16"]},
           "seeds": [0, 1, 2]}
    cells = expand(exp)
    assert len(cells) == 2 * 4 * 3
    assert len({c.run_id for c in cells}) == len(cells)
    one = next(c for c in cells if c.run_id == "gspo__rl.router_lr_mult=10__rl.rollout_dtype=bfloat16-s2")
    assert one.config.rl.algo == "gspo" and one.config.rl.router_lr_mult == 10.0
    assert one.config.rl.rollout_dtype == "bfloat16" and one.config.seed == 2 and one.config.rl.steps == 2


def test_per_arm_points_and_overrides_apply_last():
    exp = {"arms": {"gspo": {"rl": {"algo": "gspo"},
                             "_points": [{"rl.clip_low": 1e-4, "rl.clip_high": 1.3e-4},
                                         {"rl.clip_low": 3e-4, "rl.clip_high": 4e-4}]}},
           "seeds": [0]}
    cells = expand(exp, overrides=["rl.steps=7"])
    assert [(c.config.rl.clip_low, c.config.rl.clip_high) for c in cells] == [(1e-4, 1.3e-4), (3e-4, 4e-4)]
    assert all(c.config.rl.steps == 7 for c in cells)
    assert cells[0].arm == "gspo__rl.clip_low=0.0001__rl.clip_high=0.00013"


def test_filters_and_errors():
    exp = {"arms": {"a": {}, "b": {"rl": {"algo": "gspo"}}}, "seeds": [0, 1]}
    assert [c.run_id for c in expand(exp, arms=["b"], seeds=[5])] == ["b-s5"]
    with pytest.raises(ConfigError, match="--arms: unknown arm"):
        expand(exp, arms=["c"])
    with pytest.raises(ConfigError, match="unknown key"):
        expand({"armz": {}})
    with pytest.raises(ConfigError, match=r"rl\.algo"):
        expand({"arms": {"x": {"rl": {"algo": "ppo"}}}})
    with pytest.raises(ConfigError, match="non-empty list"):
        expand({"sweep": {"rl.lr": 0.1}})


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_shipped_experiments_validate(path):
    cells = expand(load_yaml(str(path)))
    assert cells, f"{path.name} expands to no cell"


def test_factors_vary_one_at_a_time_around_a_shared_base():
    exp = {"base": {"rl": {"steps": 2, "minibatches": 4}},
           "arms": {"grpo": {"rl": {"algo": "grpo"}}, "gspo": {"rl": {"algo": "gspo"}}},
           "factors": {"updates": {"1": {"rl.minibatches": 1}, "4": {}, "16": {"rl.minibatches": 16}},
                       "noise": {"0": {}, "0.1": {"rl.router_noise": 0.1}}},
           "seeds": [0]}
    cells = expand(exp)
    arms = [c.arm for c in cells]
    # base once per arm, then every non-empty level: 2 arms x (1 + 2 + 1)
    assert arms[:4] == ["grpo__base", "grpo__updates=1", "grpo__updates=16", "grpo__noise=0.1"]
    assert len(cells) == 8
    by = {c.run_id: c.config for c in cells}
    assert by["gspo__base-s0"].rl.minibatches == 4 and by["gspo__base-s0"].rl.router_noise == 0.0
    assert by["gspo__updates=16-s0"].rl.minibatches == 16 and by["gspo__updates=16-s0"].rl.router_noise == 0.0
    assert by["grpo__noise=0.1-s0"].rl.router_noise == 0.1 and by["grpo__noise=0.1-s0"].rl.minibatches == 4


@pytest.mark.parametrize("bad, match", [
    ({"factors": {"x": {"1": {}}}, "sweep": {"rl.lr": [0.1]}}, "exclude each other"),
    ({"factors": []}, "expected a mapping"),
    ({"factors": {"x": []}}, "non-empty mapping"),
    ({"factors": {"x": {"1": 3}}}, r"factors\.x\.1"),
    ({"factors": {"a=b": {"1": {}}}}, "may not contain"),
])
def test_factor_errors_name_the_entry(bad, match):
    with pytest.raises(ConfigError, match=match):
        expand(bad)


def test_a_run_written_before_a_field_existed_is_the_same_config(tmp_path):
    """config.yaml files of finished runs (committed references) lack fields added since: read back with their
    defaults they are the same config, so adding a field never makes them conflicts; a changed value still is."""
    from moe_lab.config import RunConfig, dump_yaml
    from moe_lab.store.runlog import config_state

    text = dump_yaml(RunConfig())
    older = "".join(line for line in text.splitlines(keepends=True) if "decomp_every" not in line)
    assert older != text
    (tmp_path / "config.yaml").write_text(older)
    assert config_state(tmp_path, text) == "same"
    (tmp_path / "config.yaml").write_text(older.replace("steps: 40", "steps: 41"))
    assert config_state(tmp_path, text) == "other"
    assert config_state(tmp_path / "none", text) == "new"
