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

A contrast declared with ``endpoint: collapse`` compares collapse rates (its own table, ``COLLAPSE``). Per cold start,
each arm's rate is the share of its RL seeds whose run a collapse rule stopped, and the cold start's value is the
difference of the rates (or of the differences, for an interaction). The test is the exact sign-flip permutation test
over cold starts (stats.SignFlips): all 2^m sign flips of the m per-cold-start differences, two-sided p = the share
whose |sum| is at least the observed one, a zero difference flipping to itself. The estimate is the mean difference
over cold starts. With 5 cold starts or fewer no p reaches 0.05.

The sign-flip test sees only the spread of the per-cold-start differences, not how loosely k of n runs bound each
rate: where every cold start shows the same difference (no run collapses in either arm, the common case), its
inverted interval is that one point and its TOST passes at any margin. So the 95% interval is the hull (the union)
of two: the interval that inverts the sign-flip test (Hartigan's subset means under the shift model) and the score
interval of the arms' rates pooled over the cold starts both ran (Newcombe's hybrid score interval, method 10, from
each arm's Wilson interval; for an interaction the same construction over four rates, MOVER-Wilson), clipped to
[-1, 1] ([-2, 2] for an interaction). 0/16 against 0/16 runs gives about [-0.19, 0.19]. The hull may hold 0 while
the sign-flip p is below 0.05: the p takes the per-cold-start differences as given, the interval also counts the
binomial noise of k of n runs.

TOST at a declared margin: the larger of the sign-flip TOST p (the larger one-sided sign-flip p at -margin and
+margin) and the score interval's TOST p (the one-sided p's that invert it: the normal tail at which its end reaches
the margin). So TOST p < 0.05 exactly when the 90% hull lies inside (-margin, margin). Its primary rows join the Holm
family of the primary endpoint with the p of the declared hypothesis (the sign-flip p, or this TOST p).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from moe_lab.analysis.endpoints import format_p, load_comparison
from moe_lab.analysis.stats import (RateCombination, SignFlips, block_diffs, cold_start_level, combination_cells,
                                    conditional, holm, permutation_p, pooled_combination, t_half_width, tost_p,
                                    welch_diff_ci)
from moe_lab.launch.design import COLLAPSE, Contrast
from moe_lab.launch.spec import parse_experiment
from moe_lab.store.run_folder import as_results


TABLES = ("primary", "secondary", COLLAPSE)
"""the tables of declared contrasts: each contrast on the primary and the secondary endpoint, or on the collapse rate"""
FAMILY = ("primary", COLLAPSE)
"""the tables whose primary rows Holm adjusts together: the family fixed before the runs"""


# --------------------------------------------------------------------------- the declared contrasts


def _head(runs: pd.DataFrame, setting: str, c: Contrast) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """The columns every row shares, and the runs of the contrast's two sides."""
    weights = c.weights()
    plus = runs[runs["arm_base"].map(weights) > 0]  # the arm side: arm (and minus.vs in an interaction)
    neg = runs[runs["arm_base"].map(weights) < 0]
    arm, vs = c.sides()
    return {"setting": setting, "arm": arm, "vs": vs, "role": c.role, "margin": c.margin,
            "n": len(plus), "n_vs": len(neg), "collapsed": int(plus["collapsed"].sum()),
            "collapsed_vs": int(neg["collapsed"].sum())}, plus, neg


def _collapse_row(runs: pd.DataFrame, setting: str, c: Contrast) -> dict:
    row, _, _ = _head(runs, setting, c)
    weights = c.weights()
    both = runs[runs["arm_base"].isin(list(weights))]
    cells = combination_cells(both["collapsed"].astype(float), both["arm_base"], both["block"], weights)
    per_block = block_diffs(cells)  # per cold start: the weighted combination of the arms' collapse rates
    test = SignFlips(list(per_block.values()))
    # The same runs pooled over the cold starts kept, arm by arm: k of n collapsed, in declared order.
    score = RateCombination([(w, int(sum(p[i][1].sum() for p in cells.values())),
                              sum(len(p[i][1]) for p in cells.values())) for i, w in enumerate(weights.values())])
    widest = sum(w for w in weights.values() if w > 0)  # rates lie in [0, 1]: the combination within +-widest

    def hull(level: float) -> tuple[float, float]:
        (a, b), (x, y) = test.interval(level, (-widest, widest)), score.interval(level)
        return max(min(a, x), -widest), min(max(b, y), widest)

    (lo, hi), (lo90, hi90) = hull(0.95), hull(0.90)
    (row["signflip_lo"], row["signflip_hi"]), (row["score_lo"], row["score_hi"]) = (
        test.interval(0.95, (-widest, widest)), score.interval(0.95))
    row.update(diff=test.diff, lo=lo, hi=hi, p=test.p(), exact=test.exact, blocks=len(cells), lo90=lo90, hi90=hi90,
               tost_p=max(test.tost(c.margin), score.tost(c.margin)) if c.margin else math.nan,
               per_block={str(k): d for k, d in per_block.items()})
    return row


