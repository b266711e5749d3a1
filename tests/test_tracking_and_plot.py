"""`--report-to tensorboard` mirrors the tables into event files; `moe-lab plot` on a folder of experiments."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from moe_lab.cli import main
from synthetic import PAPER_ARMS, write_experiment, write_reference

ROOT = Path(__file__).resolve().parents[1]


def test_report_to_tensorboard_event_file_holds_every_logged_scalar(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moe_lab.config import apply_overrides, load_yaml
    from moe_lab.runner import run_experiment

    smoke = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
    base = apply_overrides(smoke["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.steps=2"])
    exp = {"name": "tb", "base": base, "arms": {"gspo": smoke["arms"]["gspo"]}, "seeds": [0]}
    out = tmp_path / "out"
    assert run_experiment(exp, out, jobs=1, progress=False, echo=lambda *_: None,
                          report_to="tensorboard") == {"gspo-s0": "done"}
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
    numeric = set(metrics.select_dtypes("number").columns) - {"step", "minibatch", "update", "seed"}
    assert numeric - tags == {c for c in numeric if metrics[c].isna().all()}


def test_plot_on_a_folder_of_experiments_plots_each(tmp_path, capsys):
    root = write_reference(tmp_path / "reference", seeds=(0,))
    assert main(["plot", str(root)]) == 0
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


def test_fixture_arms_are_the_main_jobs_and_the_plots_know_them():
    from moe_lab import plots

    assert tuple(PAPER_ARMS) == plots.PAPER_ARMS
