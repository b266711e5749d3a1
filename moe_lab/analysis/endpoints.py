"""Endpoints fixed before a multi-seed run, and every pair of arms compared on them (`moe-lab compare`).

An experiment file may declare its endpoints (``endpoints:``, read by ``launch.experiment.endpoint_spec``); without one the
defaults below apply, fixed before any run they judge (an endpoint chosen after seeing the data would bias the
comparison):

- primary: per seed, the mean greedy accuracy over the last 5 scheduled evaluations (eval/acc_greedy);
- secondary: per seed, the mean sampled reward over the last 25% of the scheduled RL steps (reward/mean);
- tertiary, descriptive only: whether the run collapsed (a collapse rule fired; store/health.py).

A run a collapse rule stopped has no rows after its stop: its last value is carried forward over the steps it
did not reach (the policy it stopped with is its final policy), so an early stop is neither dropped nor
averaged over the good steps before it. "Scheduled" means the experiment's own grid (every ``rl.eval_every``
steps and the last step; steps 1..``rl.steps``), not whatever a run happened to log.

For every pair of arms: the difference of the per-seed means with its 95% Welch interval (Welch-Satterthwaite
degrees of freedom, fractional: the textbook interval, which scipy's ttest_ind(equal_var=False) also gives) and an exact two-sided permutation p-value
(every split of the pooled seeds; a Monte Carlo estimate from a fixed generator where the splits exceed
``EXACT_LIMIT``, marked in the table).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from moe_lab.analysis.stats import mean_ci, permutation_p, welch_diff_ci
from moe_lab.config import ConfigError
from moe_lab.launch.experiment import EndpointSpec, endpoint_spec  # noqa: F401  (the spec lives with the file format)
from moe_lab.launch.spec import parse_experiment
from moe_lab.store.run_folder import ResultsFolder, as_results
from moe_lab.store.status import FINISHED



def eval_schedule(steps: int, eval_every: int) -> list[int]:
    """The steps at which a run of ``steps`` RL steps evaluates when it is not stopped (rl/loop.py)."""
    grid = list(range(0, steps + 1, eval_every)) if eval_every > 0 else [0]
    return grid if grid[-1] == steps else [*grid, steps]


def carried(values: pd.Series, grid: Sequence[int]) -> np.ndarray:
    """``values`` (indexed by step) at each grid step: the last value at or before it (carried forward)."""
    values = values.dropna().sort_index()
    if values.empty:
        return np.full(len(grid), math.nan)
    pos = np.searchsorted(values.index.to_numpy(), np.asarray(grid), side="right") - 1
    out = values.to_numpy(dtype=float)[np.clip(pos, 0, None)]
    return np.where(pos >= 0, out, math.nan)


def run_endpoints(metrics: pd.DataFrame, evals: pd.DataFrame, spec: EndpointSpec = EndpointSpec(),
                  block_field: str | None = None) -> pd.DataFrame:
    """One row per finished run (done or collapsed): experiment, arm, arm_base, setting, seed, run_id, status,
    primary, secondary, collapsed (bool), block (the run's value of ``block_field``, e.g. its cold start's
    model.seed, as text; "all" without one). Running and failed runs are left out (see ``unfinished_runs``)."""
    rows = []
    keys = [k for k in ("experiment", "arm", "seed", "run_id") if k in evals.columns]
    by_run = dict(tuple(metrics.groupby(keys, sort=True))) if len(metrics) else {}
    for key, ev in evals.groupby(keys, sort=True):
        first = ev.iloc[0]
        if "status" in ev and first["status"] not in FINISHED:
            continue  # running or failed: its last value is not final, so it is no endpoint (unfinished_runs)
        steps, every = int(first["rl.steps"]), int(first["rl.eval_every"])
        grid = eval_schedule(steps, every)[-spec.last_evals:]
        acc = ev.groupby("step")[spec.primary_metric].mean()
        m = by_run.get(key)
        secondary = math.nan
        if m is not None and spec.secondary_metric in m:
            per_step = m.groupby("step")[spec.secondary_metric].mean()
            # metrics rows are numbered 0..steps-1 (an evaluation at s follows s steps): the last n are steps-n..steps-1
            tail = list(range(steps - math.ceil(spec.last_frac * steps), steps))
            secondary = float(np.nanmean(carried(per_step, tail)))
        collapsed = bool(np.isfinite(ev["collapsed_at"].astype(float)).any()) if "collapsed_at" in ev else False
        rows.append({**dict(zip(keys, key)), "arm_base": first.get("arm_base", key[keys.index("arm")]),
                     "setting": str(key[keys.index("arm")]).partition("__")[2], "status": first.get("status"),
                     "primary": float(np.nanmean(carried(acc, grid))), "secondary": secondary,
                     "collapsed": collapsed,
                     "block": str(first[block_field]) if block_field and block_field in ev else "all"})
    return pd.DataFrame(rows)


def unfinished_runs(evals: pd.DataFrame) -> list[str]:
    """Run ids of the folder that are not finished (running, interrupted, failed, unverified): no endpoint yet."""
    if "status" not in evals or not len(evals):
        return []
    status = evals.groupby("run_id", sort=True)["status"].first()
    return sorted(status[~status.isin(FINISHED)].index)


def compare_arms(per_run: pd.DataFrame, baseline: str | None = None,
                 columns: Sequence[str] = ("primary", "secondary")) -> pd.DataFrame:
    """Every pair of arms within a setting (an arm's sweep/control label; one setting without labels), or each
    arm against ``baseline`` (an arm name without its label) there: per endpoint the difference (arm - vs) with
    its Welch 95% interval and permutation p; n of each side; collapses of each side (descriptive)."""
    names = list(dict.fromkeys(per_run["arm_base"]))
    if baseline is not None and baseline not in names:
        raise ConfigError(f"--baseline={baseline}: no such arm; allowed: {', '.join(names)}")
    rows = []
    for setting, runs in per_run.groupby("setting", sort=False):
        arms = list(dict.fromkeys(runs["arm_base"]))
        pairs = [(a, baseline) for a in arms if a != baseline and baseline in arms] if baseline \
            else list(itertools.combinations(arms, 2))
        rows += [_pair_row(runs, setting, arm, other, columns) for arm, other in pairs]
    return pd.DataFrame(rows)


def _pair_row(runs: pd.DataFrame, setting: str, arm: str, other: str, columns: Sequence[str]) -> dict:
    x, y = runs[runs["arm_base"] == arm], runs[runs["arm_base"] == other]
    row = {"setting": setting, "arm": arm, "vs": other, "n": len(x), "n_vs": len(y)}
    for col in columns:
        diff, lo, hi = welch_diff_ci(x[col].tolist(), y[col].tolist(), floor_dof=False)
        p, exact = permutation_p(x[col].dropna(), y[col].dropna())
        row.update({f"{col}_diff": diff, f"{col}_lo": lo, f"{col}_hi": hi, f"{col}_p": p, f"{col}_p_exact": exact})
    row.update(collapsed=int(x["collapsed"].sum()), collapsed_vs=int(y["collapsed"].sum()))
    return row


def arm_means(per_run: pd.DataFrame) -> pd.DataFrame:
    """Per arm: n, the mean of each endpoint with its 95% t-interval, and collapses (k of n)."""
    rows = []
    for (setting, arm), g in per_run.groupby(["setting", "arm_base"], sort=False):
        row = {"setting": setting, "arm": arm, "n": len(g), "collapsed": int(g["collapsed"].sum())}
        for col in ("primary", "secondary"):
            row[col], row[f"{col}_lo"], row[f"{col}_hi"] = mean_ci(g[col])
        rows.append(row)
    return pd.DataFrame(rows)


def load_comparison(results: str | Path | ResultsFolder, baseline: str | None = None) -> tuple[
        EndpointSpec, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(spec, per-run endpoints, per-arm means, pairs) of an experiment folder; the spec from the folder's own
    experiment.yaml (the one it ran), else the defaults. One ValueError line for a folder with no runs."""
    from moe_lab.analysis.tables import load_runs

    folder = as_results(results)
    if not folder.path.is_dir():
        raise ConfigError(f"RESULTS_DIR={folder.path}: no such folder")
    exp = parse_experiment(folder.experiment())
    spec, blocks = exp.endpoints, exp.blocks
    metrics, evals = load_runs(folder.path)
    if not len(evals):
        raise ConfigError(f"RESULTS_DIR={folder.path}: no finished runs with evaluations")
    if spec.primary_metric not in evals:
        raise ConfigError(f"endpoints.primary.metric={spec.primary_metric}: not a column of the eval tables")
    per_run = run_endpoints(metrics, evals, spec, blocks.field if blocks else None)
    if not len(per_run):
        raise ConfigError(f"RESULTS_DIR={folder.path}: no finished runs yet (status done or collapsed)")
    per_run.attrs["unfinished"] = unfinished_runs(evals)
    return spec, per_run, arm_means(per_run), compare_arms(per_run, baseline)


def _ci(mean: float, lo: float, hi: float, signed: bool = False) -> str:
    fmt = "{:+.3f}" if signed else "{:.3f}"
    if not math.isfinite(lo):
        return fmt.format(mean)
    return f"{fmt.format(mean)} [{lo:+.3f}, {hi:+.3f}]" if signed else f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def format_p(p: float) -> str:
    """Four decimals, or two significant digits below 0.001: 10 against 10 seeds reach 1.1e-05 (2 of 184,756
    splits), which four decimals would print as a p of 0."""
    return f"{p:.4f}" if not p < 1e-3 else f"{p:.2g}"


def endpoints_head(spec: EndpointSpec) -> str:
    """The line that says what the endpoints are (printed above their tables)."""
    return (f"primary: mean {spec.primary_metric} over the last {spec.last_evals} scheduled evaluations; "
            f"secondary: mean {spec.secondary_metric} over the last {spec.last_frac:.0%} of steps "
            f"(a stopped run's last value carried forward); 95% t / Welch intervals")


def format_arms(arms: pd.DataFrame) -> list[str]:
    """Per arm: n, each endpoint's mean with its 95% t-interval, collapses."""
    lines = ["| setting | arm | n | primary (95% t) | secondary (95% t) | collapsed |", "|---|---|---|---|---|---|"]
    return lines + [f"| {r.setting} | {r.arm} | {r.n} | {_ci(r.primary, r.primary_lo, r.primary_hi)} | "
                    f"{_ci(r.secondary, r.secondary_lo, r.secondary_hi)} | {r.collapsed}/{r.n} |"
                    for r in arms.itertuples()]


def format_pairs(pairs: pd.DataFrame) -> list[str]:
    """Per pair of arms: each endpoint's difference with its Welch 95% interval and permutation p, collapses."""
    lines = ["| setting | arm − vs | primary diff (Welch 95%) | p | secondary diff (Welch 95%) | p | collapsed |",
             "|---|---|---|---|---|---|---|"]
    for r in pairs.itertuples():
        p1 = format_p(r.primary_p) + ("" if r.primary_p_exact else " (MC)")
        p2 = format_p(r.secondary_p) + ("" if r.secondary_p_exact else " (MC)")
        lines.append(f"| {r.setting} | {r.arm} − {r.vs} | {_ci(r.primary_diff, r.primary_lo, r.primary_hi, True)} | {p1} | "
                     f"{_ci(r.secondary_diff, r.secondary_lo, r.secondary_hi, True)} | {p2} | "
                     f"{r.collapsed}/{r.n} vs {r.collapsed_vs}/{r.n_vs} |")
    return lines


def format_comparison(spec: EndpointSpec, arms: pd.DataFrame, pairs: pd.DataFrame) -> str:
    """The two markdown tables `moe-lab compare` prints: per arm, then per pair of arms."""
    return "\n".join([endpoints_head(spec), "", *format_arms(arms), "", *format_pairs(pairs)])
