"""Figures of the endpoints fixed before a multi-seed run (moe_lab/analysis/endpoints.py): learning curves with
seed bands, and forest plots of the differences between arms.

DataFrame in, Figure out (never trains); ``load_folder``/``forest_across`` read experiment folders. Both
figures follow the endpoints' rule for a run a collapse rule stopped: its last value is carried forward over the
scheduled steps it did not reach (the policy it stopped with is its final policy), so a band late in the run
still counts the seeds that died early instead of averaging the survivors only. A run still running is not
carried (it has not stopped): it is drawn up to its last logged step, and it is left out of the forest, whose
endpoints do not exist for it yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory

from moe_lab.analysis import endpoints, results
from moe_lab.analysis.arm_traits import arms_where, is_baseline, traits_of
from moe_lab.analysis.plots import (STEP, arm_color, arm_label, arm_linestyle, arm_order, band, figure_legend,
                                    new_figure, styled)
from moe_lab.launch.experiment import EndpointSpec
from moe_lab.launch.spec import parse_experiment
from moe_lab.store.run_folder import ResultsFolder, as_results
from moe_lab.store.status import FINISHED

RUN_COLUMNS = ("experiment", "run_id", "arm", "arm_base", "seed")
WINDOW_COLOR, REFERENCE_COLOR = "0.85", "0.35"
ALL_RUNS = "all runs"  # the column title of an experiment without settings


def setting_of(arm: str) -> str:
    """The arm's setting label ('grpo__control=clip' -> 'control=clip'; '' without one), as endpoints groups."""
    return str(arm).partition("__")[2]


def _finished(row: pd.Series) -> bool:
    # Frames without a status column (hand-built ones) are taken as finished, as the endpoints take them.
    return "status" not in row.index or row["status"] in FINISHED


def eval_grid(row: pd.Series) -> list[int]:
    """A run's scheduled evaluation steps, from its config (row: any of its rows)."""
    return endpoints.eval_schedule(int(row["rl.steps"]), int(row["rl.eval_every"]))


def step_grid(row: pd.Series) -> list[int]:
    """A run's RL steps as its metrics table numbers them (0 .. rl.steps - 1)."""
    return list(range(int(row["rl.steps"])))


def carried_curves(frame: pd.DataFrame, metric: str, grid_of: Callable[[pd.Series], Sequence[int]]) -> pd.DataFrame:
    """One row per run and grid step (the run's columns of RUN_COLUMNS, setting, step, metric): the run's
    value at the step (the mean of its rows there), else its last value before it. A finished run is carried to
    the end of its grid; a running one stops at its last logged step."""
    keys = [c for c in RUN_COLUMNS if c in frame.columns]
    parts = []
    for key, run in frame.groupby(keys, sort=True, dropna=False):
        values = run.groupby("step")[metric].mean().dropna()
        if values.empty:
            continue
        grid_s = np.asarray(grid_of(run.iloc[0]), dtype=int)
        if not _finished(run.iloc[0]):
            grid_s = grid_s[grid_s <= values.index.max()]
        parts.append(pd.DataFrame({**dict(zip(keys, key)), "step": grid_s, metric: endpoints.carried(values, grid_s)}))
    out = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[*keys, "step", metric])
    return out.assign(setting=out["arm"].map(setting_of))


def _panel(ax, table: pd.DataFrame, run_values: pd.Series, arms: Sequence[str], window: tuple[float, float], *,
           ylabel: str, traits: dict) -> None:
    """Seed-band curves of one setting (``run_values``: every run's carried values there) and the endpoint's window
    shaded behind them."""
    ax.axvspan(*window, color=WINDOW_COLOR, alpha=0.6, linewidth=0, label="endpoint window")
    for arm in arms:
        rows = table[table["arm_base"] == arm]
        if rows["mean"].notna().any():
            band(ax, rows, arm_label(arm, traits), arm_color(arm, traits), linestyle=arm_linestyle(arm, arms, traits))
    ax.set(xlabel=STEP, ylabel=ylabel)
    # A t band of two or three seeds (a folder still running) reaches far past any seed's value (accuracy 1.5):
    # the axis stops a little beyond the values the runs took, so the curves stay readable.
    lo, hi = np.nanmin(run_values), np.nanmax(run_values)
    margin = 0.05 * (hi - lo) or 0.05
    bottom, top = ax.get_ylim()
    ax.set_ylim(max(bottom, lo - margin), min(top, hi + margin))


