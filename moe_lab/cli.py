"""`moe-lab run / reproduce / plot / config`: thin wrappers; the logic lives in importable modules."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from moe_lab.config import ConfigError, RunConfig, field_table, load_yaml

BUILTIN = "moe_lab.experiments"


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


def _csv(text: str | None, cast=str) -> list | None:
    return [cast(x) for x in text.split(",") if x.strip()] if text else None


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


def _run(exp: dict, out: str, args) -> int:
    common = dict(overrides=args.overrides, arms=_csv(args.arms), seeds=_csv(args.seeds, int),
                  overwrite=args.overwrite, progress=not args.no_progress)
    if args.backend == "ray":
        from moe_lab.ray_backend import run_experiment_ray

        statuses = run_experiment_ray(exp, Path(out), address=args.address, max_retries=args.max_retries, **common)
    else:
        from moe_lab.runner import run_experiment

        statuses = run_experiment(exp, Path(out), jobs=args.jobs, **common)
    _print_summary(Path(out))
    failed = [r for r, s in statuses.items() if s != "done"]
    if failed:
        print(f"{len(failed)} run(s) did not finish: {', '.join(failed)} (see their manifest.json)")
    return 1 if failed else 0


def _print_summary(out: Path) -> None:
    from moe_lab.results import format_summary, load_runs, summarize

    metrics, evals = load_runs(out)
    if len(metrics):
        table = summarize(metrics, evals)
        table.to_csv(out / "summary.csv")
        print(format_summary(table))


def _plot(results: str, out: str | None, formats: str) -> list[Path]:
    from moe_lab.figures import write_figures

    paths = write_figures(Path(results), Path(out) if out else None, formats=tuple(_csv(formats)))
    for p in paths:
        print(f"wrote {p}")
    return paths


def _config_table() -> str:
    lines = ["| field | default | allowed | meaning |", "|---|---|---|---|"]
    lines += [f"| `{n}` | `{d}` | {a} | {h} |" for n, d, a, h in field_table()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-lab", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run every cell of an experiment file (resumable, parallel)")
    p.add_argument("experiment", help="experiment YAML (or a built-in name: paper, smoke, clip_sweep, volatility_sweep)")
    p.add_argument("--out", required=True, help="experiment results folder")
    _add_run_args(p)
    p = sub.add_parser("reproduce", help="the main job: cold start, GRPO, GRPO+R2, GRPO+R3, GSPO, GSPO-token, figures")
    p.add_argument("--out", default="results/paper", help="results folder (default: results/paper)")
    _add_run_args(p)
    p = sub.add_parser("plot", help="write every figure the results support")
    p.add_argument("results", help="experiment results folder")
    p.add_argument("--out", default=None, help="figure folder (default: RESULTS/figures)")
    p.add_argument("--format", default="png", help="comma-separated: png,pdf,svg")
    p = sub.add_parser("config", help="print the table of every config field (markdown)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # FIELD=VALUE overrides may come before or after the options: collect the stray ones here.
    args, extra = parser.parse_known_args(argv)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or args.cmd not in ("run", "reproduce")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        if args.cmd == "run":
            return _run(read_experiment(args.experiment), args.out, args)
        if args.cmd == "reproduce":
            code = _run(builtin_experiment("paper"), args.out, args)
            _plot(args.out, None, "png")
            return code
        if args.cmd == "plot":
            return 0 if _plot(args.results, args.out, args.format) else 1
        print(_config_table())
        return 0
    except ValueError as exc:  # ConfigError included: bad input gets one line, not a traceback
        print(f"moe-lab: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
