"""Cold start: cache key, cache hits, atomic publication, supervised loss, determinism, checkpoint start."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoTokenizer

from moe_lab.rl import coldstart
from moe_lab.rl.coldstart import META_FILE, cache_key, cold_start, demonstration_batch, sft_loss, sft_step
from moe_lab.config import ColdStartConfig, ModelConfig, RunConfig, TaskConfig
from moe_lab.models import build_model, load_model
from moe_lab.tasks import get_task

# Runs here stop at a tiny max_steps on purpose; the warning itself has its own test.
pytestmark = pytest.mark.filterwarnings("ignore:cold start stopped:RuntimeWarning")


def tiny(tmp_path, *, model=None, task=None, **coldstart_kw) -> RunConfig:
    m = dict(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, num_experts=4, top_k=2,
             moe_intermediate_size=32, intermediate_size=64, max_positions=64)
    cs = dict(max_steps=3, batch_size=8, eval_every=2, eval_samples=8, target_accuracy=1.0,
              cache_dir=str(tmp_path / "cache"))
    m.update(model or {})
    cs.update(coldstart_kw)
    return RunConfig(model=ModelConfig(**m), task=TaskConfig(**{"length": 8, "eval_size": 16, **(task or {})}),
                     coldstart=ColdStartConfig(**cs))


def weights(path) -> dict[str, torch.Tensor]:
    # Through load_model, not the safetensors file: transformers may store experts unfused on disk.
    return load_model(path).state_dict()


def meta(path) -> dict:
    return json.loads((path / META_FILE).read_text())


# --------------------------------------------------------------------------- cache


def test_cache_key_tracks_what_changes_the_weights(tmp_path):
    cfg = tiny(tmp_path)
    key = cache_key(cfg)
    assert key == cache_key(tiny(tmp_path))
    assert key == cache_key(dataclasses.replace(cfg, coldstart=dataclasses.replace(cfg.coldstart, cache_dir="/x")))
    assert key == cache_key(dataclasses.replace(cfg, seed=7, threads=3))  # RL-only fields
    changed = [tiny(tmp_path, model={"seed": 1}), tiny(tmp_path, model={"num_experts": 8}),
               tiny(tmp_path, task={"name": "reverse"}), tiny(tmp_path, task={"partial_credit": True}),
               tiny(tmp_path, lr=1e-3), tiny(tmp_path, target_accuracy=0.5)]
    keys = {cache_key(c) for c in changed}
    assert len(keys) == len(changed) and key not in keys


def test_second_call_is_a_cache_hit(tmp_path, monkeypatch):
    cfg = tiny(tmp_path)
    path = cold_start(cfg, progress=False)
    assert path == tmp_path / "cache" / cache_key(cfg)
    stamp = (path / META_FILE).stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("a cache hit must not train")

    monkeypatch.setattr(coldstart, "warm_up", no_training)
    assert cold_start(cfg, progress=False) == path
    assert (path / META_FILE).stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary folder left behind


def test_entry_is_a_loadable_model_and_tokenizer(tmp_path):
    cfg = tiny(tmp_path)
    path = cold_start(cfg, progress=False)
    info = meta(path)
    assert info["steps"] == cfg.coldstart.max_steps and not info["reached"] and info["key"] == path.name
    assert 0.0 <= info["accuracy"] <= 1.0 and info["seconds"] > 0
    model, tok = load_model(path), AutoTokenizer.from_pretrained(path)
    assert tok.get_vocab() == get_task(cfg.task).tokenizer.get_vocab() and tok.padding_side == "left"
    assert (path / "model.safetensors").is_file()
    assert model.get_input_embeddings().num_embeddings == len(tok)


def test_concurrent_publication_keeps_the_first_entry(tmp_path):
    final, ours = tmp_path / "key", tmp_path / ".tmp-key"
    final.mkdir()
    (final / META_FILE).write_text("first")
    ours.mkdir()
    (ours / META_FILE).write_text("second")
    assert coldstart._publish(ours, final) == final
    assert (final / META_FILE).read_text() == "first" and not ours.exists()


def test_a_live_builder_of_the_same_entry_is_waited_for_not_duplicated(tmp_path, monkeypatch):
    import shutil
    import subprocess
    import sys
    import threading

    cfg = tiny(tmp_path)
    built = cold_start(cfg, progress=False)  # what the other builder will publish
    key, root = built.name, built.parent
    done = root.parent / "done"
    shutil.move(str(built), str(done))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp = root / f"{coldstart.TMP_PREFIX}{key[:16]}-{other.pid}@{coldstart.socket.gethostname()}-abc123"
        tmp.mkdir()
        assert coldstart.live_builder(root, key) == other.pid
        assert coldstart.live_builder(root, "f" * 64) is None  # another key's builder is not ours

        def publish():  # the other builder finishes: its entry appears, its temporary folder goes
            shutil.move(str(done), str(root / key))
            tmp.rmdir()

        timer = threading.Timer(0.3, publish)
        monkeypatch.setattr(coldstart, "BUILDER_POLL_S", 0.05)

        def no_training(*args, **kwargs):
            raise AssertionError("the entry another process builds must not be trained again")

        monkeypatch.setattr(coldstart, "warm_up", no_training)
        timer.start()
        assert cold_start(cfg, progress=False) == root / key
        timer.join()
    finally:
        other.kill()
        other.wait()


def test_a_dead_builder_is_not_waited_for(tmp_path):
    cfg = tiny(tmp_path)
    root = tmp_path / "cache"
    root.mkdir()
    gone = subprocess_pid_that_exited()
    (root / f"{coldstart.TMP_PREFIX}{cache_key(cfg)[:16]}-{gone}@{coldstart.socket.gethostname()}-abc123").mkdir()
    assert coldstart.live_builder(root, cache_key(cfg)) is None
    assert cold_start(cfg, progress=False) == root / cache_key(cfg)  # built here, leftover removed
    assert [p.name for p in root.iterdir()] == [cache_key(cfg)]


def subprocess_pid_that_exited() -> int:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


# --------------------------------------------------------------------------- supervised loss


def test_loss_decreases_on_demonstrations(tmp_path):
    cfg = tiny(tmp_path)
    task = get_task(cfg.task)
    tok = task.tokenizer
    model = build_model(cfg.model, len(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.coldstart.lr)
    prompts = task.eval_prompts()[:8]
    losses = [sft_step(model, opt, task, prompts) for _ in range(8)]
    assert losses[-1] < losses[0]


def test_loss_covers_response_tokens_only(tmp_path):
    cfg = tiny(tmp_path)
    task = get_task(cfg.task)
    model = build_model(cfg.model, len(task.tokenizer))
    prompts = task.eval_prompts()[:4]
    ids_BS, mask_BS, resp_BT = demonstration_batch(task, prompts)
    n_resp = len(task.demonstration(prompts[0])) + 1
    assert resp_BT.sum(-1).tolist() == [n_resp] * 4 and not resp_BT[:, :task.prompt_tokens - 1].any()
    # Extra left padding changes no response log-prob (position ids skip it), so the loss is the same.
    pad = torch.full((4, 3), task.tokenizer.pad_token_id)
    padded = (torch.cat([pad, ids_BS], 1), torch.cat([torch.zeros_like(pad), mask_BS], 1),
              torch.cat([torch.zeros(4, 3, dtype=torch.bool), resp_BT], 1))
    with torch.no_grad():
        torch.testing.assert_close(sft_loss(model, *padded), sft_loss(model, ids_BS, mask_BS, resp_BT))
        # Changing the demonstrations changes the loss, changing nothing but padding ids does not.
        noisy = padded[0].clone()
        noisy[:, :3] = 7
        torch.testing.assert_close(sft_loss(model, noisy, *padded[1:]), sft_loss(model, *padded))


# --------------------------------------------------------------------------- determinism and stopping


def test_same_seed_same_weights(tmp_path):
    cfg = tiny(tmp_path)
    before = torch.get_rng_state()
    a, b = cold_start(cfg, cache=False, progress=False), cold_start(cfg, cache=False, progress=False)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG stream is untouched
    assert a != b and meta(a)["history"] == meta(b)["history"]
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    wc = weights(cold_start(tiny(tmp_path, model={"seed": 1}), cache=False, progress=False))
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_max_steps_warns(tmp_path):
    with pytest.warns(RuntimeWarning, match="max_steps=2"):
        path = cold_start(tiny(tmp_path, max_steps=2), progress=False)
    assert meta(path)["steps"] == 2


def test_reached_target_stops_before_training(tmp_path):
    cfg = tiny(tmp_path, target_accuracy=0.0)
    path = cold_start(cfg, progress=False)
    info = meta(path)
    assert info["steps"] == 0 and info["reached"]
    fresh = build_model(cfg.model, len(get_task(cfg.task).tokenizer)).state_dict()
    assert all(torch.equal(v, fresh[k]) for k, v in weights(path).items())


def test_checkpoint_is_the_starting_point(tmp_path):
    start = cold_start(tiny(tmp_path, target_accuracy=0.0, model={"seed": 3}), progress=False)
    kept = cold_start(tiny(tmp_path, target_accuracy=0.0, model={"checkpoint": str(start)}), progress=False)
    w0, w1 = weights(start), weights(kept)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)  # target met by the checkpoint: nothing trained
    trained = cold_start(tiny(tmp_path, model={"checkpoint": str(start)}), progress=False)
    assert meta(trained)["steps"] == 3 and not all(torch.equal(w0[k], weights(trained)[k]) for k in w0)


def test_bad_config_fails_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="model.max_positions"):
        cold_start(tiny(tmp_path, task={"name": "long_addition"}), progress=False)
    with pytest.raises(ValueError, match="coldstart.lr"):
        cold_start(tiny(tmp_path, lr=0.0), progress=False)
    assert not (tmp_path / "cache").exists()
