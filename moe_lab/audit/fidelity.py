"""`moe-lab fidelity RUN_OR_CONFIG [FIELD=VALUE ...]`: moe_lab's figures against the published ones, one table.

RUN_OR_CONFIG: a run folder (its config.yaml and checkpoint; a run without a checkpoint: its cold start; a
finished run: its own metrics' rows too), an experiment file (its first cell) or a bare config YAML (their cold
start, built and cached if missing); the FIELD=VALUE overrides are `moe-lab run`'s. An experiment folder (or a
folder of run folders) is not measured: its finished runs' own metrics give the rows, per arm
(moe_lab/audit/fidelity_runs.py; no overrides). With a fixed number of rollouts (``--prompts``, in rollout batches of
rl.prompts_per_step, rl.group_size samples each) it measures the rollout/trainer mismatch the config's rollout
numerics make (rollouts and forwards only), its dense control's (``--no-dense``: skipped; it has its own cold
start), and, on a copy, a few RL steps of GRPO and of GSPO (``--update-steps``; 0: skipped): the rows of
moe_lab.audit.fidelity_table, defined in docs/metrics.md ("Fidelity against the published figures").

Prints the table (``--json``: a JSON list of its rows instead). Exit codes: 0 done (whatever the verdicts); 2 bad
input (one line on stderr, before any model is built: a missing path, a bad override or field).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from moe_lab.config.constants import BASELINE_ALGO

TAKES_OVERRIDES = True


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("fidelity", help="moe_lab's rollout/trainer mismatch, routing and update figures against the "
                                        "published ones (R3 paper, prime-rl, GSPO), one table with bands")
    p.add_argument("source", metavar="RUN_OR_CONFIG", help="run folder, experiment folder (its finished runs' "
                                                           "metrics, per arm), experiment file or config YAML")
    p.add_argument("overrides", nargs="*", metavar="FIELD=VALUE", help="override any config field, e.g. model.top_k=4")
    p.add_argument("--prompts", type=int, default=32, help="prompts of the mismatch rows (default 32: two rollout "
                                                           "batches of the default config, seconds per batch)")
    p.add_argument("--update-steps", type=int, default=4,
                   help="RL steps of GRPO and of GSPO for the update rows (default 4; 0: no update rows)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense control (it needs its own cold start)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    return p


def check(args):
    """The Source to measure and the dense control's config; ValueError (one line) before any model is built."""
    from moe_lab.audit import fidelity_run, fidelity_runs

    if fidelity_runs.is_runs_folder(Path(args.source).expanduser()):
        if args.overrides:
            raise ValueError(f"{' '.join(args.overrides)}: FIELD=VALUE overrides change a model to measure; "
                             f"{args.source!r} holds finished runs, read as they ran")
        return fidelity_runs.measure(Path(args.source).expanduser()), None
    for flag, value, low in (("--prompts", args.prompts, 2), ("--update-steps", args.update_steps, 0)):
        if value < low:
            raise ValueError(f"{flag}={value}: expected an integer >= {low}")
    source = fidelity_run.resolve(args.source, args.overrides)
    dense = None if args.no_dense else fidelity_run.dense_control(fidelity_run.measured(source.cfg))
    return source, dense


def measure(source, dense_cfg, prompts: int, update_steps: int, run_dir: Path | None = None) -> tuple[list, dict]:
    """(rows, timings in seconds) of one source; timings: mismatch, dense, updates, and step_s (GRPO's mean)."""
    from moe_lab.audit import fidelity_run, fidelity_runs, fidelity_table

    times = {}
    t0 = time.perf_counter()
    task, policy = fidelity_run.load_policy(source.cfg, source.checkpoint)
    samples = fidelity_run.mismatch_samples(policy, task, source.cfg, prompts)
    times["mismatch_s"] = time.perf_counter() - t0
    dense = None
    if dense_cfg is not None:
        t0 = time.perf_counter()
        dense_task, dense_policy = fidelity_run.load_policy(dense_cfg, None)
        dense = fidelity_run.mismatch_samples(dense_policy, dense_task, dense_cfg, prompts)
        times["dense_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    bf16_cfg = fidelity_run.bf16_numerics(source.cfg)
    bf16 = fidelity_run.mismatch_samples(policy, task, bf16_cfg, prompts)
    times["bf16_s"] = time.perf_counter() - t0
    rows = fidelity_table.mismatch_rows(samples, dense, bf16)
    if update_steps:
        t0 = time.perf_counter()
        grpo = fidelity_run.update_samples(policy, task, source.cfg, BASELINE_ALGO, update_steps)
        gspo = fidelity_run.update_samples(policy, task, source.cfg, fidelity_runs.GSPO_ALGO, update_steps)
        grpo_r2 = fidelity_run.update_samples(policy, task, source.cfg, BASELINE_ALGO, update_steps,
                                              replay=fidelity_runs.R2_REPLAY)
        times["updates_s"] = time.perf_counter() - t0
        steps = {r["step"]: r["perf/step_s"] for r in grpo}
        times["step_s"] = sum(steps.values()) / len(steps)
        rows += fidelity_table.update_rows(grpo, gspo, grpo_r2, source.cfg.rl.grad_clip)
    if run_dir is not None and fidelity_runs.with_metrics(run_dir):
        rows += fidelity_runs.measure(run_dir)[0]  # a finished run: its own rows too
    return rows, times


def main(args) -> int:
    from moe_lab.config import ConfigError

    try:
        source, dense = check(args)
    except (ValueError, ConfigError) as exc:
        print(f"moe-lab fidelity: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    from moe_lab.audit import fidelity_table

    if isinstance(source, tuple):  # finished runs: their own metrics, no model
        rows, label = source
        print(json.dumps({"source": label, "rows": as_json(rows)}, indent=1) if args.json else
              f"fidelity of {label}: the runs' own metrics\n{fidelity_table.format_table(rows)}")
        return 0
    run_dir = Path(args.source).expanduser()
    rows, times = measure(source, dense, args.prompts, args.update_steps, run_dir if run_dir.is_dir() else None)
    if args.json:
        from moe_lab.rl.coldstart import recorded

        print(json.dumps({"source": source.label, "coldstart": recorded(source.cfg), "timings": times,
                          "rows": as_json(rows)}, indent=1))
    else:
        print(f"fidelity of {source.label}: {args.prompts} prompts x {source.cfg.rl.group_size} rollouts, "
              f"{args.update_steps} RL steps per algorithm")
        print(fidelity_table.format_table(rows))
        print("timings: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    return 0


def as_json(rows: list) -> list[dict]:
    """The rows as JSON objects (a non-finite number: null)."""
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.as_dict().items()}
            for r in rows]
