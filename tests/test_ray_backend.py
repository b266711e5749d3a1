"""--backend ray: a Ray run of experiments/smoke.yaml on a local cluster gives the local backend's tables.

Skipped when Ray is not installed (pip install -e '.[ray]'). The two-node kill check is
scripts/ray_two_node_check.sh (it starts and kills `ray start` nodes: not a unit test).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from moe_lab.config import apply_overrides, load_yaml
from moe_lab.runner import run_experiment

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
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_backend_gives_the_local_backends_tables(tmp_path, local_ray):
    from moe_lab.ray_backend import run_experiment_ray

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
    from moe_lab.ray_backend import progress_line

    assert progress_line(3, 2, 1, 6) == "ray: 3/6 done, 2 running or queued, 1 failed"
