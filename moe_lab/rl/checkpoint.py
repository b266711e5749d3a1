"""Resumable training state: weights (safetensors), optimizer and RNG (tensors only), a JSON marker.

With rl.rollout_lag > 0 the lagged rollout weights (the starts of the last k steps) are saved too
(``lagged.safetensors``, keys ``<i>/<parameter name>``, oldest first): a resume samples with them.

A checkpoint is written whole into ``<dir>.tmp`` and swapped in by renames, so at every instant either
``<dir>`` or (between the two renames) ``<dir>.old`` holds a complete checkpoint: a run killed during a
save resumes from the previous one. ``state.json`` is written last and marks a folder as complete.

A checkpoint also commits the run's tables: for a state with ``rows``/``eval_rows`` it records, under
``tables``, each table's row count and a digest of those rows, and it seals the whole state with a
``digest``. A resume verifies both and refuses (ResumeError, naming the file) when a table was deleted,
truncated or rewritten, or when state.json was edited: a run never ends ``done`` with rows missing.
Files and folders are fsynced before and after the swap, so a power loss cannot undo a commit.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from moe_lab.rl.runlog import (RUN_TABLES, atomic_write_bytes, atomic_write_text, fsync_path, read_rows,
                               rows_digest)

MARKER = "state.json"
SNAPSHOTS = "lagged.safetensors"

if TYPE_CHECKING:
    import torch
# torch and safetensors are imported by the functions that read or write tensors: read_state (what `moe-lab list`
# and the runner use to see whether a run finished) reads JSON and the tables only, and importing torch costs ~1 s.


class ResumeError(ValueError):
    """The run folder's tables do not match what its checkpoint committed."""


def _state_digest(state: dict) -> str:
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
    if "digest" in state and state["digest"] != _state_digest(state):
        raise ResumeError(f"{source / MARKER}: edited after it was written (its digest does not match); "
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


def _sibling(ckpt_dir: Path, suffix: str) -> Path:
    return ckpt_dir.with_name(ckpt_dir.name + suffix)


def save(ckpt_dir: Path, model, optimizer, state: dict, snapshots: list[dict] | None = None) -> None:
    """Write a checkpoint of state (plus, additively, its table records and digest); the caller's dict is kept."""
    ckpt_dir = Path(ckpt_dir)
    tmp, old = _sibling(ckpt_dir, ".tmp"), _sibling(ckpt_dir, ".old")
    state = dict(state)
    tables = table_records(ckpt_dir.parent, state)
    if tables:
        state["tables"] = tables
    state["digest"] = _state_digest(state)
    import safetensors.torch
    import torch

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
    if snapshots:
        flat = {f"{i}/{name}": t.contiguous() for i, snap in enumerate(snapshots) for name, t in snap.items()}
        safetensors.torch.save_file(flat, str(tmp / SNAPSHOTS))
        fsync_path(tmp / SNAPSHOTS)
    fsync_path(tmp / "model.safetensors")
    buf = io.BytesIO()
    rng = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():  # generate() samples with the CUDA generator on a GPU
        rng["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save({"optimizer": optimizer.state_dict(), **rng}, buf)
    atomic_write_bytes(tmp / "optim.pt", buf.getvalue())
    atomic_write_text(tmp / MARKER, json.dumps(state, indent=2))
    shutil.rmtree(old, ignore_errors=True)
    if ckpt_dir.exists():
        os.rename(ckpt_dir, old)
    os.rename(tmp, ckpt_dir)
    fsync_path(ckpt_dir.parent)
    shutil.rmtree(old, ignore_errors=True)


def _complete(ckpt_dir: Path) -> Path | None:
    for cand in (ckpt_dir, _sibling(ckpt_dir, ".old")):
        if (cand / MARKER).is_file():
            return cand
    return None


def read_state(ckpt_dir: Path) -> tuple[dict, Path] | None:
    """(state, folder) of the complete checkpoint, verified against the run's tables; None if none is complete."""
    found = _complete(Path(ckpt_dir))
    if found is None:
        return None
    try:
        state = json.loads((found / MARKER).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ResumeError(f"{found / MARKER}: not valid JSON ({exc}); delete {found} to restart the run") from None
    verify_tables(Path(ckpt_dir).parent, state, found)
    state.pop("digest", None)
    return state, found


def load(ckpt_dir: Path, model, optimizer) -> dict | None:
    """Restore model, optimizer and RNG in place; returns the saved state, or None if none is complete.

    Raises ResumeError (naming the file) when the run's tables lack or differ from the committed rows.
    """
    got = read_state(ckpt_dir)
    if got is None:
        return None
    state, found = got
    import safetensors.torch
    import torch

    missing, unexpected = safetensors.torch.load_model(model, str(found / "model.safetensors"))
    if missing or unexpected:
        raise ValueError(f"checkpoint {found} does not fit the model: missing {missing}, unexpected {unexpected}")
    blob = torch.load(found / "optim.pt", weights_only=True)  # never unpickle code from a results folder
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    if "cuda_rng" in blob and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(blob["cuda_rng"])
    return state


def load_snapshots(ckpt_dir: Path, device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """The lagged weight snapshots of the checkpoint load() restores (oldest first); [] if none."""
    found = _complete(Path(ckpt_dir))
    if found is None or not (found / SNAPSHOTS).is_file():
        return []
    import safetensors.torch

    flat = safetensors.torch.load_file(str(found / SNAPSHOTS), device=str(device))
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        i, name = key.split("/", 1)
        snaps.setdefault(int(i), {})[name] = t
    return [snaps[i] for i in sorted(snaps)]
