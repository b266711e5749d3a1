"""`moe-lab run / reproduce / plot / config / list`: thin wrappers; the logic lives in importable modules.

Exit codes: 0 every run finished (done, or collapsed: stopped by a collapse rule, a result like any other);
1 some run did not finish (failed, or locked by another runner) or some run could not be plotted; 2 bad
input (one line on stderr, nothing written); 130 interrupted by Ctrl-C. `moe-lab verify`: 1 means some cell
gave other bits on the same machine (moe_lab/audit/verify.py). Commands in modules of their own (COMMANDS) say
their exit codes in their own docstrings.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from importlib import resources
from pathlib import Path

from moe_lab.launch.catalog import BUILTIN, builtin_names
from moe_lab.config import ConfigError, RunConfig, field_table, load_yaml

# Commands that live in a module of their own: each exposes add_parser(subparsers) -> its parser, and
# main(args) -> exit code, and imports its heavy dependencies inside main (the parser is built for every
# command). Adding a command is one line here.
COMMANDS = (
    "moe_lab.audit.check_trace",
    "moe_lab.audit.volatility",
    "moe_lab.launch.progress",
)


def builtin_experiment(name: str) -> dict:
    """An experiment shipped with the package (experiments/*.yaml), read with the safe loader."""
    path = resources.files(BUILTIN).joinpath(f"{name}.yaml")
    if not path.is_file():
        raise ConfigError(f"experiment {name!r}: no such built-in experiment")
    return load_yaml(str(path))


def read_experiment(path: str) -> dict:
    """An experiment file, or a bare RunConfig file (then it is the base of a single 'default' arm)."""
    p = Path(path)
    if not p.exists():
        if (Path("experiments") / f"{path}.yaml").exists():
            p = Path("experiments") / f"{path}.yaml"
        else:
            try:
                return builtin_experiment(path)
            except ConfigError:
                raise ConfigError(f"EXPERIMENT: {path} is neither a file nor a built-in experiment name") from None
    data = load_yaml(str(p))
    if data and set(data) <= set(RunConfig.__dataclass_fields__):
        return {"name": p.stem, "base": data}
    return data


def _csv(text: str | None, cast=str, flag: str = "") -> list | None:
    try:
        return [cast(x) for x in text.split(",") if x.strip()] if text else None
    except ValueError:
        raise ConfigError(f"{flag}={text!r}: allowed a comma-separated list of {cast.__name__}") from None


def _seeds(text: str | None) -> list[int] | None:
    seeds = _csv(text, int, "--seeds")
    if seeds is not None and (not seeds or min(seeds) < 0):
        raise ConfigError(f"--seeds={text!r}: allowed a comma-separated list of integers >= 0")
    return seeds


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="FIELD=VALUE", help="override any config field, e.g. rl.steps=5")
    p.add_argument("--jobs", type=int, default=None, help="parallel worker processes (default: cores / threads)")
    p.add_argument("--arms", default=None, help="comma-separated arms to run (default: all)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the experiment's)")
    p.add_argument("--overwrite", action="store_true", help="replace runs whose config differs from this one")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local worker processes (default), or Ray tasks (pip install -e '.[ray]')")
    p.add_argument("--address", default=None, help="--backend ray: cluster to join, HOST:PORT or auto "
                                                   "(default: start a local one)")
    p.add_argument("--max-retries", type=int, default=3, help="--backend ray: reruns of a cell whose node died")
    p.add_argument("--cpu-isa", default=None, choices=None, metavar="ISA",
                   help="pin the CPU kernels (torch, MKL, oneDNN) to avx2 or avx512 for the whole invocation: the "
                        "bits change and repeat on this machine, but still depend on the processor (measured on two: "
                        "docs/guide.md); ~1.5x slower")
    p.add_argument("--report-to", default=None, metavar="TRACKER",
                   help="also mirror every metric and eval row to a tracker: tensorboard (event files in "
                        "OUT/tensorboard/<run_id>) or wandb (offline unless WANDB_MODE is set, in "
                        "OUT/wandb/<run_id>); needs the [track] extra")


def _run(exp: dict, out: str, args) -> int:
    backend = None
    if args.backend == "ray":
        from moe_lab.launch.ray_backend import RayCells

        backend = RayCells(args.address, args.max_retries)
    from moe_lab.launch.runner import run_experiment

    statuses = run_experiment(exp, Path(out), jobs=args.jobs, overrides=args.overrides, arms=_csv(args.arms),
                              seeds=_seeds(args.seeds), overwrite=args.overwrite, progress=not args.no_progress,
                              report_to=args.report_to, backend=backend)
    _print_summary(Path(out))
    from moe_lab.rl.runlog import FINISHED, STATUS_COLLAPSED

    collapsed = [r for r, s in statuses.items() if s == STATUS_COLLAPSED]
    if collapsed:
        print(f"{len(collapsed)} collapsed (stopped by a collapse rule; finished, see collapse_rule in their "
              f"manifest.json): {', '.join(collapsed)}")
    failed = [r for r, s in statuses.items() if s not in FINISHED]
    if failed:
        print(f"{len(failed)} run(s) did not finish: {', '.join(failed)} (see their manifest.json)")
    return 1 if failed else 0


def _print_summary(out: Path) -> None:
    from moe_lab.analysis.results import format_summary, load_runs, summarize

    metrics, evals = load_runs(out)
    if len(metrics):
        table = summarize(metrics, evals)
        table.to_csv(out / "summary.csv")
        print(format_summary(table))


def _plot(results: str, out: str | None, formats: str) -> int:
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


def _config_table() -> str:
    lines = ["| field | default | allowed | meaning |", "|---|---|---|---|"]
    lines += [f"| `{n}` | `{d}` | {a} | {h} |" for n, d, a, h in field_table()]
    return "\n".join(lines)


def _add_verify_parser(sub) -> None:
    p = sub.add_parser("verify", help="re-run a few cells of a results folder and say whether this machine gives "
                                      "the same bits (moe_lab/audit/verify.py; docs/guide.md)")
    p.add_argument("results", help="results folder (experiment.yaml, runs/<run_id>/config.yaml), e.g. "
                                   "results/reference/golden/default")
    p.add_argument("--cells", default=None, help="cells to re-run: N or all (default 2: the lowest seed of the "
                                                 "first and of the last arm)")
    p.add_argument("--steps", default=None, help="RL steps per cell: K or all (default 3; all = the whole run, "
                                                 "then the primary endpoint is checked against the seed spread)")


def _verify(argv: list[str], args) -> int:
    from moe_lab.audit.verify import pin_like_reference, prepare, recorded_pins, verify

    runs, chosen, steps, exp = prepare(args.results, args.cells, args.steps)
    pin_like_reference(recorded_pins(chosen), argv)  # before any work: kernels are chosen at first use
    return verify(runs, chosen, steps, exp)


def _add_compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="every pair of arms on the endpoints fixed before the runs: difference, Welch "
                                       "95%% interval, exact permutation p (moe_lab/analysis/endpoints.py)")
    p.add_argument("results", help="experiment results folder (its experiment.yaml's endpoints:, else the defaults)")
    p.add_argument("--baseline", default=None, metavar="ARM", help="compare each arm with this one only "
                                                                   "(default: every pair)")
    p.add_argument("--csv", action="store_true", help="print the pairs table as CSV instead of markdown")


def _compare(args) -> int:
    from moe_lab.analysis.contrasts import format_declared, load_declared
    from moe_lab.analysis.endpoints import format_comparison, load_comparison

    from moe_lab.rl.run_folder import ResultsFolder

    folder = ResultsFolder(args.results)  # one reading of its experiment.yaml for the commands below
    spec, per_run, arms, pairs = load_comparison(folder, args.baseline)
    unfinished = per_run.attrs.get("unfinished", [])
    if unfinished:  # stderr: the table itself stays machine-readable with --csv
        print(f"moe-lab: note: {len(unfinished)} run(s) not finished, left out: {', '.join(unfinished)}",
              file=sys.stderr)
    interim = _interim_note(folder)
    if interim:
        print(interim, file=sys.stderr)
    from moe_lab.launch.coldstarts import mixed_notes

    for line in mixed_notes(folder.runs_dir):  # a block mixing two models of one cold-start key
        print(line, file=sys.stderr)
    print(pairs.to_csv(index=False).rstrip() if args.csv else format_comparison(spec, arms, pairs))
    declared = load_declared(args.results, per_run=per_run)
    if len(declared) and not args.csv:  # the contrasts the experiment file fixed before its runs
        print("\n" + format_declared(declared))
    return 0


def _interim_note(results) -> str | None:
    """A line when the folder's experiment (``results``: a path or a run_folder.ResultsFolder) has cells not yet
    finished (never started ones included, which the tables cannot see): an analysis fixed before the runs is the
    one after the last run, not this one."""
    from moe_lab.launch.progress import collect
    from moe_lab.rl.run_folder import as_results

    results = as_results(results)
    try:
        exp, cells = collect(results)
    except ConfigError:  # a folder without the runner's experiment.yaml: nothing to count against
        return None
    finished = sum(c.state == "finished" for c in cells)
    if finished == len(cells):
        return None
    return (f"moe-lab: note: interim: {finished} of {len(cells)} runs of {exp.get('name') or results.path.name} "
            f"finished; an analysis fixed before the runs is the one after the last (moe-lab progress {results.path})")


def _add_forest_parser(sub) -> None:
    p = sub.add_parser("forest", help="one forest plot of the primary-endpoint differences over several results "
                                      "folders (every setting of each), e.g. the rescue, its confirmation and "
                                      "the router controls")
    p.add_argument("results", nargs="+", help="experiment results folders (each read with its own endpoints:)")
    p.add_argument("--out", required=True, help="figure file to write (.png, .pdf or .svg)")
    p.add_argument("--baseline", default="grpo", metavar="ARM", help="each arm against this one (default: grpo)")
    p.add_argument("--arms", default=None, help="comma-separated: only these arms' rows (default: every arm)")
    p.add_argument("--endpoint", default="primary", choices=("primary", "secondary"),
                   help="which fixed endpoint to draw (default: primary)")


def _forest(args) -> int:
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
        raise ValueError(f"--arms={args.arms}: no finished runs of these arms beside --baseline={args.baseline} "
                         "in these folders") from None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100, bbox_inches="tight")
    print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-lab", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run every cell of an experiment file (resumable, parallel)")
    p.add_argument("experiment", help=f"experiment YAML (or a built-in name: {', '.join(builtin_names())}; "
                                      "moe-lab list describes them)")
    p.add_argument("--out", required=True, help="experiment results folder")
    _add_run_args(p)
    p = sub.add_parser("reproduce", help="the main job: cold start, GRPO, GRPO+R2, GRPO+R3, GSPO, GSPO-token, figures")
    p.add_argument("--out", default="results/paper", help="results folder (default: results/paper)")
    _add_run_args(p)
    p = sub.add_parser("plot", help="write every figure the results support")
    p.add_argument("results", help="experiment results folder")
    p.add_argument("--out", default=None, help="figure folder (default: RESULTS/figures)")
    p.add_argument("--format", default="png", help="comma-separated: png,pdf,svg")
    _add_verify_parser(sub)
    _add_compare_parser(sub)
    _add_forest_parser(sub)
    for name in COMMANDS:
        module = importlib.import_module(name)
        module.add_parser(sub).set_defaults(command_main=module.main)
    p = sub.add_parser("config", help="print the table of every config field (markdown)")
    sub.add_parser("list", help="every built-in experiment: first sentence of its description, cells, runtime on "
                                "2 cores")
    return parser


def _interrupted(args, argv: list[str]) -> int:
    if getattr(args, "cmd", None) == "verify":
        print("\nmoe-lab: interrupted; verify re-runs into a temporary folder, now removed: nothing to resume",
              file=sys.stderr)
        return 130
    if getattr(args, "command_main", None) is not None:  # a command of COMMANDS: no runs to resume
        print(f"\nmoe-lab: {args.cmd} interrupted", file=sys.stderr)
        return 130
    out = getattr(args, "out", None)
    print(f"\nmoe-lab: interrupted; unfinished runs are marked 'interrupted' in their manifest.json. Resume with:\n"
          f"  moe-lab {shlex.join(argv)}" + (f"\n(finished runs under {out} are kept)" if out else ""),
          file=sys.stderr)
    return 130


def _quiet_broken_pipe() -> int:
    # The reader (e.g. `| head`) went away: no traceback, and no second error when Python flushes at exit.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        return _interrupted(_parsed(argv), argv)
    except BrokenPipeError:
        return _quiet_broken_pipe()


def _parsed(argv: list[str]):
    try:
        return build_parser().parse_known_args(argv)[0]
    except SystemExit:
        return None


def _main(argv: list[str]) -> int:
    parser = build_parser()
    # FIELD=VALUE overrides may come before or after the options: collect the stray ones here.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or args.cmd not in ("run", "reproduce")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        if args.cmd in ("run", "reproduce"):
            from moe_lab.launch.isa import pin_or_reexec

            pin_or_reexec(args.cpu_isa, argv)  # before any work: kernels are chosen at first use
        if getattr(args, "command_main", None) is not None:
            return args.command_main(args)
        if args.cmd == "run":
            return _run(read_experiment(args.experiment), args.out, args)
        if args.cmd == "reproduce":
            code = _run(builtin_experiment("paper"), args.out, args)
            return max(code, _plot(args.out, None, "png"))
        if args.cmd == "plot":
            return _plot(args.results, args.out, args.format)
        if args.cmd == "compare":
            return _compare(args)
        if args.cmd == "forest":
            return _forest(args)
        if args.cmd == "verify":
            return _verify(argv, args)
        if args.cmd == "list":
            from moe_lab.launch.catalog import catalog, format_catalog

            print(format_catalog(catalog()))
            return 0
        print(_config_table())
        return 0
    except ValueError as exc:  # ConfigError included: bad input gets one line, not a traceback
        print(f"moe-lab: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
