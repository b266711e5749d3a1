"""Experiments composed from organisms and arm presets (moe_lab/launch/compose.py): a preset is its name's
objective, replay and correction, labelled from the same table rows; an organism sits under the base, which wins;
composing is idempotent and what the runner writes needs no organism file; bad names get one line."""

from __future__ import annotations

import itertools
from pathlib import Path

import pandas as pd
import pytest
import yaml

from moe_lab.analysis.arm_traits import traits_of
from moe_lab.analysis.plots import arm_label
from moe_lab.cli import read_experiment
from moe_lab.config import ConfigError
from moe_lab.launch.compose import arm_presets, compose, load_organism, organism_names
from moe_lab.launch.experiment import expand
from moe_lab.config.mode_specs import REPLAY_SPECS, ROLLOUT_CORRECTION_SPECS
from moe_lab.config.objective_specs import OBJECTIVE_SPECS

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted((ROOT / "experiments").glob("*.yaml"))


def test_every_objective_replay_and_correction_has_one_preset_name():
    # A name built twice (e.g. an objective named like another's suffixed form) would silently shadow one arm.
    combos = list(itertools.product(OBJECTIVE_SPECS, REPLAY_SPECS, ROLLOUT_CORRECTION_SPECS))
    presets = arm_presets()
    assert len(presets) == len(combos)
    assert {tuple(p.overrides["rl"].values()) for p in presets.values()} == set(combos)
    assert len({p.label for p in presets.values()}) == len(combos)


@pytest.mark.parametrize("name,algo,replay,correction,label", [
    ("grpo", "grpo", "none", "none", "GRPO"),
    ("grpo_r2", "grpo", "old", "none", "GRPO + R2 replay"),
    ("gspo_r3", "gspo", "rollout", "none", "GSPO + R3 replay"),
    ("grpo_tis", "grpo", "none", "tis_token", "GRPO + TIS"),
    ("grpo_r3_icepop", "grpo", "rollout", "icepop", "GRPO + R3 replay + IcePop"),
    ("gspo_token_pr2_mis_seq", "gspo_token", "predictive", "mis_seq", "GSPO-token + PR2 replay + MIS-seq"),
])
def test_a_preset_is_what_its_name_says(name, algo, replay, correction, label):
    cell = expand({"arms": [name], "base": {"rl": {"rollout_dtype": "bfloat16"}}})[0]
    assert (cell.config.rl.algo, cell.config.rl.replay, cell.config.rl.rollout_correction) == (algo, replay, correction)
    traits = traits_of(pd.DataFrame({"arm": [name, f"{name}__rl.lr=0.1"], "rl.algo": [algo] * 2,
                                     "rl.replay": [replay] * 2, "rl.rollout_correction": [correction] * 2}))
    assert arm_label(name, traits) == label and arm_label(f"{name}__rl.lr=0.1", traits) == f"{label} (lr=0.1)"


def test_a_preset_overrides_the_base_and_an_explicit_arm_is_used_as_written():
    base = {"rl": {"replay": "old", "rollout_correction": "tis_token"}}
    listed, written = (expand({"base": base, "arms": arms})[0].config.rl
                       for arms in (["grpo"], {"grpo": {"rl": {"algo": "grpo"}}}))
    assert (listed.replay, listed.rollout_correction) == ("none", "none")  # the preset says: no replay, no TIS
    assert (written.replay, written.rollout_correction) == ("old", "tis_token")  # only what the entry sets


def test_the_organism_sits_under_the_base():
    organism = load_organism("rescue")
    cells = expand({"organism": "rescue", "base": {"model": {"top_k": 2}}, "arms": ["grpo"]})
    model = cells[0].config.model
    assert model.top_k == 2  # the base wins
    assert (model.family, model.num_experts, model.moe_intermediate_size) == tuple(
        organism["model"][k] for k in ("family", "num_experts", "moe_intermediate_size"))
    assert cells[0].config.rl.rollout_dtype == organism["rl"]["rollout_dtype"]


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_composing_is_idempotent_and_leaves_no_organism_to_read(path):
    exp = read_experiment(str(path))
    once = compose(exp)
    assert compose(once) == once and "organism" not in once
    # the explicit form, as the runner writes it into a results folder, expands to the same cells
    again = yaml.safe_load(yaml.safe_dump(once, sort_keys=False))
    assert [(c.run_id, c.config) for c in expand(again)] == [(c.run_id, c.config) for c in expand(exp)]


def test_every_organism_loads_and_fixes_no_rl_training_field():
    for name in organism_names():
        config = load_organism(name)
        assert set(config.get("rl", {})) <= {"rollout_dtype", "rollout_kernels"}, name


@pytest.mark.parametrize("exp,needle", [
    ({"organism": "nope", "arms": ["grpo"]}, "organism: 'nope': no such organism; allowed: expert_bias"),
    ({"organism": "missing.yaml"}, "organism: 'missing.yaml': no such file"),
    ({"arms": ["grpo", "grpo_r9"]}, "arms: 'grpo_r9' is no arm preset"),
    ({"arms": ["grpo", "grpo"]}, "arms: an arm preset is listed twice"),
    ({"organism": "rescue", "base": 3}, "base: expected a mapping"),
])
def test_bad_organisms_and_presets_get_one_line(exp, needle):
    with pytest.raises(ConfigError) as err:
        expand(exp)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_an_organism_of_your_own_is_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("mine.yaml").write_text("name: mine\ndescription: x\nconfig: {rl: {lr: 0.1}}\n")
    with pytest.raises(ConfigError, match=r"mine.yaml: config.rl: an organism fixes only rollout_dtype, "
                                          r"rollout_kernels \(the rollout's numerics\), got \['lr'\]"):
        expand({"organism": "mine.yaml"})
    Path("mine.yaml").write_text("name: other\ndescription: x\nconfig: {model: {top_k: 1}}\n")
    with pytest.raises(ConfigError, match="with name: mine"):
        expand({"organism": "mine.yaml"})
