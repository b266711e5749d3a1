"""`moe-lab report RESULTS [--out FILE]`: REPORT.md beside an experiment's results (default RESULTS/REPORT.md), with
its figures beside it, generated from the folder alone (moe_lab/analysis/report.py).

Exit codes: 0 written; 2 bad input (no such folder, no finished runs, a malformed experiment file, a verdict
quoting a number the tables do not show).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("report", help="write REPORT.md (design, provenance, declared contrasts on both endpoints, "
                                      "collapses, declared routing/mismatch metrics, figures, verdict) beside an "
                                      "experiment's results (moe_lab/analysis/report.py)")
    p.add_argument("results", help="experiment results folder (its experiment.yaml and runs/)")
    p.add_argument("--out", default=None, metavar="FILE", help="where to write the page (default RESULTS/REPORT.md); "
                                                               "the figures go beside it")
    p.add_argument("--no-figures", action="store_true", help="write the markdown only (the figures' links stay)")
    return p


def main(args) -> int:
    from moe_lab.analysis.report import REPORT_FILE, build, write
    from moe_lab.config import ConfigError

    results = Path(args.results)
    if not results.is_dir():
        raise ConfigError(f"RESULTS={args.results}: no such folder")
    out = Path(args.out) if args.out else results / REPORT_FILE
    for path in write(build(results, figures=not args.no_figures, shown_as=args.results.rstrip("/")), out):
        print(path)
    return 0
