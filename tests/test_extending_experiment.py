"""docs/extending.md's recipes "A new organism" and "A new experiment", as written: the organism sits under the
experiment's base, the listed arms are their presets, and the blocks give the cells the page states."""

from __future__ import annotations

from pathlib import Path

import yaml

from moe_lab.commands.run import read_experiment
from moe_lab.launch.design import contrasts_spec
from moe_lab.launch.experiment import expand
from recipes import block


def test_the_new_organism_and_experiment_recipes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("my_organism.yaml").write_text(block("organism"), encoding="utf-8")
    Path("my_experiment.yaml").write_text(block("experiment"), encoding="utf-8")
    exp = read_experiment("my_experiment.yaml")
    cells = expand(exp)
    organism = yaml.safe_load(block("organism"))["config"]
    assert len(cells) == 24  # the page's count: 4 arms x 3 cold starts x 2 seeds
    for cell in cells:
        assert cell.config.model.num_experts == organism["model"]["num_experts"]
        assert cell.config.task.length == organism["task"]["length"]
        assert cell.config.rl.rollout_dtype == organism["rl"]["rollout_dtype"]
    r3 = next(c for c in cells if c.arm == "grpo_r3").config.rl
    assert (r3.algo, r3.replay, r3.rollout_correction) == ("grpo", "rollout", "none")
    assert {c.config.model.seed for c in cells} == {1, 2, 3}
    assert [(c.arm, c.vs, c.margin) for c in contrasts_spec(exp)] == [("grpo_r3", "grpo_r2", 0.02),
                                                                     ("gspo", "grpo_r2", None)]
