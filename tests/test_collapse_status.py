"""A run stopped by a collapse rule is finished: status 'collapsed', exit 0, never recomputed; manifests written
before that status existed ('failed' with a collapse rule) read the same; every manifest records the machine."""

from __future__ import annotations

import json
import subprocess
import os
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from moe_lab.store import health
from moe_lab.analysis import results
from moe_lab.cli import main
from moe_lab.config import apply_overrides, load_yaml
from moe_lab.store.run_folder import run_status
from moe_lab.store.runlog import machine_info
from moe_lab.launch.runner import run_experiment

ROOT = Path(__file__).resolve().parents[1]
SMOKE = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
QUIET = dict(jobs=1, progress=False)


def zero_reward_experiment(tmp_path: Path) -> dict:
    """A hard collapse on purpose: exact-match reward on sort-6 for an untrained tiny model is 0 on every
    rollout, so the zero_reward rule fires at step ZERO_REWARD_STEPS - 1 and stops the run."""
    base = apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}", "task.partial_credit=false",
                                           "rl.steps=8", "rl.checkpoint_every=2"])
    return {"name": "zero", "base": base, "arms": {"grpo": {}}, "seeds": [0]}


def _stamps(out: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/*") if p.is_file()}


@pytest.fixture(scope="module")
def collapsed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("collapse")
    path = tmp / "zero.yaml"
    path.write_text(yaml.safe_dump(zero_reward_experiment(tmp)), encoding="utf-8")
    return tmp, path


def test_a_hard_collapse_is_a_finished_run(collapsed_run, capsys):
    tmp, path = collapsed_run
    out = tmp / "out"
    assert main(["run", str(path), "--out", str(out), "--no-progress", "--jobs", "1"]) == 0
    stdout = capsys.readouterr().out
    assert "1 collapsed" in stdout and "did not finish" not in stdout
    run = out / "runs" / "grpo-s0"
    manifest = json.loads((run / "manifest.json").read_text())
    at = health.ZERO_REWARD_STEPS - 1
    assert (manifest["status"], manifest["collapse_rule"], manifest["collapsed_at"]) == ("collapsed", "zero_reward", at)
    rows = pd.read_parquet(run / "metrics.parquet")
    assert (rows["reward/mean"] == 0).all() and rows["step"].max() == at  # it stopped at the rule's step
    assert (manifest["rows"], manifest["eval_rows"]) == (len(rows), len(pd.read_parquet(run / "eval.parquet")))
    # its final evaluation is of the policy it stopped with (after its last checkpoint at step 4)
    assert pd.read_parquet(run / "eval.parquet")["step"].tolist()[-1] == at + 1
    metrics, evals = results.load_runs(out)
    assert set(metrics["status"]) == {"collapsed"} and (metrics["collapse_rule"] == "zero_reward").all()
    assert results.summarize(metrics, evals).set_index("arm").loc["grpo", "runs_done"] == 1


def test_manifest_records_the_machine(collapsed_run):
    machine = json.loads((collapsed_run[0] / "out" / "runs" / "grpo-s0" / "manifest.json").read_text())["machine"]
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["threads"] == 1  # the run's config `threads`, set by train() before it wrote the manifest
    assert machine["blas"] in torch.__config__.show() and machine["mkl"] == torch.backends.mkl.is_available()
    assert machine["env"] == {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
                              if k in os.environ}


def test_a_collapsed_run_is_never_recomputed(collapsed_run):
    tmp, path = collapsed_run
    out = tmp / "out"
    exp = load_yaml(str(path))
    before = _stamps(out)
    lines = []
    assert run_experiment(exp, out, echo=lines.append, **QUIET) == {"grpo-s0": "collapsed"}
    assert "1 done, 0 to resume, 0 new" in lines[0] and _stamps(out) == before


def test_a_legacy_failed_manifest_of_a_collapse_reads_as_collapsed(collapsed_run):
    """Manifests written before 'collapsed' (the references before their regeneration) say 'failed' with the rule: they are
    finished runs, loaded as collapsed and not rerun."""
    tmp, path = collapsed_run
    out = tmp / "out"
    manifest_path = out / "runs" / "grpo-s0" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    legacy = {k: v for k, v in manifest.items() if k not in ("rows", "eval_rows", "machine")}
    manifest_path.write_text(json.dumps({**legacy, "status": "failed"}))
    before = _stamps(out)
    lines = []
    assert run_experiment(load_yaml(str(path)), out, echo=lines.append, **QUIET) == {"grpo-s0": "collapsed"}
    assert "1 done, 0 to resume, 0 new" in lines[0] and _stamps(out) == before
    metrics, _ = results.load_runs(out)
    assert set(metrics["status"]) == {"collapsed"} and set(metrics["collapsed_at"]) == {manifest["collapsed_at"]}


def _committed_manifests() -> list[Path]:
    """The reference manifests git holds (a checkout may also hold runs of an experiment still running)."""
    found = sorted((ROOT / "results" / "reference").glob("*/runs/*/manifest.json"))
    listed = subprocess.run(["git", "ls-files", "results/reference"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout: every manifest there is what was shipped
        return found
    tracked = set(listed.stdout.split())
    return [p for p in found if str(p.relative_to(ROOT)) in tracked]


def test_committed_references_are_finished_and_their_collapses_read_as_such_when_written_the_old_way():
    manifests = [json.loads(p.read_text()) for p in _committed_manifests()]
    assert {m["status"] for m in manifests} <= {"done", "collapsed"}
    assert all(run_status(m) == m["status"] for m in manifests)
    collapsed = [m for m in manifests if m["status"] == "collapsed"]
    assert collapsed, "the references hold hard-collapsed runs (the atlas's lr 1e-3 cells)"
    # Before status 'collapsed' existed the same runs were written 'failed' (the atlas's generation before
    # per-group seeding was): such a manifest must still read as a collapse, never as a run to recompute.
    assert all(run_status({**m, "status": "failed"}) == "collapsed" for m in collapsed)


@pytest.mark.parametrize("manifest, status", [
    ({"status": "failed", "reason": "reward collapsed: exactly 0 for 5 consecutive steps",
      "collapse_rule": "zero_reward", "collapsed_at": 6}, "collapsed"),
    ({"status": "failed", "reason": "non-finite loss or gradient at step 3 minibatch 1",
      "collapse_rule": "non_finite", "collapsed_at": 3}, "collapsed"),
    # an error after a soft rule had marked the run: the error, not the collapse, ended it
    ({"status": "failed", "reason": "RuntimeError: boom", "collapse_rule": "reward_drop", "collapsed_at": 2,
      "traceback": "..."}, "failed"),
    ({"status": "failed", "reason": "ray: WorkerCrashedError: node died", "collapse_rule": "reward_drop",
      "collapsed_at": 2}, "failed"),
    ({"status": "failed", "reason": "reward collapsed: exactly 0 for 5 consecutive steps", "collapse_rule": None,
      "collapsed_at": None}, "failed"),
    ({"status": "done", "collapse_rule": "reward_drop", "collapsed_at": 4}, "done"),
    ({"status": "interrupted"}, "interrupted"),
])
def test_run_status(manifest, status):
    assert run_status(manifest) == status


def test_every_stop_reason_is_recognised():
    """The back-compat rule reads reasons by their start: every reason health.stop_reason writes has one."""
    params = health.CollapseParams(entropy_max=1.0)
    obs = health.StepObservation(step=3, reward=0.0, detail="step 3 minibatch 0")
    for rule in health.COLLAPSE_RULES:
        state = health.HealthState(fired=rule, reward_ema=0.1, best_ema=0.5, entropy_ema=2.0)
        reason = health.stop_reason(state, obs, params, stop_on_collapse=True)
        assert run_status({"status": "failed", "reason": reason, "collapse_rule": rule}) == "collapsed", rule


def test_machine_info_names_the_pinning_env_vars(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)  # the suite also runs with every pin set (.ci/run)
    assert machine_info()["env"] == {"MKL_CBWR": "COMPATIBLE"}
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert machine_info()["env"] == {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"}
