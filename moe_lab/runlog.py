"""What a run leaves on disk: its rows, resolved config, manifest and resumable checkpoint.

Layout of one run folder::

    config.yaml        the resolved RunConfig (safe YAML)
    manifest.json      status, reason, seed, versions, git commit, timings
    metrics.parquet    one row per minibatch update (see docs/metrics.md)
    eval.parquet       one row per evaluation
    checkpoint/        model.safetensors, optim.pt (tensors only), state.json (the commit marker)

Every write goes to a temporary file first and is renamed into place, so a run killed at any moment
leaves either the old or the new file, never half of one. Nothing here unpickles: optimizer state is
loaded with ``weights_only=True`` and configs with the safe YAML loader.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

STATUS_DONE, STATUS_RUNNING, STATUS_FAILED = "done", "running", "failed"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_parquet(path: Path, rows: list[dict]) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    frame = pd.DataFrame(rows)
    text_columns = [c for c in frame.columns if frame[c].dtype == object]
    try:
        # zstd, dictionaries only for the id strings, no per-column statistics or arrow schema blob:
        # a results table is ~40% of the default size, and reads back identically.
        frame.to_parquet(tmp, index=False, compression="zstd", compression_level=19, use_dictionary=text_columns,
                         write_statistics=False, store_schema=False)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_rows(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return pd.read_parquet(path).to_dict("records")


def read_json(path: Path) -> dict:
    path = Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def git_commit() -> str | None:
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


def config_state(run_dir: Path, config_text: str) -> str:
    """'new' (no config yet), 'same' (this very config: a resume or a finished run) or 'other'."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        return "new"
    return "same" if path.read_text(encoding="utf-8") == config_text else "other"


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
        return self.dir / "manifest.json"

    def load(self, n_rows: int, n_eval: int) -> None:
        """Resume: keep exactly the rows the last checkpoint committed (none lost, none duplicated)."""
        self.rows = read_rows(self.dir / "metrics.parquet")[:n_rows]
        self.eval_rows = read_rows(self.dir / "eval.parquet")[:n_eval]

    def add(self, row: dict) -> None:
        self.rows.append({**self.info, **row})

    def add_eval(self, row: dict) -> None:
        self.eval_rows.append({**self.info, **row})

    def flush(self) -> tuple[int, int]:
        atomic_write_parquet(self.dir / "metrics.parquet", self.rows)
        atomic_write_parquet(self.dir / "eval.parquet", self.eval_rows)
        return len(self.rows), len(self.eval_rows)

    def write_manifest(self, status: str, reason: str = "", **extra: Any) -> None:
        manifest = read_json(self.manifest_path)
        manifest.pop("traceback", None)  # belongs to the attempt that failed, not to this status
        manifest.update({**self.info, "status": status, "reason": reason, "updated": time.time(),
                         "versions": package_versions(), "git_commit": git_commit(), **extra})
        atomic_write_text(self.manifest_path, json.dumps(manifest, indent=2, default=str))
