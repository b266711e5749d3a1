"""The fidelity figures of finished runs, from their own metrics (pandas only): one row per run, then per arm over
its cold starts, and the harness alarm of each run. `moe-lab fidelity` on a run or experiment folder turns them
into rows with bands (moe_lab/audit/fidelity_runs.py); `moe-lab report` lists the alarms. Definitions in
docs/metrics.md ("Fidelity against the published figures", "Harness alarm").
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from moe_lab.analysis.stats import mean_ci, ols_slope_ci, ratio_ci
from moe_lab.analysis.tables import RUN_KEYS
from moe_lab.store import harness
from moe_lab.store.run_folder import RunFolder

SLOPE_PER = 100  # the slope of the learning curve is reported per this many RL steps
UPDATES = (1, 3)  # expert change after these many optimizer steps on one rollout batch
CHANGE = ("routing/expert_change_latent", "routing/expert_change")  # the router's own choice first (= under replay)


def last_third(evals: pd.DataFrame, metric: str = "eval/acc_greedy") -> pd.DataFrame:
    """A run's evaluations in the last third of them: the last ceil(n/3), at least 3 (fewer when it has fewer)."""
    ordered = evals.dropna(subset=[metric]).sort_values("step")
    return ordered.tail(max(3, math.ceil(len(ordered) / 3)))


def curve_slope(evals: pd.DataFrame, metric: str = "eval/acc_greedy") -> tuple[float, float, float]:
    """The declared test of "still rising": the OLS slope of ``metric`` on step over the last third of one run's
    evaluations, per SLOPE_PER steps, with its 95% t-interval (rising: the interval's lower end > 0, a one-sided
    test at 2.5%)."""
    tail = last_third(evals, metric)
    return tuple(SLOPE_PER * v for v in ols_slope_ci(tail["step"], tail[metric]))


def update_index(metrics: pd.DataFrame) -> pd.Series:
    """Each row's optimizer steps on its rollout batch before it: 0, 1, ... within each RL step of a run."""
    order = [c for c in ("update", "minibatch") if c in metrics]
    ranked = metrics.sort_values(["step", *order], kind="stable")
    return ranked.groupby("step").cumcount().reindex(metrics.index)


def _rl(metrics: pd.DataFrame) -> dict:
    """A run's rl config section from its frame's ``rl.*`` columns."""
    first = metrics.iloc[0]
    return {k[3:]: first[k] for k in metrics.columns if k.startswith("rl.") and not k.endswith("_resolved")}


def _change_column(metrics: pd.DataFrame) -> str | None:
    return next((c for c in CHANGE if c in metrics and metrics[c].notna().any()), None)


def run_row(metrics: pd.DataFrame, evals: pd.DataFrame | None = None) -> dict:
    """The fidelity figures of one run's rows (metrics.parquet; evals: its eval.parquet, for the slope)."""
    grad_clip = float(harness.rl_field(_rl(metrics), "grad_clip"))
    index = update_index(metrics)
    bound, n = harness.clip_share(metrics.get("optim/grad_norm", pd.Series(dtype=float)), grad_clip)
    out = {"grad_norm_median": float(metrics["optim/grad_norm"].median()) if "optim/grad_norm" in metrics else math.nan,
           "grad_clip": grad_clip, "clip_binds": bound / n if n and grad_clip > 0 else math.nan,
           "clip_frac": float(metrics["clip_frac/active"].mean()) if "clip_frac/active" in metrics else math.nan,
           "length": float(metrics["response/length_mean"].mean()) if "response/length_mean" in metrics else math.nan,
           "router_change": (float(metrics["mismatch/router_change"].mean()) if "mismatch/router_change" in metrics
                             else math.nan)}
    if "clip_frac/active" in metrics:
        for m, part in metrics["clip_frac/active"].groupby(index):
            out[f"clip_frac_u{m}"] = float(part.mean())
    change = _change_column(metrics)
    for m in UPDATES:
        out[f"expert_change_u{m}"] = float(metrics.loc[index == m, change].mean()) if change else math.nan
    slope = curve_slope(evals) if evals is not None and "eval/acc_greedy" in evals else (math.nan,) * 3
    out["slope"], out["slope_lo"], out["slope_hi"] = slope
    return out


