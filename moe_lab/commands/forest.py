"""`moe-lab forest RESULTS... --out FILE`: one forest plot of the primary-endpoint differences over several
results folders (every setting of each). Exit codes: 0 written; 2 bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("forest", help="one forest plot of the primary-endpoint differences over several results "
                                      "folders (every setting of each), e.g. the rescue, its confirmation and "
                                      "the router controls")
    p.add_argument("results", nargs="+", help="experiment results folders (each read with its own endpoints:)")
    p.add_argument("--out", required=True, help="figure file to write (.png, .pdf or .svg)")
    p.add_argument("--baseline", default=None, metavar="ARM",
                   help="each arm against this one (default: the arm whose config is GRPO alone, if any)")
    p.add_argument("--arms", default=None, help="comma-separated: only these arms' rows (default: every arm)")
    p.add_argument("--endpoint", default="primary", choices=("primary", "secondary"),
                   help="which fixed endpoint to draw (default: primary)")
    return p


def main(args) -> int:
    from moe_lab.analysis import endpoint_plots, results

    missing = [f for f in args.results if not Path(f).is_dir() or not results.find_run_dirs(Path(f))]
    if missing:  # named on the command line: an absent folder is a typo, not a run still to come
        raise ValueError(f"RESULTS_DIR={missing[0]}: no experiment runs there (expected RESULTS/runs/<run_id>/)")
    if Path(args.out).suffix.lower() not in (".png", ".pdf", ".svg"):
        raise ValueError(f"--out={args.out}: allowed a file name ending in .png, .pdf or .svg")
    arms = [a for a in args.arms.split(",") if a] if args.arms else None
    try:
        fig = endpoint_plots.forest_across(args.results, baseline=args.baseline, column=args.endpoint, arms=arms)
    except ValueError:
        if arms is None:
            raise
        raise ValueError(f"--arms={args.arms}: no finished runs of these arms beside --baseline="
                         f"{args.baseline or 'the baseline'} in these folders") from None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100, bbox_inches="tight")
    print(f"wrote {args.out}")
    return 0
