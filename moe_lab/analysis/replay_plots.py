"""Figures of Routing Replay's effect: the replay map and the replay-rescue head line.

DataFrame in, Figure out (reads no files, never trains); built on moe_lab/analysis/plots.py's helpers and arm colours.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from moe_lab.analysis import replay_map, results, stability
from moe_lab.analysis.arm_traits import traits_of
from moe_lab.analysis.plots import (STEP, arms_to_draw, new_figure, arm_color, arm_label, arm_linestyle, band,
                                    curves, figure_legend, styled)


def _setting_label(factor, level) -> str:
    if factor is None or (isinstance(factor, float) and np.isnan(factor)):
        return "all runs"
    return "base" if factor == "base" else f"{factor}={level}"


@styled
def replay_map_figure(metrics_df: pd.DataFrame, eval_df: pd.DataFrame,
                      treatments: Sequence[str] | None = None) -> Figure:
    """GRPO's routing share of the log-ratio variance (x) against each treatment's final greedy-accuracy
    gap to GRPO (y), one point per setting and treatment (default: replay_map.treatment_arms), with 95%
    intervals on both axes."""
    treatments = replay_map.treatment_arms(metrics_df) if treatments is None else list(treatments)
    table = replay_map.replay_map_table(metrics_df, eval_df, treatments=treatments)
    if not len(table):
        raise ValueError("replay_map: no setting has both the baseline arm (GRPO alone) with ratio/routing_share "
                         "and a treatment")
    traits = traits_of(metrics_df)
    fig, axes = new_figure(1, width=6.5, height=4.6)
    ax = axes[0, 0]
    for arm in [t for t in treatments if t in set(table["treatment"])]:
        rows = table[table["treatment"] == arm]
        x, y = rows["share"].to_numpy(float), rows["gap"].to_numpy(float)
        xerr = np.abs(np.nan_to_num(np.stack([rows["share_lo"], rows["share_hi"]]).astype(float) - x))
        yerr = np.abs(np.nan_to_num(np.stack([rows["gap_lo"], rows["gap_hi"]]).astype(float) - y))
        ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt="o", capsize=2, color=arm_color(arm, traits),
                    label=f"{arm_label(arm, traits)} - GRPO")
    # One label per setting (its treatments share x), on the point furthest from zero: an atlas has 24
    # settings x 3 treatments, and a label on every point buried the plot.
    labelled = table.assign(_abs=table["gap"].abs().fillna(-1.0)).sort_values("_abs", ascending=False)
    for _, row in labelled.drop_duplicates(["factor", "level"]).iterrows():
        ax.annotate(_setting_label(row["factor"], row["level"]), (row["share"], row["gap"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    ax.set(xlabel="routing share of GRPO's log-ratio variance\nVar(d_route) / (Var(d_route) + Var(d_weight))",
           ylabel="final greedy accuracy gap to GRPO", title="replay map (mean over seeds, 95% intervals)")
    figure_legend(fig, ax)
    return fig


def _survival(ax, metrics_df: pd.DataFrame, arms: Sequence[str], traits: dict) -> None:
    table = stability.survival_table(metrics_df[metrics_df["arm"].isin(arms)])
    for arm in arms:
        rows = table[table["arm"] == arm]
        ax.step(rows["step"], rows["survival"], where="post", color=arm_color(arm, traits),
                linestyle=arm_linestyle(arm, arms, traits))
    ax.set(xlabel=STEP, ylabel="share of runs not yet collapsed", ylim=(-0.03, 1.05), title="collapse survival")


def held_evals(eval_df: pd.DataFrame, metric: str = "eval/acc_greedy") -> pd.DataFrame:
    """Each run's evaluations on the union of every run's evaluation steps, its last value held after it
    stops: a run a collapse rule stopped keeps the accuracy of the policy it stopped with, instead of
    dropping out and leaving a mean over the survivors only (which would flatter the arm)."""
    keys = [c for c in ("arm", "experiment", "run_id", "seed") if c in eval_df.columns]
    wide = eval_df.pivot_table(index="step", columns=keys, values=metric, aggfunc="mean").sort_index().ffill()
    return wide.stack(keys, future_stack=True).rename(metric).dropna().reset_index()


def _eval_curves(ax, eval_df: pd.DataFrame, arms: Sequence[str], traits: dict) -> None:
    table = results.per_step(held_evals(eval_df[eval_df["arm"].isin(arms)]), "eval/acc_greedy", by=("arm",))
    for arm in arms:
        rows = table[table["arm"] == arm]
        band(ax, rows, arm_label(arm, traits), arm_color(arm, traits), linestyle=arm_linestyle(arm, arms, traits))
    ax.set(xlabel=STEP, ylabel="greedy accuracy (held-out prompts)",
           title="held-out accuracy (a stopped run holds its last)")


@styled
def rescue(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, arms: Sequence[str] | None = None) -> Figure:
    """The replay-rescue head line: training reward, held-out greedy accuracy, collapse survival, the
    per-step maximum token-ratio variance and pre-clip gradient norm (log), and the routing share of the
    log-ratio variance; every curve the mean over seeds with its 95% band."""
    arms, traits = arms_to_draw(metrics_df, arms), traits_of(metrics_df)
    step_max = (metrics_df.groupby(["arm", "seed", "step"], as_index=False)
                [["ratio/token_var", "optim/grad_norm"]].max())
    fig, axes = new_figure(3, 2, width=4.2, height=3.2)
    curves(axes[0, 0], metrics_df, "reward/mean", arms, ylabel="mean reward per response", title="training reward")
    _eval_curves(axes[0, 1], eval_df, arms, traits)
    _survival(axes[0, 2], metrics_df, arms, traits)
    curves(axes[1, 0], step_max, "ratio/token_var", arms, ylabel="token-ratio variance (step max, log)",
           title="token-ratio variance", log=True, traits=traits)
    curves(axes[1, 1], step_max, "optim/grad_norm", arms, ylabel="gradient norm before clipping (step max, log)",
           title="gradient norm", log=True, traits=traits)
    if replay_map.SHARE in metrics_df and metrics_df[replay_map.SHARE].notna().any():
        curves(axes[1, 2], metrics_df, replay_map.SHARE, arms, ylabel="Var(d_route) share of log-ratio variance",
               title="routing share of the ratio noise")
    else:
        axes[1, 2].set_visible(False)
    figure_legend(fig, axes[0, 0])
    fig.suptitle("Does Routing Replay rescue GRPO? (mean over seeds, 95% bands)")
    return fig
