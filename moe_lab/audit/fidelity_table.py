"""The table of `moe-lab fidelity`: each row a quantity (defined in docs/metrics.md, "Fidelity against the published
figures"), moe_lab's value with a 95% interval over its units (prompts, or updates), the published value with its
source, and a band with pass/fail.

Bands: ``within2x`` ([lo/2, 2 hi] of the published value or range), ``at_least`` (>= a bound, a direction or a
fraction), ``at_most`` (<= a bound), or ``REPORTED`` (no published figure to hold it to: no verdict). Intervals come
from moe_lab.analysis.stats (``mean_ci`` over units, ``ratio_ci`` for ratios of means, paired where the units are
the same samples). In band is judged on the interval: ``pass`` when the whole 95% interval lies inside the band,
``FAIL`` when it lies wholly outside, ``edge`` when it straddles a bound (not in band); without an interval (one
unit) no verdict. ``point_ok`` keeps the point estimate's verdict beside it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from moe_lab.analysis.stats import mean_ci, ratio_ci
from moe_lab.store.harness import clip_binds

R3_PAPER = "R3 paper, arXiv:2510.11370 (Qwen3-30B-A3B, 48 layers)"
PRIME_2808 = "prime-rl #2808 (Qwen3-30B-A3B): R3 takes mismatch KL 0.0015 -> 0.0002-0.0005"
GSPO_PAPER = "GSPO paper, arXiv:2507.18071 (48 layers)"
PUBLISHED_GRAD = "published 30B MoE runs (issue 62)"
UPDATES = (1, 3)  # expert change after this many optimizer steps on one batch


@dataclass(frozen=True)
class Band:
    text: str
    lo: float = -math.inf
    hi: float = math.inf

    def judge(self, value: float, lo: float, hi: float) -> tuple[str, bool | None, bool | None]:
        """(verdict, in band on the interval, in band on the point) of a value and its interval."""
        if math.isnan(self.lo) or not math.isfinite(value):
            return "-", None, None
        point = self.lo <= value <= self.hi
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return "-", None, point
        if self.lo <= lo and hi <= self.hi:
            return "pass", True, point
        return ("FAIL" if hi < self.lo or lo > self.hi else "edge"), False, point


REPORTED = Band("reported", math.nan, math.nan)


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
    ok: bool | None  # in band on the interval; None: reported only, or no interval
    verdict: str = "-"  # pass, edge, FAIL or -
    point_ok: bool | None = None  # in band on the point estimate
    band_lo: float | None = None
    band_hi: float | None = None
    arm: str = ""  # the arm of an experiment folder's row ("" for a measured model)

    def as_dict(self) -> dict:
        return asdict(self)


def row(key: str, quantity: str, stat, units: str, published: str, source: str, band: Band, arm: str = "") -> Row:
    """A Row from (value, lo, hi) and its band, judged on the interval."""
    value, lo, hi = (float(x) for x in stat[:3])
    verdict, ok, point = band.judge(value, lo, hi)
    bounds = (None, None) if math.isnan(band.lo) else (band.lo, band.hi)
    return Row(key, quantity, value, lo, hi, units, published, source, band.text, ok, verdict, point, *bounds, arm)


def within2x(lo: float, hi: float | None = None) -> Band:
    hi = lo if hi is None else hi
    return Band(f"within 2x: [{lo / 2:.3g}, {2 * hi:.3g}]", lo / 2, 2 * hi)


def at_least(bound: float, text: str) -> Band:
    return Band(text, bound, math.inf)


def at_most(bound: float, text: str) -> Band:
    return Band(text, -math.inf, bound)


def at_least_open(bound: float, text: str) -> Band:
    """Above a bound (a slope > 0): the interval's lower end must exceed it."""
    return Band(text, math.nextafter(bound, math.inf), math.inf)


def _col(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows]


