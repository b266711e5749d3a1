"""The command line: bad input is one line naming the field, before any work; experiments resolve by name or path."""

from __future__ import annotations

import pytest

from moe_lab.cli import builtin_experiment, main, read_experiment


@pytest.mark.parametrize("override,field", [("rl.algo=ppo", "rl.algo"), ("rl.clip_low=2", "rl.clip_low"),
                                            ("model.nope=1", "model.nope"), ("rl.minibatches=3", "rl.minibatches")])
def test_bad_override_fails_before_any_work(tmp_path, capsys, override, field):
    code = main(["run", "smoke", "--out", str(tmp_path / "out"), override])
    err = capsys.readouterr().err
    assert code == 2 and field in err and "Traceback" not in err
    assert not (tmp_path / "out").exists(), "nothing may be written before the config is valid"


@pytest.mark.parametrize("override,field", [("task.length=2", "task.length"), ("model.checkpoint=/no/such", "model.checkpoint"),
                                            ("model.max_positions=12", "model.max_positions")])
def test_task_and_model_mismatches_fail_before_any_folder_is_made(tmp_path, capsys, override, field):
    code = main(["run", "smoke", "--out", str(tmp_path / "out"), override])
    assert code == 2 and field in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unknown_flag_and_unknown_experiment(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["run", "smoke", "--out", str(tmp_path), "--bogus"])
    assert main(["run", "no_such_experiment", "--out", str(tmp_path)]) == 2
    assert "neither a file nor a built-in experiment" in capsys.readouterr().err


def test_builtin_experiments_ship_with_the_package():
    for name in ("paper", "smoke", "clip_sweep", "volatility_sweep"):
        assert builtin_experiment(name)["arms"], name


def test_bare_run_config_file_is_one_default_arm(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("rl: {algo: gspo, steps: 3}\nseed: 4\n")
    exp = read_experiment(str(path))
    assert exp == {"name": "mine", "base": {"rl": {"algo": "gspo", "steps": 3}, "seed": 4}}


def test_config_prints_every_field(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "| `rl.algo` |" in out and "| `model.family` |" in out
