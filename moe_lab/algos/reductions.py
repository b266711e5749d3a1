"""How a metric combines over the disjoint parts of a batch (the ranks of a data-parallel step), declared
where the metric is made: every module that makes metrics has a ``REDUCTIONS`` table (metric name, or an
fnmatch pattern such as ``routing/layer_*/load_entropy``, -> one of the kinds below), and
``moe_lab.rl.dp_split.combine_metrics`` refuses a metric that declares none (it would otherwise silently
become some mean). Pure data: no torch.
"""

from __future__ import annotations

TOKEN_MEAN = "token_mean"  # a mean over response tokens: weighted by each part's tokens
SEQ_MEAN = "seq_mean"  # a mean over sequences: weighted by each part's sequences
MAX, MIN = "max", "min"
SAME = "same"  # identical on every part (the global gradient norm, the learning rate)
SLOWEST = "slowest"  # a timing (perf/*): the slowest part
ESS = "ess"  # rollout_corr/ess: recomputed exactly from each part's weight sums (needs rollout_corr/weight_mean)


def variance_of(mean_key: str, weight: str) -> tuple[str, str, str]:
    """A variance around the metric ``mean_key``: combined exactly by the law of total variance."""
    return ("var", mean_key, weight)


def std_of(mean_key: str, weight: str) -> tuple[str, str, str]:
    """A standard deviation around ``mean_key``: combined as its variance."""
    return ("std", mean_key, weight)


def covariance_of(mean_a: str, mean_b: str, weight: str) -> tuple[str, str, str, str]:
    """A covariance of the metrics whose means are ``mean_a`` and ``mean_b``: the law of total covariance."""
    return ("cov", mean_a, mean_b, weight)


def share_of(part: str, other: str) -> tuple[str, str, str]:
    """part / (part + other) of two combined metrics (0 when both are 0, as on one part; NaN if undefined)."""
    return ("share", part, other)
