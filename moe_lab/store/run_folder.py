"""The one reader of what the runner and ``runlog`` leave on disk: a results folder and its run folders.

Layout (file names declared once, in ``runlog``, the writer, and here for the results folder)::

    <results>/experiment.yaml            the experiment as the runner ran it (``ResultsFolder.experiment``)
    <results>/runs/<run_id>/             one ``RunFolder`` per cell: config.yaml, manifest.json, metrics.parquet,
                                         eval.parquet, checkpoint/, .lock (see ``runlog``)
    <results>/coldstarts/<key>.json      each cold start's recipe and weights digest (``rl.coldstart_recipe``)

A manifest is read once per ``RunFolder`` and through one upgrade of older layouts (``upgrade_manifest``), and a
cell's state has one vocabulary, the runner's (declared with every status word in ``runlog``): ``new`` (no config
yet), ``done`` (finished, done or collapsed, and its tables hold what it committed), ``resume`` (anything else the
runner would run on from its checkpoint) or ``conflict`` (the folder holds another config). `moe-lab run`,
`progress`, `compare`, `verify` and `list` all ask ``RunFolder.cell_state`` / ``RunFolder.finished``, so none of
them calls finished a run the runner resumes. Which subfolders are runs is answered once (``run_dirs``), for the
runner's results folders and the tables' experiment folders alike; what the runner says of a run (failed,
interrupted) it writes through ``RunFolder.record`` / ``mark_interrupted``; the rows a run has committed (those no
resume recomputes: what a tracker streams) are ``RunFolder.committed_rows``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from moe_lab.config import load_yaml
from moe_lab.store.checkpoint_state import ResumeError, read_state
from moe_lab.store.files import atomic_write_text, read_json
from moe_lab.store.health import STOP_REASON_PREFIXES
from moe_lab.store.layout import (CHECKPOINT_DIR, COLDSTARTS_DIR, CONFIG_FILE, EVAL_FILE, EXPERIMENT_FILE, LOCK_FILE,
                                  MANIFEST_FILE, METRICS_FILE, RUN_MARKERS, RUN_TABLES, RUNS_DIR)
from moe_lab.store.runlog import RunLock, RunLocked, RunLog, config_state
from moe_lab.store.status import (CELL_CONFLICT, CELL_DONE, CELL_NEW, CELL_RESUME, CONFIG_OTHER, CONFIG_SAME, FINISHED,
                                  STATUS_COLLAPSED, STATUS_DONE, STATUS_FAILED, STATUS_INTERRUPTED, STATUS_UNVERIFIED)

INTERRUPTED_REASON = "stopped by the user (SIGINT); rerun the same command to resume"
# health.stop_reason's openings tell a manifest of a collapse without the 'collapsed' status (status 'failed', no
# traceback) apart from a run that failed on an error.


def run_status(manifest: dict) -> str | None:
    """The manifest's status, reading a 'failed' manifest that a collapse rule wrote (it names the rule, holds a
    stop reason and no traceback: a collapse in committed folders that lack the status) as 'collapsed'."""
    status = manifest.get("status")
    if (status == STATUS_FAILED and manifest.get("collapse_rule") and "traceback" not in manifest
            and str(manifest.get("reason", "")).startswith(STOP_REASON_PREFIXES)):
        return STATUS_COLLAPSED
    return status


def first_segments(manifest: dict) -> list[dict]:
    """The manifest's ``segments`` (moe_lab.rl.loop.provenance); for a manifest without them,
    one segment of what it recorded at top level (its last start's step, machine and cold start), or none when it
    recorded no cold start."""
    segments = manifest.get("segments") or ()
    if not segments and "coldstart" in manifest:
        segments = [{"from_step": manifest.get("resumed_from_step"), "machine": manifest.get("machine"),
                     "coldstart": manifest["coldstart"]}]
    return list(segments)


def upgrade_manifest(raw: dict) -> dict:
    """A manifest of any layout in today's: the status as ``run_status`` reads it and ``segments`` as
    ``first_segments`` gives them (absent when there are none). The raw manifest is not changed."""
    manifest = dict(raw)
    if "status" in raw:
        manifest["status"] = run_status(raw)
    segments = first_segments(raw)
    if segments:
        manifest["segments"] = segments
    return manifest


def is_run_dir(path: str | Path) -> bool:
    """Whether a folder is a run folder: it holds a manifest, a metrics table or a config."""
    return any((Path(path) / name).exists() for name in RUN_MARKERS)


def run_dirs(folder: str | Path, with_manifest: bool = False) -> list[Path]:
    """The run folders among ``folder``'s subfolders, in name order (only those holding a manifest with
    ``with_manifest``): the one answer to which subfolders are runs, for the runner's runs/ and the tables alike; a
    stray subfolder (notes, plots) is none."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = sorted(p for p in folder.iterdir() if p.is_dir() and is_run_dir(p))
    return [p for p in found if not with_manifest or (p / MANIFEST_FILE).is_file()]


