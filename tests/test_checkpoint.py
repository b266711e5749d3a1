"""Checkpoints: a save killed at any point leaves a complete checkpoint to resume from."""

from __future__ import annotations

import os

import torch

from moe_lab.rl import checkpoint


def _state(model, opt, value: float, step: int, path):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    checkpoint.save(path, model, opt, {"step": step})


def test_kill_between_the_renames_resumes_from_the_previous_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = tmp_path / "checkpoint"
    _state(model, opt, 1.0, 1, ckpt)
    _state(model, opt, 2.0, 2, ckpt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    # A third save killed after moving the current checkpoint aside and before publishing the new one:
    os.rename(ckpt, tmp_path / "checkpoint.old")
    (tmp_path / "checkpoint.tmp").mkdir()
    (tmp_path / "checkpoint.tmp" / "model.safetensors").write_bytes(b"half written")

    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = checkpoint.load(ckpt, fresh, fresh_opt)
    assert state == {"step": 2}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k])
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


def test_no_complete_checkpoint_means_a_fresh_start(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    model = torch.nn.Linear(3, 2)
    assert checkpoint.load(tmp_path / "checkpoint", model, torch.optim.AdamW(model.parameters())) is None
