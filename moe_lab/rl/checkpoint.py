"""Resumable training state: weights (safetensors), optimizer and RNG (tensors only), a JSON marker.

With rl.rollout_lag > 0 the lagged rollout weights (the starts of the last k steps) are saved too
(``lagged.safetensors``, keys ``<i>/<parameter name>``, oldest first): a resume samples with them.

A checkpoint is written whole into ``<dir>.tmp`` and swapped in by renames, so at every instant either
``<dir>`` or (between the two renames) ``<dir>.old`` holds a complete checkpoint: a run killed during a
save resumes from the previous one. ``state.json`` is written last and marks a folder as complete; what it commits
of the run's tables, and reading it back without torch, is moe_lab/store/checkpoint_state.py's (file names:
moe_lab/store/layout.py). Files and folders are fsynced before and after the swap, so a power loss cannot undo a
commit.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from moe_lab.store.checkpoint_state import complete, read_state, seal, sibling
from moe_lab.store.files import atomic_write_bytes, atomic_write_text, fsync_path
from moe_lab.store.layout import MARKER_FILE, MODEL_FILE, OPTIMIZER_FILE, PREVIOUS_SUFFIX, SNAPSHOTS_FILE, STAGING_SUFFIX

if TYPE_CHECKING:
    import torch
# torch and safetensors are imported by the functions that read or write tensors: importing torch costs ~1 s.


def save(ckpt_dir: Path, model, optimizer, state: dict, snapshots: list[dict] | None = None) -> None:
    """Write a checkpoint of state (plus, additively, its table records and digest); the caller's dict is kept."""
    ckpt_dir = Path(ckpt_dir)
    tmp, old = sibling(ckpt_dir, STAGING_SUFFIX), sibling(ckpt_dir, PREVIOUS_SUFFIX)
    state = seal(ckpt_dir.parent, state)
    import safetensors.torch
    import torch

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    safetensors.torch.save_model(model, str(tmp / MODEL_FILE))
    if snapshots:
        flat = {f"{i}/{name}": t.contiguous() for i, snap in enumerate(snapshots) for name, t in snap.items()}
        safetensors.torch.save_file(flat, str(tmp / SNAPSHOTS_FILE))
        fsync_path(tmp / SNAPSHOTS_FILE)
    fsync_path(tmp / MODEL_FILE)
    buf = io.BytesIO()
    rng = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():  # generate() samples with the CUDA generator on a GPU
        rng["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save({"optimizer": optimizer.state_dict(), **rng}, buf)
    atomic_write_bytes(tmp / OPTIMIZER_FILE, buf.getvalue())
    atomic_write_text(tmp / MARKER_FILE, json.dumps(state, indent=2))
    shutil.rmtree(old, ignore_errors=True)
    if ckpt_dir.exists():
        os.rename(ckpt_dir, old)
    os.rename(tmp, ckpt_dir)
    fsync_path(ckpt_dir.parent)
    shutil.rmtree(old, ignore_errors=True)


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

    missing, unexpected = safetensors.torch.load_model(model, str(found / MODEL_FILE))
    if missing or unexpected:
        raise ValueError(f"checkpoint {found} does not fit the model: missing {missing}, unexpected {unexpected}")
    blob = torch.load(found / OPTIMIZER_FILE, weights_only=True)  # never unpickle code from a results folder
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    if "cuda_rng" in blob and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(blob["cuda_rng"])
    return state


def load_snapshots(ckpt_dir: Path, device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """The lagged weight snapshots of the checkpoint load() restores (oldest first); [] if none."""
    found = complete(Path(ckpt_dir))
    if found is None or not (found / SNAPSHOTS_FILE).is_file():
        return []
    import safetensors.torch

    flat = safetensors.torch.load_file(str(found / SNAPSHOTS_FILE), device=str(device))
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        i, name = key.split("/", 1)
        snaps.setdefault(int(i), {})[name] = t
    return [snaps[i] for i in sorted(snaps)]
