"""One page for a folder of experiments (`moe-lab plot results/reference`): a panel per experiment with its
primary endpoint metric against the RL step, the mean over seeds of each arm.

Every figure of every reference takes minutes to draw (`moe-lab plot FOLDER --all`). This page reads the
eval tables only, so it is quick. An experiment's own figures come from `moe-lab plot FOLDER/<experiment>`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from moe_lab.analysis import plots
from moe_lab.analysis.figures import DPI
from moe_lab.config import ConfigError
from moe_lab.launch.spec import parse_experiment
from moe_lab.store.run_folder import ResultsFolder, RunFolder, runs_under

NAME = "summary"
NCOLS = 4
LEGEND_MAX = 6  # more arms than this: a legend would hide the curves; the panel title counts them


def primary_metric(folder: Path) -> str:
    """The experiment's primary endpoint metric (its experiment.yaml; the default one without a readable file)."""
    try:
        return parse_experiment(ResultsFolder(folder).experiment()).endpoints.primary_metric
    except (OSError, ConfigError):
        return parse_experiment(None).endpoints.primary_metric


def eval_curves(folder: Path, metric: str) -> tuple[pd.DataFrame, list[tuple[str, str]]]:
    """(arm, seed, step, value) of every run under folder that logged ``metric``; [(unreadable run, why)]."""
    rows, unreadable = [], []
    for run in map(RunFolder, runs_under(folder)):
        try:
            manifest = run.manifest
            frame = pd.read_parquet(run.eval_path, columns=["step", metric]) if run.eval_path.exists() else None
        except Exception as exc:  # noqa: BLE001 - one unreadable run must not hide the others
            unreadable.append((str(run.path), f"{type(exc).__name__}: {' '.join(str(exc).split())}"))
            continue
        if frame is not None and len(frame):
            rows.append(frame.rename(columns={metric: "value"}).assign(arm=str(manifest.get("arm", run.run_id)),
                                                                        seed=manifest.get("seed")))
    columns = ["arm", "seed", "step", "value"]
    return (pd.concat(rows, ignore_index=True)[columns] if rows else pd.DataFrame(columns=columns)), unreadable


@plots.styled
def summary_figure(panels: Sequence[tuple[str, str, pd.DataFrame]]) -> Figure:
    """One panel per (experiment, metric, curves): each arm's mean over seeds against the step."""
    nrows = max(1, math.ceil(len(panels) / NCOLS))
    fig, axes = plots.new_figure(NCOLS, nrows, width=3.6, height=2.6)
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    for ax, (name, metric, curves) in zip(axes.flat, panels):
        mean = curves.groupby(["arm", "step"])["value"].mean().reset_index()
        arms = sorted(set(mean["arm"]))
        for arm in arms:
            line = mean[mean["arm"] == arm]
            ax.plot(line["step"], line["value"], lw=1.0 if len(arms) <= LEGEND_MAX else 0.5, label=arm)
        runs = curves[["arm", "seed"]].drop_duplicates().shape[0]
        ax.set_title(f"{name} ({runs} runs, {len(arms)} arms)", fontsize=9)
        ax.set_xlabel(plots.STEP, fontsize=8)
        ax.set_ylabel(metric, fontsize=8)
        ax.tick_params(labelsize=7)
        if 1 < len(arms) <= LEGEND_MAX:
            ax.legend(fontsize=6, frameon=False)
    fig.suptitle("Each experiment's primary metric, mean over seeds per arm (every figure: moe-lab plot "
                 "<experiment> or --all)")
    return fig


def write_summary(folders: Sequence[Path], out_dir: Path, formats: Sequence[str],
                  progress: Callable[[int, int, Path, int], None] | None = None) -> tuple[list[Path], list]:
    """Write out_dir/summary.<format> for the experiment folders; (written paths, [(unreadable run, why)]).
    ``progress(i, n, folder, runs)`` after each folder is read."""
    panels, unreadable = [], []
    for i, folder in enumerate(folders, 1):
        metric = primary_metric(folder)
        curves, bad = eval_curves(folder, metric)
        unreadable += bad
        if len(curves):
            panels.append((folder.name, metric, curves))
        if progress is not None:
            progress(i, len(folders), folder, curves[["arm", "seed"]].drop_duplicates().shape[0])
    if not panels:
        return [], unreadable
    fig = summary_figure(panels)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{NAME}.{fmt}" for fmt in formats]
    for path, fmt in zip(paths, formats):
        fig.savefig(path, format=fmt, dpi=DPI, bbox_inches="tight")
    return paths, unreadable
