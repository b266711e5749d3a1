"""Every statistic moe_lab reports, in one module (numpy/scipy/pandas only): t-intervals of a mean over runs
(per group and step, per arm), Wilson intervals of collapse rates, the Kaplan-Meier survival of runs, and the
statistics of `moe-lab compare`: a contrast between two arms run from the same cold starts (blocks), the
run-level Welch interval and permutation p, TOST and Holm, and for a contrast of collapse rates the exact
sign-flip test over cold starts (``SignFlips``) and the score interval of the pooled rates (``RateCombination``).
Formulas in docs/metrics.md and docs/guide.md.

Two intervals answer two questions, and `moe-lab compare` prints both, side by side, never one in place of the
other (no model selection switches between them):

- **Cold-start level** (the unit of generalisation): the difference of the arms' means within each cold start,
  d_1..d_m, and the one-sample t on them: mean(d), sd(d)/sqrt(m), m - 1 degrees of freedom. It covers what a
  NEW cold start would show: the between-cold-start spread of the effect is in its standard error. With three
  cold starts it has 2 degrees of freedom, so its intervals are wide on purpose.
- **Conditional on these cold starts**: the same point estimate (the equal-weight mean of the d_j), with only
  the run-to-run noise inside each (cold start, arm) cell in its standard error (a stratified Welch interval:
  se^2 = sum_j (s2_aj/n_aj + s2_bj/n_bj) / m^2, Welch-Satterthwaite df). It says what more RL seeds from these
  same checkpoints would show, nothing about another checkpoint. With one cold start it is Welch's interval.

Why not a REML mixed model (random intercept per cold start and per cold start x arm): its df jump
between the cold-start level (m - 1) and the pooled within-cold-start count (about N - m) whenever REML puts the
cold start x arm variance at 0, and simulated under the null its nominal 95% interval then covers 75-93%.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import optimize, stats

EXACT_LIMIT = 2_000_000  # permutation splits enumerated exactly (10 vs 10 seeds: 184,756)
MC_SAMPLES = 200_000
MC_SEED = 0

# Two-sided 95% Student-t quantiles t_{0.975, df} (any statistics table; tests re-derive each entry by
# integrating the t density). Between table rows we interpolate linearly in 1/df, the standard practice,
# which is exact to ~1e-4 here; df -> inf is the normal quantile.
T975 = {1: 12.706204736, 2: 4.302652730, 3: 3.182446305, 4: 2.776445105, 5: 2.570581836, 6: 2.446911851,
        7: 2.364624252, 8: 2.306004135, 9: 2.262157163, 10: 2.228138852, 11: 2.200985160, 12: 2.178812830,
        13: 2.160368656, 14: 2.144786688, 15: 2.131449546, 16: 2.119905299, 17: 2.109815578, 18: 2.100922040,
        19: 2.093024054, 20: 2.085963447, 21: 2.079613845, 22: 2.073873068, 23: 2.068657610, 24: 2.063898562,
        25: 2.059538553, 26: 2.055529439, 27: 2.051830516, 28: 2.048407142, 29: 2.045229642, 30: 2.042272456,
        40: 2.021075390, 60: 2.000297822, 120: 1.979930405}
Z975 = 1.959963985


# --------------------------------------------------------------------------- a mean over runs


def t_quantile_975(df: float) -> float:
    """t_{0.975, df}: the half-width factor of a 95% interval of a mean from df + 1 values."""
    if not df >= 1:
        return math.nan
    df = float(df)
    if df.is_integer() and int(df) in T975:
        return T975[int(df)]
    rows = sorted(T975) + [math.inf]
    hi = next(r for r in rows if r > df)
    lo = max(r for r in rows if r < df)
    t_lo, t_hi = T975[lo], T975.get(hi, Z975)
    w = (1 / lo - 1 / df) / (1 / lo - (0 if math.isinf(hi) else 1 / hi))
    return t_lo + w * (t_hi - t_lo)


def mean_ci(values: Iterable[float]) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean and its 95% t-interval over the finite values (NaN width for one value)."""
    x = np.asarray([v for v in values if v is not None], dtype=float)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if x.size == 1:
        return mean, math.nan, math.nan
    half = t_quantile_975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return mean, mean - half, mean + half


