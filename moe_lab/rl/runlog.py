"""What a run leaves on disk: its rows, resolved config, manifest and resumable checkpoint.

Layout of one run folder::

    config.yaml        the resolved RunConfig (safe YAML)
    manifest.json      status, reason, seed, versions, git commit, timings
    metrics.parquet    one row per minibatch update (see docs/metrics.md)
    eval.parquet       one row per evaluation
    checkpoint/        model.safetensors, optim.pt (tensors only), state.json (the commit marker)

Every write goes to a temporary file first, is fsynced and renamed into place, and the folder is fsynced,
so a run killed at any moment (or a machine that loses power) leaves either the old or the new file, never
half of one. Results are world-readable under the user's umask (0644 files), not mkstemp's 0600. Nothing
here unpickles: optimizer state is loaded with ``weights_only=True`` and configs with the safe YAML loader.

One writer per run folder: ``RunLock`` holds an advisory ``flock`` on ``<run>/.lock``; the OS releases it
when the holder dies, so a stale lock never blocks a resume.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import math
import numbers
import os
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from moe_lab.config.constants import MACHINE_ENV
from moe_lab.rl.cpuinfo import processor_info
from moe_lab.config import ConfigError, dump_yaml, from_dict, load_yaml, upgrade_run_config, validate

# --- The one status vocabulary of a run folder: every word the manifest, the runner, `moe-lab progress` and the
# tables give a run or a cell, declared here once; every reader and writer takes its words from here.
# A manifest's "status" (the strings committed results hold: never change one):
STATUS_DONE = "done"                # every step ran: finished and final (never recomputed)
STATUS_COLLAPSED = "collapsed"      # a collapse rule of moe_lab/rl/health.py stopped it: finished and final like done
STATUS_RUNNING = "running"          # a process trains it (or did, and was killed: then a reader says STATUS_STOPPED)
STATUS_FAILED = "failed"            # an exception ended it (its traceback in the manifest); the runner resumes it
STATUS_INTERRUPTED = "interrupted"  # Ctrl-C stopped it and the runner marked it; the runner resumes it
MANIFEST_STATUSES = (STATUS_DONE, STATUS_COLLAPSED, STATUS_RUNNING, STATUS_FAILED, STATUS_INTERRUPTED)
FINISHED = (STATUS_DONE, STATUS_COLLAPSED)
# What readers and the runner say of a run, never written into a manifest:
STATUS_UNVERIFIED = "unverified"  # says finished, but its tables do not hold the rows it committed: the runner reruns it
STATUS_STOPPED = "stopped"        # says running, but no live process holds its .lock: it resumes from its checkpoint
STATUS_LOCKED = "locked"          # the runner's outcome for a cell another runner holds ('locked: <why>'; nothing written)
# The runner's state of a cell's folder (rl/run_folder.py RunFolder.cell_state): no config yet; finished (done or
# collapsed, its tables verified); anything else it runs on from its checkpoint; the folder holds another config.
CELL_NEW, CELL_DONE, CELL_RESUME, CELL_CONFLICT = "new", "done", "resume", "conflict"
CELL_STATES = (CELL_NEW, CELL_DONE, CELL_RESUME, CELL_CONFLICT)
# `moe-lab progress`'s word for each cell, in the order it prints them: the cell states in words (done: finished,
# conflict: other config, new: not started), a resumed cell told apart by its manifest and its .lock.
PROGRESS_FINISHED, PROGRESS_CONFLICT, PROGRESS_NEW = "finished", "other config", "not started"
PROGRESS_STATES = (PROGRESS_FINISHED, STATUS_RUNNING, STATUS_STOPPED, STATUS_INTERRUPTED, STATUS_FAILED,
                   STATUS_UNVERIFIED, PROGRESS_CONFLICT, PROGRESS_NEW)
# the files of a run folder (the layout above): every reader takes them from here (rl/run_folder.py)
CONFIG_FILE, MANIFEST_FILE, METRICS_FILE, EVAL_FILE = "config.yaml", "manifest.json", "metrics.parquet", "eval.parquet"
CHECKPOINT_DIR, LOCK_FILE = "checkpoint", ".lock"
# each table of a run: its file -> (the manifest / checkpoint field counting its committed rows, the column that
# steps it: a tracker's x axis)
RUN_TABLES = {METRICS_FILE: ("rows", "update"), EVAL_FILE: ("eval_rows", "step")}


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def public_mode(path: str | Path, directory: bool = False) -> None:
    """0644 files / 0755 folders under the umask: mkstemp and mkdtemp create 0600 / 0700."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a folder's entries (the renames into it), to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        _discard(tmp)
        raise
    _publish(tmp, path)