def _windows(first: pd.Series, spec: EndpointSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """(primary, secondary) windows of a run's schedule, as endpoints.run_endpoints takes them."""
    grid = eval_grid(first)
    steps = int(first["rl.steps"])
    return (grid[-spec.last_evals:][0], grid[-1]), (steps - math.ceil(spec.last_frac * steps) + 1, steps)


@styled
def learning_curves(metrics: pd.DataFrame, evals: pd.DataFrame, spec: EndpointSpec = EndpointSpec(),
                    arms: Sequence[str] | None = None) -> Figure:
    """Per setting (one column each), the primary metric at each scheduled evaluation (top) and the secondary
    metric per step (bottom, where logged): per arm the mean over seeds with its 95% t band, stopped runs carried
    forward; each endpoint's window shaded; the cold start (the step-0 evaluation, mean over runs) dashed."""
    if spec.primary_metric not in evals or not evals[spec.primary_metric].notna().any():
        raise ValueError(f"learning_curves: the eval frame has no values for {spec.primary_metric}")
    panels = [(spec.primary_metric, carried_curves(evals, spec.primary_metric, eval_grid))]
    if spec.secondary_metric in metrics and metrics[spec.secondary_metric].notna().any():
        panels.append((spec.secondary_metric, carried_curves(metrics, spec.secondary_metric, step_grid)))
    traits = traits_of(evals)
    arms = list(arms) if arms is not None else arm_order(panels[0][1]["arm_base"].unique(), traits)
    settings = sorted(panels[0][1]["setting"].unique())
    fig, axes = new_figure(len(settings), len(panels), width=4.4, height=3.2)
    for i, (metric, carried) in enumerate(panels):
        table = results.per_step(carried, metric, by=("setting", "arm_base"))
        for j, setting in enumerate(settings):
            first = evals[evals["arm"].map(setting_of) == setting].iloc[0]
            _panel(axes[i, j], table[table["setting"] == setting], carried.loc[carried["setting"] == setting, metric],
                   arms, _windows(first, spec)[i], ylabel=metric, traits=traits)
    for j, setting in enumerate(settings):
        ev = evals[evals["arm"].map(setting_of) == setting]
        cold = ev.loc[ev["step"] == 0, spec.primary_metric].mean()
        if math.isfinite(cold):
            axes[0, j].axhline(cold, color=REFERENCE_COLOR, linestyle="--", linewidth=1, label="cold start (step 0)")
        axes[0, j].set_title(setting or ALL_RUNS)
    figure_legend(fig, axes[0, 0])
    fig.suptitle(f"mean over seeds, 95% t band; a stopped run holds its last value\nshaded: the endpoints' windows "
                 f"(last {spec.last_evals} evaluations, last {spec.last_frac:.0%} of steps)")
    return fig


# --------------------------------------------------------------------------- differences between arms


def finished_endpoints(metrics: pd.DataFrame, evals: pd.DataFrame, spec: EndpointSpec = EndpointSpec()) -> pd.DataFrame:
    """endpoints.run_endpoints of the runs that finished (done, or stopped by a collapse rule): a running run's
    carried value is not its endpoint. The same rows as `moe-lab compare` once every run has finished."""
    per_run = endpoints.run_endpoints(metrics, evals, spec)
    return per_run[per_run["status"].isin(FINISHED)] if "status" in per_run else per_run


def endpoint_pairs(per_run: pd.DataFrame, baseline: str | None = None, traits: dict | None = None) -> pd.DataFrame:
    """endpoints.compare_arms against ``baseline`` where the runs have that arm, else every pair of arms; no
    ``baseline``: the arm whose config is the baseline objective alone (GRPO: arm_traits.is_baseline), by
    ``traits`` (arm_traits.traits_of of the runs' frame), if any."""
    if baseline is None:
        found = arms_where(per_run["arm_base"].unique(), traits or {}, is_baseline)
        baseline = found[0] if found else None
    present = baseline is not None and baseline in set(per_run["arm_base"])
    return endpoints.compare_arms(per_run, baseline if present else None)


def load_folder(folder: str | Path | ResultsFolder) -> tuple[EndpointSpec, pd.DataFrame, pd.DataFrame]:
    """(spec, metrics, evals) of an experiment folder; the spec from its experiment.yaml (the one it ran)."""
    folder = as_results(folder)
    metrics, evals = results.load_runs(folder.path)
    return parse_experiment(folder.experiment()).endpoints, metrics, evals


def _row_label(group: str, r, traits: dict) -> str:
    where = " · ".join(part for part in (group, r.setting) if part)
    return f"{where + ': ' if where else ''}{arm_label(r.arm, traits)} − {arm_label(r.vs, traits)}"


def _p_text(r, column: str) -> str:
    p, exact = getattr(r, f"{column}_p"), getattr(r, f"{column}_p_exact")
    return f"p={endpoints.format_p(p)}{'' if exact else ' (MC)'}  n={r.n} vs {r.n_vs}"


@styled
def forest(entries: Sequence[tuple[str, pd.DataFrame]], column: str = "primary",
           xlabel: str | None = None, traits: dict | None = None) -> Figure:
    """One row per pair of arms of each (label, endpoints.compare_arms frame) entry, top to bottom: the
    difference of the endpoint (arm − vs) as a point with its Welch 95% interval as whiskers, a line at 0,
    the permutation p and both n written beside the row. Separate intervals are not the test: the row is.
    ``traits``: the arms' (arm_traits.traits_of), for their colours and labels."""
    traits = traits or {}
    rows = [(label, r) for label, pairs in entries for r in pairs.itertuples(index=False)]
    if not rows:
        raise ValueError("forest: no pair of arms to compare (one arm per setting, or no finished runs)")
    fig, axes = new_figure(1, width=7.0, height=1.1 + 0.32 * len(rows))
    ax = axes[0, 0]
    beside = blended_transform_factory(ax.transAxes, ax.transData)  # x in the axes, y on the row
    for i, (label, r) in enumerate(rows):
        diff, lo, hi = (float(getattr(r, f"{column}_{k}")) for k in ("diff", "lo", "hi"))
        xerr_2x1 = np.nan_to_num(np.array([[diff - lo], [hi - diff]]))  # one seed a side: no interval, no whisker
        ax.errorbar([diff], [-i], xerr=xerr_2x1, fmt="o", capsize=3, color=arm_color(r.arm, traits))
        ax.text(1.02, -i, _p_text(r, column), transform=beside, va="center", fontsize=7)
        if i and (label, r.setting) != (rows[i - 1][0], rows[i - 1][1].setting):
            ax.axhline(0.5 - i, color="0.8", linewidth=0.6)  # a rule between experiments/settings
    ax.axvline(0.0, color="0.3", linewidth=1)
    ax.set_yticks(-np.arange(len(rows)), [_row_label(label, r, traits) for label, r in rows])
    ax.set_ylim(-len(rows) + 0.5, 0.5)
    ax.set_xlabel(xlabel or f"{column} endpoint: difference of the per-seed means (arm − baseline), Welch 95%")
    ax.set_title("differences between arms: point, Welch 95% interval, permutation p (exact unless MC)")
    return fig


def forest_of_frames(metrics: pd.DataFrame, evals: pd.DataFrame, spec: EndpointSpec = EndpointSpec(),
                     baseline: str | None = None) -> Figure:
    """The forest of one experiment's finished runs (each arm against ``baseline`` where present; default: the
    baseline by its config, endpoint_pairs)."""
    traits = traits_of(evals)
    pairs = endpoint_pairs(finished_endpoints(metrics, evals, spec), baseline, traits)
    names = evals["experiment"].dropna().unique() if "experiment" in evals else []
    return forest([(str(names[0]) if len(names) == 1 else "", pairs)], traits=traits,
                  xlabel=f"difference in mean {spec.primary_metric} over the last {spec.last_evals} evaluations "
                         "(arm − baseline), Welch 95%")


def forest_across(folders: Sequence[str | Path], baseline: str | None = None, column: str = "primary",
                  arms: Sequence[str] | None = None) -> Figure:
    """One forest over several experiment folders (each its own rows, labelled with the folder's name); a
    folder that is absent, has no runs or no finished ones is left out. Each folder's endpoints come from its
    own experiment.yaml.
    ``arms``: only the rows of these arms against the baseline (default: the baseline by its config,
    endpoint_pairs), else every arm."""
    entries, traits = [], {}
    for folder in map(Path, folders):
        if not folder.is_dir() or not results.find_run_dirs(folder):  # absent or not started yet
            continue
        spec, metrics, evals = load_folder(folder)
        per_run = finished_endpoints(metrics, evals, spec)
        if not len(per_run):  # every run still running: nothing to compare yet
            continue
        folder_traits = traits_of(evals)
        traits.update(folder_traits)
        pairs = endpoint_pairs(per_run, baseline, folder_traits)
        entries.append((folder.name, pairs if arms is None else pairs[pairs["arm"].isin(arms)]))
    return forest(entries, column=column, traits=traits)