def ratio_ci(num: Sequence[float], den: Sequence[float], paired: bool) -> tuple[float, float, float]:
    """(R, lo, hi): the ratio of means R = mean(num) / mean(den) with a 95% delta-method t-interval.

    paired (the same units measured twice, e.g. k3 with and without replay on the same prompts): se from the
    per-unit residuals num - R den, df = n - 1; unpaired (two independent samples): se^2 = (s_num^2 / n_num +
    R^2 s_den^2 / n_den) / mean(den)^2 with the smaller sample's df. NaN bounds with fewer than 2 units or a
    zero denominator mean."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if paired:
        keep = np.isfinite(a) & np.isfinite(b)
        a, b = a[keep], b[keep]
    else:
        a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if a.size == 0 or b.size == 0 or b.mean() == 0:
        return math.nan, math.nan, math.nan
    ratio = float(a.mean() / b.mean())
    if min(a.size, b.size) < 2:
        return ratio, math.nan, math.nan
    if paired:
        se, df = float((a - ratio * b).std(ddof=1)) / math.sqrt(a.size) / abs(b.mean()), a.size - 1
    else:
        var = a.var(ddof=1) / a.size + ratio ** 2 * b.var(ddof=1) / b.size
        se, df = math.sqrt(var) / abs(b.mean()), min(a.size, b.size) - 1
    half = t_quantile_975(df) * se
    return ratio, ratio - half, ratio + half


def ols_slope_ci(x: Sequence[float], y: Sequence[float]) -> tuple[float, float, float]:
    """(slope, lo, hi): the least-squares slope of y on x with its 95% t-interval (se = sqrt(SSE / (n - 2) /
    Sxx), df = n - 2); NaN bounds with fewer than 3 finite points, NaN throughout when x does not vary."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    sxx = float(((a - a.mean()) ** 2).sum()) if a.size else 0.0
    if sxx == 0:
        return math.nan, math.nan, math.nan
    slope = float(((a - a.mean()) * (b - b.mean())).sum() / sxx)
    if a.size < 3:
        return slope, math.nan, math.nan
    resid = b - b.mean() - slope * (a - a.mean())
    half = t_quantile_975(a.size - 2) * math.sqrt(float((resid ** 2).sum()) / (a.size - 2) / sxx)
    return slope, slope - half, slope + half


def ci_columns(grouped: pd.core.groupby.SeriesGroupBy) -> pd.DataFrame:
    """Vectorised mean_ci over groups: columns mean, lo, hi, n."""
    out = grouped.agg(["mean", "std", "count"])
    t = out["count"].map(lambda n: t_quantile_975(n - 1))
    half = t * out["std"] / np.sqrt(out["count"])
    return pd.DataFrame({"mean": out["mean"], "lo": out["mean"] - half, "hi": out["mean"] + half,
                         "n": out["count"]})


def group_ci(per_run: pd.DataFrame, cols: Sequence[str], by: list[str]) -> pd.DataFrame:
    """Per group of ``by``: each column's mean over the group's rows (runs) with its 95% t-interval, as
    columns col, col_lo, col_hi."""
    parts = []
    for col in cols:
        ci = ci_columns(per_run.groupby(by, dropna=False, sort=True)[col])
        parts.append(ci[["mean", "lo", "hi"]].set_axis([col, f"{col}_lo", f"{col}_hi"], axis=1))
    return pd.concat(parts, axis=1) if parts else pd.DataFrame()


# --------------------------------------------------------------------------- collapses: rates and survival


