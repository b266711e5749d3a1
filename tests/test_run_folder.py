"""One reader of a results folder (moe_lab/rl/run_folder.py): the runner, `progress`, `compare`'s tables and `verify`
agree on which runs are finished, a finished manifest whose tables do not hold its committed rows included."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from moe_lab.analysis.endpoints import unfinished_runs
from moe_lab.analysis.tables import load_runs
from moe_lab.audit.verify import load_reference
from moe_lab.config import dump_yaml
from moe_lab.launch.experiment import expand
from moe_lab.launch.progress import collect
from moe_lab.launch.runner import plan
from moe_lab.rl import checkpoint
from moe_lab.rl.run_folder import DONE, RESUME, UNVERIFIED, ResultsFolder, RunFolder, upgrade_manifest

EXP = {"name": "tiny", "base": {"rl": {"steps": 4}}, "arms": {"grpo": {"rl": {"algo": "grpo"}}},
       "seeds": [0, 1, 2, 3, 4, 5]}
STEPS = 4


def _tables(run: Path, steps: int, value: float = 0.5) -> None:
    pd.DataFrame({"step": list(range(steps)), "reward/mean": [value] * steps}).to_parquet(run / "metrics.parquet")
    pd.DataFrame({"step": [steps], "eval/acc_greedy": [value]}).to_parquet(run / "eval.parquet")


def _commit(run: Path, steps: int) -> None:
    """A checkpoint committing the run's first ``steps`` metric rows and its one eval row (their digests)."""
    model = torch.nn.Linear(1, 1)
    checkpoint.save(run / "checkpoint", model, torch.optim.SGD(model.parameters(), lr=0.1),
                    {"step": steps, "rows": steps, "eval_rows": 1})


def _run(out: Path, cell, status: str, steps: int = STEPS, **manifest) -> Path:
    run = out / "runs" / cell.run_id
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_yaml(cell.config), encoding="utf-8")
    (run / "manifest.json").write_text(json.dumps({"run_id": cell.run_id, "arm": cell.arm, "seed": cell.seed,
                                                   "status": status, "steps_done": steps, **manifest}))
    _tables(run, steps)
    return run


@pytest.fixture
def results(tmp_path):
    out = tmp_path / "res"
    out.mkdir()
    (out / "experiment.yaml").write_text(yaml.safe_dump(EXP), encoding="utf-8")
    c = expand(EXP)
    _commit(_run(out, c[0], "done"), STEPS)  # finished: its checkpoint verifies its tables
    _run(out, c[1], "done", rows=STEPS, eval_rows=1)  # finished, checkpoint/ trimmed: the manifest's counts hold
    _run(out, c[2], "done", rows=STEPS + 2, eval_rows=1)  # trimmed, but its metrics table lacks 2 counted rows
    run = _run(out, c[3], "done", rows=STEPS, eval_rows=1)
    _commit(run, STEPS)
    _tables(run, STEPS, value=0.25)  # rewritten after the commit: the digest no longer matches
    run = _run(out, c[4], "done", rows=STEPS, eval_rows=1)
    _commit(run, STEPS)
    (run / "metrics.parquet").unlink()  # only the checkpoint (and the manifest) is left of its rows
    (run / "eval.parquet").unlink()
    _run(out, c[5], "collapsed", reason="reward collapsed", rows=STEPS, eval_rows=1)
    return out


def test_progress_compare_and_verify_call_finished_exactly_what_the_runner_calls_done(results):
    cells = expand(EXP)
    groups = plan(cells, results / "runs", overwrite=False)
    done = {c.run_id for c in groups[DONE]}
    ids = [c.run_id for c in cells]
    assert done == {ids[0], ids[1], ids[5]} and {c.run_id for c in groups[RESUME]} == {ids[2], ids[3], ids[4]}
    _, progress = collect(results)
    assert {p.run_id for p in progress if p.state == "finished"} == done
    assert {p.run_id: p.state for p in progress if p.run_id not in done} == {i: UNVERIFIED for i in ids[2:5]}
    with pytest.warns(UserWarning, match=f"skipping run .*{ids[4]}"):  # no metrics table left to read
        metrics, evals = load_runs(results)
    statuses = metrics.groupby("run_id")["status"].first()
    assert set(statuses[statuses.isin(("done", "collapsed"))].index) == done
    assert set(unfinished_runs(evals)) == {ids[2], ids[3]}  # ids[4] has no eval rows left to show
    refs = {r.run_id: r.done for r in load_reference(results)}  # verify re-runs a tampered one, and says so
    assert {i for i, ok in refs.items() if ok} == done and {i for i, ok in refs.items() if not ok} == {ids[2], ids[3]}


def test_a_manifest_is_read_once_and_through_one_upgrade(results):
    run = ResultsFolder(results).run(expand(EXP)[1].run_id)
    assert run.finished() == "done"
    run.manifest_path.write_text(json.dumps({"status": "failed"}))
    assert run.status == "done"  # kept from the first reading
    assert RunFolder(run.path).status == "failed"


def test_the_upgrade_reads_older_layouts_as_todays():
    warm = {"key": "abc", "steps": 250}
    legacy = {"status": "failed", "collapse_rule": "reward", "reason": "reward collapsed at step 9",
              "coldstart": warm, "machine": {"cpu": "x"}, "resumed_from_step": 40}
    got = upgrade_manifest(legacy)
    assert got["status"] == "collapsed"
    assert got["segments"] == [{"from_step": 40, "machine": {"cpu": "x"}, "coldstart": warm}]
    assert legacy["status"] == "failed" and "segments" not in legacy  # the raw manifest is left as it was
    crashed = {**legacy, "traceback": "..."}
    assert upgrade_manifest(crashed)["status"] == "failed"
    today = {"status": "done", "coldstart": warm, "segments": [{"from_step": 0, "coldstart": warm}]}
    assert upgrade_manifest(today) == today