def mismatch_rows(samples: list[dict], dense: list[dict] | None, bf16: list[dict] | None = None) -> list[Row]:
    """Rows of the rollout/trainer mismatch, over prompts (``samples``: fidelity_run.mismatch_samples; ``bf16``:
    the same with bf16 on both sides)."""
    n = f"{len(samples)} prompts"
    p = mean_ci(_col(samples, "router_change"))
    out = [router_row(p, n)]
    if bf16 is not None:
        out.append(router_row(mean_ci(_col(bf16, "router_change")), f"{len(bf16)} prompts", bf16=True))
    L = samples[0]["layers"] if samples else 0
    predicted = 1 - (1 - p[0]) ** L
    out.append(row("token_share", "share of tokens with >= 1 disagreeing router", mean_ci(_col(samples, "any_change")),
                   n, "94% (1-(1-0.10)^48 = 99.4%)", R3_PAPER,
                   Band(f"within 2x of 1-(1-p)^L = {predicted:.3g} (p above, L = {L})", predicted / 2, 2 * predicted)))
    out.append(row("k3", "rollout/trainer k3, the trainer's own routing", mean_ci(_col(samples, "k3")), n,
                   "1.535e-3; 0.0015", f"{R3_PAPER}; {PRIME_2808}", within2x(1.535e-3)))
    out.append(row("k3_replayed", "rollout/trainer k3, the rollout's routes replayed (R3)",
                   mean_ci(_col(samples, "k3_replayed")), n, "0.0002-0.0005", PRIME_2808, within2x(2e-4, 5e-4)))
    ratio = ratio_ci(_col(samples, "k3_replayed"), _col(samples, "k3"), paired=True)
    out.append(row("routing_share", "routing's share of k3: 1 - k3_replayed / k3 (paired)",
                   (1 - ratio[0], 1 - ratio[2], 1 - ratio[1]), n, "0.67-0.87 (3-7x)", PRIME_2808,
                   at_least(2 / 3, ">= 2/3 (a 3x reduction)")))
    if dense is not None:
        out.append(row("moe_dense_k3", "k3 of the MoE / k3 of its dense control",
                       ratio_ci(_col(samples, "k3"), _col(dense, "k3"), paired=False),
                       f"{len(samples)} + {len(dense)} prompts", "2.4 (1.535e-3 / 6.4e-4 of dense Qwen3-8B)",
                       R3_PAPER, at_least(1.0, "MoE/dense > 1")))
    for key, what in (("extreme_ln2", "share of tokens with |logp diff| > ln 2 (AReaL tau=2)"),
                      ("extreme_ln5", "share of extreme tokens, |logp diff| > ln 5 (AReaL tau=5)")):
        out.append(row(key, what, mean_ci(_col(samples, key)), n, "no figure in issue 55", "AReaL #1207", REPORTED))
    if samples and "length" in samples[0]:
        out.append(length_row(mean_ci(_col(samples, "length")), n))
    return out


# Rows a measured model and an experiment folder's finished runs both give (moe_lab/audit/fidelity_runs.py).

def router_row(stat, units: str, bf16: bool = False, arm: str = "") -> Row:
    key, how = ("router_disagreement_bf16", "bf16 on both sides") if bf16 else ("router_disagreement", "configured")
    return row(key, f"per-router rollout/trainer disagreement ({how} numerics)", stat, units, "~10% of routers",
               R3_PAPER, within2x(0.10), arm)


def clip_ratio_row(stat, units: str, replay: bool, update: int | None = None, arm: str = "") -> Row:
    """GSPO's clip fraction over GRPO's (``replay``: GRPO + R2, the GSPO paper's Figure 2; else free routing),
    averaged over the updates, or at one update index (``update``: the optimizer steps before it on its batch)."""
    key = "clip_ratio_replay" if replay else "clip_ratio"
    where = "" if update is None else f", update {update} of each batch"
    return row(key + ("" if update is None else f"_u{update}"),
               f"GSPO / {'GRPO + R2' if replay else 'GRPO'} share of tokens clipped (clip_frac/active{where})",
               stat, units, "about two orders of magnitude", GSPO_PAPER, within2x(100.0), arm)


def expert_change_row(update: int, stat, units: str, arm: str = "") -> Row:
    key = "expert_change_update" + ("" if update == 1 else str(update))
    band = within2x(0.10) if update == 1 else REPORTED  # the paper's figure is per update
    return row(key, f"activated experts changed after {update} update(s) on one batch", stat, units, "~10% per update",
               GSPO_PAPER, band, arm)


def gradient_rows(median, share, units: str, grad_clip: float, arm: str = "") -> list[Row]:
    """The median global gradient norm and the share of updates on which rl.grad_clip binds."""
    return [row("grad_norm_median", "median global gradient norm (optim/grad_norm, before the clip)", median, units,
                "0.02-0.07 under a clip of 1.0", PUBLISHED_GRAD, within2x(0.02, 0.07), arm),
            row("grad_clip_share", f"share of updates on which rl.grad_clip={grad_clip:g} binds", share, units,
                "spikes only", PUBLISHED_GRAD, at_most(0.10, "<= 10% (spikes only)") if grad_clip > 0 else REPORTED,
                arm)]


