"""`moe-lab fidelity` on finished runs: the rows their own metrics give (no model is built).

An experiment folder (or a folder of run folders): per arm, each run's figures (moe_lab/analysis/run_fidelity.py)
averaged over its cold starts, the interval over cold starts (over runs where an arm has one cold start); then,
for each GSPO arm, its clip fraction over that of the GRPO + R2 arm and of the GRPO arm (no replay, no correction)
at the same number of mini-batches, paired by cold start, averaged over the runs and per update index. A single
finished run folder: its figures with intervals over its RL steps (its learning-curve slope: its own OLS interval).
Only finished runs are read (manifest status done or collapsed).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from moe_lab.analysis import run_fidelity as rf
from moe_lab.analysis.stats import mean_ci
from moe_lab.analysis.tables import find_run_dirs, load_runs
from moe_lab.audit import fidelity_table as ft
from moe_lab.config.constants import BASELINE_ALGO, NO_CORRECTION, NO_REPLAY
from moe_lab.config.mode_specs import OLD_FORWARD, REPLAY_SPECS
from moe_lab.config.objective_specs import OBJECTIVE_SPECS
from moe_lab.store.layout import CONFIG_FILE
from moe_lab.store.status import FINISHED

# The GSPO paper's comparison, by the tables' traits: the baseline objective (GRPO) with free routing and with the
# old policy's routing replayed (R2), against the first PPO-clip objective on a sequence ratio (GSPO).
GSPO_ALGO = next(name for name, spec in OBJECTIVE_SPECS.items() if spec.ppo_clip and not spec.token_clip)
R2_REPLAY = next(name for name, spec in REPLAY_SPECS.items() if spec.forces == OLD_FORWARD)


def finished(path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """(metrics, evals, runs found) of the finished runs under path; ValueError (one line) when none is."""
    dirs = find_run_dirs(path)
    if not dirs:
        raise ValueError(f"RUN_OR_CONFIG {str(path)!r}: a folder without run folders or a config.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unreadable run is counted below, not warned about per run
        metrics, evals = load_runs(path)
    if not len(metrics) or "status" not in metrics:
        raise ValueError(f"RUN_OR_CONFIG {str(path)!r}: none of its {len(dirs)} run folders has readable metrics")
    metrics = metrics[metrics["status"].isin(FINISHED)]
    if not len(metrics):
        raise ValueError(f"RUN_OR_CONFIG {str(path)!r}: none of its {len(dirs)} runs has finished")
    evals = evals[evals["run_id"].isin(set(metrics["run_id"]))] if len(evals) else evals
    return metrics, evals, len(dirs)


def _arm_rows(runs: pd.DataFrame, arm: str) -> list[ft.Row]:
    stat = {c: rf.arm_interval(runs, c) for c in ("router_change", "grad_norm_median", "clip_binds", "length", "slope",
                                                  *(f"expert_change_u{m}" for m in rf.UPDATES))}
    grad_clip = float(runs["grad_clip"].iloc[0])
    out = [ft.router_row(stat["router_change"], stat["router_change"][3], arm=arm)]
    out += [ft.expert_change_row(m, stat[f"expert_change_u{m}"], stat[f"expert_change_u{m}"][3], arm)
            for m in rf.UPDATES if math.isfinite(stat[f"expert_change_u{m}"][0])]  # fewer updates per batch: none
    out += ft.gradient_rows(stat["grad_norm_median"], stat["clip_binds"], stat["grad_norm_median"][3], grad_clip, arm)
    out += [ft.length_row(stat["length"], stat["length"][3], arm), ft.slope_row(stat["slope"], stat["slope"][3], arm)]
    return out


def _baseline(runs: pd.DataFrame, gspo: pd.Series, replay: str) -> str | None:
    """The GRPO arm (``replay``, no correction) with the GSPO arm's number of mini-batches."""
    match = runs[(runs["algo"] == BASELINE_ALGO) & (runs["replay"] == replay) & (runs["correction"] == NO_CORRECTION)
                 & (runs["minibatches"] == gspo["minibatches"])]
    return match["arm"].iloc[0] if len(match) else None


