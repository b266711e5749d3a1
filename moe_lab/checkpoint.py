"""Resumable training state: weights (safetensors), optimizer and RNG (tensors only), a JSON marker.

``state.json`` is written last and is the commit marker: a checkpoint without it is ignored, so a run
killed during a save resumes from the previous complete checkpoint.
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


def save(ckpt_dir: Path, model, optimizer, state: dict) -> None:
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    marker = ckpt_dir / "state.json"
    if marker.exists():
        os.unlink(marker)  # the files below are about to change: invalidate first
    tmp = ckpt_dir / ".model.safetensors.tmp"
    safetensors.torch.save_model(model, str(tmp))
    os.replace(tmp, ckpt_dir / "model.safetensors")
    buf = io.BytesIO()
    rng = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available():  # generate() samples with the CUDA generator on a GPU
        rng["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save({"optimizer": optimizer.state_dict(), **rng}, buf)
    atomic_write_bytes(ckpt_dir / "optim.pt", buf.getvalue())
    atomic_write_text(marker, json.dumps(state, indent=2))


def load(ckpt_dir: Path, model, optimizer) -> dict | None:
    """Restore model, optimizer and RNG in place; returns the saved state, or None if none is complete."""
    ckpt_dir = Path(ckpt_dir)
    marker = ckpt_dir / "state.json"
    if not marker.exists():
        return None
    state = json.loads(marker.read_text(encoding="utf-8"))
    missing, unexpected = safetensors.torch.load_model(model, str(ckpt_dir / "model.safetensors"))
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not fit the model: missing {missing}, unexpected {unexpected}")
    blob = torch.load(ckpt_dir / "optim.pt", weights_only=True)  # never unpickle code from a results folder
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    if "cuda_rng" in blob and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(blob["cuda_rng"])
    return state


def remove(ckpt_dir: Path) -> None:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
