"""Issue 64's physics check of the fast float8 emulation: on each routing_matters cold start, `moe-lab fidelity`
with ``rl.rollout_kernels=batch_variant_fast`` against the exact emulation's committed rows
(results/reference/routing_matters/fidelity/fidelity_<seed>.json, recorded with ``batch_variant``), printed side
by side. A row passes when the fast value lies inside the exact row's 95% interval.

Usage: python scripts/fidelity_fast_vs_exact.py OUT [--seeds 701,...] [--table-only]
Runs, for each seed missing from OUT (one JSON per cold start, resumable):
  moe-lab fidelity experiments/routing_matters.yaml model.seed=SEED rl.minibatches=4
      rl.rollout_kernels=batch_variant_fast coldstart.cache_dir=results/reference/routing_matters/coldstarts
      --prompts 96 --update-steps 0 --no-dense --json
(the committed exact rows were measured with the same call under ``batch_variant``), then prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXACT = ROOT / "results" / "reference" / "routing_matters" / "fidelity"
COLDSTARTS = ROOT / "results" / "reference" / "routing_matters" / "coldstarts"
ROWS = ("router_disagreement", "token_share", "k3", "k3_replayed", "routing_share")
SEEDS = "701,702,703,704,705,706,707,708"  # routing_matters' cold starts (its blocks)


def fidelity(seed: int) -> dict:
    cmd = [sys.executable, "-m", "moe_lab.cli", "fidelity", str(ROOT / "experiments" / "routing_matters.yaml"),
           f"model.seed={seed}", "rl.minibatches=4", "rl.rollout_kernels=batch_variant_fast",
           f"coldstart.cache_dir={COLDSTARTS}", "--prompts", "96", "--update-steps", "0", "--no-dense", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"fidelity on cold start {seed} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def by_key(record: dict) -> dict:
    return {row["key"]: row for row in record["rows"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seeds", default=SEEDS)
    parser.add_argument("--table-only", action="store_true", help="print the table from OUT, run nothing")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    missing = [s for s in seeds if not (EXACT / f"fidelity_{s}.json").is_file()]
    if missing:
        sys.exit(f"--seeds: no committed exact fidelity for {missing} in {EXACT}")
    args.out.mkdir(parents=True, exist_ok=True)
    passed = total = 0
    print(f"{'cold start':<10} {'row':<20} {'fast':>10} {'exact':>10}  exact 95% interval      verdict")
    for seed in seeds:
        path = args.out / f"fidelity_{seed}.json"
        if not path.is_file():
            if args.table_only:
                continue
            path.write_text(json.dumps(fidelity(seed), indent=1) + "\n", encoding="utf-8")
        fast, exact = by_key(json.loads(path.read_text())), by_key(json.loads((EXACT / path.name).read_text()))
        for key in ROWS:
            value, ref = fast[key]["value"], exact[key]
            inside = ref["lo"] <= value <= ref["hi"]
            passed, total = passed + inside, total + 1
            print(f"{seed:<10} {key:<20} {value:>10.4g} {ref['value']:>10.4g}  [{ref['lo']:.4g}, {ref['hi']:.4g}]"
                  f"{'':<4} {'inside' if inside else 'OUTSIDE'}")
    print(f"{passed} of {total} fast rows inside the exact emulation's 95% intervals")
    return 0 if passed == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