def _publish(tmp: str, path: Path) -> None:
    """Move a written, fsynced temp file into place (0644, folder fsynced); the temp file never stays behind."""
    try:
        public_mode(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        _discard(tmp)
        raise


def _discard(tmp: str) -> None:
    if os.path.exists(tmp):
        os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_parquet(path: Path, rows: list[dict]) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    import pandas as pd  # here, not at the top: every `moe-lab` command imports this module (~0.4 s for pandas)

    frame = pd.DataFrame(rows)
    text_columns = [c for c in frame.columns if frame[c].dtype == object]
    try:
        # zstd, dictionaries only for the id strings, no per-column statistics or arrow schema blob:
        # a results table is ~40% of the default size, and reads back identically.
        frame.to_parquet(tmp, index=False, compression="zstd", compression_level=19, use_dictionary=text_columns,
                         write_statistics=False, store_schema=False)
        fsync_path(tmp)
    except BaseException:
        _discard(tmp)
        raise
    _publish(tmp, path)


def read_rows(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    import pandas as pd

    return pd.read_parquet(path).to_dict("records")


def read_json(path: Path) -> dict:
    """{} for a missing file; a ValueError naming the file for one that is not a JSON mapping."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); restore it or delete the run folder") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}; restore it or delete the run folder")
    return data


def _canonical(value: Any) -> str:
    # Numbers by their float value: a column read back from parquet may come back float where an int was
    # written (or NaN where None was), and the same rows must give the same digest.
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "null"
    if isinstance(value, (bool, str)) or not isinstance(value, numbers.Real):
        return repr(value)
    f = float(value)
    return "null" if math.isnan(f) else f.hex()


def rows_digest(rows: list[dict]) -> str:
    """sha256 of rows (order and values; dict order ignored): what a checkpoint commits of a table."""
    h = hashlib.sha256()
    for row in rows:
        h.update("\x1e".join(f"{k}\x1f{_canonical(v)}" for k, v in sorted(row.items())).encode("utf-8"))
        h.update(b"\x1d")
    return h.hexdigest()


class RunLocked(RuntimeError):
    """Another process holds the run folder's lock."""


class RunLock:
    """Exclusive advisory lock on a run folder (``flock``, released by the OS when the holder dies)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise RunLocked(f"{self.path.parent} is locked by another runner (pid {holder}); skipped") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode("ascii"), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self if self.fd is not None else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """HEAD of the checkout when this process first asks: a worker keeps the code it imported for its whole
    life, so a commit made while it runs must not be written into its later manifests: they would name code the run never ran
    (replay_rescue_confirm's committed manifests do: each names the HEAD at its run's end)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def package_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for name in ("moe_lab", "torch", "transformers", "pandas", "numpy", "safetensors"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def machine_info() -> dict[str, Any]:
    """What decides a CPU run's floating-point results besides the code: the kernels torch dispatches to
    (cpu_capability), the BLAS it was built with, the intra-op thread count, the env vars that pin them, and
    the processor (``cpu``: MKL and oneDNN also choose code paths by its model; moe_lab/rl/cpuinfo.py)."""
    import torch

    build = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=([^,\s]+)", build)
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "blas": blas and blas.group(1),
            "mkl": torch.backends.mkl.is_available(), "mkldnn": torch.backends.mkldnn.is_available(),
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "env": {k: os.environ[k] for k in MACHINE_ENV if k in os.environ}, "cpu": processor_info()}


def config_state(run_dir: Path, config_text: str) -> str:
    """'new' (no config yet), 'same' (this very config: a resume or a finished run) or 'other'.

    A config.yaml may lack fields its writer did not have: it is read back with the values it ran with
    (``upgrade_run_config``: their defaults, or the legacy value of a field whose default changed results) and
    compared again, so adding a field does not turn every finished run, committed references included, into a
    conflict, and a run of the old behaviour is never taken for one of the new."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        return "new"
    if path.read_text(encoding="utf-8") == config_text:
        return "same"
    try:
        upgraded = dump_yaml(validate(from_dict(upgrade_run_config(load_yaml(str(path))))))
    except (ConfigError, OSError):
        return "other"
    return "same" if upgraded == config_text else "other"


class RunLog:
    """The rows and status of one run, flushed atomically together with each checkpoint."""

    def __init__(self, run_dir: Path, run_info: dict[str, Any]):
        self.dir = Path(run_dir)
        self.info = dict(run_info)
        self.rows: list[dict] = []
        self.eval_rows: list[dict] = []
        self.started = time.time()

    @property
    def manifest_path(self) -> Path:
        return self.dir / MANIFEST_FILE

    def load(self, n_rows: int, n_eval: int) -> None:
        """Resume: keep exactly the rows the last checkpoint committed (none lost, none duplicated)."""
        self.rows = read_rows(self.dir / METRICS_FILE)[:n_rows]
        self.eval_rows = read_rows(self.dir / EVAL_FILE)[:n_eval]

    def add(self, row: dict) -> None:
        self.rows.append({**self.info, **row})

    def add_eval(self, row: dict) -> None:
        self.eval_rows.append({**self.info, **row})

    def flush(self) -> tuple[int, int]:
        atomic_write_parquet(self.dir / METRICS_FILE, self.rows)
        atomic_write_parquet(self.dir / EVAL_FILE, self.eval_rows)
        return len(self.rows), len(self.eval_rows)

    def write_manifest(self, status: str, reason: str = "", **extra: Any) -> None:
        manifest = read_json(self.manifest_path)
        manifest.pop("traceback", None)  # belongs to the attempt that failed, not to this status
        manifest.update({**self.info, "status": status, "reason": reason, "updated": time.time(),
                         "versions": package_versions(), "git_commit": git_commit(), **extra})
        if status in FINISHED:  # what a finished run's tables must hold, even once checkpoint/ is trimmed
            manifest.update(rows=len(self.rows), eval_rows=len(self.eval_rows))
        atomic_write_text(self.manifest_path, json.dumps(manifest, indent=2, default=str))
