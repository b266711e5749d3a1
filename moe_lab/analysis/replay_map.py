"""The replay map (experiments/replay_map.yaml) and the replay-rescue summary: where Routing Replay matters.

One point per setting (a factor level of a one-factor-at-a-time experiment, or the whole experiment): x is
how much of GRPO's importance-ratio noise comes from routing (``ratio/routing_share`` of its runs, the ratio
decomposition of docs/metrics.md), y is what replay (or GSPO) buys over GRPO in final greedy accuracy.
Reads the frames of moe_lab.analysis.results; never trains, never reads files.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from moe_lab.analysis import arm_traits
from moe_lab.analysis.stats import mean_ci, welch_diff_ci
from moe_lab.analysis.tables import check_columns
from moe_lab.analysis.stability import with_labels

SHARE = "ratio/routing_share"


def reference_arm(metrics_df: pd.DataFrame) -> str | None:
    """The base arm every gap is measured against: GRPO without replay, by its config (arm_traits.is_baseline)."""
    return arm_traits.base_arm_where(metrics_df, arm_traits.is_baseline)


def is_treatment(t: arm_traits.ArmTraits) -> bool:
    """What the map places against the reference: the baseline objective with replay, or GSPO's family."""
    return arm_traits.is_replay_of_baseline(t) or arm_traits.is_sequence_ratio_clip(t)


def treatment_arms(metrics_df: pd.DataFrame) -> list[str]:
    """The frame's treatment base arms (is_treatment), in the tables' order."""
    arms = metrics_df["arm"].dropna().map(arm_traits.base_arm).unique() if "arm" in metrics_df else []
    return arm_traits.arms_where(arms, arm_traits.traits_of(metrics_df), is_treatment)


def _per_run(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One row per run: keys, seed, share (mean of the run's logged routing shares), acc (final greedy)."""
    run = [*keys, "seed"]
    m = metrics_df.dropna(subset=[SHARE]) if SHARE in metrics_df else metrics_df.iloc[:0]
    share = m.groupby(run, dropna=False)[SHARE].mean().rename("share")
    last = eval_df[eval_df["step"] == eval_df.groupby(run, dropna=False)["step"].transform("max")]
    acc = last.groupby(run, dropna=False)["eval/acc_greedy"].mean().rename("acc")
    return pd.concat([share, acc], axis=1).reset_index()


def replay_map_table(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, *, reference: str | None = None,
                     treatments: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per (setting, treatment arm present): factor, level (both None outside a factors design),
    share (mean over the reference arm's runs of their mean ratio/routing_share) with share_lo/share_hi (95%
    t-interval over seeds), gap = mean final greedy accuracy of the treatment minus the reference's, with
    gap_lo/gap_hi (Welch 95%), acc_ref, acc_treat, n_ref, n_treat. A factors design's shared base cells
    ('<arm>__base') are one setting of their own (factor 'base'): each setting appears once on the map.
    Default reference and treatments: by the arms' config (reference_arm, treatment_arms)."""
    check_columns(metrics_df, ["arm", "seed", "step"], "metrics_df")
    ref_arm = reference_arm(metrics_df) if reference is None else reference
    treated = treatment_arms(metrics_df) if treatments is None else list(treatments)
    check_columns(eval_df, ["arm", "seed", "step", "eval/acc_greedy"], "eval_df")
    m, e = (with_labels(f) for f in (metrics_df, eval_df))
    m, e = (f.assign(factor=f["factor"].fillna("-"), level=f["level"].fillna("-")) for f in (m, e))
    runs = _per_run(m, e, ["factor", "level", "arm_base"])
    rows = []
    for (factor, level), cell in runs.groupby(["factor", "level"], sort=False):
        ref = cell[cell["arm_base"] == ref_arm]
        if not len(ref):
            continue
        share, share_lo, share_hi = mean_ci(ref["share"])
        for arm in (t for t in treated if t in set(cell["arm_base"])):
            treat = cell[cell["arm_base"] == arm]
            gap, lo, hi = welch_diff_ci(treat["acc"], ref["acc"])
            rows.append({"factor": None if factor == "-" else factor, "level": None if level == "-" else level,
                         "treatment": arm, "share": share, "share_lo": share_lo, "share_hi": share_hi,
                         "gap": gap, "gap_lo": lo, "gap_hi": hi, "acc_ref": ref["acc"].mean(),
                         "acc_treat": treat["acc"].mean(), "n_ref": len(ref), "n_treat": len(treat)})
    return pd.DataFrame(rows, columns=["factor", "level", "treatment", "share", "share_lo", "share_hi", "gap",
                                       "gap_lo", "gap_hi", "acc_ref", "acc_treat", "n_ref", "n_treat"])
