"""Faults a batch of runs meets on a shared machine: a killed or interrupted runner, two runners on one folder,
tables lost behind a checkpoint's back, a broken cold-start cache, closed pipes; and file modes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from moe_lab.rl import coldstart
from moe_lab.config import apply_overrides, from_dict, load_yaml, validate
from moe_lab.store import checkpoint_state
from moe_lab.store.files import read_rows, rows_digest
from moe_lab.store.runlog import RunLock, RunLocked
from moe_lab.launch.runner import run_experiment
from moe_lab.rl.loop import train

ROOT = Path(__file__).resolve().parents[1]
SMOKE = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
TINY_MODEL = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "num_experts": 4, "top_k": 2,
              "moe_intermediate_size": 32, "intermediate_size": 64}
QUIET = {"echo": lambda *_: None, "progress": False, "jobs": 1}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def tiny_exp(cache: Path, steps: int = 4, arms=("grpo",)) -> dict:
    base = apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={cache}", f"rl.steps={steps}"])
    base["model"] = dict(TINY_MODEL)
    return {"name": "tiny", "base": base, "arms": {a: SMOKE["arms"][a] for a in arms}, "seeds": [0]}


def tiny_cfg(cache: Path, *overrides: str):
    return validate(from_dict(apply_overrides(tiny_exp(cache)["base"], list(overrides))))


# --------------------------------------------------------------------------- parent death and Ctrl-C


def _children(pid: int) -> list[int]:
    """Live (non-zombie) pool workers whose parent is pid, from /proc (psutil is not a dependency)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z" and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # an orphan nobody reaps is dead all the same


def _as_from_a_terminal() -> None:
    # A suite started in the background by a non-interactive shell (`pytest &`) inherits SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler in the runner: the runner would train on through the
    # "Ctrl-C". A command typed at a terminal starts with SIGINT at its default, as here.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop(proc: subprocess.Popen, workers: list[int]) -> None:
    """Whatever the test's outcome, nothing it started keeps running (the runner, its workers)."""
    for pid in [proc.pid, *workers]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _launch_runner(tmp_path: Path, cache: Path) -> tuple[subprocess.Popen, Path]:
    """`moe-lab run --jobs 2` on two long tiny runs, returned once both workers are training."""
    exp = tiny_exp(cache, steps=2000, arms=("grpo", "gspo"))
    exp["base"]["rl"]["checkpoint_every"] = 1
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps(exp))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "moe_lab.cli", "run", str(path), "--out", str(out), "--jobs", "2",
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                            preexec_fn=_as_from_a_terminal)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        states = [json.loads(p.read_text()).get("status") for p in out.glob("runs/*/manifest.json")]
        ckpts = list(out.glob("runs/*/checkpoint/state.json"))
        if states.count("running") == 2 and len(ckpts) == 2:
            return proc, out
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the runner never had two runs training: {proc.communicate()}")


def test_sigkill_of_the_runner_takes_its_workers_down(tmp_path, cache):
    proc, _ = _launch_runner(tmp_path, cache)
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    deadline = time.time() + 10
    while time.time() < deadline and any(map(_alive, workers)):
        time.sleep(0.1)
    assert not [w for w in workers if _alive(w)], "workers outlived their SIGKILLed parent"


def test_ctrl_c_stops_workers_marks_runs_and_exits_130(tmp_path, cache):
    proc, out = _launch_runner(tmp_path, cache)
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        _stop(proc, workers)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr and "Resume with" in stderr and "--out" in stderr, stderr
    assert not [w for w in workers if _alive(w)]
    manifests = [json.loads(p.read_text()) for p in out.glob("runs/*/manifest.json")]
    assert [m["status"] for m in manifests] == ["interrupted", "interrupted"], manifests
    # what was committed before the interrupt resumes: the checkpoint still verifies against the tables
    for run in out.glob("runs/*"):
        assert checkpoint_state.read_state(run / "checkpoint") is not None


# --------------------------------------------------------------------------- one writer per run folder


def test_second_runner_skips_a_locked_cell_and_the_table_stays_whole(tmp_path, cache):
    exp = tiny_exp(cache)
    run_dir = tmp_path / "e" / "runs" / "grpo-s0"
    lines = []
    with RunLock(run_dir):  # another runner holds the cell (flock conflicts across descriptors, same process too)
        statuses = run_experiment(exp, tmp_path / "e", **{**QUIET, "echo": lines.append})
    assert statuses["grpo-s0"].startswith("locked") and "locked by another runner" in statuses["grpo-s0"]
    assert any("grpo-s0: locked" in ln for ln in lines), lines
    assert not (run_dir / "manifest.json").exists() and not (run_dir / "metrics.parquet").exists()
    assert run_experiment(exp, tmp_path / "e", **QUIET) == {"grpo-s0": "done"}
    steps, minibatches = exp["base"]["rl"]["steps"], exp["base"]["rl"]["minibatches"]
    assert len(pd.read_parquet(run_dir / "metrics.parquet")) == steps * minibatches


