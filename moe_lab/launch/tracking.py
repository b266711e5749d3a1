"""Mirror a run's tables to an experiment tracker (`--report-to tensorboard|wandb`); parquet stays the source.

The mirror is written from the committed tables after the runs of an invocation end (done, failed or
resumed), one tracker folder per run: ``<out>/<tracker>/<run_id>/``. Every finite numeric column of
metrics.parquet is a scalar stepped by ``update`` (one point per minibatch update); every one of eval.parquet
is stepped by ``step``. Rewriting a run's folder first keeps the mirror equal to the tables after a resume.

wandb runs offline unless ``WANDB_MODE`` says otherwise, so that a run needs no account and no network
(`wandb sync OUT/wandb/<run_id>/wandb/offline-run-*` uploads it later). Its history has one global step,
so each row carries its x as a value (``update`` for the metrics, ``eval_step`` for the evals) and every
column is bound to that x with ``define_metric``. With ``WANDB_MODE=online`` each mirroring is a new wandb
run in the experiment's group (a resumed cell appears twice there; the newest is the whole table).
The trackers are optional extras: ``pip install -e ".[track]"``.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pandas as pd

from moe_lab.config import ConfigError
from moe_lab.rl.run_folder import RunFolder
from moe_lab.rl.runlog import RUN_TABLES

ID_COLUMNS = ("step", "minibatch", "update", "seed")
# table file -> the column that steps its scalars
TABLES = {name: x for name, (_, x) in RUN_TABLES.items()}
# wandb: the key each table's x is logged under; the evals' apart from `step`, which wandb reserves
WANDB_STEP_KEYS = {"update": "update", "step": "eval_step"}


def _check_tensorboard() -> None:
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    import tensorboard  # noqa: F401


def _check_wandb() -> None:
    import wandb  # noqa: F401


def check_report_to(name: str) -> None:
    """Refuse an unknown or uninstalled tracker before any work starts."""
    if name not in TRACKERS:
        raise ConfigError(f"--report-to={name!r}: allowed {', '.join(TRACKERS)}")
    try:
        TRACKERS[name][0]()
    except ImportError:
        raise ConfigError(f"--report-to={name}: the {name} package is not installed; "
                          'pip install -e ".[track]"') from None


def _tables(run_dir: Path) -> dict[str, tuple[pd.DataFrame, str]]:
    return {name: (pd.read_parquet(run_dir / name), x) for name, x in TABLES.items() if (run_dir / name).exists()}


def _numeric(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.select_dtypes("number").columns if c not in ID_COLUMNS]


def _rows(frame: pd.DataFrame, x: str):
    """(x value, {column: value}) per row of frame, finite numeric values only."""
    if x not in frame.columns:
        return
    numeric = _numeric(frame)
    for _, row in frame.iterrows():
        yield int(row[x]), {c: float(row[c]) for c in numeric if math.isfinite(float(row[c]))}


def _mirror_tensorboard(run_dir: Path, logdir: Path, tables: dict, group: str | None) -> int:
    from torch.utils.tensorboard import SummaryWriter

    n = 0
    writer = SummaryWriter(log_dir=str(logdir))
    try:
        for frame, x in tables.values():
            for step, values in _rows(frame, x):
                for tag, value in values.items():
                    writer.add_scalar(tag, value, step)
                n += len(values)
    finally:
        writer.close()
    return n


def _run_config(run_dir: Path) -> dict:
    run = RunFolder(run_dir)
    return run.config() if run.config_path.exists() else {}


def _mirror_wandb(run_dir: Path, logdir: Path, tables: dict, group: str | None) -> int:
    import wandb

    logdir.mkdir(parents=True)
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                              save_code=False, x_disable_meta=True)
    run = wandb.init(dir=str(logdir), mode=os.environ.get("WANDB_MODE") or "offline",
                     project=os.environ.get("WANDB_PROJECT") or "moe_lab", group=group, name=run_dir.name,
                     config=_run_config(run_dir), settings=settings)
    n = 0
    try:
        for frame, x in tables.values():
            key = WANDB_STEP_KEYS[x]
            run.define_metric(key, hidden=True)
            for col in _numeric(frame):
                run.define_metric(col, step_metric=key)
            for step, values in _rows(frame, x):
                run.log({key: step, **values})
                n += len(values)
    finally:
        run.finish()
    return n


# name -> (check that the package imports, mirror one run folder)
TRACKERS = {"tensorboard": (_check_tensorboard, _mirror_tensorboard), "wandb": (_check_wandb, _mirror_wandb)}


def mirror_run(run_dir: Path, logdir: Path, report_to: str = "tensorboard", group: str | None = None) -> int:
    """Write run_dir's tables to the tracker under logdir (replaced); returns the scalars written."""
    run_dir, logdir = Path(run_dir), Path(logdir)
    tables = _tables(run_dir)
    if not tables:
        return 0
    shutil.rmtree(logdir, ignore_errors=True)
    return TRACKERS[report_to][1](run_dir, logdir, tables, group)


class TrackerError(ValueError):
    """A tracker failed after the runs ended (e.g. wandb online without a login); the tables are intact."""


def mirror_runs(report_to: str, run_dirs: list[Path], root: Path, group: str | None = None) -> int:
    """Mirror every run folder that has tables to root/<run_id>; returns the scalars written.

    A run the tracker refuses does not stop the others; the first failure is raised after all were tried."""
    check_report_to(report_to)
    n, failed = 0, []
    try:
        for d in (Path(d) for d in run_dirs if Path(d).is_dir()):
            try:
                n += mirror_run(d, Path(root) / d.name, report_to, group)
            except Exception as exc:  # noqa: BLE001 - any tracker fault is reported, the runs are done
                failed.append(f"{d.name}: {type(exc).__name__}: {exc}")
    finally:
        if report_to == "wandb":
            import wandb

            wandb.teardown()  # stop wandb's service process: nothing is left running after the invocation
    if failed:
        raise TrackerError(f"--report-to {report_to}: could not mirror {len(failed)} run(s) ({failed[0]}); "
                           "their tables are complete, rerun the same command to mirror them again")
    return n
