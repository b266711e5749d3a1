"""Resumable training state: weights (safetensors), optimizer and RNG (tensors only), a JSON marker.

With rl.rollout_lag > 0 the lagged rollout weights (the starts of the last k steps) are saved too
(``lagged.safetensors``, keys ``<i>/<parameter name>``, oldest first): a resume samples with them.

A checkpoint is written whole into ``<dir>.tmp`` and swapped in by renames, so at every instant either
``<dir>`` or (between the two renames) ``<dir>.old`` holds a complete checkpoint: a run killed during a
save resumes from the previous one. ``state.json`` is written last and marks a folder as complete.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import safetensors.torch
import torch

from moe_lab.runlog import atomic_write_bytes, atomic_write_text

MARKER = "state.json"
SNAPSHOTS = "lagged.safetensors"


def _sibling(ckpt_dir: Path, suffix: str) -> Path:
    return ckpt_dir.with_name(ckpt_dir.name + suffix)


def save(ckpt_dir: Path, model, optimizer, state: dict, snapshots: list[dict] | None = None) -> None:
    ckpt_dir = Path(ckpt_dir)
    tmp, old = _sibling(ckpt_dir, ".tmp"), _sibling(ckpt_dir, ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    safetensors.torch.save_model(model, str(tmp / "model.safetensors"))
    if snapshots:
        flat = {f"{i}/{name}": t.contiguous() for i, snap in enumerate(snapshots) for name, t in snap.items()}
        safetensors.torch.save_file(flat, str(tmp / SNAPSHOTS))
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
    shutil.rmtree(old, ignore_errors=True)


def _complete(ckpt_dir: Path) -> Path | None:
    for cand in (ckpt_dir, _sibling(ckpt_dir, ".old")):
        if (cand / MARKER).is_file():
            return cand
    return None


def load(ckpt_dir: Path, model, optimizer) -> dict | None:
    """Restore model, optimizer and RNG in place; returns the saved state, or None if none is complete."""
    found = _complete(Path(ckpt_dir))
    if found is None:
        return None
    state = json.loads((found / MARKER).read_text(encoding="utf-8"))
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
    flat = safetensors.torch.load_file(str(found / SNAPSHOTS), device=str(device))
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        i, name = key.split("/", 1)
        snaps.setdefault(int(i), {})[name] = t
    return [snaps[i] for i in sorted(snaps)]
