"""The tables of `moe-lab report` that `moe-lab compare` does not print: collapse counts with Wilson intervals, and
the descriptive routing and mismatch tables of the metrics an experiment file declares (``describe:``).

Descriptive means no test: per run, the mean of each declared metric over a declared window of RL steps (each
step's rows averaged first, so a metric logged once per step and one logged per update weigh steps alike); then
per cell the median and range over its runs and the mean with its 95% t-interval, and per cold start the
cell's mean over the runs from it.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from moe_lab.analysis.stats import group_ci, wilson_interval
from moe_lab.launch.design import Describe


def fmt(x: float) -> str:
    """Three significant digits (what the report's tables print and a verdict may quote)."""
    if not math.isfinite(x):
        return "n/a"
    return f"{x:.3g}" if x == 0 or 1e-3 <= abs(x) < 1e4 else f"{x:.2e}".replace("e-0", "e-").replace("e+0", "e+")


def collapse_table(per_run: pd.DataFrame) -> list[str]:
    """Per cell: runs that a collapse rule stopped, k of n, with the 95% Wilson interval of the rate."""
    lines = ["| setting | arm | collapsed | rate, 95% Wilson |", "|---|---|---|---|"]
    for (setting, arm), g in per_run.groupby(["setting", "arm_base"], sort=False):
        k, n = int(g["collapsed"].sum()), len(g)
        lo, hi = wilson_interval(k, n)
        lines.append(f"| {setting} | {arm} | {k}/{n} | {k / n:.2f} [{lo:.2f}, {hi:.2f}] |")
    k, n = int(per_run["collapsed"].sum()), len(per_run)
    lo, hi = wilson_interval(k, n)
    return [*lines, f"| all | all | {k}/{n} | {k / n:.2f} [{lo:.2f}, {hi:.2f}] |"]


def window_means(metrics: pd.DataFrame, per_run: pd.DataFrame, spec: Describe, label: str) -> pd.DataFrame:
    """One row per finished run (its setting, arm_base, block) with each declared metric's mean over the window."""
    first, last = spec.windows[label]
    present = [m for m in spec.metrics if m in metrics]
    inside = metrics[(metrics["step"] >= first) & (metrics["step"] <= last)]
    by_step = inside.groupby(["run_id", "step"], sort=True)[present].mean()
    means = by_step.groupby(level="run_id").mean()
    keep = per_run.set_index("run_id")[["setting", "arm_base", "block"]]
    return keep.join(means, how="left").reset_index()


def describe_tables(metrics: pd.DataFrame, per_run: pd.DataFrame, spec: Describe) -> list[str]:
    """Per window and declared metric: per cell (median [range], mean [95% t]) and per cold start (cell means)."""
    lines: list[str] = []
    missing = [m for m in spec.metrics if m not in metrics]
    if missing:
        lines += [f"Not logged by these runs (left out): {', '.join(f'`{m}`' for m in missing)}.", ""]
    for label, (first, last) in spec.windows.items():
        runs = window_means(metrics, per_run, spec, label)
        blocks = list(dict.fromkeys(runs["block"]))
        for metric in (m for m in spec.metrics if m in runs):
            lines += [f"**`{metric}`, {label}** (per-run mean over steps {first}-{last})", "",
                      "| setting | arm | n | median [range] over runs | mean, 95% t | "
                      + " | ".join(f"cold start {b}" for b in blocks) + " |",
                      "|---|---|---|---|---|" + "---|" * len(blocks)]
            ci = group_ci(runs, [metric], ["setting", "arm_base"])
            for (setting, arm), g in runs.groupby(["setting", "arm_base"], sort=False):
                v = g[metric].dropna()
                mean, lo, hi = ci.loc[(setting, arm)]
                per_block = g.groupby("block")[metric].mean()
                cells = " | ".join(fmt(per_block.get(b, math.nan)) for b in blocks)
                lines.append(f"| {setting} | {arm} | {len(v)} | {fmt(float(np.median(v)) if len(v) else math.nan)} "
                             f"[{fmt(v.min() if len(v) else math.nan)}, {fmt(v.max() if len(v) else math.nan)}] | "
                             f"{fmt(mean)} [{fmt(lo)}, {fmt(hi)}] | {cells} |")
            lines.append("")
    return lines