def wilson_interval(k: int, n: int, z: float = Z975) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n (95% by default). Unlike the normal (Wald) interval it
    stays inside [0, 1] and has a non-zero width at k = 0 or k = n, which is where collapse rates over a
    handful of seeds live. (NaN, NaN) for n = 0."""
    if n <= 0:
        return math.nan, math.nan
    if not 0 <= k <= n:
        raise ValueError(f"k={k!r}: allowed 0 <= k <= n={n}")
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At k = 0 (k = n) the bound is exactly 0 (1) analytically; rounding would leave ~1e-17.
    return (0.0 if k == 0 else centre - half), (1.0 if k == n else centre + half)


def kaplan_meier(times: np.ndarray, events: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, ...]:
    """(survival, at_risk, died) at each of ``steps``: a unit with time t is at risk at every step <= t (a
    censored unit is still at risk at its censoring step, the convention when a censoring and an event tie);
    S *= 1 - d_t / n_t at each step."""
    at_risk = (times[None, :] >= steps[:, None]).sum(axis=1)
    died = ((times[None, :] == steps[:, None]) & events[None, :]).sum(axis=1)
    survival = np.cumprod(1.0 - np.divide(died, at_risk, out=np.zeros(len(steps)), where=at_risk > 0))
    return survival, at_risk, died


# --------------------------------------------------------------------------- a contrast by cold start


@dataclass(frozen=True)
class Interval:
    """A difference with its standard error, degrees of freedom, 95% interval and two-sided p."""
    diff: float
    se: float
    df: float
    lo: float
    hi: float
    p: float

    @classmethod
    def from_t(cls, diff: float, se: float, df: float) -> "Interval":
        if not (math.isfinite(se) and df > 0):
            return cls(diff, se, df, math.nan, math.nan, math.nan)
        if se == 0:
            return cls(diff, 0.0, df, diff, diff, 0.0 if diff != 0 else 1.0)
        half = float(stats.t.ppf(0.975, df)) * se  # df = inf gives the normal quantile
        return cls(diff, se, df, diff - half, diff + half, float(2 * stats.t.sf(abs(diff) / se, df)))


def _finite(values: Sequence[float]) -> np.ndarray:
    a = np.asarray(values, float)
    return a[np.isfinite(a)]


Cells = dict
"""block -> ((weight, the group's finite values), ...): one group per arm, in declared order. A difference of two
arms has weights (+1, -1); an interaction (a difference of differences) has four groups, (+1, -1, -1, +1)."""


def combination_cells(y: Sequence[float], group: Sequence, block: Sequence, weights: dict) -> Cells:
    """Per block with a finite value in every weighted group: the groups of ``weights`` (label -> weight, in
    order), blocks in sorted order. A block missing any group is left out: its combination is undefined."""
    y, g, b = np.asarray(y, float), np.asarray(group), np.asarray(block)
    cells = {}
    for key in sorted(set(b.tolist()), key=str):
        parts = tuple((float(w), _finite(y[(b == key) & (g == label)])) for label, w in weights.items())
        if all(len(v) for _, v in parts):
            cells[key] = parts
    return cells


def block_cells(y: Sequence[float], is_arm: Sequence[bool], block: Sequence) -> Cells:
    """Per block with a finite value in both arms: the arm's values (weight +1) and the other's (weight -1)."""
    return combination_cells(y, np.asarray(is_arm, bool), block, {True: 1.0, False: -1.0})


def _combination(parts) -> float:
    # Summed in declared order from 0.0: with weights +1, -1 this is bit for bit mean(arm) - mean(vs).
    total = 0.0
    for w, v in parts:
        total += w * float(v.mean())
    return total


def block_diffs(cells: Cells) -> dict:
    """block -> the weighted combination of the groups' means within it (mean(arm) - mean(vs) for two arms)."""
    return {k: _combination(parts) for k, parts in cells.items()}


def cold_start_level(cells: Cells) -> Interval:
    """The one-sample t of the per-cold-start differences (m - 1 df); NaN bounds with fewer than 2 cold starts."""
    d = np.array(list(block_diffs(cells).values()))
    if len(d) < 2:
        return Interval.from_t(float(d.mean()) if len(d) else math.nan, math.nan, math.nan)
    return Interval.from_t(float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))), len(d) - 1)