def length_row(stat, units: str, arm: str = "") -> Row:
    return row("response_length", "response length, tokens", stat, units, "thousands of tokens", GSPO_PAPER, REPORTED,
               arm)


def slope_row(stat, units: str, arm: str = "") -> Row:
    return row("learning_slope", "slope of eval/acc_greedy per 100 steps, last third of evaluations (OLS)", stat,
               units, "still rising", "issue 62", at_least_open(0.0, "> 0 (still rising)"), arm)


def _depth_ratio(row_: dict, layers: int) -> float:
    """Expert change of the deeper half of the MoE layers over the shallower half (nan when both are 0)."""
    per = np.array([row_[f"routing/layer_{l}/expert_change"] for l in range(layers)])
    half = layers // 2
    deep, shallow = per[layers - half:].mean(), per[:half].mean()
    return float(deep / shallow) if shallow > 0 else math.nan


def _per_step(rows: list[dict], fn) -> list[float]:
    steps = sorted({r["step"] for r in rows})
    return [fn([r for r in rows if r["step"] == s]) for s in steps]


def update_rows(grpo: list[dict], gspo: list[dict] | None, grpo_r2: list[dict] | None = None,
                grad_clip: float = 1.0) -> list[Row]:
    """Rows of the updates: rl_step's rows (fidelity_run.update_samples, their ``index``: optimizer steps before
    each on its batch) of GRPO, of GSPO and of GRPO + R2 for the clip ratios."""
    layers = sum(1 for key in grpo[0] if key.startswith("routing/layer_") and key.endswith("/expert_change"))
    out = []
    for m in UPDATES:
        after = [r for r in grpo if r["index"] == m]
        out.append(expert_change_row(m, mean_ci(_col(after, "routing/expert_change")), f"{len(after)} updates"))
    first = [r for r in grpo if r["index"] == 1]
    out.insert(1, row("expert_change_depth", "expert change, deeper half / shallower half of the MoE layers",
                      mean_ci([_depth_ratio(r, layers) for r in first]), f"{len(first)} updates",
                      "more prominent in deeper models", GSPO_PAPER, at_least(1.0, "deeper/shallower > 1")))
    steps = f"{len({r['step'] for r in grpo})} steps"
    median = mean_ci(_per_step(grpo, lambda rs: float(np.median(_col(rs, "optim/grad_norm")))))
    share = mean_ci(_per_step(grpo, lambda rs: np.mean([clip_binds(g, grad_clip) for g in _col(rs, "optim/grad_norm")])))
    out += gradient_rows(median, share if grad_clip > 0 else (math.nan,) * 3, steps, grad_clip)
    for base, replay in ((grpo_r2, True), (grpo, False)):
        if gspo is None or base is None:
            continue
        units = f"{len(gspo)} + {len(base)} updates"
        out.append(clip_ratio_row(ratio_ci(_col(gspo, "clip_frac/active"), _col(base, "clip_frac/active"),
                                           paired=False), units, replay))
        for m in sorted({r["index"] for r in gspo} - {0}) if replay else ():
            a, b = ([r["clip_frac/active"] for r in rs if r["index"] == m] for rs in (gspo, base))
            out.append(clip_ratio_row(ratio_ci(a, b, paired=False), f"{len(a)} + {len(b)} updates", True, m))
    return out


def _fmt(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.4g}"


def format_table(rows: list[Row]) -> str:
    """One line per row: key, value [lo, hi], verdict on the interval (the point's in brackets where it
    differs), band, published (source); an experiment folder's rows under a line per arm. Definitions in
    docs/metrics.md."""
    lines = [f"{'quantity':<26} {'moe_lab [95% CI]':<30} {'verdict':<16} band | published (source)"]
    arm = ""
    for r in rows:
        if r.arm != arm:
            arm = r.arm
            lines.append(f"-- {arm}")
        value = f"{_fmt(r.value)} [{_fmt(r.lo)}, {_fmt(r.hi)}]"
        differs = r.point_ok is not None and r.point_ok != bool(r.ok)
        verdict = r.verdict + (f" (point {'in' if r.point_ok else 'out'})" if differs else "")
        lines.append(f"{r.key:<26} {value:<30} {verdict:<16} {r.band} | {r.published} ({r.source}; over {r.units})")
    return "\n".join(lines)
