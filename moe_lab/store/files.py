"""Writing and reading a run's files safely: every write goes to a temporary file first, is fsynced and renamed
into place, and the folder is fsynced, so a run killed at any moment (or a machine that loses power) leaves either
the old or the new file, never half of one. Results are world-readable under the user's umask (0644 files), not
mkstemp's 0600. Tables are parquet; ``rows_digest`` is what a checkpoint commits of one."""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import tempfile
from pathlib import Path
from typing import Any


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
