"""`moe-lab progress`: what it counts from the runner's bookkeeping, that it never shows an endpoint (a collapsed
run is 'finished', never 'collapsed'), that it reads a live run's lock without taking it, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from moe_lab.cli import main
from moe_lab.config import dump_yaml
from moe_lab.launch.experiment import expand
from moe_lab.launch.progress import collect, time_left
from moe_lab.store.runlog import RunLock

EXP = {"name": "tiny_blocks",
       "base": {"rl": {"steps": 20}},
       "arms": {"grpo": {"rl": {"algo": "grpo"}}, "gspo": {"rl": {"algo": "gspo"}}},
       "blocks": {"field": "model.seed", "seeds": {1: [10, 11], 2: [20, 21]}}}


def _manifest(run: Path, **fields) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "manifest.json").write_text(json.dumps(fields), encoding="utf-8")


def _metrics(run: Path, steps: int) -> None:
    pd.DataFrame({"step": [s for s in range(steps) for _ in range(2)], "minibatch": [0, 1] * steps}).to_parquet(
        run / "metrics.parquet")


def _finished(run: Path, **fields) -> None:
    """A finished run as the runner leaves it: its manifest, its tables holding the rows it counts."""
    _manifest(run, rows=2 * fields["steps_done"], eval_rows=0, **fields)
    _metrics(run, fields["steps_done"])


def _configs(out: Path, exp: dict) -> None:
    for c in expand(exp):  # each started run holds its own config, as the runner writes it
        if (out / "runs" / c.run_id).is_dir():
            (out / "runs" / c.run_id / "config.yaml").write_text(dump_yaml(c.config), encoding="utf-8")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def results(tmp_path):
    out = tmp_path / "res"
    runs = out / "runs"
    out.mkdir()
    (out / "experiment.yaml").write_text(yaml.safe_dump(EXP), encoding="utf-8")
    _finished(runs / "grpo-s10", status="done", steps_done=20, wall_s=40.0)
    _finished(runs / "gspo-s10", status="collapsed", steps_done=5, wall_s=20.0, reason="reward collapsed")
    _manifest(runs / "grpo-s20", status="running")
    _metrics(runs / "grpo-s20", 7)
    _manifest(runs / "gspo-s20", status="running")  # its runner died: the pid in .lock is gone
    _metrics(runs / "gspo-s20", 3)
    (runs / "gspo-s20" / ".lock").write_text(str(_dead_pid()), encoding="ascii")
    _manifest(runs / "grpo-s11", status="failed", reason="boom", traceback="...")
    _configs(out, EXP)
    return out


def test_states_counts_and_steps_come_from_the_runs_bookkeeping(results):
    with RunLock(results / "runs" / "grpo-s20"):  # a live runner holds this one
        _, cells = collect(results)
    by_id = {c.run_id: c for c in cells}
    assert [c.run_id for c in cells] == ["grpo-s10", "grpo-s20", "grpo-s11", "grpo-s21",
                                        "gspo-s10", "gspo-s20", "gspo-s11", "gspo-s21"]
    assert {k: by_id[k].state for k in by_id} == {
        "grpo-s10": "finished", "gspo-s10": "finished", "grpo-s20": "running", "gspo-s20": "stopped",
        "grpo-s11": "failed", "grpo-s21": "not started", "gspo-s11": "not started", "gspo-s21": "not started"}
    assert by_id["grpo-s20"].steps_done == 7 and by_id["gspo-s20"].steps_done == 3
    assert by_id["grpo-s20"].block == 2 and by_id["grpo-s11"].block == 1


def test_reading_a_live_run_does_not_take_its_lock(results):
    run = results / "runs" / "grpo-s20"
    with RunLock(run):
        _, cells = collect(results)
        assert next(c for c in cells if c.run_id == "grpo-s20").pid is not None
    RunLock(run).acquire().release()  # and nothing of progress's is left holding it


def test_time_left_pools_the_pace_and_counts_unfinished_runs_at_full_length(results):
    _, cells = collect(results)
    per_step, hours = time_left(cells, jobs=2)
    assert per_step == pytest.approx((40.0 + 20.0) / (20 + 5))
    left_steps = (20 - 7) + (20 - 3) + 20 * 4  # grpo-s20 and gspo-s20 from their logged steps; s11 x2, s21 x2
    assert hours == pytest.approx(per_step * left_steps / 2 / 3600)


def test_the_report_never_names_an_endpoint_and_exits_1_until_all_finish(results, capsys):
    assert main(["progress", str(results)]) == 1
    out = capsys.readouterr().out
    assert "collapse" not in out and "reward" not in out and "acc" not in out
    assert out.splitlines()[0] == "tiny_blocks: 8 runs: 2 finished, 2 stopped, 1 failed, 3 not started"
    grid = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  g")}
    assert grid == {"grpo": ["1/2", "0/2"], "gspo": ["1/2", "0/2"]}
    assert f"resume: moe-lab run {results / 'experiment.yaml'} --out {results}" in out


def test_exit_0_when_every_run_finished(tmp_path, capsys):
    exp = {**EXP, "blocks": {"field": "model.seed", "seeds": {1: [10]}}}
    (tmp_path / "experiment.yaml").write_text(yaml.safe_dump(exp), encoding="utf-8")
    for arm in ("grpo", "gspo"):
        _finished(tmp_path / "runs" / f"{arm}-s10", status="done", steps_done=20, wall_s=1.0)
    _configs(tmp_path, exp)
    assert main(["progress", str(tmp_path)]) == 0
    assert "left" not in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [(["progress", "/no/such/folder"], "RESULTS_DIR=/no/such/folder"),
                                         (["progress", ".", "--jobs", "0"], "--jobs=0")])
def test_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_compare_notes_an_interim_folder_and_says_nothing_of_a_finished_one(results, tmp_path):
    from moe_lab.commands.compare import interim_note as _interim_note

    assert _interim_note(results) == (
        f"moe-lab: note: interim: 2 of 8 runs of tiny_blocks finished; an analysis fixed before the runs is the "
        f"one after the last (moe-lab progress {results})")
    done = tmp_path / "done"
    (done / "runs").mkdir(parents=True)
    exp = {**EXP, "blocks": {"field": "model.seed", "seeds": {1: [10]}}}
    (done / "experiment.yaml").write_text(yaml.safe_dump(exp), encoding="utf-8")
    for arm in ("grpo", "gspo"):
        _finished(done / "runs" / f"{arm}-s10", status="done", steps_done=20, wall_s=1.0)
    _configs(done, exp)
    assert _interim_note(done) is None
    assert _interim_note(tmp_path / "no_experiment_file") is None


def test_a_folder_holding_another_config_is_not_counted_as_this_experiments_run(results):
    run = results / "runs" / "grpo-s10"
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("steps: 20", "steps: 30"))
    _, cells = collect(results)
    assert next(c for c in cells if c.run_id == "grpo-s10").state == "other config"


def test_report_of_a_declared_experiment_part_way_shows_no_outcome(results):
    # An analysis fixed before the runs is the one after the last run: while cells are unfinished, the page of an
    # experiment with declared contrasts gives its design and how far it has got, no endpoint, contrast or collapse.
    from moe_lab.analysis.report import build

    exp = {**EXP, "contrasts": {"primary": [{"arm": "gspo", "vs": "grpo"}]}}
    (results / "experiment.yaml").write_text(yaml.safe_dump(exp), encoding="utf-8")
    text = build(results, figures=False, shown_as="res").text
    assert "Interim: 2 of 8 runs finished (`moe-lab progress res`)" in text
    assert "## Design" in text and not any(h in text for h in ("## Endpoints", "## Declared", "## Collapses"))
