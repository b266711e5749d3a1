"""The figures of `moe-lab report`: learning curves per arm, the declared contrasts per cold start, and the
metrics the experiment file declares (``describe:``). DataFrame in, Figure out; report.py writes them."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from moe_lab.analysis.arm_traits import traits_of
from moe_lab.analysis.plots import STEP, arm_order, curves, figure_legend, new_figure, styled
from moe_lab.launch.design import Describe


@styled
def contrast_dots(tables: dict[str, pd.DataFrame]) -> Figure:
    """Per endpoint (one column each) and declared contrast (one row each): the difference on every cold start
    (dots) and its mean with the 95% interval over cold starts (bar), against 0."""
    fig, axes = new_figure(len(tables), 1, width=5.0, height=0.6 + 0.5 * max(len(t) for t in tables.values()))
    for ax, (column, table) in zip(axes[0], tables.items()):
        labels = [f"{r.setting + ': ' if r.setting else ''}{r.arm} − {r.vs}" for r in table.itertuples()]
        for i, r in enumerate(table.itertuples()):
            ax.plot(list(r.per_block.values()), [i] * len(r.per_block), "o", color="0.45", markersize=4)
            ax.errorbar(r.diff, i, xerr=[[r.diff - r.lo], [r.hi - r.diff]], fmt="D", color="black", capsize=3)
        ax.axvline(0.0, color="0.6", linewidth=1)
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set(xlabel=f"difference of the {column} endpoint", title=f"{column}: per cold start (dots), 95% over "
                                                                      "cold starts (bar)")
    return fig


@styled
def describe_curves(metrics: pd.DataFrame, spec: Describe) -> Figure:
    """Each declared metric per arm against the RL step (mean over runs, 95% t band)."""
    present = [m for m in spec.metrics if m in metrics]
    arms = arm_order(metrics["arm"].unique(), traits_of(metrics))
    fig, axes = new_figure(min(3, len(present)), -(-len(present) // 3), width=4.4, height=3.2)
    for ax, metric in zip(axes.flat, present):
        curves(ax, metrics, metric, arms, ylabel=metric, title=metric)
    for ax in list(axes.flat)[len(present):]:
        ax.set_visible(False)
    figure_legend(fig, axes.flat[0])
    fig.suptitle(f"each run's step mean, then the mean over runs with its 95% t band, against the {STEP}")
    return fig
