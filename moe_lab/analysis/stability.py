"""Collapse and stability statistics over runs (pandas only, no torch): collapse rates with Wilson intervals,
Kaplan-Meier survival and the one-factor-at-a-time stability atlas.

Reads the frames of ``results.load_runs`` (its ``collapsed_at`` / ``collapse_rule`` and the sweep labels
``arm_base`` / ``factor`` / ``level``); formulas in docs/metrics.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from moe_lab.analysis import arm_traits
from moe_lab.analysis.stats import group_ci, kaplan_meier, wilson_interval
from moe_lab.analysis.tables import arm_factor_level, base_arm, check_columns, final_values, last_frac_means, run_keys

# --------------------------------------------------------------------------- collapse


COLLAPSE_COLUMNS = ("collapses", "collapse_rate", "collapse_rate_lo", "collapse_rate_hi", "collapse_step_median")


def collapse_runs(metrics_df: pd.DataFrame, by: Sequence[str] = ("arm",)) -> pd.DataFrame:
    """One row per run: by..., run keys, collapsed_at (NaN = never), collapse_rule, last_step (its last
    logged step: where an uncollapsed run is censored)."""
    by = [by] if isinstance(by, str) else list(by)
    check_columns(metrics_df, [*by, "step", "collapsed_at"], "by")
    keys = list(dict.fromkeys([*by, *run_keys(metrics_df)]))
    grouped = metrics_df.groupby(keys, dropna=False, sort=True)
    out = grouped["collapsed_at"].first().astype(float).to_frame()
    out["collapse_rule"] = grouped["collapse_rule"].first() if "collapse_rule" in metrics_df else ""
    out["last_step"] = grouped["step"].max()
    return out.reset_index()


def collapse_stats(metrics_df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per group: collapses (k of its runs), collapse_rate = k/n with its Wilson 95% interval, and the median
    collapsed_at over the collapsed runs (NaN when none collapsed). NaN columns when the frame has no
    collapsed_at (frames not read by load_runs): unknown, not 'never'."""
    if "collapsed_at" not in metrics_df:
        index = metrics_df.groupby(by, dropna=False, sort=True).size().index
        return pd.DataFrame(math.nan, index=index, columns=list(COLLAPSE_COLUMNS))
    at = collapse_runs(metrics_df, by).groupby(by, dropna=False, sort=True)["collapsed_at"]
    k, n = at.count(), at.size()
    lo, hi = zip(*(wilson_interval(int(a), int(b)) for a, b in zip(k, n))) if len(n) else ((), ())
    return pd.DataFrame({"collapses": k, "collapse_rate": k / n, "collapse_rate_lo": lo, "collapse_rate_hi": hi,
                         "collapse_step_median": at.median()}, index=n.index)


def survival_table(metrics_df: pd.DataFrame, by: Sequence[str] = ("arm",)) -> pd.DataFrame:
    """Kaplan-Meier share of runs not yet collapsed, per group and step 0..(last step of its runs).

    An uncollapsed run is censored at its last logged step (it is still at risk at that step, as is the
    convention when a censoring and an event tie). At each collapse step t: S *= 1 - d_t / n_t, with d_t the
    runs collapsing at t and n_t the runs whose collapse or censoring step is >= t. Columns: by..., step,
    survival, at_risk (n_t), collapsed (d_t).
    """
    by = [by] if isinstance(by, str) else list(by)
    runs = collapse_runs(metrics_df, by)
    runs["time"] = runs["collapsed_at"].fillna(runs["last_step"])
    parts = []
    for key, group in runs.groupby(by, dropna=False, sort=True):
        steps = np.arange(int(group["time"].max()) + 1)
        times, events = group["time"].to_numpy(float), group["collapsed_at"].notna().to_numpy()
        survival, at_risk, died = kaplan_meier(times, events, steps)
        key = key if isinstance(key, tuple) else (key,)
        parts.append(pd.DataFrame({**dict(zip(by, key)), "step": steps, "survival": survival,
                                   "at_risk": at_risk, "collapsed": died}))
    columns = [*by, "step", "survival", "at_risk", "collapsed"]
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)


# --------------------------------------------------------------------------- stability atlas


def _is_number(text: str) -> bool:
    try:
        float(text)
    except (TypeError, ValueError):
        return False
    return True


