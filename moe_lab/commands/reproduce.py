"""`moe-lab reproduce [--out DIR]`: the main job (the built-in experiment `paper`), then its figures.

Exit codes: as `moe-lab run`, and 1 also when some run could not be plotted.
"""

from __future__ import annotations

import argparse

from moe_lab.commands.plot import plot
from moe_lab.commands.run import add_run_args, builtin_experiment, on_interrupt, pin_isa, run_cells  # noqa: F401

TAKES_OVERRIDES = True


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("reproduce", help="the main job: cold start, GRPO, GRPO+R2, GRPO+R3, GSPO, GSPO-token, figures")
    p.add_argument("--out", default="results/paper", help="results folder (default: results/paper)")
    add_run_args(p)
    return p


def main(args) -> int:
    pin_isa(args)
    code = run_cells(builtin_experiment("paper"), args.out, args)
    return max(code, plot(args.out, None, "png"))
