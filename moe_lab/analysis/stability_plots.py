"""Figures of collapse and stability: survival, the stability atlas (experiments/atlas.yaml) and the
head to head of experiments/stabilizers.yaml. DataFrame in, Figure out (reads no files); built on
moe_lab/analysis/plots.py's helpers and arm colours.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from moe_lab.analysis import stability
from moe_lab.analysis.arm_traits import traits_of
from moe_lab.analysis.plots import (STEP, arm_color, arm_label, arm_linestyle, arm_order, arms_to_draw, curves,
                                    figure_legend, new_figure, positive_floor, styled)

# (arm_table column, axis label, log x)
H2H_PANELS = (("acc_greedy", "final greedy accuracy", False),
              ("collapse_rate", "collapsed runs (Wilson 95%)", False),
              ("expert_change", "expert change per update\n(router's own, last 25%)", False),
              ("router_shift", "router shift |Δ log p_router|\n(last 25%)", False),
              ("ratio_var_p99", "p99 of minibatch\ntoken-ratio variance (log)", True),
              ("clip_active", "clipped (zeroed) token share\n(last 25%, log)", True))


def _bars(ax, table: pd.DataFrame, arms: Sequence[str], col: str, label: str, log: bool, traits) -> None:
    rows = table.set_index("arm").reindex(list(arms))
    mean, lo, hi = (rows[c].to_numpy(float) for c in (col, f"{col}_lo", f"{col}_hi"))
    if log:
        lo = positive_floor(lo, mean)
    err = np.abs(np.nan_to_num(np.stack([np.where(np.isnan(lo), mean, lo), np.where(np.isnan(hi), mean, hi)])
                               - mean[None, :]))
    y = np.arange(len(arms))
    ax.barh(y, np.nan_to_num(mean), xerr=err, capsize=2, color=[arm_color(a, traits) for a in arms])
    ax.set_yticks(y, [arm_label(a, traits) for a in arms])
    ax.invert_yaxis()
    ax.set(xlabel=label)
    if log and np.nanmax(np.nan_to_num(mean)) > 0:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels of a short log range overprint


@styled
def head_to_head(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, arms: Sequence[str] | None = None) -> Figure:
    """Every stabilizer side by side (stability.arm_table): the training-reward curve, then one bar panel
    per quantity, each arm's mean over seeds with its 95% interval (Wilson for the collapse rate)."""
    arms = arms_to_draw(metrics_df, arms)
    table = stability.arm_table(metrics_df[metrics_df["arm"].isin(arms)],
                                eval_df[eval_df["arm"].isin(arms)] if len(eval_df) else eval_df)
    fig, axes = new_figure(4, 2, width=4.2, height=3.4)
    curves(axes[0, 0], metrics_df, "reward/mean", arms, ylabel="mean reward per response", title="training reward")
    panels, traits = [ax for ax in axes.flat][1:], traits_of(metrics_df)
    for ax, (col, label, log) in zip(panels, H2H_PANELS):
        _bars(ax, table, arms, col, label, log, traits)
    for ax in panels[len(H2H_PANELS):]:
        ax.set_visible(False)
    figure_legend(fig, axes[0, 0])
    fig.suptitle("Stabilizers head to head (mean over seeds, 95% intervals)")
    return fig


# --------------------------------------------------------------------------- collapse and the stability atlas


def _all_handles(fig: Figure, axes) -> None:
    """One figure legend from the labelled lines of every panel (a panel may miss an arm), first seen first."""
    seen = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncols=min(len(seen), 3) or 1)


@styled
def survival(metrics_df: pd.DataFrame, arms: Sequence[str] | None = None) -> Figure:
    """Share of runs not yet collapsed against the RL step, per arm: the Kaplan-Meier step function of
    stability.survival_table (a run that ends uncollapsed is censored at its last step)."""
    if "collapsed_at" not in metrics_df:
        raise ValueError("survival: the frame has no collapsed_at column (read it with results.load_runs)")
    arms = arms_to_draw(metrics_df, arms)
    table = stability.survival_table(metrics_df[metrics_df["arm"].isin(arms)])
    fig, axes = new_figure(1, width=5.0)
    ax = axes[0, 0]
    traits = traits_of(metrics_df)
    for arm in arms:
        rows = table[table["arm"] == arm]
        ax.step(rows["step"], rows["survival"], where="post", color=arm_color(arm, traits),
                linestyle=arm_linestyle(arm, arms, traits), label=arm_label(arm, traits))
    ax.set(xlabel=STEP, ylabel="share of runs not yet collapsed", ylim=(-0.03, 1.05),
           title="survival (censored at each run's last step)")
    figure_legend(fig, ax)
    fig.suptitle("Collapse survival per arm (rules: moe_lab/store/health.py)")
    return fig