def conditional(cells: Cells) -> Interval:
    """The stratified Welch interval: conditional on these cold starts (needs >= 2 runs in every cell):
    se^2 = sum over blocks and groups of w^2 s^2 / n / m^2, Welch-Satterthwaite df."""
    m = len(cells)
    if not m:
        return Interval.from_t(math.nan, math.nan, math.nan)
    diff = float(np.mean(list(block_diffs(cells).values())))
    groups = [(w, g) for parts in cells.values() for w, g in parts]
    if min(len(g) for _, g in groups) < 2:
        return Interval.from_t(diff, math.nan, math.nan)
    var = np.array([w * w * g.var(ddof=1) / len(g) / m ** 2 for w, g in groups])
    dof = np.array([len(g) - 1 for _, g in groups], float)
    total = float(var.sum())
    df = math.inf if total == 0 else total ** 2 / float(np.sum(var ** 2 / dof))
    return Interval.from_t(diff, math.sqrt(total), df)


def pooled_combination(groups: Sequence[tuple[float, Sequence[float]]]) -> tuple[float, float, float]:
    """(sum w mean(g), lo, hi) over runs pooled across cold starts: the run-level Welch interval of a weighted
    combination of independent groups (se^2 = sum w^2 s^2 / n, Welch-Satterthwaite df); NaN bounds when a group
    has fewer than 2 finite values. For an interaction it ignores the cold starts, as the two-arm Welch does."""
    parts = [(float(w), _finite(g)) for w, g in groups]
    if not all(len(v) for _, v in parts):
        return math.nan, math.nan, math.nan
    diff = _combination(parts)
    if min(len(v) for _, v in parts) < 2:
        return diff, math.nan, math.nan
    var = np.array([w * w * v.var(ddof=1) / len(v) for w, v in parts])
    total = float(var.sum())
    if total == 0:
        return diff, diff, diff
    df = total ** 2 / float(np.sum(var ** 2 / np.array([len(v) - 1 for _, v in parts], float)))
    iv = Interval.from_t(diff, math.sqrt(total), df)
    return diff, iv.lo, iv.hi


class SignFlips:
    """The sign-flip test of the mean of per-cold-start differences d_1..d_m (of collapse rates), exact over all
    2^m sign vectors (past EXACT_LIMIT: MC_SAMPLES random ones, fixed generator, the observed one counted once
    more). With no difference each d_j is symmetric about 0 (arms exchangeable within a cold start): the two-sided
    p is the share of sign vectors with |sum s_j d_j| >= |sum d_j| (ties within 1e-9; a zero flips to itself).
    The interval inverts the test under the shift model (d_j = mean difference + noise symmetric about 0): flipping
    a subset S of d - delta keeps the sum as large exactly when mean_S(d) <= delta, so the bounds are order
    statistics of the 2^m - 1 subset means (Hartigan 1969; no grid), clipped to the values the difference can
    take. p <= alpha exactly when the 1 - alpha interval excludes 0; TOST is the larger one-sided p at -+margin."""

    def __init__(self, diffs: Sequence[float]):
        d = _finite(diffs)
        self.m, self.diff, self.exact = len(d), float(d.mean()) if len(d) else math.nan, 2 ** len(d) <= EXACT_LIMIT
        if self.exact:
            sums, sizes = np.zeros(1), np.zeros(1)
            for x in d:  # every subset: those without x, then the same with x
                sums, sizes = np.r_[sums, sums + x], np.r_[sizes, sizes + 1]
        else:
            picks = np.random.default_rng(MC_SEED).random((MC_SAMPLES, len(d))) < 0.5
            sums, sizes = picks @ d, picks.sum(axis=1).astype(float)
        self._observed = 0 if self.exact else 1  # counted beside the random draws
        self._total, self._sums, self._count = float(d.sum()), sums, len(sums) + self._observed
        self._means = np.sort(sums[sizes > 0] / sizes[sizes > 0])
        self._always = int((sizes == 0).sum()) + self._observed  # the empty flip: in every one-sided count

    def p(self) -> float:
        """The two-sided p of no difference."""
        hits = np.abs(self._total - 2 * self._sums) >= abs(self._total) - 1e-9
        return float((hits.sum() + self._observed) / self._count) if self.m else math.nan

    def p_above(self, delta: float) -> float:
        """One-sided p of H0: mean difference <= delta (small when the differences lie above delta)."""
        return (self._always + int(np.searchsorted(self._means, delta, side="right"))) / self._count

    def p_below(self, delta: float) -> float:
        """One-sided p of H0: mean difference >= delta."""
        return (self._always + len(self._means) - int(np.searchsorted(self._means, delta, side="left"))) / self._count

    def interval(self, level: float = 0.95, bounds: tuple[float, float] = (-math.inf, math.inf)) -> tuple[float, float]:
        """The equal-tailed ``level`` interval: every delta neither one-sided test rejects at (1 - level) / 2."""
        if not self.m:
            return math.nan, math.nan
        k = math.floor((1 - level) / 2 * self._count - self._always) + 1  # subset means at or past a bound
        lo, hi = (self._means[k - 1], self._means[-k]) if k >= 1 else (-math.inf, math.inf)
        return max(float(lo), bounds[0]), min(float(hi), bounds[1])

    def tost(self, margin: float) -> float:
        """p of H0: |mean difference| >= margin (the larger one-sided p)."""
        return max(self.p_above(-margin), self.p_below(margin)) if self.m else math.nan