def _ratio_rows(runs: pd.DataFrame) -> list[ft.Row]:
    out = []
    gspos = runs[(runs["algo"] == GSPO_ALGO) & (runs["replay"] == NO_REPLAY)].drop_duplicates("arm")
    for _, gspo in gspos.iterrows():
        for replay, mode in ((True, R2_REPLAY), (False, NO_REPLAY)):
            base = _baseline(runs, gspo, mode)
            if base is None:
                continue
            label = f"{gspo['arm']} / {base}"
            stat = rf.clip_ratio(runs, gspo["arm"], base)
            out.append(ft.clip_ratio_row(stat, stat[3], replay, arm=label))
            updates = sorted(int(c.removeprefix("clip_frac_u")) for c in runs if c.startswith("clip_frac_u"))
            for m in updates if replay else ():
                if m:  # the first update of a batch is on-policy: nothing to clip on either side
                    stat = rf.clip_ratio(runs, gspo["arm"], base, f"clip_frac_u{m}")
                    out.append(ft.clip_ratio_row(stat, stat[3], replay, m, arm=label))
    return out


def experiment_rows(metrics: pd.DataFrame, evals: pd.DataFrame) -> list[ft.Row]:
    """Per arm, then the clip ratios (module docstring)."""
    runs = rf.per_run(metrics, evals)
    out = []
    for arm, part in runs.groupby("arm", sort=True):
        out += _arm_rows(part, arm)
    return out + _ratio_rows(runs)


def run_rows(metrics: pd.DataFrame, evals: pd.DataFrame) -> list[ft.Row]:
    """One finished run's rows, intervals over its RL steps (the same definitions per step)."""
    arm = str(metrics["run_id"].iloc[0])
    per_step = [rf.run_row(part) for _, part in metrics.groupby("step", sort=True)]
    steps = pd.DataFrame(per_step)
    n = f"{len(steps)} steps"

    def over_steps(col: str):
        return mean_ci(steps[col]) if col in steps else (math.nan,) * 3

    grad_clip = float(steps["grad_clip"].iloc[0])
    out = [ft.router_row(over_steps("router_change"), n, arm=arm)]
    out += [ft.expert_change_row(m, over_steps(f"expert_change_u{m}"), n, arm) for m in rf.UPDATES]
    share = over_steps("clip_binds") if grad_clip > 0 else (math.nan,) * 3
    out += ft.gradient_rows(over_steps("grad_norm_median"), share, n, grad_clip, arm)
    slope = rf.curve_slope(evals) if len(evals) else (math.nan,) * 3
    evals_n = len(rf.last_third(evals)) if len(evals) else 0
    out += [ft.length_row(over_steps("length"), n, arm),
            ft.slope_row(slope, f"{evals_n} evaluations", arm)]
    clip = over_steps("clip_frac")
    out.append(ft.row("clip_frac", "share of tokens clipped (clip_frac/active)", clip, n, "-", "-", ft.REPORTED, arm))
    return out


def measure(path: str | Path) -> tuple[list[ft.Row], str]:
    """(rows, label) of the finished runs under path."""
    metrics, evals, found = finished(path)
    n = metrics["run_id"].nunique()
    label = f"{n} finished run(s) of {found} under {path}"
    if n == 1 and found == 1:
        return run_rows(metrics, evals), label
    return experiment_rows(metrics, evals), label


def is_runs_folder(path: Path) -> bool:
    """A folder of finished runs to read rather than a model to measure: run folders under it (a run folder's own
    config.yaml makes it a model to measure: `moe-lab fidelity RUN` measures its checkpoint and reads its rows)."""
    return path.is_dir() and not (path / CONFIG_FILE).is_file() and bool(find_run_dirs(path))


def with_metrics(path: Path) -> bool:
    """A run folder that has finished (its own metrics can be read beside the measurement)."""
    try:
        metrics, _, _ = finished(path)
    except (ValueError, FileNotFoundError):
        return False
    return bool(len(metrics)) and bool(np.isfinite(metrics["step"]).any())
