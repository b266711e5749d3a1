"""`--report-to tensorboard|wandb` mirrors the tables into the trackers' files; `moe-lab plot` on experiments."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from moe_lab.cli import main
from synthetic import PAPER_ARMS, write_experiment, write_reference

ROOT = Path(__file__).resolve().parents[1]


def _smoke_run(tmp_path: Path, report_to: str) -> Path:
    """2 steps of the smoke config's GSPO arm, mirrored to report_to; returns the experiment folder."""
    from moe_lab.config import apply_overrides, load_yaml
    from moe_lab.launch.runner import run_experiment

    smoke = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
    base = apply_overrides(smoke["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.steps=2"])
    exp = {"name": "tracked", "base": base, "arms": {"gspo": smoke["arms"]["gspo"]}, "seeds": [0]}
    out = tmp_path / "out"
    assert run_experiment(exp, out, jobs=1, progress=False, echo=lambda *_: None,
                          report_to=report_to) == {"gspo-s0": "done"}
    return out


def _numeric_columns(table: pd.DataFrame) -> set[str]:
    return set(table.select_dtypes("number").columns) - {"step", "minibatch", "update", "seed"}


def test_report_to_tensorboard_event_file_holds_every_logged_scalar(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = _smoke_run(tmp_path, "tensorboard")
    acc = EventAccumulator(str(out / "tensorboard" / "gspo-s0"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    metrics = pd.read_parquet(out / "runs" / "gspo-s0" / "metrics.parquet")
    evals = pd.read_parquet(out / "runs" / "gspo-s0" / "eval.parquet")
    for col in ("loss", "clip_frac/active", "ratio/token_var", "routing/expert_change", "reward/mean"):
        events = acc.Scalars(col)
        assert [e.step for e in events] == metrics["update"].tolist()
        # float32 in the event file
        assert [e.value for e in events] == pytest.approx(metrics[col].tolist(), rel=1e-6, abs=1e-30)
    greedy = acc.Scalars("eval/acc_greedy")
    assert [e.step for e in greedy] == evals["step"].tolist()
    assert [e.value for e in greedy] == pytest.approx(evals["eval/acc_greedy"].tolist())
    numeric = _numeric_columns(metrics)
    assert numeric - tags == {c for c in numeric if metrics[c].isna().all()}


def test_report_to_wandb_offline_run_file_holds_every_row_and_nothing_stays_running(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import wandb_log

    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default must be offline: no account, no network
    out = _smoke_run(tmp_path, "wandb")
    files = list((out / "wandb" / "gspo-s0").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history = wandb_log.history(files[0])
    metrics = pd.read_parquet(out / "runs" / "gspo-s0" / "metrics.parquet")
    evals = pd.read_parquet(out / "runs" / "gspo-s0" / "eval.parquet")
    train_rows = [r for r in history if "update" in r]
    eval_rows = [r for r in history if "eval_step" in r]
    assert len(train_rows) + len(eval_rows) == len(history)
    assert [r["update"] for r in train_rows] == metrics["update"].tolist()
    assert [r["eval_step"] for r in eval_rows] == evals["step"].tolist()
    for col in _numeric_columns(metrics):  # float64 JSON in the run file: exact
        logged = [r.get(col, float("nan")) for r in train_rows]
        np.testing.assert_array_equal(logged, metrics[col].to_numpy(float), err_msg=col)
    for col in _numeric_columns(evals):
        assert [r[col] for r in eval_rows] == evals[col].tolist(), col
    recorded = wandb_log.config(files[0])
    saved = yaml.safe_load((out / "runs" / "gspo-s0" / "config.yaml").read_text())
    assert {k: recorded[k] for k in saved} == saved
    # wandb's service process was stopped with the invocation
    assert not [pid for pid, cmd in _processes() if "wandb-core" in cmd and pid != os.getpid()]
    # a second invocation (the cell is done, every row already sent) adds no run beside it
    _smoke_run(tmp_path, "wandb")
    assert len(list((out / "wandb" / "gspo-s0").glob("wandb/offline-run-*/run-*.wandb"))) == 1


def test_a_tracker_that_refuses_is_one_line_after_the_runs_and_the_tables_are_kept(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    # online without an API key: wandb refuses before any network access
    for name, value in (("WANDB_MODE", "online"), ("WANDB_API_KEY", ""), ("HOME", str(tmp_path)),
                        ("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))):
        monkeypatch.setenv(name, value)
    smoke = tmp_path / "exp.yaml"
    from moe_lab.config import load_yaml

    exp = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
    exp["base"]["coldstart"]["cache_dir"] = str(tmp_path / "cache")
    smoke.write_text(yaml.safe_dump({**exp, "arms": {"gspo": exp["arms"]["gspo"]}, "seeds": [0]}))
    code = main(["run", str(smoke), "--out", str(tmp_path / "out"), "--report-to", "wandb", "--no-progress",
                 "rl.steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if "moe-lab: error" in ln]
    assert len(lines) == 1 and "--report-to wandb" in lines[0] and "gspo-s0" in lines[0], err
    manifest = json.loads((tmp_path / "out" / "runs" / "gspo-s0" / "manifest.json").read_text())
    assert manifest["status"] == "done" and len(pd.read_parquet(tmp_path / "out" / "runs" / "gspo-s0" / "metrics.parquet"))


def _processes():
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                yield int(p.name), (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue


def test_plot_on_a_folder_of_experiments_draws_one_summary_page_and_says_how_to_get_the_rest(tmp_path, capsys):
    from moe_lab.analysis.summary_page import eval_curves, primary_metric

    root = write_reference(tmp_path / "reference", seeds=(0, 1))
    assert main(["plot", str(root)]) == 0
    err = capsys.readouterr().err
    names = sorted(p.name for p in root.iterdir() if (p / "runs").is_dir())
    assert (root / "figures" / "summary.png").is_file()
    assert not any((root / name / "figures").exists() for name in names)
    assert f"[{len(names)}/{len(names)}] {names[-1]}:" in err and f"moe-lab plot {root} --all" in err
    # the page's curves are the eval tables' rows: one per run and evaluation
    curves, unreadable = eval_curves(root / names[0], primary_metric(root / names[0]))
    evals = [pd.read_parquet(p / "eval.parquet") for p in sorted((root / names[0] / "runs").iterdir())]
    assert not unreadable and len(curves) == sum(map(len, evals))
    assert curves["value"].sum() == pytest.approx(sum(e["eval/acc_greedy"].sum() for e in evals))


def test_plot_all_on_a_folder_of_experiments_plots_each(tmp_path, capsys):
    root = write_reference(tmp_path / "reference", seeds=(0,))
    assert main(["plot", str(root), "--all"]) == 0
    for name in ("paper", "clip_sweep", "volatility_sweep"):
        assert (root / name / "figures" / "reward_curves.png").is_file(), name
    assert (root / "clip_sweep" / "figures" / "clip_sweep.png").is_file()
    assert (root / "volatility_sweep" / "figures" / "volatility_sweep.png").is_file()
    assert not (root / "figures").exists()


def test_plot_with_an_unreadable_run_writes_the_rest_and_exits_non_zero(tmp_path, capsys):
    exp = write_experiment(tmp_path / "exp", PAPER_ARMS, seeds=(0,), steps=3, layers=2)
    broken = exp / "runs" / "gspo-s0"
    (broken / "metrics.parquet").write_bytes(b"not parquet")
    assert main(["plot", str(exp)]) == 1
    captured = capsys.readouterr()
    assert (exp / "figures" / "clip_fraction.png").is_file() and "wrote" in captured.out
    errors = [ln for ln in captured.err.splitlines() if "error" in ln]
    assert len(errors) == 1 and str(broken) in errors[0]


def test_plot_of_an_empty_folder_says_so(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 1
    assert "no runs to plot" in capsys.readouterr().err


def test_the_plots_order_the_paper_arms_as_the_paper_by_their_config():
    from moe_lab.analysis import plots
    from moe_lab.analysis.arm_traits import ArmTraits

    traits = {arm: ArmTraits(over["rl"]["algo"], over["rl"]["replay"], over["rl"]["rollout_correction"])
              for arm, over in PAPER_ARMS.items()}
    assert plots.arm_order(list(reversed(PAPER_ARMS)), traits) == list(PAPER_ARMS)
