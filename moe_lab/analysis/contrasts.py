"""Declared contrasts of an experiment (``contrasts:``), by cold start, with TOST and Holm.

An interaction ((A - B) - (C - D), ``minus:``) is one more contrast of the same kind: its per-cold-start value is the
difference of the two differences within that cold start, and the same two intervals, TOST and Holm apply.

Each contrast is taken within each setting and reported twice (moe_lab/analysis/stats.py says why): at the cold-start
level, the unit of generalisation (the t over the per-cold-start differences, m - 1 df), which TOST and Holm use;
and conditional on these cold starts (a stratified Welch interval), labelled so and printed beside it. An
experiment without ``blocks:`` has one cold start: no cold-start-level interval exists, and the conditional one
is Welch's.

TOST (two one-sided tests) of |arm - vs| < margin uses the cold-start-level estimate, standard error and degrees
of freedom; its p is the larger one-sided p, and it is below 0.05 exactly when the 90% interval lies inside
(-margin, margin). Holm's step-down adjustment runs over the primary contrasts of every setting together, each
entering with the p of its declared hypothesis (the difference test, or TOST where a margin is declared).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from moe_lab.analysis.endpoints import format_p, load_comparison
from moe_lab.analysis.stats import (block_diffs, cold_start_level, combination_cells, conditional, holm,
                                    permutation_p, pooled_combination, t_half_width, tost_p, welch_diff_ci)
from moe_lab.launch.design import Contrast
from moe_lab.launch.spec import parse_experiment
from moe_lab.store.run_folder import as_results


# --------------------------------------------------------------------------- the declared contrasts


def _one(runs: pd.DataFrame, setting: str, c: Contrast, column: str) -> dict:
    weights = c.weights()
    plus = runs[runs["arm_base"].map(weights) > 0]  # the arm side: arm (and minus.vs in an interaction)
    neg = runs[runs["arm_base"].map(weights) < 0]
    arm, vs = c.sides()
    row = {"setting": setting, "arm": arm, "vs": vs, "role": c.role, "margin": c.margin,
           "n": len(plus), "n_vs": len(neg), "collapsed": int(plus["collapsed"].sum()),
           "collapsed_vs": int(neg["collapsed"].sum())}
    both = runs[runs["arm_base"].isin(list(weights))]
    cells = combination_cells(both[column], both["arm_base"], both["block"], weights)
    level, cond = cold_start_level(cells), conditional(cells)
    row.update(diff=level.diff, se=level.se, df=level.df, lo=level.lo, hi=level.hi, p=level.p, blocks=len(cells),
               cond_se=cond.se, cond_df=cond.df, cond_lo=cond.lo, cond_hi=cond.hi, cond_p=cond.p)
    row["per_block"] = {str(k): d for k, d in block_diffs(cells).items()}
    if c.minus:  # no two-sample permutation exists for a difference of differences; Welch pooled over cold starts
        groups = [(w, both.loc[both["arm_base"] == a, column].tolist()) for a, w in weights.items()]
        row["welch_diff"], row["welch_lo"], row["welch_hi"] = pooled_combination(groups)
        row["perm_p"] = math.nan
        return row
    row["welch_diff"], row["welch_lo"], row["welch_hi"] = welch_diff_ci(plus[column].tolist(), neg[column].tolist(),
                                                                        floor_dof=False)
    row["perm_p"] = permutation_p(plus[column].dropna(), neg[column].dropna())[0]
    return row


def declared_contrasts(per_run: pd.DataFrame, contrasts: Sequence[Contrast], column: str = "primary") -> pd.DataFrame:
    """One row per declared contrast and setting (both arms present): the difference with its cold-start-level
    95% interval, p and df (``diff, se, df, lo, hi, p``), the 90% interval and TOST p where a margin is declared,
    the p of the declared hypothesis, Holm-adjusted over the primary rows (on the primary endpoint only: the
    family fixed before the runs; n/a on another endpoint); the interval conditional on these cold
    starts (``cond_*``); the per-cold-start differences and the run-level Welch/permutation figures."""
    rows = []
    for setting, runs in per_run.groupby("setting", sort=False):
        arms = set(runs["arm_base"])
        rows += [_one(runs, setting, c, column) for c in contrasts if set(c.weights()) <= arms]
    table = pd.DataFrame(rows)
    if not len(table):
        return table
    half90 = t_half_width(table["se"], table["df"].astype(float), 0.95)
    table["lo90"], table["hi90"] = table["diff"] - half90, table["diff"] + half90
    table["tost_p"] = [tost_p(d, se, df, m) if m > 0 else math.nan
                       for d, se, df, m in zip(table["diff"], table["se"], table["df"], table["margin"].fillna(0))]
    table["hypothesis_p"] = np.where(table["margin"].notna(), table["tost_p"], table["p"])
    primary = table["role"] == "primary"
    table["holm_p"] = math.nan
    if column == "primary":  # the family Holm controls: the primary contrasts on the primary endpoint, no other
        table.loc[primary, "holm_p"] = holm(table.loc[primary, "hypothesis_p"].tolist())
    return table


def load_declared(results, column: str = "primary", per_run: pd.DataFrame | None = None) -> pd.DataFrame:
    """The declared contrasts of a results folder (its experiment.yaml's ``contrasts:``), on ``column``; an
    empty frame when the file declares none. ``per_run``: the folder's endpoints when the caller has them
    (``load_comparison``), so the runs are not read twice."""
    contrasts = list(parse_experiment(as_results(results).experiment()).contrasts)
    if not contrasts:
        return pd.DataFrame()
    if per_run is None:
        _, per_run, _, _ = load_comparison(results)
    return declared_contrasts(per_run, contrasts, column)


def _signed(x: float, digits: int = 3) -> str:
    return f"{x:+.{digits}f}" if math.isfinite(x) else "n/a"


def _p(p: float) -> str:
    return format_p(p) if math.isfinite(p) else "n/a"


def format_declared(table: pd.DataFrame, column: str = "primary") -> str:
    """The declared-contrasts table `moe-lab compare` prints after the pairwise ones."""
    lines = [f"declared contrasts on the {column} endpoint, the cold start as the unit: difference, its 95% interval "
             "over cold starts (t on the per-cold-start differences, m - 1 df; what a new cold start would show), "
             "TOST where a margin is declared and Holm over the primary rows (primary endpoint only); beside it, "
             "labelled, the 95% interval conditional on these cold starts only (stratified Welch: run-to-run noise "
             "within them)",
             "", "| setting | contrast | role | n | cold starts | difference, 95% over cold starts | df | p | "
             "equivalence: margin, 90% interval, TOST p | Holm p | conditional on these cold starts: 95%, df, p | "
             "per cold start | run-level Welch 95%, permutation p | collapsed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        eq = (f"±{r.margin:g}, [{_signed(r.lo90)}, {_signed(r.hi90)}], {_p(r.tost_p)}"
              if isinstance(r.margin, float) and math.isfinite(r.margin) else "")
        blocks = ", ".join(f"{k}: {_signed(v)}" for k, v in r.per_block.items())
        lines.append(
            f"| {r.setting} | {r.arm} − {r.vs} | {r.role} | {r.n} vs {r.n_vs} | {r.blocks} | "
            f"{_signed(r.diff)} [{_signed(r.lo)}, {_signed(r.hi)}] | {r.df:.1f} | {_p(r.p)} | {eq} | "
            f"{_p(r.holm_p)} | [{_signed(r.cond_lo)}, {_signed(r.cond_hi)}], {r.cond_df:.1f}, {_p(r.cond_p)} | "
            f"{blocks} | {_signed(r.welch_diff)} [{_signed(r.welch_lo)}, {_signed(r.welch_hi)}], "
            f"{_p(r.perm_p)} | {r.collapsed}/{r.n} vs {r.collapsed_vs}/{r.n_vs} |")
    return "\n".join(lines)
