"""--backend ray: a Ray run of experiments/smoke.yaml on a local cluster gives the local backend's tables.

Skipped when Ray is not installed (pip install -e '.[ray]'). The two-node kill check is
scripts/ray_two_node_check.sh (it starts and kills `ray start` nodes: not a unit test).
The local cluster writes nothing outside the test's own folders: Ray 2.x enables token authentication for a
local cluster and would save a new token to ~/.ray/auth_token unless one is given (RAY_AUTH_TOKEN, read by
the driver and inherited by every Ray process), and it keeps its session files under RAY_TMPDIR (/tmp/ray
by default).
"""

from __future__ import annotations

import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

from moe_lab.config import apply_overrides, load_yaml
from moe_lab.launch.runner import run_experiment

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
SMOKE = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
# A slice of the smoke grid keeps this under a minute on 2 cores: free routing, both replays, a new objective
# and the off-policy knobs; the other arms exercise the same task path.
SMOKE["arms"] = {a: SMOKE["arms"][a] for a in ("grpo", "grpo_r2", "grpo_r3", "rspo", "knobs2")}


def _tables(out: Path, name: str) -> dict[str, pd.DataFrame]:
    tables = {}
    for path in sorted((out / "runs").glob(f"*/{name}")):
        df = pd.read_parquet(path)
        tables[path.parent.name] = df.drop(columns=[c for c in df.columns if c.startswith("perf/")])
    return tables


@pytest.fixture
def local_ray(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    # a short folder of the test's own: Ray's unix socket paths under it must fit in 107 bytes, which a
    # pytest tmp_path (plus Ray's session_<date>_<pid>/sockets/...) does not
    temp = Path(tempfile.mkdtemp(prefix="ray"))
    monkeypatch.setenv("RAY_TMPDIR", str(temp))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(temp))
    yield temp
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def test_ray_backend_gives_the_local_backends_tables(tmp_path, local_ray):
    from moe_lab.launch.ray_backend import run_experiment_ray

    exp = dict(SMOKE, base=apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}"]))
    quiet = dict(progress=False, echo=lambda *_: None)
    local = run_experiment(exp, tmp_path / "local", jobs=1, **quiet)
    remote = run_experiment_ray(exp, tmp_path / "ray", **quiet)
    assert remote == local and set(local.values()) == {"done"} and len(local) == len(SMOKE["arms"])
    for name in ("metrics.parquet", "eval.parquet"):
        a, b = _tables(tmp_path / "local", name), _tables(tmp_path / "ray", name)
        assert list(a) == list(b) == sorted(local)
        for run_id in a:
            pd.testing.assert_frame_equal(a[run_id], b[run_id], obj=f"{run_id}/{name}")
    # a second call finds every cell finished: no task runs, no table is rewritten
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "ray" / "runs").glob("*/metrics.parquet")}
    lines = []
    assert run_experiment_ray(exp, tmp_path / "ray", progress=False, echo=lines.append) == local
    assert f"{len(local)} done, 0 to resume, 0 new" in lines[0]
    assert stamps == {p: p.stat().st_mtime_ns for p in stamps}


def test_progress_line():
    from moe_lab.launch.ray_backend import progress_line

    assert progress_line(3, 2, 1, 6) == "ray: 3/6 done, 2 running or queued, 1 failed"
    assert progress_line(3, 2, 1, 6, collapsed=2) == "ray: 3/6 done (2 collapsed), 2 running or queued, 1 failed"


class _FakeRay:
    """ray.wait / ray.get over finished results: what _wait_all needs of Ray."""

    def __init__(self, results: dict):
        self.results = results

    def wait(self, refs, num_returns=1):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        return self.results[ref]


def test_collapsed_cells_count_as_finished(tmp_path, capsys):
    from moe_lab.launch.ray_backend import _wait_all

    results = {"a": ("a-s0", "done"), "b": ("b-s0", "collapsed"), "c": ("c-s0", "failed")}
    statuses = _wait_all(_FakeRay(results), {ref: None for ref in results}, tmp_path, 3, progress=True)
    assert statuses == {"a-s0": "done", "b-s0": "collapsed", "c-s0": "failed"}
    assert capsys.readouterr().err.splitlines()[-1] == "ray: 2/3 done (1 collapsed), 0 running or queued, 1 failed"


def _unused_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there


def test_unreachable_cluster_is_one_line_before_any_work(tmp_path, capsys):
    from moe_lab.cli import main

    address = f"127.0.0.1:{_unused_loopback_port()}"
    t0 = time.monotonic()
    code = main(["run", "smoke", "--out", str(tmp_path / "out"), "--backend", "ray", "--address", address])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - t0 < 20 and not ray.is_initialized()
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"--address={address}: no Ray cluster answers there" in err and "ray start --head" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("error, says", [
    (ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379"), "RAY_AUTH_TOKEN"),  # wrong token too
    (ray.exceptions.AuthenticationError("Token authentication is enabled but no token was found"),
     "refused this client's token"),
])
def test_join_failures_are_one_line(monkeypatch, error, says):
    """What ray.init raises when it cannot join (measured on Ray 2.60: a wrong token gives a ConnectionError
    after ~20 s of retries; no token at all an AuthenticationError) becomes one line saying what to do."""
    from moe_lab.launch import ray_backend

    def refuse(**kwargs):
        raise error

    monkeypatch.setattr(ray_backend, "probe", lambda address: None)  # the cluster 'answers' on its port
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(ValueError) as err:
        ray_backend.connect("10.0.0.1:6379")
    assert "\n" not in str(err.value) and says in str(err.value) and str(err.value).startswith("--address=10.0.0.1")
