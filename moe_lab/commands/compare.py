"""`moe-lab compare RESULTS [--baseline ARM] [--csv]`: every pair of arms on the endpoints fixed before the
runs, then the contrasts the experiment file declared, on the primary and then the secondary endpoint, then those
of the collapse rate, the cold start as the unit (moe_lab/analysis/endpoints.py, analysis/contrasts.py).

Exit codes: 0 printed; 2 bad input. Notes (unfinished runs left out, an interim folder, a block mixing two
models of one cold-start key) go to stderr, so the table stays machine-readable with --csv.
"""

from __future__ import annotations

import argparse
import sys

from moe_lab.config import ConfigError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("compare", help="every pair of arms on the endpoints fixed before the runs: difference, Welch "
                                       "95%% interval, exact permutation p (moe_lab/analysis/endpoints.py)")
    p.add_argument("results", help="experiment results folder (its experiment.yaml's endpoints:, else the defaults)")
    p.add_argument("--baseline", default=None, metavar="ARM", help="compare each arm with this one only "
                                                                   "(default: every pair)")
    p.add_argument("--csv", action="store_true", help="print the pairs table as CSV instead of markdown")
    return p


def main(args) -> int:
    from moe_lab.analysis.contrasts import format_declared, load_declared_tables
    from moe_lab.analysis.endpoints import format_comparison, load_comparison

    from moe_lab.store.run_folder import ResultsFolder

    folder = ResultsFolder(args.results)  # one reading of its experiment.yaml for the calls below
    spec, per_run, arms, pairs = load_comparison(folder, args.baseline)
    unfinished = per_run.attrs.get("unfinished", [])
    if unfinished:  # stderr: the table itself stays machine-readable with --csv
        print(f"moe-lab: note: {len(unfinished)} run(s) not finished, left out: {', '.join(unfinished)}",
              file=sys.stderr)
    interim = interim_note(folder)
    if interim:
        print(interim, file=sys.stderr)
    from moe_lab.launch.coldstart_origin import mixed_notes

    for line in mixed_notes(folder.runs_dir):  # a block mixing two models of one cold-start key
        print(line, file=sys.stderr)
    print(pairs.to_csv(index=False).rstrip() if args.csv else format_comparison(spec, arms, pairs))
    # the contrasts the experiment file fixed before its runs, both endpoints and the collapse rate, by cold start
    for column, declared in load_declared_tables(folder, per_run=per_run).items():
        if len(declared) and not args.csv:
            print("\n" + format_declared(declared, column))
    return 0


def interim_note(results) -> str | None:
    """A line when the folder's experiment (``results``: a path or a run_folder.ResultsFolder) has cells not yet
    finished (never started ones included, which the tables cannot see): an analysis fixed before the runs is the
    one after the last run, not this one."""
    from moe_lab.launch.progress import finished_of
    from moe_lab.store.run_folder import as_results

    results = as_results(results)
    counted = finished_of(results)
    if counted is None or counted[1] == counted[2]:
        return None
    exp, finished, total = counted
    return (f"moe-lab: note: interim: {finished} of {total} runs of {exp.name or results.path.name} "
            f"finished; an analysis fixed before the runs is the one after the last (moe-lab progress {results.path})")