def t_half_width(se, df, quantile: float):
    """The half-width of a two-sided t-interval: t_{quantile, df} * se (quantile 0.95 gives the 90% interval;
    se, df scalars or arrays; df = inf gives the normal quantile)."""
    return stats.t.ppf(quantile, df) * se


def detectable_difference(se, df, power: float = 0.8):
    """The smallest true difference a two-sided 5% t-test with this standard error and df detects with ``power``:
    (t_{0.975, df} + t_{power, df}) * se, the usual approximation (it ignores the non-central t's skew). With the se
    the runs gave, it says how fine the design resolved a difference, not how likely this result was."""
    return (stats.t.ppf(0.975, df) + stats.t.ppf(power, df)) * se


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


# --------------------------------------------------------------------------- run-level (one cold start, or ignoring them)


def welch_diff_se(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """(mean(a) - mean(b), its standard error, Welch-Satterthwaite degrees of freedom) over the finite values;
    NaN where a side has no value (se, df: fewer than 2); df = inf when both sides are constant."""
    a, b = (np.asarray([v for v in x if math.isfinite(v)], float) for x in (a, b))
    if not len(a) or not len(b):
        return math.nan, math.nan, math.nan
    diff = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return diff, math.nan, math.nan
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        return diff, 0.0, math.inf
    return diff, math.sqrt(va + vb), (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))


def welch_diff_ci(a: Sequence[float], b: Sequence[float], floor_dof: bool = True) -> tuple[float, float, float]:
    """(mean(a) - mean(b), lo, hi): the difference of two means with its 95% Welch interval (unequal
    variances; Welch-Satterthwaite degrees of freedom, floored by default: conservative; ``floor_dof=False``
    keeps them fractional, the textbook interval). NaN bounds when either side has < 2 finite values."""
    diff, se, dof = welch_diff_se(a, b)
    if not math.isfinite(se):
        return diff, math.nan, math.nan
    if se == 0:
        return diff, diff, diff
    # Degrees of freedom floored to an integer: a tabulated quantile, and the interval errs wide, never narrow.
    half = t_quantile_975(math.floor(dof) if floor_dof else dof) * se
    return diff, diff - half, diff + half


