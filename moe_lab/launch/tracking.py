"""Stream each run's rows to an experiment tracker while it runs (`--report-to tensorboard|wandb`); parquet stays the
source.

While the runner's cells run, a follower thread in the runner's process reads their run folders every ``POLL_S``
seconds and hands each run's tracker sink the rows committed since its last look (``RunFolder.committed_rows``: the
rows the last checkpoint, or a finished run's manifest, counts; the rows after a checkpoint wait for the next one, as
a resume recomputes them), the way TRL's callbacks and torchtitan's metric logger log as training goes; a last pass
when the cells end sends the rest, and the rows of cells finished before. The training code knows nothing of it
(rl/ sits below launch/, and a run's rows and resume stay as they are): data goes one way, run folder -> tracker.

Each row reaches the tracker once, in order, across interruptions and resumes: what was sent is recorded beside
the tracker's files (``<out>/<tracker>/<run_id>/streamed.json``: rows and a digest per table) and the next
invocation goes on from there. A record that the run's tables no longer begin with (the run was replaced by
--overwrite, or restarted), or a tracker folder without one (a mirror of older code), is emptied and the run sent
again from its first row. Every finite numeric column of metrics.parquet is a scalar stepped by ``update`` (one
point per minibatch update); every one of eval.parquet is stepped by ``step``.

wandb runs offline unless ``WANDB_MODE`` says otherwise, so that a run needs no account and no network
(`wandb sync OUT/wandb/<run_id>/wandb/offline-run-*` uploads it later). Its history has one global step,
so each row carries its x as a value (``update`` for the metrics, ``eval_step`` for the evals) and every
column is bound to that x with ``define_metric``. A sink opens on its run's first rows to send: an invocation
with nothing new for a run leaves its tracker files as they are. Online, a resumed cell's later rows continue its
wandb run (one id per results folder and run, ``resume="allow"``); offline each invocation that sent rows leaves
its own offline run holding them. The trackers are optional extras: ``pip install -e ".[track]"``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import threading
from pathlib import Path
from typing import Protocol

import pandas as pd

from moe_lab.config import ConfigError
from moe_lab.store.run_folder import RunFolder
from moe_lab.store.files import atomic_write_text, rows_digest
from moe_lab.store.layout import RUN_TABLES

ID_COLUMNS = ("step", "minibatch", "update", "seed")
# wandb: the key each table's x is logged under; the evals' apart from `step`, which wandb reserves
WANDB_STEP_KEYS = {"update": "update", "step": "eval_step"}
# seconds between two looks of the follower at the running cells' folders
POLL_S = 5.0
# what was sent of a run, beside its tracker files: {table file: {"rows": n, "sha256": digest of those rows}}
STREAMED_FILE = "streamed.json"


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


def _numeric(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.select_dtypes("number").columns if c not in ID_COLUMNS]


def scalar_rows(frame: pd.DataFrame, x: str):
    """(x value, {column: value}) per row of a slice of a run's table, finite numeric values only (the numeric
    columns are the whole table's: a slice keeps its dtypes)."""
    if x not in frame.columns:
        return
    numeric = _numeric(frame)
    for _, row in frame.iterrows():
        yield int(row[x]), {c: float(row[c]) for c in numeric if math.isfinite(float(row[c]))}


class Sink(Protocol):
    """Where one run's rows go, in order, each once: ``log`` a slice of one of its tables (``x``: the column that
    steps it) and return the scalars written; ``flush`` before what was sent is recorded; ``close`` at the end."""

    def log(self, frame: pd.DataFrame, x: str) -> int: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """A run's scalars into a SummaryWriter on its tracker folder (a later invocation adds an event file to it)."""

    def __init__(self, run_dir: Path, logdir: Path, group: str | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(logdir))

    def log(self, frame: pd.DataFrame, x: str) -> int:
        n = 0
        for step, values in scalar_rows(frame, x):
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
            n += len(values)
        return n

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _run_config(run_dir: Path) -> dict:
    run = RunFolder(run_dir)
    return run.config() if run.config_path.exists() else {}


class WandbSink:
    """A run's rows into one wandb run (offline unless WANDB_MODE says otherwise), each row carrying its x."""

    def __init__(self, run_dir: Path, logdir: Path, group: str | None):
        import wandb

        logdir.mkdir(parents=True, exist_ok=True)
        mode = os.environ.get("WANDB_MODE") or "offline"
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                  save_code=False, x_disable_meta=True)
        # online, a resumed cell goes on in its wandb run: one id per results folder and run
        resume = dict(id=hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16],
                      resume="allow") if mode == "online" else {}
        self.run = wandb.init(dir=str(logdir), mode=mode, project=os.environ.get("WANDB_PROJECT") or "moe_lab",
                              group=group, name=Path(run_dir).name, config=_run_config(run_dir), settings=settings,
                              **resume)

    def log(self, frame: pd.DataFrame, x: str) -> int:
        key, n = WANDB_STEP_KEYS[x], 0
        self.run.define_metric(key, hidden=True)
        for col in _numeric(frame):
            self.run.define_metric(col, step_metric=key)
        for step, values in scalar_rows(frame, x):
            self.run.log({key: step, **values})
            n += len(values)
        return n

    def flush(self) -> None:
        """wandb writes its run file as it goes: nothing to force."""

    def close(self) -> None:
        self.run.finish()


# name -> (check that the package imports, the sink of one run: (run_dir, logdir, group) -> Sink)
TRACKERS = {"tensorboard": (_check_tensorboard, TensorBoardSink), "wandb": (_check_wandb, WandbSink)}


