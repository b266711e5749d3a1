"""What a run writes: its rows, resolved config and manifest (``RunLog``), flushed with each checkpoint, and
the one writer's lock. The folder's layout and file names are ``layout``'s, the words a manifest says
``status``'s, the safe writes ``files``'.

Nothing here unpickles: optimizer state is loaded with ``weights_only=True`` and configs with the safe YAML loader.
One writer per run folder: ``RunLock`` holds an advisory ``flock`` on ``<run>/.lock``; the OS releases it
when the holder dies, so a stale lock never blocks a resume.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from moe_lab.config.constants import MACHINE_ENV
from moe_lab.config import ConfigError, dump_yaml, from_dict, load_yaml, upgrade_run_config, validate
from moe_lab.store.cpuinfo import processor_info
from moe_lab.store.files import atomic_write_parquet, atomic_write_text, read_json, read_rows
from moe_lab.store.layout import CONFIG_FILE, EVAL_FILE, LOCK_FILE, MANIFEST_FILE, METRICS_FILE
from moe_lab.store.status import CONFIG_NEW, CONFIG_OTHER, CONFIG_SAME, FINISHED


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
    the processor (``cpu``: MKL and oneDNN also choose code paths by its model; moe_lab/store/cpuinfo.py)."""
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
        return CONFIG_NEW
    if path.read_text(encoding="utf-8") == config_text:
        return CONFIG_SAME
    try:
        upgraded = dump_yaml(validate(from_dict(upgrade_run_config(load_yaml(str(path))))))
    except (ConfigError, OSError):
        return CONFIG_OTHER
    return CONFIG_SAME if upgraded == config_text else CONFIG_OTHER


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