def per_run(metrics: pd.DataFrame, evals: pd.DataFrame) -> pd.DataFrame:
    """One row per run of load_runs' frames: its arm, algorithm, replay, correction, mini-batches and cold start
    (model.seed), and run_row's figures."""
    keys = [k for k in RUN_KEYS if k in metrics]
    eval_groups = dict(iter(evals.groupby(keys))) if len(evals) else {}
    rows = []
    for key, part in metrics.groupby(keys, sort=True):
        first = part.iloc[0]
        ident = {"run_id": first["run_id"], "arm": first["arm"], "algo": first.get("rl.algo", first.get("algo")),
                 "replay": first.get("rl.replay", first.get("replay")),
                 "correction": first.get("rl.rollout_correction", "none"),
                 "minibatches": first.get("rl.minibatches", math.nan), "coldstart": first.get("model.seed", math.nan)}
        rows.append({**ident, **run_row(part, eval_groups.get(key))})
    return pd.DataFrame(rows)


def units(runs: pd.DataFrame, column: str) -> tuple[pd.Series, str]:
    """An arm's unit values of ``column``: the mean over each cold start's runs (over runs when it has one cold
    start), and the unit's name."""
    if runs["coldstart"].nunique() > 1:
        return runs.groupby("coldstart")[column].mean(), "cold starts"
    return runs.set_index("run_id")[column], "runs"


def arm_interval(runs: pd.DataFrame, column: str) -> tuple[float, float, float, str]:
    """(mean, lo, hi, units) of an arm's column: mean_ci over its units."""
    values, name = units(runs, column)
    finite = values[np.isfinite(values.astype(float))]
    return (*mean_ci(finite), f"{len(finite)} {name}")


def clip_ratio(runs: pd.DataFrame, arm: str, base: str, column: str = "clip_frac") -> tuple[float, float, float, str]:
    """The ratio of arm's mean ``column`` over base's, paired by cold start (by RL seed when one cold start is
    shared), with its delta-method interval (stats.ratio_ci)."""
    a, b = runs[runs["arm"] == arm], runs[runs["arm"] == base]
    by = "coldstart" if a["coldstart"].nunique() > 1 else "seed_of"
    if by == "seed_of":
        a, b = (x.assign(seed_of=x["run_id"].str.rsplit("-", n=1).str[-1]) for x in (a, b))
    ua, ub = a.groupby(by)[column].mean(), b.groupby(by)[column].mean()
    shared = ua.index.intersection(ub.index)
    return (*ratio_ci(ua[shared], ub[shared], paired=True),
            f"{len(shared)} {'cold starts' if by == 'coldstart' else 'seeds'}")


def alarms(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per run: run_id, arm, its alarm lines (the manifest's where it records them, else the rule on its
    metrics rows) and where they came from ('manifest' or 'metrics')."""
    keys = [k for k in RUN_KEYS if k in metrics]
    rows = []
    for _, part in metrics.groupby(keys, sort=True):
        first = part.iloc[0]
        recorded = harness.recorded(RunFolder(first["run_dir"]).manifest) if "run_dir" in part else None
        lines = recorded if recorded is not None else harness.alarm(part.to_dict("records"), _rl(part))
        rows.append({"run_id": first["run_id"], "arm": first["arm"], "alarm": lines,
                     "source": "manifest" if recorded is not None else "metrics"})
    return pd.DataFrame(rows, columns=["run_id", "arm", "alarm", "source"])


def format_alarms(table: pd.DataFrame) -> list[str]:
    """The report's lines: per arm with flagged runs, the rules that fired and the runs ([] when none)."""
    flagged = table[table["alarm"].map(bool)]
    if not len(flagged):
        return []
    lines = ["## Harness alarms", "",
             f"Runs whose own metrics raise the harness alarm (docs/metrics.md: `rl.grad_clip` binds on more than "
             f"{harness.GRAD_CLIP_SHARE_MAX:.0%} of the updates, or a clipped objective's ratio clip never fired): "
             f"{len(flagged)} of {len(table)} runs.", "", "| arm | runs flagged | rules | runs |", "|---|---|---|---|"]
    for arm, part in flagged.groupby("arm", sort=True):
        rules = sorted({line.split(":", 1)[0] for lines in part["alarm"] for line in lines})
        total = int((table["arm"] == arm).sum())
        lines.append(f"| {arm} | {len(part)} of {total} | {', '.join(rules)} | {', '.join(part['run_id'])} |")
    return [*lines, ""]