def _one(runs: pd.DataFrame, setting: str, c: Contrast, column: str) -> dict:
    weights = c.weights()
    row, plus, neg = _head(runs, setting, c)
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


def _table(per_run: pd.DataFrame, contrasts: Sequence[Contrast], column: str) -> pd.DataFrame:
    rows = []
    for setting, runs in per_run.groupby("setting", sort=False):
        arms = set(runs["arm_base"])
        rows += [_collapse_row(runs, setting, c) if column == COLLAPSE else _one(runs, setting, c, column)
                 for c in contrasts if set(c.weights()) <= arms]
    table = pd.DataFrame(rows)
    if not len(table):
        return table
    if column != COLLAPSE:
        half90 = t_half_width(table["se"], table["df"].astype(float), 0.95)
        table["lo90"], table["hi90"] = table["diff"] - half90, table["diff"] + half90
        table["tost_p"] = [tost_p(d, se, df, m) if m > 0 else math.nan for d, se, df, m in
                           zip(table["diff"], table["se"], table["df"], table["margin"].fillna(0))]
    table["hypothesis_p"] = np.where(table["margin"].notna(), table["tost_p"], table["p"])
    table["holm_p"] = math.nan
    return table


def declared_tables(per_run: pd.DataFrame, contrasts: Sequence[Contrast],
                    columns: Sequence[str] = TABLES) -> dict[str, pd.DataFrame]:
    """column -> its table of declared contrasts (``TABLES``; an empty frame where none is declared). Holm adjusts
    the primary rows of the primary endpoint and of the collapse rate together, whichever tables are asked for (the
    family is fixed before the runs); rows outside it keep a NaN ``holm_p``."""
    wanted = list(dict.fromkeys([*columns, *(FAMILY if set(columns) & set(FAMILY) else ())]))
    tables = {}
    for column in wanted:  # a table not asked for is computed for its primary rows only: their place in Holm
        on = [c for c in contrasts if (c.endpoint == COLLAPSE) == (column == COLLAPSE)
              and (column in columns or c.role == "primary")]
        tables[column] = _table(per_run, on, column)
    family = {column: (t, t["role"] == "primary") for column, t in tables.items() if column in FAMILY and len(t)}
    adjusted = iter(holm([p for t, rows in family.values() for p in t.loc[rows, "hypothesis_p"]]))
    joined = [column for column, (_, rows) in family.items() if rows.any()]
    for t, rows in family.values():
        t.loc[rows, "holm_p"] = [next(adjusted) for _ in range(int(rows.sum()))]
        t.attrs["holm_family"] = joined  # which tables' primary rows the Holm p counted (the headers say it)
    return {column: tables[column] for column in columns}


def declared_contrasts(per_run: pd.DataFrame, contrasts: Sequence[Contrast], column: str = "primary") -> pd.DataFrame:
    """One row per declared contrast and setting (both arms present) on ``column`` (``TABLES``). On an endpoint:
    the difference with its cold-start-level 95% interval, p and df (``diff, se, df, lo, hi, p``), the 90%
    interval and TOST p where a margin is declared, the p of the declared hypothesis, Holm-adjusted over the primary
    rows (``declared_tables``); the interval conditional on these cold starts (``cond_*``); the per-cold-start
    differences and the run-level Welch/permutation figures. On the collapse rate: ``diff, p, exact`` of the
    sign-flip test, ``lo, hi`` (``lo90, hi90``) the union of its 95% (90%) interval and the score interval,
    ``signflip_lo/hi, score_lo/hi`` the two 95% intervals, ``tost_p`` (the larger of the two methods'), the hypothesis
    and Holm p, the per-cold-start differences."""
    return declared_tables(per_run, contrasts, (column,))[column]


def load_declared_tables(results, per_run: pd.DataFrame | None = None,
                         columns: Sequence[str] = TABLES) -> dict[str, pd.DataFrame]:
    """The declared contrasts of a results folder (its experiment.yaml's ``contrasts:``), per column of
    ``columns``; {} when the file declares none. ``per_run``: the folder's endpoints when the caller has them
    (``load_comparison``), so the runs are not read twice."""
    contrasts = list(parse_experiment(as_results(results).experiment()).contrasts)
    if not contrasts:
        return {}
    if per_run is None:
        _, per_run, _, _ = load_comparison(results)
    return declared_tables(per_run, contrasts, columns)


def load_declared(results, column: str = "primary", per_run: pd.DataFrame | None = None) -> pd.DataFrame:
    """``load_declared_tables`` of one column; an empty frame when the file declares no contrasts."""
    return load_declared_tables(results, per_run, (column,)).get(column, pd.DataFrame())


def _signed(x: float, digits: int = 3) -> str:
    return f"{x:+.{digits}f}" if math.isfinite(x) else "n/a"


