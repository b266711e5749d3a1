"""The summary of an experiment over seeds (``summarize``, ``format_summary``) and, re-exported, the loaders
and reductions of ``moe_lab.analysis.tables`` (``load_runs``, ``per_step``...) and the intervals of
``moe_lab.analysis.stats`` (``mean_ci``...), so that notebooks and the CLI read them from one module."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from moe_lab.analysis import stability
from moe_lab.analysis.stats import T975, Z975, group_ci, mean_ci, t_quantile_975  # noqa: F401 - re-exported
from moe_lab.analysis.tables import (  # noqa: F401 - re-exported
    ENV_RESULTS, ID_COLUMNS, RUN_KEYS, SUMMARY_EVAL, SUMMARY_METRICS, arm_factor_level,
    base_arm, check_columns, final_values, find_run_dirs, flatten, last_frac_means, load_runs,
    per_run_step, per_step, reference_dir, run_keys,
)
from moe_lab.store.status import FINISHED


def summarize(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, *, by: Sequence[str] = ("arm",),
              last_frac: float = 0.25) -> pd.DataFrame:
    """One row per group (default: per arm), over its runs (seeds):

    seeds, runs, runs_done (finished: 'done' or 'collapsed'); the final greedy/sampled eval accuracy (each run's last evaluation); and the
    mean over the last ``last_frac`` of each run's steps of every SUMMARY_METRICS column. Each quantity q
    gives q (mean over runs), q_lo and q_hi (95% t-interval over runs; NaN with a single run). A metric
    absent from the frame gives NaN columns rather than an error: some runs do not log every metric.
    Collapse (moe_lab/store/health.py): collapses (runs with a collapsed_at), collapse_rate with its Wilson 95%
    interval collapse_rate_lo/_hi, collapse_step_median over the collapsed runs.
    """
    by = [by] if isinstance(by, str) else list(by)
    if not by:
        raise ValueError("by: expected at least one column name, e.g. ('arm',)")
    if not 0.0 < last_frac <= 1.0:
        raise ValueError(f"last_frac={last_frac!r}: allowed 0 < last_frac <= 1")
    check_columns(metrics_df, [*by, "step", "seed", "status"], "by")
    if len(eval_df):
        check_columns(eval_df, [*by, "step"], "by")
    keys = list(dict.fromkeys([*by, *run_keys(metrics_df)]))
    runs = metrics_df.groupby(keys, dropna=False, sort=True)[["seed", "status"]].first().reset_index()
    counts = runs.groupby(by, dropna=False, sort=True).agg(
        seeds=("seed", "nunique"), runs=("seed", "size"), runs_done=("status", lambda s: int(s.isin(FINISHED).sum())))
    final = final_values(eval_df, SUMMARY_EVAL, by) if len(eval_df) else \
        pd.DataFrame(columns=[*keys, *SUMMARY_EVAL])
    tail = last_frac_means(metrics_df, SUMMARY_METRICS, by, last_frac)
    final[list(SUMMARY_EVAL)] = final[list(SUMMARY_EVAL)].astype(float)
    table = counts.join(stability.collapse_stats(metrics_df, by), how="left").join(
        group_ci(final, SUMMARY_EVAL, by), how="left").join(group_ci(tail, SUMMARY_METRICS, by), how="left")
    return table.reset_index()


SHORT_NAMES = {"eval/acc_greedy": "acc greedy", "eval/acc_sampled": "acc sampled", "clip_frac/active": "clip active",
               "clip_frac/out_of_range": "clip out", "ratio/token_var": "ratio var", "ratio/extreme_frac": "extreme",
               "routing/expert_change": "expert chg", "routing/expert_change_latent": "latent chg",
               "reward/mean": "reward"}


def _fmt_ci(mean: float, lo: float, hi: float) -> str:
    if not np.isfinite(mean):
        return "-"
    text = f"{mean:.3g}" if abs(mean) >= 1e-2 or mean == 0 else f"{mean:.2e}"
    return text if not np.isfinite(lo) else f"{text} ±{(hi - lo) / 2:.2g}"


def format_summary(df: pd.DataFrame) -> str:
    """A compact terminal table of summarize()'s output: 'mean ±half-width' of each 95% interval."""
    quantities = [q for q in (*SUMMARY_EVAL, *SUMMARY_METRICS) if q in df.columns]
    lead = [c for c in df.columns if c not in quantities and not str(c).endswith(("_lo", "_hi"))
            and c not in ("seeds", "runs", "runs_done", *stability.COLLAPSE_COLUMNS)]
    out = df[lead].copy()
    if "runs" in df:
        out["done"] = [f"{d}/{n}" for d, n in zip(df["runs_done"], df["runs"])]
    if "collapses" in df and df["collapses"].notna().any():
        out["collapsed [95%]"] = [f"{k:.0f}/{n} [{lo:.2f}, {hi:.2f}]" if np.isfinite(k) else "-" for k, n, lo, hi in
                                  zip(df["collapses"], df["runs"], df["collapse_rate_lo"], df["collapse_rate_hi"])]
        out["collapse step"] = [f"{m:g}" if np.isfinite(m) else "-" for m in df["collapse_step_median"]]
    for q in quantities:
        if df[q].notna().any():
            out[SHORT_NAMES.get(q, q)] = [_fmt_ci(m, lo, hi) for m, lo, hi in zip(df[q], df[f"{q}_lo"], df[f"{q}_hi"])]
    return out.to_string(index=False)
