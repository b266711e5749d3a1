"""The command line: bad input is one line naming the field, before any work; experiments resolve by name or path."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from moe_lab.launch.catalog import Runtime, builtin_names, first_sentence
from moe_lab.cli import builtin_experiment, main, read_experiment
from moe_lab.launch.spec import parse_experiment
from moe_lab.config import load_yaml
from moe_lab.launch.experiment import expand

ROOT = Path(__file__).resolve().parents[1]


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


def _experiment_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted((ROOT / "experiments").glob("*.yaml"))}


def test_builtin_experiments_ship_with_the_package():
    """Every experiments/*.yaml is a built-in, found by listing the package (no hand-kept list)."""
    files = _experiment_files()
    assert builtin_names() == sorted(files) and {"paper", "smoke", "clip_sweep", "volatility_sweep"} <= set(files)
    for name, path in files.items():
        assert builtin_experiment(name) == load_yaml(str(path)), name


def test_run_help_names_every_builtin(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name in _experiment_files():
        assert name in help_text, name


def test_list_shows_each_builtin_with_its_cells_and_runtime(capsys):
    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, path in _experiment_files().items():
        exp = load_yaml(str(path))
        row = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [name])
        fields = lines[row].split()
        assert int(fields[1]) == len(expand(exp)), name  # independently: arms x points x seeds
        assert first_sentence(exp.get("description")) in lines[row + 1]
        runs = ROOT / "results" / "reference" / name / "runs"
        if runs.is_dir() and sorted(p.name for p in runs.iterdir()) == sorted(c.run_id for c in expand(exp)):
            wall = sum(json.loads(m.read_text())["wall_s"] for m in runs.glob("*/manifest.json"))
            # the sum is recomputed here; its printed form (min, or s under a minute) is Runtime's one owner
            assert lines[row].endswith(str(Runtime(wall / 2 / 60, "reference"))), lines[row]
        elif "minutes_2cores" in exp:
            assert lines[row].endswith("(yaml)"), lines[row]
        else:
            assert lines[row].endswith("not measured"), lines[row]
    assert lines[-1].startswith("runtime: (reference)")


def test_a_new_experiment_file_is_listed(monkeypatch, tmp_path):
    """experiments/*.yaml added later (e.g. replay_rescue.yaml) appear without any code change."""
    from moe_lab.launch import catalog

    folder = tmp_path / "exps"
    folder.mkdir()
    (folder / "replay_rescue.yaml").write_text("name: replay_rescue\ndescription: Rescue. More words.\n"
                                               "base: {rl: {steps: 2}}\narms: {a: {}, b: {}}\nseeds: [0, 1, 2]\n"
                                               "minutes_2cores: 4\n")
    (folder / "broken.yaml").write_text("name: broken\nbase: {rl: {algo: ppo}}\n")
    monkeypatch.setattr(catalog.resources, "files", lambda _pkg: folder)
    broken, entry = catalog.catalog(reference_dir=tmp_path / "no_reference")
    assert (entry.name, entry.cells, entry.description) == ("replay_rescue", 6, "Rescue.")
    assert (entry.runtime.minutes, entry.runtime.source) == (4.0, "yaml")
    # a file that does not expand is listed with its error instead of hiding the others
    assert broken.cells is None and broken.description.startswith("invalid:") and "rl.algo" in broken.description


def test_runtime_from_a_reference_is_the_summed_wall_time_over_two_workers(tmp_path):
    from moe_lab.launch.catalog import runtime

    walls = {"a-s0": 60.0, "a-s1": 90.0, "b-s0": 30.0}
    for run_id, wall in walls.items():  # finished runs as the runner leaves them: manifest and the rows it counts
        (tmp_path / "x" / "runs" / run_id).mkdir(parents=True)
        (tmp_path / "x" / "runs" / run_id / "manifest.json").write_text(
            json.dumps({"status": "done", "wall_s": wall, "rows": 1, "eval_rows": 0}))
        pd.DataFrame({"step": [0]}).to_parquet(tmp_path / "x" / "runs" / run_id / "metrics.parquet")
    got = runtime("x", parse_experiment({"minutes_2cores": 99}), list(walls), reference_dir=tmp_path)
    assert (got.minutes, got.source) == (180.0 / 2 / 60, "reference")
    # a run the runner would run again (its table lacks a row its manifest counts) measures nothing
    pd.DataFrame({"step": []}).to_parquet(tmp_path / "x" / "runs" / "b-s0" / "metrics.parquet")
    assert runtime("x", parse_experiment({"minutes_2cores": 99}), list(walls), reference_dir=tmp_path).source == "yaml"
    pd.DataFrame({"step": [0]}).to_parquet(tmp_path / "x" / "runs" / "b-s0" / "metrics.parquet")
    # a reference that is not exactly the experiment's cells says nothing about it: the YAML's field then
    assert runtime("x", parse_experiment({"minutes_2cores": 99}), ["a-s0"], reference_dir=tmp_path).source == "yaml"
    assert runtime("x", parse_experiment({}), ["a-s0"], reference_dir=tmp_path).source == "not measured"


def test_first_sentence():
    from moe_lab.launch.catalog import first_sentence

    assert first_sentence("Clip-range sweep. GRPO's 0.2 clip\n  and more.") == "Clip-range sweep."
    assert first_sentence("lr 1e-4, 0.3 accuracy (GSPO 0.65). 30 steps.") == "lr 1e-4, 0.3 accuracy (GSPO 0.65)."


def test_bare_run_config_file_is_one_default_arm(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("rl: {algo: gspo, steps: 3}\nseed: 4\n")
    exp = read_experiment(str(path))
    assert exp == {"name": "mine", "base": {"rl": {"algo": "gspo", "steps": 3}, "seed": 4}}


def test_config_prints_every_field(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "| `rl.algo` |" in out and "| `model.family` |" in out
