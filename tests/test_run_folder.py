"""One reader of a results folder (moe_lab/store/run_folder.py): the runner, `progress`, `compare`'s tables and `verify`
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
from moe_lab.store.run_folder import ResultsFolder, RunFolder, upgrade_manifest
from moe_lab.store.status import CELL_DONE, CELL_RESUME, STATUS_UNVERIFIED

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
    done = {c.run_id for c in groups[CELL_DONE]}
    ids = [c.run_id for c in cells]
    assert done == {ids[0], ids[1], ids[5]} and {c.run_id for c in groups[CELL_RESUME]} == {ids[2], ids[3], ids[4]}
    _, progress = collect(results)
    assert {p.run_id for p in progress if p.state == "finished"} == done
    assert {p.run_id: p.state for p in progress if p.run_id not in done} == {i: STATUS_UNVERIFIED for i in ids[2:5]}
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


def test_progress_words_each_cell_as_the_runner_plans_it(results):
    """Every folder of a results folder, as progress reads it, is in the runner's cell state: finished = done, other
    config = conflict, not started = new, every other word = resume (failed, interrupted, stopped, unverified)."""
    from moe_lab.store.status import (CELL_CONFLICT, CELL_DONE, CELL_NEW, CELL_RESUME, PROGRESS_CONFLICT,
                                      PROGRESS_FINISHED, PROGRESS_NEW, STATUS_FAILED, STATUS_INTERRUPTED,
                                      STATUS_RUNNING, STATUS_STOPPED)

    exp = {**EXP, "seeds": list(range(11))}
    (results / "experiment.yaml").write_text(yaml.safe_dump(exp), encoding="utf-8")
    cells = expand(exp)
    _run(results, cells[6], STATUS_FAILED, steps=2, traceback="...")
    _run(results, cells[7], STATUS_INTERRUPTED, steps=2)
    _run(results, cells[8], STATUS_RUNNING, steps=2)  # no live process holds it: stopped
    other = _run(results, cells[9], "done")
    (other / "config.yaml").write_text(dump_yaml(cells[9].config).replace("steps: 4", "steps: 5"), encoding="utf-8")
    # cells[10]: never started
    _, progress = collect(results)
    word = {p.run_id: p.state for p in progress}
    expected = {PROGRESS_FINISHED: CELL_DONE, PROGRESS_CONFLICT: CELL_CONFLICT, PROGRESS_NEW: CELL_NEW}
    with pytest.raises(Exception, match="different config"):
        plan(cells, results / "runs", overwrite=False)
    states = {c.run_id: RunFolder(results / "runs" / c.run_id).cell_state(dump_yaml(c.config)) for c in cells}
    assert {i: expected.get(w, CELL_RESUME) for i, w in word.items()} == states
    assert set(word.values()) == {PROGRESS_FINISHED, STATUS_UNVERIFIED, STATUS_FAILED, STATUS_INTERRUPTED, STATUS_STOPPED,
                                  PROGRESS_CONFLICT, PROGRESS_NEW}


def test_every_lister_of_run_folders_names_the_same_runs_beside_stray_folders(results):
    """The runner's results folder, the tables, the cold-start notes and the report count the same run folders;
    a folder of notes, an empty one and one of plots are none of them."""
    from moe_lab.analysis.tables import find_run_dirs
    from moe_lab.launch.coldstart_origin import coldstart_records
    from moe_lab.store.run_folder import run_dirs

    runs = results / "runs"
    (runs / "notes").mkdir()
    (runs / "notes" / "README.md").write_text("not a run")
    (runs / "empty").mkdir()
    (runs / "plots").mkdir()
    (runs / "plots" / "reward.png").write_bytes(b"")
    ids = sorted(c.run_id for c in expand(EXP))
    assert [p.name for p in run_dirs(runs)] == ids
    assert [r.run_id for r in ResultsFolder(results).run_folders()] == ids
    assert [r.run_id for r in ResultsFolder(results).run_folders(with_manifest=True)] == ids
    assert [p.name for p in find_run_dirs(results)] == ids == [p.name for p in find_run_dirs(runs)]
    for c in expand(EXP):  # each manifest names its cold start: the notes read every run and nothing else
        manifest = json.loads((runs / c.run_id / "manifest.json").read_text())
        (runs / c.run_id / "manifest.json").write_text(json.dumps({**manifest, "coldstart": {"key": "k"}}))
    assert sorted(r for models in coldstart_records(runs).values() for rs in models.values() for r, _ in rs) == ids


def test_no_module_spells_a_status_word_of_its_own():
    """The status vocabulary is declared once (store/status.py): the runner, progress, the run folder, the tables, the
    trackers and the commands compare and write the names, never a literal word (docstrings aside)."""
    import ast

    import moe_lab
    from moe_lab.store import status

    words = {*status.MANIFEST_STATUSES, status.STATUS_UNVERIFIED, status.STATUS_STOPPED, status.STATUS_LOCKED,
             *status.CELL_STATES, *status.PROGRESS_STATES}
    pkg = Path(moe_lab.__file__).parent
    files = [pkg / f for f in ("launch/progress.py", "launch/runner.py", "launch/ray_backend.py", "launch/tracking.py",
                               "store/run_folder.py", "analysis/tables.py", "analysis/figures.py", "rl/loop.py",
                               "rl/distributed.py", "audit/verify.py")]
    files += sorted((pkg / "commands").glob("*.py"))
    found = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        found += [f"{path.relative_to(pkg)}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in words and id(n) not in docs]
    assert not found, "\n".join(found)