def permutation_p(a: Sequence[float], b: Sequence[float]) -> tuple[float, bool]:
    """(two-sided p of the difference of means, exact?): the share of splits of the pooled values into groups
    of len(a) and len(b) whose |difference of means| is at least the observed one (ties within 1e-12).

    Past EXACT_LIMIT splits, MC_SAMPLES random splits estimate it as (hits + 1) / (MC_SAMPLES + 1): the observed
    split counts as one of the draws, so the estimate is a valid p and never 0 (Phipson & Smyth 2010; scipy's
    permutation_test does the same). The draws permute the sorted pool and fill the smaller group first, so
    p(a, b) == p(b, a): which arm is named first does not change the estimate."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if not len(a) or not len(b):
        return math.nan, True
    observed = abs(a.mean() - b.mean())
    total, n = len(a) + len(b), min(len(a), len(b))
    pooled = np.sort(np.concatenate([a, b]))
    exact = math.comb(total, n) <= EXACT_LIMIT
    if exact:
        idx = np.array(list(itertools.combinations(range(total), n)), dtype=np.int64)
    else:
        rng = np.random.default_rng(MC_SEED)
        idx = np.argsort(rng.random((MC_SAMPLES, total)), axis=1)[:, :n]
    sum_n = pooled[idx].sum(axis=1)
    hits = np.abs(sum_n / n - (pooled.sum() - sum_n) / (total - n)) >= observed - 1e-12
    return (float(hits.mean()) if exact else (float(hits.sum()) + 1) / (MC_SAMPLES + 1)), exact


# The score interval of a weighted sum of collapse rates: a contrast of collapse rates reports it beside the
# sign-flip test over cold starts (contrasts.py says how the two combine).
Z_FAR = 38.0  # a normal quantile past which no tail is representable (norm.sf(38) ~ 3e-316)


class RateCombination:
    """A weighted sum of independent binomial rates, sum_i w_i k_i / n_i, with the MOVER-Wilson interval (Zou &
    Donner 2008): with (l_i, u_i) each rate's Wilson interval at z and [a_i, b_i] the ends of w_i (l_i, u_i),
    lo = d - sqrt(sum_i (w_i p_i - a_i)^2) and hi = d + sqrt(sum_i (b_i - w_i p_i)^2). For weights (+1, -1) this
    is Newcombe's hybrid score interval of p_1 - p_2 (Newcombe 1998, method 10); its width is non-zero at 0/n.

    p_below / p_above invert the interval: the one-sided p at delta is the normal tail Phi(-z) of the z at which
    the interval's end reaches delta, so p < alpha exactly when the 1 - 2 alpha interval excludes delta."""

    def __init__(self, groups: Sequence[tuple[float, int, int]]):
        self.groups = [(float(w), int(k), int(n)) for w, k, n in groups]
        ok = bool(self.groups) and all(n > 0 for _, _, n in self.groups)
        self.diff = sum(w * k / n for w, k, n in self.groups) if ok else math.nan

    def bounds(self, z: float) -> tuple[float, float]:
        """The interval at normal quantile z >= 0 (z = 1.96: 95%)."""
        if not math.isfinite(self.diff):
            return math.nan, math.nan
        below = above = 0.0
        for w, k, n in self.groups:
            wp = w * k / n
            a, b = sorted(w * x for x in wilson_interval(k, n, z))
            below, above = below + (wp - a) ** 2, above + (b - wp) ** 2
        return self.diff - math.sqrt(below), self.diff + math.sqrt(above)

    def interval(self, level: float = 0.95) -> tuple[float, float]:
        return self.bounds(float(stats.norm.ppf(0.5 + level / 2)))

    def _end(self, z: float) -> float:
        # The upper end at z >= 0, the lower end at -z below 0: one curve, non-decreasing in z (Wilson intervals
        # nest as z grows), through the estimate at z = 0.
        lo, hi = self.bounds(abs(z))
        return hi if z >= 0 else lo

    def _z_at(self, delta: float) -> float:
        """The z at which the interval's end reaches delta (+-inf where none does or every one does)."""
        if not math.isfinite(self.diff):
            return math.nan
        if self._end(Z_FAR) < delta:
            return math.inf
        if self._end(-Z_FAR) >= delta:
            return -math.inf
        return float(optimize.brentq(lambda z: self._end(z) - delta, -Z_FAR, Z_FAR, xtol=1e-12))

    def p_below(self, delta: float) -> float:
        """One-sided p of H0: combination >= delta (small when the interval's upper end stays below delta)."""
        return float(stats.norm.sf(self._z_at(delta)))

    def p_above(self, delta: float) -> float:
        """One-sided p of H0: combination <= delta."""
        return float(stats.norm.cdf(self._z_at(delta)))

    def tost(self, margin: float) -> float:
        """p of H0: |combination| >= margin (the larger one-sided p)."""
        return max(self.p_above(-margin), self.p_below(margin))
