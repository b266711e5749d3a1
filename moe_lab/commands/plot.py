"""`moe-lab plot RESULTS [--out DIR] [--format png,pdf,svg] [--all]`: every figure the results support.

An experiment folder gets all its figures. A folder of experiments (e.g. results/reference) gets one summary page,
RESULTS/figures/summary.png (moe_lab/analysis/summary_page.py), and a line saying how to get the rest; ``--all``
draws every figure of every experiment instead (minutes for the references). A line on stderr per experiment
shows progress.

Exit codes: 0 something plotted and every run read; 1 nothing to plot, or some run could not be read (after
writing what could be); 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plot", help="write every figure the results support (a folder of experiments: a summary page)")
    p.add_argument("results", help="experiment results folder, or a folder of them")
    p.add_argument("--out", default=None, help="figure folder (default: RESULTS/figures)")
    p.add_argument("--format", default="png", help="comma-separated: png,pdf,svg")
    p.add_argument("--all", action="store_true", dest="every",
                   help="a folder of experiments: every figure of each one, not the summary page")
    return p


def main(args) -> int:
    return plot(args.results, args.out, args.format, every=args.every)


def plot(results: str, out: str | None, formats: str, every: bool = False) -> int:
    """Figures of one experiment folder, or of each experiment in a folder of them (``every``; else the summary
    page); exit code. Non-zero when nothing was plotted or when any run could not be read (after writing what
    could be)."""
    from moe_lab.analysis.figures import experiment_folders, parse_formats, plot_folder

    formats = parse_formats(formats)
    folders = experiment_folders(Path(results))
    start = time.perf_counter()
    if len(folders) > 1 and not every:
        paths, unreadable = _summary(Path(results), folders, out, formats, start)
    else:
        def progress(i, n, folder, written):
            for p in written:
                print(f"wrote {p}", flush=True)
            if n > 1:
                _say(f"[{i}/{n}] {folder.name}: {len(written)} files ({time.perf_counter() - start:.0f} s)")

        paths, unreadable = plot_folder(Path(results), Path(out) if out else None, formats=formats, progress=progress)
    for run, why in unreadable:
        print(f"moe-lab: error: unreadable run {run}: {why}", file=sys.stderr)
    if not paths and not unreadable:
        print(f"moe-lab: error: {results}: no runs to plot", file=sys.stderr)
    return 1 if unreadable or not paths else 0


def _summary(results: Path, folders: list[Path], out: str | None, formats, start: float):
    from moe_lab.analysis.summary_page import write_summary

    def progress(i, n, folder, runs):
        _say(f"[{i}/{n}] {folder.name}: {runs} runs read ({time.perf_counter() - start:.0f} s)")

    paths, unreadable = write_summary(folders, Path(out) if out else results / "figures", formats, progress)
    for p in paths:
        print(f"wrote {p}")
    _say(f"one summary page for {len(folders)} experiments; an experiment's figures: moe-lab plot "
         f"{results / folders[0].name} (or any other); every figure of all {len(folders)} (minutes): "
         f"moe-lab plot {results} --all")
    return paths, unreadable


def _say(line: str) -> None:
    print(f"moe-lab plot: {line}", file=sys.stderr, flush=True)