def _p(p: float) -> str:
    return format_p(p) if math.isfinite(p) else "n/a"


def _markdown(caption: str, columns: list[str], table: pd.DataFrame, cells) -> str:
    """A declared-contrasts table: its caption, then one markdown row per contrast; ``cells(r)`` gives a row's
    cells after the setting and the contrast, the per-cold-start differences going where ``columns`` names them."""
    lines = [caption, "", "| " + " | ".join(["setting", "contrast", *columns]) + " |",
             "|" + "---|" * (len(columns) + 2)]
    for r in table.itertuples():
        row = [r.setting, f"{r.arm} − {r.vs}", *cells(r)]
        if "per cold start" in columns:
            blocks = ", ".join(f"{k}: {_signed(v)}" for k, v in r.per_block.items())
            row.insert(2 + columns.index("per cold start"), blocks)
        lines.append("| " + " | ".join(map(str, row)) + " |")
    return "\n".join(lines)


def format_declared(table: pd.DataFrame, column: str = "primary") -> str:
    """The declared-contrasts table `moe-lab compare` prints after the pairwise ones."""
    if column == COLLAPSE:
        return format_collapse(table)
    family = ("primary endpoint only" if COLLAPSE not in table.attrs.get("holm_family", ()) else
              "primary endpoint only, counted with the primary contrasts of the collapse rate")
    caption = (f"declared contrasts on the {column} endpoint, the cold start as the unit: difference, its 95% interval "
               "over cold starts (t on the per-cold-start differences, m - 1 df; what a new cold start would show), "
               f"TOST where a margin is declared and Holm over the primary rows ({family}); beside it, "
               "labelled, the 95% interval conditional on these cold starts only (stratified Welch: run-to-run noise "
               "within them)")
    columns = ["role", "n", "cold starts", "difference, 95% over cold starts", "df", "p",
               "equivalence: margin, 90% interval, TOST p", "Holm p", "conditional on these cold starts: 95%, df, p",
               "per cold start", "run-level Welch 95%, permutation p", "collapsed"]
    return _markdown(caption, columns, table, lambda r: [
        r.role, f"{r.n} vs {r.n_vs}", str(r.blocks), f"{_signed(r.diff)} [{_signed(r.lo)}, {_signed(r.hi)}]",
        f"{r.df:.1f}", _p(r.p), _equivalence(r), _p(r.holm_p),
        f"[{_signed(r.cond_lo)}, {_signed(r.cond_hi)}], {r.cond_df:.1f}, {_p(r.cond_p)}",
        f"{_signed(r.welch_diff)} [{_signed(r.welch_lo)}, {_signed(r.welch_hi)}], {_p(r.perm_p)}",
        f"{r.collapsed}/{r.n} vs {r.collapsed_vs}/{r.n_vs}"])


def _equivalence(r) -> str:
    if not (isinstance(r.margin, float) and math.isfinite(r.margin)):
        return ""
    return f"±{r.margin:g}, [{_signed(r.lo90)}, {_signed(r.hi90)}], {_p(r.tost_p)}"


def format_collapse(table: pd.DataFrame) -> str:
    """The table of declared contrasts of the collapse rate."""
    caption = ("declared contrasts of the collapse rate, the cold start as the unit: per cold start, each arm's share "
               "of RL seeds whose run a collapse rule stopped; the mean over cold starts of the per-cold-start "
               "difference, the exact two-sided sign-flip p over cold starts; the 95% interval is the union of the one "
               "that inverts "
               "the sign-flip test (subset means) and Newcombe's hybrid score interval of the arms' rates pooled over "
               "the cold starts (Wilson per arm; MOVER-Wilson for an interaction), clipped to the range a rate "
               "difference can take; TOST where a margin is declared (the larger p of the two methods: below 0.05 "
               "exactly when the 90% union lies inside the margin) and Holm over the primary rows, counted with the "
               "primary contrasts of the primary endpoint")
    columns = ["role", "collapsed", "cold starts", "rate difference, 95% interval (sign-flip ∪ Newcombe)",
               "sign-flip 95%; Newcombe 95%", "sign-flip p",
               "equivalence: margin, 90% interval (sign-flip ∪ Newcombe), TOST p", "Holm p", "per cold start"]
    return _markdown(caption, columns, table, lambda r: [
        r.role, f"{r.collapsed}/{r.n} vs {r.collapsed_vs}/{r.n_vs}", str(r.blocks),
        f"{_signed(r.diff)} [{_signed(r.lo)}, {_signed(r.hi)}]",
        f"[{_signed(r.signflip_lo)}, {_signed(r.signflip_hi)}]; [{_signed(r.score_lo)}, {_signed(r.score_hi)}]",
        f"{_p(r.p)}{'' if r.exact else ' (MC)'}", _equivalence(r), _p(r.holm_p)])
