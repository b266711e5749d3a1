"""`moe-lab plot RESULTS [--out DIR] [--format png,pdf,svg]`: every figure the results support.

Exit codes: 0 something plotted and every run read; 1 nothing to plot, or some run could not be read (after
writing what could be); 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plot", help="write every figure the results support")
    p.add_argument("results", help="experiment results folder")
    p.add_argument("--out", default=None, help="figure folder (default: RESULTS/figures)")
    p.add_argument("--format", default="png", help="comma-separated: png,pdf,svg")
    return p


def main(args) -> int:
    return plot(args.results, args.out, args.format)


def plot(results: str, out: str | None, formats: str) -> int:
    """Figures of one experiment folder, or of each experiment in a folder of them; exit code.

    Non-zero when nothing was plotted or when any run could not be read (after writing what could be).
    """
    from moe_lab.analysis.figures import plot_folder

    paths, unreadable = plot_folder(Path(results), Path(out) if out else None, formats=formats)
    for p in paths:
        print(f"wrote {p}")
    for run, why in unreadable:
        print(f"moe-lab: error: unreadable run {run}: {why}", file=sys.stderr)
    if not paths and not unreadable:
        print(f"moe-lab: error: {results}: no runs to plot", file=sys.stderr)
    return 1 if unreadable or not paths else 0