def level_order(levels: Iterable[str]) -> list[str]:
    """A factor's levels in their natural order: numeric when every level is a number, else as first met."""
    levels = list(dict.fromkeys(str(v) for v in levels))
    return sorted(levels, key=float) if all(map(_is_number, levels)) else levels


def with_base_levels(frame: pd.DataFrame, design: dict) -> pd.DataFrame:
    """Rows of a ``factors`` experiment's shared base cells ('<arm>__base') copied onto every factor's axis,
    at the level that factor's block marks as the base ({}), so each factor's curve includes the base point."""
    from moe_lab.launch.experiment import BASE_LABEL, factor_levels

    frame = with_labels(frame)
    if not len(frame):
        return frame
    is_base = frame["factor"] == BASE_LABEL
    parts = [frame[~is_base]]
    for factor, levels in factor_levels(design).items():
        at = next((label for label, over in levels if not over), None)
        if at is not None:
            parts.append(frame[is_base].assign(factor=factor, level=at))
    return pd.concat(parts, ignore_index=True)


def design_levels(design: dict) -> dict[str, list[str]]:
    """factor -> its level labels in the order the experiment file lists them."""
    from moe_lab.launch.experiment import factor_levels

    return {factor: [label for label, _ in levels] for factor, levels in factor_levels(design).items()}


def atlas_reference(metrics_df: pd.DataFrame) -> str | None:
    """The base arm the atlas's accuracy gap is taken to: GRPO + R2 by its config (arm_traits.is_atlas_reference)."""
    return arm_traits.base_arm_where(metrics_df, arm_traits.is_atlas_reference)


def atlas_table(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, *, reference: str | None = None,
                last_frac: float = 0.25, levels: dict[str, Sequence] | None = None,
                design: dict | None = None) -> pd.DataFrame:
    """The stability atlas: one row per (factor, level, arm_base) of a one-factor-at-a-time experiment
    (arms labelled '<arm>__<factor>=<level>'), each a mean over that cell's runs (seeds):

    - expert_change: the router's own expert change per update (routing/expert_change_latent where logged,
      else routing/expert_change: under replay the forced change is 0 by construction), mean over the last
      ``last_frac`` of the run's updates;
    - ratio_var_p99: the 99th percentile (linear interpolation) of the run's minibatch ratio/token_var;
    - acc_greedy: the final greedy accuracy; acc_gap: acc_greedy minus the ``reference`` arm's at the same
      factor and level (NaN where that cell is missing; default reference: atlas_reference).
    Also runs and level_index (the level's position in its factor: ``levels[factor]`` if given, else
    level_order). Rows without a factor label are left out. ``design``: the experiment (its ``factors``
    block), whose shared base cells then join every factor at its base level, in the file's level order.
    """
    check_columns(metrics_df, ["arm", "step", "ratio/token_var", "routing/expert_change"], "metrics_df")
    reference = atlas_reference(metrics_df) if reference is None else reference
    if len(eval_df):
        check_columns(eval_df, ["arm", "step", "eval/acc_greedy"], "eval_df")
    frames = [with_labels(f) for f in (metrics_df, eval_df)]
    if design is not None and design.get("factors"):
        frames = [with_base_levels(f, design) for f in frames]
        levels = levels or design_levels(design)
    m, e = (f[f["factor"].notna()] if len(f) else f for f in frames)
    keys = ["factor", "level", "arm_base"]
    rkeys = list(dict.fromkeys([*keys, *run_keys(m)]))
    change = m["routing/expert_change"]
    if "routing/expert_change_latent" in m:
        change = m["routing/expert_change_latent"].fillna(change)
    by_update = m.assign(_change=change, step=m["update"] if "update" in m else m["step"])
    per_run = last_frac_means(by_update, ["_change"], keys, last_frac).set_index(rkeys)
    per_run["ratio_var_p99"] = m.groupby(rkeys, dropna=False, sort=True)["ratio/token_var"].quantile(0.99)
    if len(e):
        per_run["acc_greedy"] = final_values(e, ["eval/acc_greedy"], keys).set_index(rkeys)["eval/acc_greedy"]
    else:
        per_run["acc_greedy"] = math.nan
    per_run = per_run.rename(columns={"_change": "expert_change"}).astype(float)
    grouped = per_run.groupby(keys, dropna=False, sort=True)
    table = grouped[["expert_change", "ratio_var_p99", "acc_greedy"]].mean()
    table.insert(0, "runs", grouped.size())
    table = table.reset_index()
    ref = table[table["arm_base"] == reference].set_index(["factor", "level"])["acc_greedy"]
    table["acc_gap"] = table["acc_greedy"] - [ref.get((f, lv), math.nan) for f, lv in zip(table["factor"],
                                                                                            table["level"])]
    order = {f: [str(v) for v in (levels or {}).get(f, [])] or level_order(table.loc[table["factor"] == f, "level"])
             for f in table["factor"].unique()}
    unknown = [(f, lv) for f, lv in zip(table["factor"], table["level"]) if lv not in order[f]]
    if unknown:
        raise ValueError(f"levels: {unknown[:3]} not listed; allowed: the levels of each factor, e.g. {order}")
    table["level_index"] = [order[f].index(lv) for f, lv in zip(table["factor"], table["level"])]
    factor_rank = {f: i for i, f in enumerate(dict.fromkeys([*(levels or {}), *sorted(order)]))}
    table = table.assign(_f=table["factor"].map(factor_rank)).sort_values(["_f", "level_index", "arm_base"])
    return table.drop(columns="_f").reset_index(drop=True)


