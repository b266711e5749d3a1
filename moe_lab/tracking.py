"""Mirror a run's tables to an experiment tracker (`--report-to tensorboard`); parquet stays the source of truth.

The mirror is written from the committed tables after the runs of an invocation end (done, failed or
resumed), one tracker folder per run: ``<out>/tensorboard/<run_id>/``. Every numeric column of
metrics.parquet is a scalar at global step ``update`` (one point per minibatch update); every numeric column
of eval.parquet at step ``step``. Rewriting a run's folder first keeps the mirror equal to the tables after a
resume. The tracker is an optional extra: ``pip install -e ".[track]"``.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pandas as pd

from moe_lab.config import ConfigError

TRACKERS = ("tensorboard",)
ID_COLUMNS = ("step", "minibatch", "update", "seed")


def check_report_to(name: str) -> None:
    """Refuse an unknown or uninstalled tracker before any work starts."""
    if name not in TRACKERS:
        raise ConfigError(f"--report-to={name!r}: allowed {', '.join(TRACKERS)}")
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(f"--report-to={name}: the tensorboard package is not installed; "
                          'pip install -e ".[track]"') from None


def _scalars(frame: pd.DataFrame, x: str):
    """(tag, value, step) for every finite numeric value of frame, stepped by column x."""
    if x not in frame.columns:
        return
    numeric = [c for c in frame.select_dtypes("number").columns if c not in ID_COLUMNS]
    for _, row in frame.iterrows():
        for col in numeric:
            value = float(row[col])
            if math.isfinite(value):
                yield col, value, int(row[x])


def mirror_run(run_dir: Path, logdir: Path) -> int:
    """Write run_dir's tables as tensorboard scalars under logdir (replaced); returns the scalars written."""
    from torch.utils.tensorboard import SummaryWriter

    run_dir, logdir = Path(run_dir), Path(logdir)
    frames = {}
    for name, x in (("metrics.parquet", "update"), ("eval.parquet", "step")):
        if (run_dir / name).exists():
            frames[name] = (pd.read_parquet(run_dir / name), x)
    if not frames:
        return 0
    shutil.rmtree(logdir, ignore_errors=True)
    n = 0
    writer = SummaryWriter(log_dir=str(logdir))
    try:
        for frame, x in frames.values():
            for tag, value, step in _scalars(frame, x):
                writer.add_scalar(tag, value, step)
                n += 1
    finally:
        writer.close()
    return n


def mirror_runs(report_to: str, run_dirs: list[Path], root: Path) -> int:
    """Mirror every run folder that has tables to root/<run_id>; returns the scalars written."""
    check_report_to(report_to)
    return sum(mirror_run(d, Path(root) / Path(d).name) for d in run_dirs if Path(d).is_dir())
