"""`moe-lab verify RESULTS [--cells N|all] [--steps K|all]`: re-run a few cells of a results folder and say
whether this machine gives the same bits (the logic: moe_lab/audit/verify.py; docs/guide.md).

Exit codes: those of moe_lab/audit/verify.py (1: some cell gave other bits on the same machine); 130
interrupted (the re-runs go to a temporary folder, removed: nothing to resume).
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("verify", help="re-run a few cells of a results folder and say whether this machine gives "
                                      "the same bits (moe_lab/audit/verify.py; docs/guide.md)")
    p.add_argument("results", help="results folder (experiment.yaml, runs/<run_id>/config.yaml), e.g. "
                                   "results/reference/golden/default")
    p.add_argument("--cells", default=None, help="cells to re-run: N or all (default 2: the lowest seed of the "
                                                 "first and of the last arm)")
    p.add_argument("--steps", default=None, help="RL steps per cell: K or all (default 3; all = the whole run, "
                                                 "then the primary endpoint is checked against the seed spread)")
    return p


def main(args) -> int:
    from moe_lab.audit.verify import pin_like_reference, prepare, recorded_pins, verify

    runs, chosen, steps, exp = prepare(args.results, args.cells, args.steps)
    pin_like_reference(recorded_pins(chosen), args.argv)  # before any work: kernels are chosen at first use
    return verify(runs, chosen, steps, exp)


def on_interrupt(args) -> str:
    return "\nmoe-lab: interrupted; verify re-runs into a temporary folder, now removed: nothing to resume"
