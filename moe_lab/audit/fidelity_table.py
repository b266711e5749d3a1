"""The table of `moe-lab fidelity`: each row a quantity (defined in docs/metrics.md, "Fidelity against the published
figures"), moe_lab's value with a 95% interval over its units (prompts, or updates), the published value with its
source, and a band with pass/fail.

Bands: ``within2x`` (value in [lo/2, 2 hi] of the published value or range), ``at_least`` (value >= a bound, a
direction or a fraction), or ``reported`` (no published figure to hold it to: no verdict). Intervals come from
moe_lab.analysis.stats (``mean_ci`` over units, ``ratio_ci`` for ratios of means, paired where the units are the
same samples); the verdict reads the point value only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from moe_lab.analysis.stats import mean_ci, ratio_ci

R3_PAPER = "R3 paper, arXiv:2510.11370 (Qwen3-30B-A3B, 48 layers)"
PRIME_2808 = "prime-rl #2808 (Qwen3-30B-A3B): R3 takes mismatch KL 0.0015 -> 0.0002-0.0005"
GSPO_PAPER = "GSPO paper, arXiv:2507.18071 (48 layers)"


@dataclass(frozen=True)
class Row:
    key: str
    quantity: str
    value: float
    lo: float
    hi: float
    units: str  # what the interval is over
    published: str
    source: str
    band: str
    ok: bool | None  # None: reported only

    def as_dict(self) -> dict:
        return asdict(self)


def within2x(value: float, lo: float, hi: float | None = None) -> tuple[str, bool | None]:
    hi = lo if hi is None else hi
    band = f"within 2x: [{lo / 2:.3g}, {2 * hi:.3g}]"
    return band, (lo / 2 <= value <= 2 * hi) if math.isfinite(value) else None


def at_least(value: float, bound: float, text: str) -> tuple[str, bool | None]:
    return text, (value >= bound) if math.isfinite(value) else None


def _col(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows]


def mismatch_rows(samples: list[dict], dense: list[dict] | None) -> list[Row]:
    """Rows of the rollout/trainer mismatch, over prompts (``samples``: fidelity_run.mismatch_samples)."""
    n = f"{len(samples)} prompts"
    out = []
    p = mean_ci(_col(samples, "router_change"))
    out.append(Row("router_disagreement", "per-router rollout/trainer disagreement", *p, n, "~10% of routers",
                   R3_PAPER, *within2x(p[0], 0.10)))
    L = samples[0]["layers"] if samples else 0
    predicted = 1 - (1 - p[0]) ** L
    share = mean_ci(_col(samples, "any_change"))
    band = f"within 2x of 1-(1-p)^L = {predicted:.3g} (p above, L = {L})"
    out.append(Row("token_share", "share of tokens with >= 1 disagreeing router", *share, n,
                   "94% (1-(1-0.10)^48 = 99.4%)", R3_PAPER,
                   band, (predicted / 2 <= share[0] <= 2 * predicted) if math.isfinite(share[0]) else None))
    k3 = mean_ci(_col(samples, "k3"))
    out.append(Row("k3", "rollout/trainer k3, the trainer's own routing", *k3, n, "1.535e-3; 0.0015",
                   f"{R3_PAPER}; {PRIME_2808}", *within2x(k3[0], 1.535e-3)))
    k3r = mean_ci(_col(samples, "k3_replayed"))
    out.append(Row("k3_replayed", "rollout/trainer k3, the rollout's routes replayed (R3)", *k3r, n,
                   "0.0002-0.0005", PRIME_2808, *within2x(k3r[0], 2e-4, 5e-4)))
    ratio = ratio_ci(_col(samples, "k3_replayed"), _col(samples, "k3"), paired=True)
    share_r = (1 - ratio[0], 1 - ratio[2], 1 - ratio[1])
    out.append(Row("routing_share", "routing's share of k3: 1 - k3_replayed / k3 (paired)", *share_r, n,
                   "0.67-0.87 (3-7x)", PRIME_2808, *at_least(share_r[0], 2 / 3, ">= 2/3 (a 3x reduction)")))
    if dense is not None:
        r = ratio_ci(_col(samples, "k3"), _col(dense, "k3"), paired=False)
        out.append(Row("moe_dense_k3", "k3 of the MoE / k3 of its dense control", *r,
                       f"{len(samples)} + {len(dense)} prompts", "2.4 (1.535e-3 / 6.4e-4 of dense Qwen3-8B)",
                       R3_PAPER, *at_least(r[0], 1.0, "MoE/dense > 1")))
    for key, what in (("extreme_ln2", "share of tokens with |logp diff| > ln 2 (AReaL tau=2)"),
                      ("extreme_ln5", "share of extreme tokens, |logp diff| > ln 5 (AReaL tau=5)")):
        out.append(Row(key, what, *mean_ci(_col(samples, key)), n, "no figure in issue 55", "AReaL #1207",
                       "reported", None))
    return out


def _depth_ratio(row: dict, layers: int) -> float:
    """Expert change of the deeper half of the MoE layers over the shallower half (nan when both are 0)."""
    per = np.array([row[f"routing/layer_{l}/expert_change"] for l in range(layers)])
    half = layers // 2
    deep, shallow = per[layers - half:].mean(), per[:half].mean()
    return float(deep / shallow) if shallow > 0 else math.nan


def update_rows(grpo: list[dict], gspo: list[dict] | None) -> list[Row]:
    """Rows of the updates: rl_step's rows (fidelity_run.update_samples) of GRPO, and of GSPO for the clip ratio."""
    first = [r for r in grpo if r["minibatch"] == 1]  # after one optimizer step on the same batch
    layers = sum(1 for key in grpo[0] if key.startswith("routing/layer_") and key.endswith("/expert_change"))
    n = f"{len(first)} updates"
    change = mean_ci(_col(first, "routing/expert_change"))
    out = [Row("expert_change_update", "activated experts changed after one update", *change, n, "~10%",
               GSPO_PAPER, *within2x(change[0], 0.10))]
    depth = mean_ci([_depth_ratio(r, layers) for r in first])
    out.append(Row("expert_change_depth", "expert change, deeper half / shallower half of the MoE layers", *depth, n,
                   "more prominent in deeper models", GSPO_PAPER, *at_least(depth[0], 1.0, "deeper/shallower > 1")))
    if gspo is not None:
        r = ratio_ci(_col(gspo, "clip_frac/active"), _col(grpo, "clip_frac/active"), paired=False)
        out.append(Row("clip_ratio", "GSPO / GRPO share of tokens clipped (clip_frac/active)", *r,
                       f"{len(gspo)} + {len(grpo)} updates", "about two orders of magnitude", GSPO_PAPER,
                       *within2x(r[0], 100.0)))
    return out


def _fmt(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.4g}"


def format_table(rows: list[Row]) -> str:
    """One line per row: key, value [lo, hi], verdict, band, published (source); the definitions in
    docs/metrics.md."""
    verdict = {True: "pass", False: "FAIL", None: "-"}
    lines = [f"{'quantity':<22} {'moe_lab [95% CI]':<30} {'verdict':<7} band | published (source)"]
    for r in rows:
        value = f"{_fmt(r.value)} [{_fmt(r.lo)}, {_fmt(r.hi)}]"
        lines.append(f"{r.key:<22} {value:<30} {verdict[r.ok]:<7} {r.band} | {r.published} ({r.source}; "
                     f"over {r.units})")
    return "\n".join(lines)
