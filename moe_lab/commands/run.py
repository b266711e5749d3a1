"""`moe-lab run EXPERIMENT --out DIR [FIELD=VALUE ...]`: run every cell of an experiment file (resumable, parallel).

Exit codes: 0 every run finished (done, or collapsed: stopped by a collapse rule, a result like any other);
1 some run did not finish (failed, or locked by another runner); 2 bad input (one line on stderr, nothing
written); 130 interrupted by Ctrl-C (unfinished runs are marked 'interrupted': the same command resumes).
"""

from __future__ import annotations

import argparse
import shlex
from importlib import resources
from pathlib import Path

from moe_lab.config import ConfigError, RunConfig, load_yaml
from moe_lab.launch.catalog import BUILTIN, builtin_names

TAKES_OVERRIDES = True


def builtin_experiment(name: str) -> dict:
    """An experiment shipped with the package (experiments/*.yaml), read with the safe loader."""
    path = resources.files(BUILTIN).joinpath(f"{name}.yaml")
    if not path.is_file():
        raise ConfigError(f"experiment {name!r}: no such built-in experiment")
    return _checked(path.read_text(encoding="utf-8"), load_yaml(str(path)), f"experiments/{name}.yaml")


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
    return _checked(p.read_text(encoding="utf-8"), data, str(p))


def _checked(text: str, exp: dict, where: str) -> dict:
    """``exp`` once its file's text passes design.check_tost_named (TOST named -> a margin declared)."""
    from moe_lab.launch.design import check_tost_named

    check_tost_named(text, exp if isinstance(exp, dict) else None, where)
    return exp


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


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The arguments `moe-lab run` and `moe-lab reproduce` share."""
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


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="run every cell of an experiment file (resumable, parallel)")
    p.add_argument("experiment", help=f"experiment YAML (or a built-in name: {', '.join(builtin_names())}; "
                                      "moe-lab list describes them)")
    p.add_argument("--out", required=True, help="experiment results folder")
    add_run_args(p)
    return p


def pin_isa(args) -> None:
    """Before any work (kernels are chosen at first use): re-execute pinned when --cpu-isa asks for it."""
    from moe_lab.launch.isa import pin_or_reexec

    pin_or_reexec(args.cpu_isa, args.argv)


def main(args) -> int:
    pin_isa(args)
    return run_cells(read_experiment(args.experiment), args.out, args)


def run_cells(exp: dict, out: str, args) -> int:
    """Run the cells of ``exp`` into ``out`` as the run arguments say; print the summary; the exit code."""
    backend = None
    if args.backend == "ray":
        from moe_lab.launch.ray_backend import RayCells

        backend = RayCells(args.address, args.max_retries)
    from moe_lab.launch.runner import run_experiment

    statuses = run_experiment(exp, Path(out), jobs=args.jobs, overrides=args.overrides, arms=_csv(args.arms),
                              seeds=_seeds(args.seeds), overwrite=args.overwrite, progress=not args.no_progress,
                              report_to=args.report_to, backend=backend)
    _print_summary(Path(out))
    from moe_lab.store.status import FINISHED, STATUS_COLLAPSED

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


def on_interrupt(args) -> str:
    out = getattr(args, "out", None)
    return (f"\nmoe-lab: interrupted; unfinished runs are marked 'interrupted' in their manifest.json. Resume with:\n"
            f"  moe-lab {shlex.join(args.argv)}" + (f"\n(finished runs under {out} are kept)" if out else ""))