class RunStream:
    """One run's rows on their way to a tracker: what was sent (read from and recorded in its tracker folder), the
    sink opened on the first rows to send. ``complete``: the run is finished and all of it was sent."""

    def __init__(self, run_dir: Path, logdir: Path, open_sink):
        self.run_dir, self.logdir, self.open_sink = Path(run_dir), Path(logdir), open_sink
        self.sent: dict | None = None  # read on the first look
        self.sink: Sink | None = None
        self.complete = False

    @property
    def record_path(self) -> Path:
        return self.logdir / STREAMED_FILE

    def poll(self) -> int:
        """Send the rows committed since the last look; the scalars written."""
        folder = RunFolder(self.run_dir)
        committed = folder.committed_rows()  # the counts before the tables: a table holds at least them
        if self.sent is None:
            self.sent = self._recorded(committed)
        n = 0
        for name, (_, x) in RUN_TABLES.items():
            done, upto = self.sent.get(name, {}).get("rows", 0), committed.get(name, 0)
            if upto <= done:
                continue
            frame = pd.read_parquet(self.run_dir / name)
            if self.sink is None:
                self.sink = self.open_sink(self.run_dir, self.logdir)
            n += self.sink.log(frame.iloc[done:upto], x)
            self.sink.flush()
            self.sent[name] = {"rows": upto, "sha256": rows_digest(frame.iloc[:upto].to_dict("records"))}
            self.logdir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.record_path, json.dumps(self.sent, indent=2))
        self.complete = folder.finished() is not None and all(
            self.sent.get(name, {}).get("rows", 0) >= k for name, k in committed.items())
        return n

    def _recorded(self, committed: dict[str, int]) -> dict:
        """What an earlier invocation sent, if the run's tables still begin with it; else {} and an empty folder."""
        try:
            sent = json.loads(self.record_path.read_text(encoding="utf-8")) if self.record_path.is_file() else None
        except ValueError:
            sent = None
        if sent is not None and all(self._holds(name, rec, committed) for name, rec in sent.items()):
            return sent
        shutil.rmtree(self.logdir, ignore_errors=True)  # another run's rows, or an older mirror's: sent again
        return {}

    def _holds(self, name: str, rec: dict, committed: dict[str, int]) -> bool:
        if not rec.get("rows"):
            return True
        if committed.get(name, 0) < rec["rows"]:
            return False
        rows = pd.read_parquet(self.run_dir / name).iloc[:rec["rows"]].to_dict("records")
        return rows_digest(rows) == rec.get("sha256")

    def close(self) -> None:
        if self.sink is not None:
            sink, self.sink = self.sink, None
            sink.close()


class TrackerError(ValueError):
    """A tracker failed (e.g. wandb online without a login); the runs went on and their tables are intact."""


class TrackerStream:
    """The runner's tracker: a RunStream per run folder, looked at by a thread every ``poll_s`` while the cells run
    (``start``) and once more when they end (``finish``). A run the tracker refuses is not streamed further and
    never stops the runs: ``finish`` raises TrackerError naming the first, after every other run was sent."""

    def __init__(self, report_to: str, run_dirs: list[Path], root: Path, group: str | None = None,
                 poll_s: float | None = None):
        check_report_to(report_to)
        sink = TRACKERS[report_to][1]
        self.report_to, self.poll_s = report_to, POLL_S if poll_s is None else poll_s
        self.streams = [RunStream(d, Path(root) / d.name, lambda run, logdir: sink(run, logdir, group))
                        for d in map(Path, run_dirs)]
        self.failed: dict[str, str] = {}
        self.scalars = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "TrackerStream":
        self._thread = threading.Thread(target=self._follow, daemon=True, name="tracker-stream")
        self._thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """One look at every run not yet complete nor refused."""
        for stream in self.streams:
            run_id = stream.run_dir.name
            if stream.complete or run_id in self.failed or not stream.run_dir.is_dir():
                continue
            try:
                self.scalars += stream.poll()
            except Exception as exc:  # noqa: BLE001 - any tracker fault is reported after the runs, which go on
                self.failed[run_id] = f"{type(exc).__name__}: {exc}"
                _close_quietly(stream)

    def stop(self) -> None:
        """Stop the thread (its current look ends first) and close every sink."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for stream in self.streams:
            _close_quietly(stream)
        if self.report_to == "wandb":
            import wandb

            wandb.teardown()  # stop wandb's service process: nothing is left running after the invocation

    def finish(self) -> int:
        """Stop following, send what the runs committed since, close; the scalars written in all."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.poll()
        finally:
            self.stop()
        if self.failed:
            first = next(iter(self.failed.items()))
            raise TrackerError(f"--report-to {self.report_to}: could not stream {len(self.failed)} run(s) "
                               f"({first[0]}: {first[1]}); their tables are complete, rerun the same command to "
                               "send the rest")
        return self.scalars


def _close_quietly(stream: RunStream) -> None:
    try:
        stream.close()
    except Exception:  # noqa: BLE001 - a sink that cannot close has already been reported or will be
        pass


def mirror_runs(report_to: str, run_dirs: list[Path], root: Path, group: str | None = None) -> int:
    """Send every run folder's committed rows not yet sent to root/<run_id> in one pass; returns the scalars written
    (TrackerError after all were tried when the tracker refused some)."""
    return TrackerStream(report_to, run_dirs, root, group).finish()
