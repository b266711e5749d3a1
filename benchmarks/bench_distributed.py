"""Scaling overheads on this machine (prints figures; not a test).

1. Data-parallel RL: median seconds per RL step (rank 0's perf/step_s) under torchrun at 1 and 2 ranks
   (gloo, CPU), same global batch. On 2 cores expect no speed-up: this measures the split's overhead.
2. Ray backend: wall seconds of the smoke grid on the local backend (--jobs 2) and on a local Ray cluster
   (ray.init(num_cpus=2)), and the difference per cell. Cold starts are cached before either is timed.

    OMP_NUM_THREADS=1 python benchmarks/bench_distributed.py [--steps 4] [--no-ray]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import yaml

from moe_lab.config import apply_overrides, load_yaml

ROOT = Path(__file__).resolve().parents[1]
SMOKE = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))


def dp_step_seconds(tmp: Path, nproc: int, steps: int) -> float:
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump(apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp / 'cache'}",
                                                                      f"rl.steps={steps}", "rl.prompts_per_step=8"])))
    out = tmp / f"dp{nproc}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "moe_lab.train", str(config), "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    df = pd.read_parquet(out / "metrics.parquet")
    per_step = df.groupby("step")["perf/step_s"].first().tolist()
    return statistics.median(per_step[1:] or per_step)  # step 0 pays one-off warm-up


def grid_seconds(tmp: Path) -> tuple[float, float, int]:
    import ray

    from moe_lab.launch.ray_backend import run_experiment_ray
    from moe_lab.launch.runner import run_experiment

    exp = dict(SMOKE, base=apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp / 'cache'}"]))
    quiet = dict(progress=False, echo=lambda *_: None)
    run_experiment(exp, tmp / "warm", jobs=1, seeds=[9], **quiet)  # fills the cold-start cache
    t0 = time.perf_counter()
    run_experiment(exp, tmp / "local", jobs=2, **quiet)
    local = time.perf_counter() - t0
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        t0 = time.perf_counter()
        run_experiment_ray(exp, tmp / "ray", **quiet)
        remote = time.perf_counter() - t0
    finally:
        ray.shutdown()
    return local, remote, len(SMOKE["arms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for n in (1, 2):
            print(f"data-parallel, {n} rank(s): {dp_step_seconds(tmp, n, args.steps):.3f} s per RL step "
                  f"(8 prompts x 4 responses, 2 minibatches)", flush=True)
        if not args.no_ray:
            local, remote, cells = grid_seconds(tmp)
            print(f"smoke grid ({cells} cells, 2 CPUs): local backend {local:.1f} s, Ray backend {remote:.1f} s "
                  f"(cluster start excluded); overhead {(remote - local) / cells:+.2f} s per cell")


if __name__ == "__main__":
    main()