ATLAS_ROWS = (("expert_change", "expert change per update\n(last 25% of updates)", False),
              ("ratio_var_p99", "p99 of minibatch\ntoken-ratio variance (log)", True),
              ("acc_gap", "final greedy accuracy\nminus {ref}'s", False))


ATLAS_WRAP = 6
ATLAS_TICK_CHARS = 24  # total characters of a panel's level names beyond which they are slanted


def _atlas_column(axes, sub: pd.DataFrame, factor: str, reference: str | None, first: bool, traits) -> None:
    """One factor's three panels (ATLAS_ROWS), top to bottom."""
    ticks = sub.drop_duplicates("level_index").sort_values("level_index")
    for i, (col, ylabel, log) in enumerate(ATLAS_ROWS):
        ax = axes[i]
        for arm in arm_order(sub["arm_base"].astype(str).unique(), traits):
            rows = sub[sub["arm_base"] == arm].sort_values("level_index")
            ax.plot(rows["level_index"], rows[col], marker="o", color=arm_color(arm, traits),
                    label=arm_label(arm, traits))
        labels = ticks["level"].astype(str).tolist()
        # long level names (the combinations) would overlap side by side in a panel ~1.5 inches wide
        slanted = sum(map(len, labels)) > ATLAS_TICK_CHARS
        ax.set_xticks(ticks["level_index"].to_numpy(), labels, rotation=30 if slanted else 0,
                      ha="right" if slanted else "center", fontsize="x-small" if slanted else None)
        values = sub[col].to_numpy(float)
        if log and (values[np.isfinite(values)] > 0).all() and np.isfinite(values).any():
            ax.set_yscale("log")
        if col == "acc_gap":
            ax.axhline(0.0, color="0.5", linewidth=0.8)
        if i == 0:
            ax.set_title(factor)
        if i == len(ATLAS_ROWS) - 1:
            ax.set_xlabel("level")
        if first:
            ax.set_ylabel(ylabel.format(ref=arm_label(reference, traits) if reference else "no reference"))


@styled
def atlas(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, *, reference: str | None = None,
          levels: dict[str, Sequence] | None = None, design: dict | None = None) -> Figure:
    """The stability atlas (stability.atlas_table): one column per factor (wrapped every ATLAS_WRAP factors
    into another block of rows), rows = expert change per update,
    p99 of minibatch token-ratio variance, and the final greedy-accuracy gap to the reference arm at the same
    level (default: stability.atlas_reference); x = the factor's levels (categorical, in level order), one line
    per base arm."""
    reference = stability.atlas_reference(metrics_df) if reference is None else reference
    table = stability.atlas_table(metrics_df, eval_df, reference=reference, levels=levels, design=design)
    factors = list(dict.fromkeys(table["factor"]))
    if not factors:
        raise ValueError("atlas: no arm carries a '<arm>__<factor>=<level>' label")
    # Wrap long designs (the shipped atlas has 12 factors) into blocks of ATLAS_WRAP columns.
    ncols = min(len(factors), ATLAS_WRAP)
    blocks = -(-len(factors) // ncols)
    fig, axes = new_figure(ncols, len(ATLAS_ROWS) * blocks, width=2.8, height=2.3)
    traits = traits_of(metrics_df)
    for j, factor in enumerate(factors):
        block, c = divmod(j, ncols)
        _atlas_column(axes[block * len(ATLAS_ROWS):(block + 1) * len(ATLAS_ROWS), c],
                      table[table["factor"] == factor], factor, reference, c == 0, traits)
    for ax in axes.flat:
        if not ax.has_data():
            ax.set_visible(False)
    _all_handles(fig, axes)
    fig.suptitle("Stability atlas: one factor at a time (mean over seeds per cell)")
    return fig
