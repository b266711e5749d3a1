"""The score interval of a weighted sum of collapse rates (``RateCombination``): Newcombe's hybrid score interval
of a difference of two rates, MOVER-Wilson for more, and the one-sided p's that invert it. A contrast of collapse rates
reports it beside the sign-flip test over cold starts (contrasts.py says how the two combine). In its own module
because analysis/stats.py, which owns every other statistic and the Wilson interval this one builds on, is at the
house size limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scipy import optimize, stats

from moe_lab.analysis.stats import wilson_interval

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