def runs_under(path: str | Path) -> list[Path]:
    """The run folders of an experiment folder (under its runs/), of a runs/ folder, or a run folder itself."""
    path = Path(path)
    if is_run_dir(path):
        return [path]
    return run_dirs(path / RUNS_DIR if (path / RUNS_DIR).is_dir() else path)


def experiment_name(run_dir: str | Path) -> str:
    """The name of the experiment folder a run folder sits in (under its runs/, or directly)."""
    run_dir = Path(run_dir)
    return run_dir.parent.parent.name if run_dir.parent.name == RUNS_DIR else run_dir.parent.name


def _table_rows(path: Path) -> int:
    """Rows of a parquet table from its footer (0 for a missing file): what a row count needs, no column read."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows if path.exists() else 0


def _member(name: str) -> property:
    """The path of one of a run folder's files, named once in store/runlog.py."""
    return property(lambda self: self.path / name, doc=f"path of the run's {name}")


class RunFolder:
    """One run folder; its manifest read on first use (upgraded), then kept."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    @property
    def run_id(self) -> str:
        return self.path.name

    config_path = _member(CONFIG_FILE)
    manifest_path = _member(MANIFEST_FILE)
    metrics_path = _member(METRICS_FILE)
    eval_path = _member(EVAL_FILE)
    lock_path = _member(LOCK_FILE)
    checkpoint_dir = _member(CHECKPOINT_DIR)

    @functools.cached_property
    def manifest(self) -> dict:
        """The manifest in today's layout ({} without one); a ValueError naming the file for a broken one."""
        return upgrade_manifest(read_json(self.manifest_path))

    @property
    def status(self) -> str | None:
        return self.manifest.get("status")

    def config(self, upgraded: bool = True) -> dict:
        """config.yaml as a mapping, read like any old config (config.legacy) unless ``upgraded`` is False."""
        from moe_lab.config import upgrade_run_config

        data = load_yaml(str(self.config_path))
        return upgrade_run_config(data) if upgraded else data

    def finished(self) -> str | None:
        """'done' or 'collapsed' for a finished run whose tables hold what it committed (never recomputed), else
        None: the runner resumes it."""
        return self.status if self.status in FINISHED and self._tables_committed() else None

    def verified_status(self) -> str | None:
        """The manifest's status, STATUS_UNVERIFIED in place of a finished one that ``finished`` does not confirm."""
        return STATUS_UNVERIFIED if self.status in FINISHED and not self.finished() else self.status

    def _tables_committed(self) -> bool:
        """The final checkpoint's rows, verified with their digests, or the row counts of the manifest (a folder
        trimmed of checkpoint/, or a collapsed run: it stops after its last checkpoint, with more rows than that)."""
        try:
            committed = read_state(self.checkpoint_dir) is not None
        except ResumeError:
            return False  # resumed: train() refuses with the message naming the file, and the run is not 'done'
        if committed and self.status == STATUS_DONE:
            return True
        if not self.metrics_path.exists():
            return False
        return all(_table_rows(self.path / name) >= self.manifest[key] for name, (key, _) in RUN_TABLES.items()
                   if key in self.manifest)

    def committed_rows(self) -> dict[str, int]:
        """{table file: rows} the run has committed, which no resume recomputes (the rows after them may come back
        different): a finished run's counts (its manifest's, else its final checkpoint's, else its whole tables), else
        its last checkpoint's ({} before the first, or when its tables do not match it). A table on disk always holds
        at least the rows committed when it is read after the counts."""
        try:
            got = read_state(self.checkpoint_dir)
        except ValueError:  # ResumeError, or a half-read marker: nothing committed that can be trusted
            got = None
        state = got[0] if got else {}
        if self.finished():
            return {name: int(self.manifest.get(key, state.get(key, _table_rows(self.path / name))))
                    for name, (key, _) in RUN_TABLES.items()}
        return {name: int(state[key]) for name, (key, _) in RUN_TABLES.items() if key in state}

    def record(self, status: str, info: dict, reason: str = "", **extra) -> None:
        """Write what the runner says of this run (failed, interrupted) into its manifest through the run log, the
        one writer of manifests; the caller holds the folder's lock. ``info``: the run's id columns (loop.run_info)."""
        RunLog(self.path, info).write_manifest(status, reason, **extra)
        self.__dict__.pop("manifest", None)  # the next reading is of the file as written

    def mark_interrupted(self, info: dict) -> bool:
        """Mark a run that started and neither finished nor failed 'interrupted', under its lock; a folder another
        runner holds, or with an unreadable manifest, is left alone. Whether it was marked."""
        try:
            manifest = self.manifest
        except ValueError:
            return False
        if not manifest or manifest.get("status") in (*FINISHED, STATUS_FAILED):
            return False
        try:
            lock = RunLock(self.path).acquire()
        except RunLocked:
            return False  # another runner's cell: not ours to mark
        with lock:
            self.record(STATUS_INTERRUPTED, info, INTERRUPTED_REASON)
        return True

    def cell_state(self, config_text: str) -> str:
        """The runner's state of this folder for a cell of config ``config_text`` (one of CELL_STATES)."""
        state = config_state(self.path, config_text)
        if state != CONFIG_SAME:
            return CELL_CONFLICT if state == CONFIG_OTHER else CELL_NEW
        return CELL_DONE if self.finished() else CELL_RESUME

    def live_pid(self) -> int | None:
        """The pid written in .lock if that process is alive (read only: taking the flock to test it would make a
        starting runner skip the cell as locked)."""
        try:
            pid = int(self.lock_path.read_text(encoding="ascii").strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid

    def steps_logged(self) -> int:
        """RL steps in the metrics table (a manifest counts them only when the run ends). The table is replaced
        atomically, so a read during a write sees the old or the new one, never half."""
        import pandas as pd

        if not self.metrics_path.exists():
            return 0
        step = pd.read_parquet(self.metrics_path, columns=["step"])["step"]
        return int(step.max()) + 1 if len(step) else 0


class ResultsFolder:
    """The --out folder of `moe-lab run`: experiment.yaml and runs/; the experiment read on first use, then kept."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"ResultsFolder({str(self.path)!r})"

    @property
    def experiment_path(self) -> Path:
        return self.path / EXPERIMENT_FILE

    @property
    def runs_dir(self) -> Path:
        return self.path / RUNS_DIR

    @property
    def coldstarts_dir(self) -> Path:
        """The cold starts' recipes; in references made before recipes, their weights (one folder per key)."""
        return self.path / COLDSTARTS_DIR

    def coldstart_recipe(self, key: str) -> Path:
        return self.coldstarts_dir / f"{key}.json"

    @functools.cached_property
    def _experiment(self) -> dict | None:
        return load_yaml(str(self.experiment_path)) if self.experiment_path.is_file() else None

    def experiment(self) -> dict | None:
        """The experiment the runner wrote (None without the file; a ConfigError naming it when unreadable)."""
        return self._experiment

    def write_experiment(self, exp: dict) -> None:
        import yaml

        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.experiment_path, yaml.safe_dump(exp, sort_keys=False))
        self.__dict__.pop("_experiment", None)  # the next reading is of the file as written

    def run(self, run_id: str) -> RunFolder:
        return RunFolder(self.runs_dir / run_id)

    def run_folders(self, with_manifest: bool = False) -> list[RunFolder]:
        """The run folders under runs/ (``run_dirs``), in name order."""
        return [RunFolder(p) for p in run_dirs(self.runs_dir, with_manifest)]


def as_results(folder: str | Path | ResultsFolder) -> ResultsFolder:
    """A ResultsFolder for a path (the same object for one): callers that share one read the experiment once."""
    return folder if isinstance(folder, ResultsFolder) else ResultsFolder(folder)
