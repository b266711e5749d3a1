"""The head-to-head figure of experiments/stabilizers.yaml: DataFrame in, Figure out (reads no files).

Kept beside moe_lab/plots.py (whose helpers and arm colours it uses) so that file stays readable.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from moe_lab import stability
from moe_lab.plots import (_arms, _figure, _positive_floor, arm_color, arm_label, curves, figure_legend,
                           styled)

# (arm_table column, axis label, log x)
H2H_PANELS = (("acc_greedy", "final greedy accuracy", False),
              ("collapse_rate", "collapsed runs (Wilson 95%)", False),
              ("expert_change", "expert change per update\n(router's own, last 25%)", False),
              ("router_shift", "router shift |Δ log p_router|\n(last 25%)", False),
              ("ratio_var_p99", "p99 of minibatch\ntoken-ratio variance (log)", True),
              ("clip_active", "clipped (zeroed) token share\n(last 25%, log)", True))


def _bars(ax, table: pd.DataFrame, arms: Sequence[str], col: str, label: str, log: bool) -> None:
    rows = table.set_index("arm").reindex(list(arms))
    mean, lo, hi = (rows[c].to_numpy(float) for c in (col, f"{col}_lo", f"{col}_hi"))
    if log:
        lo = _positive_floor(lo, mean)
    err = np.abs(np.nan_to_num(np.stack([np.where(np.isnan(lo), mean, lo), np.where(np.isnan(hi), mean, hi)])
                               - mean[None, :]))
    y = np.arange(len(arms))
    ax.barh(y, np.nan_to_num(mean), xerr=err, capsize=2, color=[arm_color(a) for a in arms])
    ax.set_yticks(y, [arm_label(a) for a in arms])
    ax.invert_yaxis()
    ax.set(xlabel=label)
    if log and np.nanmax(np.nan_to_num(mean)) > 0:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels of a short log range overprint


@styled
def head_to_head(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, arms: Sequence[str] | None = None) -> Figure:
    """Every stabilizer side by side (stability.arm_table): the training-reward curve, then one bar panel
    per quantity, each arm's mean over seeds with its 95% interval (Wilson for the collapse rate)."""
    arms = _arms(metrics_df, arms)
    table = stability.arm_table(metrics_df[metrics_df["arm"].isin(arms)],
                                eval_df[eval_df["arm"].isin(arms)] if len(eval_df) else eval_df)
    fig, axes = _figure(4, 2, width=4.2, height=3.4)
    curves(axes[0, 0], metrics_df, "reward/mean", arms, ylabel="mean reward per response", title="training reward")
    panels = [ax for ax in axes.flat][1:]
    for ax, (col, label, log) in zip(panels, H2H_PANELS):
        _bars(ax, table, arms, col, label, log)
    for ax in panels[len(H2H_PANELS):]:
        ax.set_visible(False)
    figure_legend(fig, axes[0, 0])
    fig.suptitle("Stabilizers head to head (mean over seeds, 95% intervals)")
    return fig
