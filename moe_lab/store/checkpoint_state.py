"""What a checkpoint commits, read without torch: its folder's layout (``layout``: the marker written last,
the staging and previous folders of the swap), the state in its marker, and the run's tables it sealed.

A checkpoint commits the run's tables: for a state with ``rows``/``eval_rows`` it records, under ``tables``, each
table's row count and a digest of those rows, and it seals the whole state with a ``digest``. A resume verifies both
and refuses (ResumeError, naming the file) when a table was deleted, truncated or rewritten, or when state.json was
edited: a run never ends ``done`` with rows missing. ``read_state`` is what `moe-lab list` and the runner use to see
whether a run finished; moe_lab/rl/checkpoint.py writes and loads the tensors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from moe_lab.store.files import read_rows, rows_digest
from moe_lab.store.layout import MARKER_FILE, PREVIOUS_SUFFIX, RUN_TABLES


class ResumeError(ValueError):
    """The run folder's tables do not match what its checkpoint committed."""


def state_digest(state: dict) -> str:
    body = {k: v for k, v in state.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def table_records(run_dir: Path, state: dict) -> dict:
    """{file: {rows, sha256}} of the first state[key] rows of each table, as they are on disk now."""
    out = {}
    for name, (key, _) in RUN_TABLES.items():  # the state key that counts the table's first rows
        if key in state:
            n = int(state[key])
            out[name] = {"rows": n, "sha256": rows_digest(read_rows(Path(run_dir) / name)[:n])}
    return out


def verify_tables(run_dir: Path, state: dict, source: Path) -> None:
    """Raise ResumeError naming the file when a table lacks, or differs in, the rows the checkpoint committed."""
    run_dir = Path(run_dir)
    if "digest" in state and state["digest"] != state_digest(state):
        raise ResumeError(f"{source / MARKER_FILE}: edited after it was written (its digest does not match); "
                          f"restore it, or delete {source} to restart the run from step 0")
    fix = f"restore it, or delete the run folder {run_dir} to rerun it from scratch"
    for name, (key, _) in RUN_TABLES.items():
        if key not in state:
            continue
        want = state.get("tables", {}).get(name, {"rows": int(state[key])})
        path = run_dir / name
        if want["rows"] and not path.exists():
            raise ResumeError(f"{path}: missing, but checkpoint {source} committed {want['rows']} rows to it; {fix}")
        rows = read_rows(path)
        if len(rows) < want["rows"]:
            raise ResumeError(f"{path}: holds {len(rows)} rows, but checkpoint {source} committed {want['rows']}; {fix}")
        if "sha256" in want and rows_digest(rows[:want["rows"]]) != want["sha256"]:
            raise ResumeError(f"{path}: its first {want['rows']} rows differ from those checkpoint {source} "
                              f"committed; {fix}")


def sibling(ckpt_dir: Path, suffix: str) -> Path:
    """<checkpoint><suffix>: the folder a checkpoint is staged in (STAGING_SUFFIX) or swapped out to (PREVIOUS_SUFFIX)."""
    return ckpt_dir.with_name(ckpt_dir.name + suffix)


def seal(run_dir: Path, state: dict) -> dict:
    """The state a checkpoint writes: plus, additively, its table records and the digest of the whole; the
    caller's dict is kept."""
    state = dict(state)
    tables = table_records(run_dir, state)
    if tables:
        state["tables"] = tables
    state["digest"] = state_digest(state)
    return state


def complete(ckpt_dir: Path) -> Path | None:
    """The folder holding the complete checkpoint (the marker written last): ``ckpt_dir``, or mid-swap its previous one."""
    for cand in (ckpt_dir, sibling(ckpt_dir, PREVIOUS_SUFFIX)):
        if (cand / MARKER_FILE).is_file():
            return cand
    return None


def read_state(ckpt_dir: Path) -> tuple[dict, Path] | None:
    """(state, folder) of the complete checkpoint, verified against the run's tables; None if none is complete."""
    found = complete(Path(ckpt_dir))
    if found is None:
        return None
    try:
        state = json.loads((found / MARKER_FILE).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ResumeError(f"{found / MARKER_FILE}: not valid JSON ({exc}); delete {found} to restart the run") from None
    verify_tables(Path(ckpt_dir).parent, state, found)
    state.pop("digest", None)
    return state, found
