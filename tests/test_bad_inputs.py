"""Every bad input of issue 11 gets one line on stderr naming the problem, a non-zero exit, and nothing written.

Each case drives `moe_lab.cli.main` in-process with a fresh tmp folder; `--out` must not exist afterwards
(or, where it existed before, must be unchanged).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moe_lab.cli import main

SMOKE_BASE = ("model: {num_layers: 1, hidden_size: 32, num_heads: 2, num_kv_heads: 1, num_experts: 4, top_k: 2,"
              " moe_intermediate_size: 32, intermediate_size: 64}\n"
              "task: {name: sort, length: 6, eval_size: 16}\n")


def _exp(body: str) -> str:
    return "name: bad\n" + body


# (id, experiment file text or None for the built-in smoke, extra argv, text the one line must contain)
CASES = [
    ("yaml_syntax", "name: x\narms: {grpo: {rl: {algo: grpo}}\nseeds: [0]\n", [], "exp.yaml:"),
    ("yaml_syntax_line", "name: x\nseeds: [0\nbase: {}\n", [], "invalid YAML"),
    ("empty_file", "", [], "empty file"),
    ("comment_only_file", "# nothing\n", [], "empty file"),
    ("duplicate_key", "name: x\nseeds: [0]\nseeds: [1]\n", [], "duplicate key 'seeds'"),
    ("duplicate_nested_key", "name: x\nbase: {rl: {lr: 0.1, lr: 0.2}}\n", [], "duplicate key 'lr'"),
    ("unsafe_tag", "name: !!python/object/apply:os.system ['echo hi']\n", [], "python/object"),
    ("top_level_list", "- 1\n- 2\n", [], "expected a mapping at the top level"),
    ("seeds_scalar", _exp("seeds: 3\n"), [], "seeds: expected a non-empty list"),
    ("seeds_negative", _exp("seeds: [-1]\n"), [], "seeds: expected"),
    ("seeds_bool", _exp("seeds: [true]\n"), [], "seeds: expected"),
    ("arms_not_presets", _exp("arms: [grpo, nope]\n"), [], "arms: 'nope' is no arm preset"),
    ("arm_not_mapping", _exp("arms: {grpo: 5}\n"), [], "arms.grpo: expected a mapping"),
    ("arm_points_not_list", _exp("arms: {grpo: {_points: 3}}\n"), [], "arms.grpo._points"),
    ("base_list", _exp("base: [1, 2]\n"), [], "base: expected a mapping"),
    ("sweep_list", _exp("sweep: [1, 2]\n"), [], "sweep: expected a mapping"),
    ("sweep_scalar_values", _exp("sweep: {rl.lr: 0.1}\n"), [], "sweep.rl.lr: expected a non-empty list"),
    ("unknown_top_key", _exp("armz: {}\n"), [], "unknown key"),
    ("jobs_zero", None, ["--jobs", "0"], "--jobs=0"),
    ("jobs_negative", None, ["--jobs", "-3"], "--jobs=-3"),
    ("seeds_flag_text", None, ["--seeds", "a,b"], "--seeds="),
    ("float_overflow", None, ["rl.lr=1e300"], "rl.lr"),
    ("float_inf", None, ["rl.lr=1e400"], "rl.lr"),
    ("bad_choice", None, ["rl.algo=ppo"], "rl.algo"),
    ("report_to_unknown", None, ["--report-to", "mlflow"], "--report-to"),
    # smoke's family (qwen3_moe) has no expert correction bias to update
    ("bias_rate_no_bias", None, ["rl.bias_update_rate=0.001"], "rl.bias_update_rate=0.001: model.family=qwen3_moe"),
    ("coldstart_bias_rate_no_bias", None, ["coldstart.bias_update_rate=0.001"], "coldstart.bias_update_rate"),
]


def _call(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals (choices) exit 2 with one usage line + one error line
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("text,extra,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_experiment_or_flag(tmp_path, capsys, text, extra, needle):
    exp = "smoke"
    if text is not None:
        (tmp_path / "exp.yaml").write_text(text)
        exp = str(tmp_path / "exp.yaml")
    out = tmp_path / "out"
    code, err = _call(["run", exp, "--out", str(out), *extra], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0
    assert needle in err, err
    assert "Traceback" not in err
    assert lines[-1].startswith(("moe-lab: error:", "moe-lab run: error:")), err
    assert len([ln for ln in lines if "error" in ln]) == 1, err
    assert not out.exists(), "nothing may be written for a bad input"


def test_out_is_a_file(tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("not a folder")
    code, err = _call(["run", "smoke", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1 and "--out" in err and "is a file" in err
    assert out.read_text() == "not a folder"


def test_out_under_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code, err = _call(["run", "smoke", "--out", str(tmp_path / "f" / "out")], capsys)
    assert code == 2 and err.count("\n") == 1 and "--out" in err


def test_out_unwritable(tmp_path, capsys):
    # /proc refuses new entries even to root (chmod does not stop root, so a read-only tmp folder cannot be used)
    code, err = _call(["run", "smoke", "--out", "/proc/moe_lab_out"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--out: cannot write" in err
    assert not os.path.exists("/proc/moe_lab_out")


def test_out_holding_another_experiment_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "experiment.yaml").write_text("name: paper\narms: {grpo: {}}\n")
    before = sorted(p.name for p in out.iterdir())
    code, err = _call(["run", "smoke", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1 and "holds experiment 'paper'" in err and "--overwrite" in err
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / "experiment.yaml").read_text() == "name: paper\narms: {grpo: {}}\n"


def test_corrupt_manifest_is_named(tmp_path, capsys):
    from moe_lab.config import apply_overrides, dump_yaml, from_dict, load_yaml
    from moe_lab.launch.experiment import expand

    root = Path(__file__).resolve().parents[1]
    smoke = load_yaml(str(root / "experiments" / "smoke.yaml"))
    cell = expand(smoke, arms=["grpo"])[0]
    run_dir = tmp_path / "out" / "runs" / cell.run_id
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cell.config))
    (run_dir / "manifest.json").write_text("{not json")
    code, err = _call(["run", "smoke", "--out", str(tmp_path / "out"), "--arms", "grpo"], capsys)
    assert code == 2 and err.count("\n") == 1 and str(run_dir / "manifest.json") in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "manifest.json"]
    assert not (tmp_path / "out" / "experiment.yaml").exists()


def test_plot_of_a_missing_folder(tmp_path, capsys):
    code, err = _call(["plot", str(tmp_path / "nope")], capsys)
    assert code == 2 and err.count("\n") == 1 and "not a folder" in err


def test_yaml_error_names_file_and_line(tmp_path):
    from moe_lab.config import ConfigError, load_yaml

    path = tmp_path / "c.yaml"
    path.write_text("a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: invalid YAML"):
        load_yaml(str(path))
    path.write_text("a: 1\nb: 2\na: 3\n")
    with pytest.raises(ConfigError, match=rf"{path}:3: .*duplicate key 'a' \(first at line 1\)"):
        load_yaml(str(path))