def with_labels(frame: pd.DataFrame) -> pd.DataFrame:
    """arm_base, factor and level columns (load_runs adds them; hand-made frames may not have them)."""
    if not len(frame) or {"arm_base", "factor", "level"} <= set(frame.columns):
        return frame
    factor_level = frame["arm"].map(arm_factor_level)
    return frame.assign(arm_base=frame["arm"].map(base_arm), factor=factor_level.str[0], level=factor_level.str[1])


# ---------------------------------------------------------------- head to head (experiments/stabilizers.yaml)

# (column of arm_table, source metric, how each run reduces it) -- see docs/metrics.md, "head to head".
ARM_TABLE_METRICS = (("reward", "reward/mean", "last"), ("expert_change", "_change", "last"),
                     ("router_shift", "routing/router_shift", "last"), ("clip_active", "clip_frac/active", "last"),
                     ("clip_out", "clip_frac/out_of_range", "last"), ("ratio_var_p99", "ratio/token_var", "p99"))


def arm_table(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, *, last_frac: float = 0.25) -> pd.DataFrame:
    """One row per arm, each quantity the mean over its runs (seeds) with a 95% t-interval (q, q_lo, q_hi):
    acc_greedy (final evaluation); reward, expert_change (the router's own choice: routing/expert_change_latent
    where logged, else routing/expert_change), router_shift, clip_active, clip_out (means over the last
    ``last_frac`` of each run's steps); ratio_var_p99 (each run's 99th percentile of its minibatch
    ratio/token_var). Plus collapses, collapse_rate and its Wilson interval, collapse_step_median."""
    check_columns(metrics_df, ["arm", "step", "ratio/token_var", "routing/expert_change"], "metrics_df")
    change = metrics_df["routing/expert_change"]
    if "routing/expert_change_latent" in metrics_df:
        change = metrics_df["routing/expert_change_latent"].fillna(change)
    m = metrics_df.assign(_change=change)
    keys = list(dict.fromkeys(["arm", *run_keys(m)]))
    last = [src for _, src, how in ARM_TABLE_METRICS if how == "last"]
    per_run = last_frac_means(m, last, ["arm"], last_frac).set_index(keys)
    per_run["ratio/token_var"] = m.groupby(keys, dropna=False, sort=True)["ratio/token_var"].quantile(0.99)
    per_run = per_run.rename(columns={src: col for col, src, _ in ARM_TABLE_METRICS})
    cols = [col for col, _, _ in ARM_TABLE_METRICS]
    if len(eval_df):
        per_run["acc_greedy"] = final_values(eval_df, ["eval/acc_greedy"], ["arm"]).set_index(keys)["eval/acc_greedy"]
    else:
        per_run["acc_greedy"] = math.nan
    per_run = per_run.reset_index()
    table = group_ci(per_run, ["acc_greedy", *cols], ["arm"])
    table.insert(0, "runs", per_run.groupby("arm", sort=True).size())
    return table.join(collapse_stats(m, ["arm"]), how="left").reset_index()
