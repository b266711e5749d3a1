"""A field's bounds come from the objective where the objective declares them (objective_specs: field_bounds):
CISPO's own setting, rl.clip_low=1.0, validates and trains exactly as its paper default does; an objective that
declares nothing keeps the field's bounds, refused in one line naming the field, the objective and the range."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from moe_lab.algos.losses import policy_loss
from moe_lab.algos.objectives import OBJECTIVES
from moe_lab.cli import main
from moe_lab.config import PAPER_CLIP, ConfigError, apply_overrides, field_table, from_dict, load_yaml, validate
from moe_lab.config.objective_specs import OBJECTIVE_SPECS
from moe_lab.rl.loop import train

SMOKE = load_yaml(str(Path(__file__).resolve().parents[1] / "experiments" / "smoke.yaml"))


@pytest.mark.parametrize("algo", list(OBJECTIVE_SPECS))
def test_clip_low_at_one_is_allowed_exactly_where_the_objective_declares_it(algo):
    data = {"rl": {"algo": algo, "clip_low": 1.0}}
    if "clip_low" in OBJECTIVE_SPECS[algo].field_bounds():
        assert validate(from_dict(data)).rl.clip_low == 1.0
        with pytest.raises(ConfigError, match=rf"^rl\.clip_low=-0\.1 is out of range for rl\.algo={algo}: allowed >= 0\.0$"):
            validate(from_dict({"rl": {"algo": algo, "clip_low": -0.1}}))
    else:
        with pytest.raises(ConfigError) as err:
            validate(from_dict(data))
        assert str(err.value) == f"rl.clip_low=1.0 is out of range for rl.algo={algo}: allowed >= 0.0 and < 1.0"
    assert OBJECTIVE_SPECS["cispo"].field_bounds() and not OBJECTIVE_SPECS["grpo"].field_bounds()


def _loss_takes(algo: str, clip_low: float) -> bool:
    """Does the loss's own argument check (moe_lab/algos/losses.py) take this clip_low for ``algo``?"""
    B, T = 2, 3
    try:
        policy_loss(torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B), torch.ones(B, T), algo=algo,
                    clip_low=clip_low, clip_high=PAPER_CLIP[algo][1])
    except ValueError as err:
        assert str(err).startswith("clip_low"), err
        return False
    return True


def _config_takes(algo: str, clip_low: float) -> bool:
    try:
        validate(from_dict({"rl": {"algo": algo, "clip_low": clip_low}}))
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("algo", list(OBJECTIVE_SPECS))
def test_the_loss_takes_the_clip_low_values_the_config_takes(algo):
    """policy_loss's bound on clip_low (Objective.clip_low_max) is the config's for that objective, not a copy."""
    low_max = OBJECTIVES[algo].clip_low_max
    values = [0.0, 0.5, 0.999, 1.0, 5.0, -0.1] + ([low_max] if math.isfinite(low_max) else [])
    assert [_loss_takes(algo, v) for v in values] == [_config_takes(algo, v) for v in values]
    assert _config_takes(algo, 1.0) == ("clip_low" in OBJECTIVE_SPECS[algo].field_bounds())


def test_the_table_says_which_objectives_bound_clip_low_otherwise():
    allowed = {name: a for name, _, a, _ in field_table()}["rl.clip_low"]
    unbounded = [a for a, s in OBJECTIVE_SPECS.items() if s.field_bounds()]
    assert allowed == f">= 0.0 and < 1.0; {', '.join(unbounded)}: >= 0.0"


def test_grpo_at_clip_low_one_is_refused_by_the_command_in_one_line(tmp_path, capsys):
    code = main(["run", "smoke", "--out", str(tmp_path / "out"), "rl.clip_low=1.0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert "rl.clip_low=1.0" in err and "< 1.0" in err and not (tmp_path / "out").exists()


def test_cispo_at_its_own_clip_low_trains_as_its_paper_default(tmp_path):
    """rl.clip_low=1.0 set explicitly is CISPO's paper default: one step gives the same table, bit for bit."""
    tables = {}
    for name, extra in (("explicit", ["rl.clip_low=1.0"]), ("default", [])):
        cfg = validate(from_dict(apply_overrides(SMOKE["base"], [
            f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.algo=cispo", "rl.loss_agg=token-mean", "rl.steps=1",
            *extra])))
        assert train(cfg, tmp_path / name, run_id="r") == "done"
        table = pd.read_parquet(tmp_path / name / "metrics.parquet")
        tables[name] = table.drop(columns=[c for c in table if c.startswith("perf/")])
    assert len(tables["explicit"]) > 0 and tables["explicit"]["ratio/token_mean"].notna().all()
    pd.testing.assert_frame_equal(tables["explicit"], tables["default"], check_exact=True)
