"""Declared contrasts of an experiment (``contrasts:``), stratified by cold start, with TOST and Holm.

Why a mixed model and not a two-level bootstrap: with three cold starts a bootstrap over cold starts has ten
distinct resamples and understates their spread by a factor (m-1)/m, so its intervals are too narrow exactly
where the question is whether a result carries over to a new cold start. The model, fitted per contrast to the
two arms' per-run endpoints y (one value per run):

    y = mu_arm + u_block + v_block,arm + e,   u ~ N(0, s2_b), v ~ N(0, s2_v), e ~ N(0, s2_e)

- ``u`` is the random intercept per cold start the analysis plan names: how good a checkpoint is. It cancels in
  a within-block contrast but not in an unbalanced one.
- ``v`` lets the arm difference itself vary from cold start to cold start: without it, three cold starts of
  ten runs each would count as thirty independent replications of one effect. When REML puts s2_v at 0, the
  model is the random-intercept model.
- Fitted by REML (variance ratios profiled, searched from several starts and on the boundary); the contrast's
  degrees of freedom by Satterthwaite's approximation with the REML information matrix (what lmerTest does). In
  a balanced design with s2_v > 0 this is exactly the one-sample t-test of the per-cold-start differences (m-1
  degrees of freedom; tested), so three cold starts give 2 degrees of freedom: wide intervals, on purpose.

TOST (two one-sided tests) of |arm - vs| < margin uses the same estimate, standard error and degrees of
freedom; its p is the larger one-sided p, and it is below 0.05 exactly when the 90% interval lies inside
(-margin, margin). Holm's step-down adjustment runs over the primary contrasts of every setting together,
each entering with the p of its declared hypothesis (the difference test, or TOST where a margin is declared).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import optimize, stats

from moe_lab.analysis.endpoints import format_p, load_comparison, permutation_p
from moe_lab.analysis.replay_map import welch_diff_ci, welch_diff_se
from moe_lab.config import load_yaml
from moe_lab.launch.design import Contrast, contrasts_spec

ZERO = 1e-9  # a variance ratio below this is on the boundary: the component is left out of Satterthwaite


def _onehot(labels: np.ndarray) -> np.ndarray:
    _, inv = np.unique(labels, return_inverse=True)
    return np.eye(int(inv.max()) + 1)[inv]


def _reml_nll(gammas: np.ndarray, y: np.ndarray, X: np.ndarray, G: list[np.ndarray]) -> float:
    """REML negative log-likelihood with s2_e profiled out, at variance ratios ``gammas`` (one per G_i = Z_i Z_i')."""
    n, p = X.shape
    V = np.eye(n) + sum(g * Gi for g, Gi in zip(gammas, G))
    L = np.linalg.cholesky(V)
    Xs, ys = np.linalg.solve(L, X), np.linalg.solve(L, y)
    XtViX = Xs.T @ Xs
    beta = np.linalg.solve(XtViX, Xs.T @ ys)
    rss = float(np.sum((ys - Xs @ beta) ** 2))
    logdet = 2 * np.log(np.diag(L)).sum() + np.linalg.slogdet(XtViX)[1]
    return 0.5 * ((n - p) * math.log(max(rss, 1e-300) / (n - p)) + logdet)


def _fit_ratios(y: np.ndarray, X: np.ndarray, G: list[np.ndarray]) -> np.ndarray:
    """REML variance ratios >= 0: Nelder-Mead on sqrt-ratios from several starts, and every boundary face."""
    best_val, best = math.inf, np.zeros(len(G))
    for free in itertools.product([False, True], repeat=len(G)):
        idx = [i for i, f in enumerate(free) if f]

        def nll(t, idx=idx):
            g = np.zeros(len(G))
            g[idx] = np.square(t)
            return _reml_nll(g, y, X, G)

        starts = [np.full(len(idx), s) for s in (0.3, 1.0, 3.0)] if idx else [np.zeros(0)]
        for t0 in starts:
            if idx:
                res = optimize.minimize(nll, t0, method="Nelder-Mead",
                                        options={"xatol": 1e-8, "fatol": 1e-12, "maxiter": 4000})
                val, t = float(res.fun), res.x
            else:
                val, t = nll(t0), t0
            if val < best_val - 1e-12:
                best_val, best = val, np.zeros(len(G))
                best[idx] = np.square(t)
    return best


def mixed_contrast(y: Sequence[float], is_arm: Sequence[bool], block: Sequence) -> dict:
    """The arm - vs difference of the model above: diff, se, df, the 95% interval, two-sided p, the variance
    components (s2_e, s2_b, s2_v) and the number of blocks. Needs both arms in at least two blocks."""
    y, a, b = np.asarray(y, float), np.asarray(is_arm, bool), np.asarray(block)
    X = np.column_stack([a, ~a]).astype(float)
    cells = np.array([f"{bb}|{aa}" for bb, aa in zip(b, a)])
    Z = [_onehot(b), _onehot(cells)]
    G = [z @ z.T for z in Z]
    gam = _fit_ratios(y, X, G)
    V = np.eye(len(y)) + sum(g * Gi for g, Gi in zip(gam, G))
    Vi = np.linalg.inv(V)
    M = np.linalg.inv(X.T @ Vi @ X)
    beta = M @ X.T @ Vi @ y
    s2 = float((y - X @ beta) @ Vi @ (y - X @ beta)) / (len(y) - 2)
    c = np.array([1.0, -1.0])
    var = s2 * float(c @ M @ c)
    df = _satterthwaite(s2 * V, X, [np.eye(len(y))] + [Gi for g, Gi in zip(gam, G) if g > ZERO], c)
    diff, se = float(c @ beta), math.sqrt(var)
    half = float(stats.t.ppf(0.975, df)) * se
    p = float(2 * stats.t.sf(abs(diff) / se, df)) if se > 0 else math.nan
    return {"diff": diff, "se": se, "df": df, "lo": diff - half, "hi": diff + half, "p": p,
            "s2_e": s2, "s2_b": s2 * gam[0], "s2_v": s2 * gam[1], "blocks": len(np.unique(b))}


def _satterthwaite(V: np.ndarray, X: np.ndarray, G: list[np.ndarray], c: np.ndarray) -> float:
    """df = 2 (c'Phi c)^2 / (g' Cov(psi) g): g the gradient of c'Phi c in the free variance components psi,
    Cov(psi) the inverse REML information 1/2 tr(P G_i P G_j)."""
    Vi = np.linalg.inv(V)
    M = np.linalg.inv(X.T @ Vi @ X)
    P = Vi - Vi @ X @ M @ X.T @ Vi
    u = Vi @ X @ M @ c  # d(c'Mc)/d psi_i = u' G_i u
    grad = np.array([u @ Gi @ u for Gi in G])
    info = np.array([[0.5 * np.trace(P @ Gi @ P @ Gj) for Gj in G] for Gi in G])
    denom = float(grad @ np.linalg.pinv(info) @ grad)
    return 2 * float(c @ M @ c) ** 2 / denom if denom > 0 else math.inf


def tost_p(diff: float, se: float, df: float, margin: float) -> float:
    """p of H0: |difference| >= margin (the larger of the two one-sided p's)."""
    if not se > 0:
        return math.nan
    lower = stats.t.sf((diff + margin) / se, df)  # H0: diff <= -margin
    upper = stats.t.cdf((diff - margin) / se, df)  # H0: diff >= +margin
    return float(max(lower, upper))


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (NaN stays NaN and is not counted)."""
    ps = np.asarray(ps, float)
    ok = np.flatnonzero(np.isfinite(ps))
    out = np.full(len(ps), math.nan)
    order = ok[np.argsort(ps[ok], kind="stable")]
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * ps[i]))
        out[i] = running
    return out.tolist()


# --------------------------------------------------------------------------- the declared contrasts


def _one(runs: pd.DataFrame, setting: str, c: Contrast, column: str) -> dict:
    x, y = runs[runs["arm_base"] == c.arm], runs[runs["arm_base"] == c.vs]
    row = {"setting": setting, "arm": c.arm, "vs": c.vs, "role": c.role, "margin": c.margin,
           "n": len(x), "n_vs": len(y), "collapsed": int(x["collapsed"].sum()),
           "collapsed_vs": int(y["collapsed"].sum())}
    both = pd.concat([x, y])
    both = both[np.isfinite(both[column].astype(float))]
    common = set(x["block"]) & set(y["block"])
    if len(common) >= 2:
        fit = mixed_contrast(both[column], both["arm_base"] == c.arm, both["block"])
        row.update(model="mixed", **fit)
    else:  # one cold start: the runs are the replications (Welch), as in every older experiment
        diff, se, df = welch_diff_se(x[column].tolist(), y[column].tolist())
        half = float(stats.t.ppf(0.975, df)) * se
        row.update(model="welch", diff=diff, lo=diff - half, hi=diff + half, se=se, df=df, blocks=len(common),
                   p=float(2 * stats.t.sf(abs(diff) / se, df)) if se > 0 else math.nan)
    per_block = both.groupby("block").apply(
        lambda g: g.loc[g["arm_base"] == c.arm, column].mean() - g.loc[g["arm_base"] == c.vs, column].mean(),
        include_groups=False)
    row["per_block"] = {str(k): float(v) for k, v in per_block.items()}
    row["welch_diff"], row["welch_lo"], row["welch_hi"] = welch_diff_ci(x[column].tolist(), y[column].tolist(),
                                                                        floor_dof=False)
    row["perm_p"] = permutation_p(x[column].dropna(), y[column].dropna())[0]
    return row


def declared_contrasts(per_run: pd.DataFrame, contrasts: Sequence[Contrast], column: str = "primary") -> pd.DataFrame:
    """One row per declared contrast and setting (both arms present): the stratified difference with its 95%
    interval, p and degrees of freedom, the 90% interval and TOST p where a margin is declared, the p of the
    declared hypothesis, Holm-adjusted over the primary rows, and the run-level Welch/permutation figures."""
    rows = []
    for setting, runs in per_run.groupby("setting", sort=False):
        arms = set(runs["arm_base"])
        rows += [_one(runs, setting, c, column) for c in contrasts if {c.arm, c.vs} <= arms]
    table = pd.DataFrame(rows)
    if not len(table):
        return table
    half90 = stats.t.ppf(0.95, table["df"].astype(float)) * table["se"]  # df = inf gives the normal quantile
    table["lo90"], table["hi90"] = table["diff"] - half90, table["diff"] + half90
    table["tost_p"] = [tost_p(d, se, df, m) if m > 0 else math.nan
                       for d, se, df, m in zip(table["diff"], table["se"], table["df"], table["margin"].fillna(0))]
    table["hypothesis_p"] = np.where(table["margin"].notna(), table["tost_p"], table["p"])
    primary = table["role"] == "primary"
    table["holm_p"] = math.nan
    table.loc[primary, "holm_p"] = holm(table.loc[primary, "hypothesis_p"].tolist())
    return table


def load_declared(results: str, column: str = "primary", per_run: pd.DataFrame | None = None) -> pd.DataFrame:
    """The declared contrasts of a results folder (its experiment.yaml's ``contrasts:``), on ``column``; an
    empty frame when the file declares none. ``per_run``: the folder's endpoints when the caller has them
    (``load_comparison``), so the runs are not read twice."""
    exp_file = Path(results) / "experiment.yaml"
    contrasts = contrasts_spec(load_yaml(str(exp_file))) if exp_file.is_file() else []
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
    lines = [f"declared contrasts on the {column} endpoint, stratified by cold start (linear mixed model: random "
             "intercept per cold start and per cold start x arm, REML, Satterthwaite df; one cold start: Welch); "
             "Holm over the primary rows; TOST where a margin is declared",
             "", "| setting | contrast | role | n | cold starts | difference (95%) | df | p | equivalence: margin, "
             "90% interval, TOST p | Holm p | per cold start | run-level Welch 95%, permutation p | collapsed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table.itertuples():
        eq = (f"±{r.margin:g}, [{_signed(r.lo90)}, {_signed(r.hi90)}], {_p(r.tost_p)}"
              if isinstance(r.margin, float) and math.isfinite(r.margin) else "")
        blocks = ", ".join(f"{k}: {_signed(v)}" for k, v in r.per_block.items())
        lines.append(
            f"| {r.setting} | {r.arm} − {r.vs} | {r.role} | {r.n} vs {r.n_vs} | {r.blocks} | "
            f"{_signed(r.diff)} [{_signed(r.lo)}, {_signed(r.hi)}] | {r.df:.1f} | {_p(r.p)} | {eq} | "
            f"{_p(r.holm_p)} | {blocks} | {_signed(r.welch_diff)} [{_signed(r.welch_lo)}, {_signed(r.welch_hi)}], "
            f"{_p(r.perm_p)} | {r.collapsed}/{r.n} vs {r.collapsed_vs}/{r.n_vs} |")
    return "\n".join(lines)