def test_two_concurrent_runners_one_table_and_a_message_from_the_loser(tmp_path, cache):
    exp = tiny_exp(cache, steps=80)  # long enough to still be running while the second runner plans
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps(exp))
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-m", "moe_lab.cli", "run", str(path), "--out", str(out), "--jobs", "1",
                              "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                             start_new_session=True)
    manifest = out / "runs" / "grpo-s0" / "manifest.json"
    deadline = time.time() + 240
    while time.time() < deadline and first.poll() is None and not manifest.exists():
        time.sleep(0.05)
    # the first runner and its worker are frozen, lock held, while the second plans: no race with its end
    os.killpg(first.pid, signal.SIGSTOP)
    try:
        assert first.poll() is None, "the first runner ended before the second could start: raise rl.steps"
        lines = []
        second = run_experiment(exp, out, **{**QUIET, "echo": lines.append})
    except BaseException:
        os.killpg(first.pid, signal.SIGKILL)
        raise
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert second["grpo-s0"].startswith("locked"), second
    assert any(ln.startswith("grpo-s0: locked") and "another runner" in ln for ln in lines), lines
    table = pd.read_parquet(out / "runs" / "grpo-s0" / "metrics.parquet")
    assert table["update"].tolist() == list(range(80 * exp["base"]["rl"]["minibatches"]))
    assert json.loads(manifest.read_text())["status"] == "done"
    assert checkpoint_state.read_state(out / "runs" / "grpo-s0" / "checkpoint") is not None


def test_a_dead_holders_lock_never_blocks(tmp_path):
    code = ("import sys, time; from moe_lab.store.runlog import RunLock; RunLock(sys.argv[1]).acquire(); "
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunLocked, match=f"pid {holder.pid}"):
        RunLock(tmp_path).acquire()
    holder.kill()
    holder.wait()
    with RunLock(tmp_path):
        pass


# --------------------------------------------------------------------------- resume that cannot lose data


@pytest.fixture()
def finished(tmp_path, cache):
    cfg = tiny_cfg(cache, "rl.steps=4", "rl.checkpoint_every=2")
    run_dir = tmp_path / "run"
    assert train(cfg, run_dir, run_id="r") == "done"
    return cfg, run_dir


def test_checkpoint_records_row_counts_and_digests(finished):
    cfg, run_dir = finished
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    rows = read_rows(run_dir / "metrics.parquet")
    assert state["tables"]["metrics.parquet"] == {"rows": len(rows), "sha256": rows_digest(rows)}
    assert len(rows) == cfg.rl.steps * cfg.rl.minibatches == state["rows"]


@pytest.mark.parametrize("damage,needle", [
    ("delete", "metrics.parquet: missing"),
    ("truncate", "metrics.parquet: holds 3 rows"),
    ("rewrite", "metrics.parquet: its first 8 rows differ"),
    ("edit_step", "state.json: edited"),
    ("delete_eval", "eval.parquet: missing"),
])
def test_resume_refuses_tables_that_do_not_match_the_checkpoint(finished, damage, needle):
    cfg, run_dir = finished
    table = run_dir / "metrics.parquet"
    if damage == "delete":
        table.unlink()
    elif damage == "truncate":
        pd.read_parquet(table).iloc[:3].to_parquet(table)
    elif damage == "rewrite":
        df = pd.read_parquet(table)
        df.loc[0, "loss"] += 1.0
        df.to_parquet(table)
    elif damage == "edit_step":
        marker = run_dir / "checkpoint" / "state.json"
        marker.write_text(marker.read_text().replace('"step": 4', '"step": 99'))
    else:
        (run_dir / "eval.parquet").unlink()
    with pytest.raises(checkpoint_state.ResumeError, match=needle) as err:
        train(cfg, run_dir, run_id="r")
    assert "delete" in str(err.value)  # says what to do


def test_a_done_run_whose_table_is_gone_is_not_reported_done(tmp_path, cache):
    exp = tiny_exp(cache)
    assert run_experiment(exp, tmp_path / "e", **QUIET) == {"grpo-s0": "done"}
    run_dir = tmp_path / "e" / "runs" / "grpo-s0"
    (run_dir / "metrics.parquet").unlink()
    lines = []
    assert run_experiment(exp, tmp_path / "e", **{**QUIET, "echo": lines.append}) == {"grpo-s0": "failed"}
    assert any(ln.startswith("grpo-s0: failed: ResumeError:") and "metrics.parquet: missing" in ln for ln in lines)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "metrics.parquet: missing" in manifest["reason"]


