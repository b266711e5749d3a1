"""Kernel-ISA pinning: does it change the numbers, does a pinned run repeat itself, and what does it cost?
(prints figures; not a test).

Runs the main job's `grpo` seed 0 for a few RL steps, alternating the default kernels with every ISA pinned
to AVX2 (ATEN_CPU_CAPABILITY, MKL_CBWR, ONEDNN_MAX_CPU_ISA), each setting with its own cold-start cache
(built on its first repeat and timed separately). Prints per setting: cold-start supervised steps and seconds,
the mean RL step time of each repeat (perf/step_s, first step left out), whether the repeats' tables are
bit-identical, and whether the settings' tables differ.

    python benchmarks/bench_isa.py [--steps 6] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
SETTINGS = {"default": {}, "pinned_avx2": PINNED}
PINS = tuple(PINNED)


def run(out: Path, cache: Path, env_extra: dict, steps: int) -> Path:
    env = {k: v for k, v in os.environ.items() if k not in PINS} | env_extra
    cmd = [sys.executable, "-m", "moe_lab.cli", "run", "paper", "--arms", "grpo", "--seeds", "0", "--jobs", "1",
           "--no-progress", "--out", str(out), f"rl.steps={steps}", f"coldstart.cache_dir={cache}"]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out / "runs" / "grpo-s0"


def table(run_dir: Path) -> pd.DataFrame:
    m = pd.read_parquet(run_dir / "metrics.parquet")
    return m[[c for c in m.columns if not c.startswith("perf/")]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_isa-"))
    runs: dict[str, list[Path]] = {name: [] for name in SETTINGS}
    for rep in range(args.repeats):  # interleaved, so both settings see the same machine load
        for name, env in SETTINGS.items():
            runs[name].append(run(root / f"{name}-{rep}", root / f"cache-{name}", env, args.steps))
    for name, dirs in runs.items():
        meta = json.loads(next((root / f"cache-{name}").glob("*/coldstart.json")).read_text())
        step_s = [pd.read_parquet(d / "metrics.parquet").groupby("step")["perf/step_s"].first().iloc[1:].mean()
                  for d in dirs]
        same = all(table(d).equals(table(dirs[0])) for d in dirs[1:])
        print(f"{name:12s} cold start {meta['steps']} steps in {meta['seconds']:.0f} s | RL step s per repeat: "
              + ", ".join(f"{s:.2f}" for s in step_s) + f" | repeats bit-identical: {same}")
    a, b = (runs[name][0] for name in SETTINGS)
    print("default vs pinned tables identical:", table(a).equals(table(b)))


if __name__ == "__main__":
    main()