def test_a_done_run_trimmed_of_its_checkpoint_stays_done(tmp_path, cache):
    """results/reference ships without checkpoint/ folders: the manifest's row counts vouch for the tables."""
    import shutil

    exp = tiny_exp(cache)
    run_experiment(exp, tmp_path / "e", **QUIET)
    run_dir = tmp_path / "e" / "runs" / "grpo-s0"
    shutil.rmtree(run_dir / "checkpoint")
    stamp = (run_dir / "metrics.parquet").stat().st_mtime_ns
    lines = []
    assert run_experiment(exp, tmp_path / "e", **{**QUIET, "echo": lines.append}) == {"grpo-s0": "done"}
    assert "1 done" in lines[0] and (run_dir / "metrics.parquet").stat().st_mtime_ns == stamp
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["rows"] == len(pd.read_parquet(run_dir / "metrics.parquet"))


def test_extra_rows_after_the_checkpoint_are_dropped_not_refused(finished, tmp_path):
    """A kill between a table flush and the checkpoint that commits it leaves extra rows: they are redone."""
    cfg, run_dir = finished
    ref = pd.read_parquet(run_dir / "metrics.parquet")
    ckpt = run_dir / "checkpoint" / "state.json"
    state = json.loads(ckpt.read_text())
    # pretend the last commit was at step 2: rewrite the marker as a step-2 checkpoint would have sealed it
    state.update(step=2, rows=4, eval_rows=2)
    state.pop("tables"), state.pop("digest")
    state["tables"] = checkpoint_state.table_records(run_dir, state)
    state["digest"] = checkpoint_state.state_digest(state)
    ckpt.write_text(json.dumps(state))
    got = checkpoint_state.read_state(run_dir / "checkpoint")
    assert got is not None and got[0]["step"] == 2
    assert len(ref) == 8  # the table still holds rows 5..8 beyond the commit: allowed, they are rewritten


# --------------------------------------------------------------------------- cold-start cache


def _entry(cache_dir: Path) -> tuple:
    cfg = tiny_cfg(cache_dir)
    return cfg, coldstart.cold_start(cfg, progress=False)


@pytest.mark.parametrize("damage", ["meta_deleted", "weights_truncated", "meta_garbage", "wrong_key"])
def test_a_broken_cache_entry_is_moved_aside_and_rebuilt(tmp_path, damage):
    cfg, entry = _entry(tmp_path / "cache")
    weights = entry / "model.safetensors"
    good = weights.read_bytes()
    if damage == "meta_deleted":
        (entry / coldstart.META_FILE).unlink()
    elif damage == "weights_truncated":
        weights.write_bytes(good[: len(good) // 2])
    elif damage == "meta_garbage":
        (entry / coldstart.META_FILE).write_text("{")
    else:
        meta = json.loads((entry / coldstart.META_FILE).read_text())
        (entry / coldstart.META_FILE).write_text(json.dumps({**meta, "key": "0" * 64}))
    assert coldstart.entry_problem(entry, entry.name)
    with pytest.warns(RuntimeWarning, match=f"cache entry {entry} is broken"):
        again = coldstart.cold_start(cfg, progress=False)
    assert again == entry and coldstart.entry_problem(entry, entry.name) == ""
    assert weights.read_bytes() == good  # same config -> the same weights, rebuilt
    aside = [p for p in entry.parent.iterdir() if p.name.startswith(".broken-")]
    assert len(aside) == 1


def test_dead_writers_tmp_folders_are_cleaned_live_ones_kept(tmp_path):
    cfg, entry = _entry(tmp_path / "cache")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    host = socket.gethostname()
    gone = entry.parent / f".tmp-{entry.name[:16]}-{dead.pid}@{host}-abc123"
    live = entry.parent / f".tmp-{entry.name[:16]}-{os.getpid()}@{host}-def456"
    other_host = entry.parent / f".tmp-{entry.name[:16]}-{dead.pid}@elsewhere.example-ghi789"
    for p in (gone, live, other_host):
        p.mkdir()
        (p / "config.json").write_text("{}")
    assert coldstart.cold_start(cfg, progress=False) == entry
    assert not gone.exists() and live.exists() and other_host.exists()


# --------------------------------------------------------------------------- durability


def test_results_are_world_readable_under_the_umask(tmp_path, cache):
    old = os.umask(0o022)
    try:
        run_experiment(tiny_exp(cache), tmp_path / "e", **QUIET)
        entry = coldstart.cold_start(tiny_cfg(tmp_path / "cache2"), progress=False)
    finally:
        os.umask(old)
    run_dir = tmp_path / "e" / "runs" / "grpo-s0"
    for f in ("metrics.parquet", "eval.parquet", "manifest.json", "config.yaml", "checkpoint/state.json",
              "checkpoint/optim.pt", "../../experiment.yaml"):
        assert (run_dir / f).stat().st_mode & 0o777 == 0o644, f
    for d in (run_dir, run_dir / "checkpoint", entry):
        assert d.stat().st_mode & 0o777 == 0o755, d


def test_closed_stdout_pipe_exits_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "moe_lab.cli", "config"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.close()  # the reader is gone before the first line is written, as with `| head -0`
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert err == "" and proc.returncode == 1, err
