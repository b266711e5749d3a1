"""Cold start: supervised warm-up of a fresh (or loaded) MoE policy on task demonstrations, cached on disk.

RL from a random policy gets reward 0 on every sample and hence no signal; the paper starts from a model
that already solves part of its tasks. We stop warming up at a modest sampled accuracy (target_accuracy,
default 0.3) so that RL still has room to improve and its stability can be compared across algorithms.

The result (model + tokenizer, safetensors) lives in ``cache_dir/<key>``, where the key hashes every
setting that changes the weights. It is trained in a temporary folder and renamed into place, so a
reader sees a complete entry or none, and concurrent workers computing the same key agree: the first
rename wins and the others reuse its entry.

An entry is verified before use (metadata, key, config, tokenizer, every weight tensor readable); a broken
one is moved aside to ``.broken-*`` and rebuilt with a warning naming it, and the ``.tmp-*`` folders of
writers that died (same host, process gone) are removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import itertools
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from moe_lab.config import RunConfig, validate
from moe_lab.models import build_model, load_model, resolve_device
from moe_lab.config.constants import MACHINE_ENV
from moe_lab.rl.expert_bias import ExpertBias
from moe_lab.rl.rollout import accuracy, forward_logits, token_logprobs
from moe_lab.routing import record
from moe_lab.tasks import Task, encode_response, get_task, task_tokenizer

# Bump when the training recipe changes in a way the config cannot see: old cache entries then go stale.
FORMAT_VERSION = 1
META_FILE = "coldstart.json"


KEYED_SECTIONS = ("model", "task", "coldstart")  # what determines the warmed-up weights (cache_dir aside)


def keyed_sections(cfg: RunConfig) -> dict[str, dict]:
    """The sections that determine the warmed-up weights, as plain values (cache_dir left out)."""
    sections = {name: dataclasses.asdict(getattr(cfg, name)) for name in KEYED_SECTIONS}
    sections["coldstart"].pop("cache_dir")
    return sections


def cache_key(cfg: RunConfig) -> str:
    """sha256 of the canonical JSON of everything that determines the warmed-up weights (not cache_dir)."""
    sections = keyed_sections(cfg)
    # a field declared with param(unhashed=v) is left out at v: the cold starts cached and committed before it
    # existed keep their keys (results name those keys), so their cached models stay valid
    for name in KEYED_SECTIONS:
        for f in dataclasses.fields(getattr(cfg, name)):
            if "unhashed" in f.metadata and sections[name][f.name] == f.metadata["unhashed"]:
                sections[name].pop(f.name)
    payload = {"format": FORMAT_VERSION, **sections}
    pins = kernel_pins()
    if pins:  # kernels pinned (moe-lab run --cpu-isa): their own warm-up; unpinned keys stay as they were
        payload["pins"] = pins
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def kernel_pins() -> dict[str, str]:
    """The kernel pins this process runs with (moe-lab run --cpu-isa): part of the cache key where set."""
    return {k: os.environ[k] for k in MACHINE_ENV if k in os.environ}


def cache_root(cfg: RunConfig) -> Path:
    return Path(cfg.coldstart.cache_dir).expanduser()


# --------------------------------------------------------------------------- supervised step


def demonstration_batch(task: Task, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded, demonstrations (+ EOS) right-padded: the layout of a rollout batch.

    Returns input_ids_BS, attention_mask_BS and response_mask_BT (True where token t+1 is a response token,
    the column convention of rollout.token_logprobs).
    """
    tok = task.tokenizer
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    resp_ids = [encode_response(tok, task.demonstration(p)) for p in prompts]
    P, N = max(map(len, prompt_ids)), max(map(len, resp_ids))
    ids_BS = torch.full((len(prompts), P + N), tok.pad_token_id, dtype=torch.long)
    mask_BS = torch.zeros_like(ids_BS)
    for b, (p, r) in enumerate(zip(prompt_ids, resp_ids)):
        ids_BS[b, P - len(p):P], ids_BS[b, P:P + len(r)] = torch.tensor(p), torch.tensor(r)
        mask_BS[b, P - len(p):P + len(r)] = 1
    resp_BS = torch.zeros_like(mask_BS, dtype=torch.bool)
    resp_BS[:, P:] = mask_BS[:, P:].bool()
    return ids_BS, mask_BS, resp_BS[:, 1:]


def sft_loss(model, ids_BS: torch.Tensor, mask_BS: torch.Tensor, resp_BT: torch.Tensor,
             aux_loss_coef: float = 0.0) -> torch.Tensor:
    """Teacher-forced cross-entropy, mean over response tokens only (prompt and padding carry no loss).

    aux_loss_coef > 0 adds the model's own load-balancing loss (``output_router_logits=True``), as MoE
    pretraining does; at 0 the forward is exactly the one without it.
    """
    kwargs = {"output_router_logits": True} if aux_loss_coef > 0 else {}
    out = forward_logits(model, ids_BS, mask_BS, **kwargs)
    logp_BT = token_logprobs(out.logits, ids_BS)
    # where, not a product with the mask: a padding row's logits are never allowed to leak (even as NaN * 0)
    loss = -torch.where(resp_BT, logp_BT, 0.0).sum() / resp_BT.sum().clamp(min=1)
    return loss + aux_loss_coef * out.aux_loss if aux_loss_coef > 0 else loss


def sft_step(model, optimizer: torch.optim.Optimizer, task: Task, prompts: list[str],
             aux_loss_coef: float = 0.0, bias: ExpertBias | None = None) -> float:
    """One AdamW step on the demonstrations of `prompts`; returns the loss before the step. ``bias``
    (coldstart.bias_update_rate): the expert biases then step too, from this forward's loads over its real
    tokens (recording the routing changes no bit of the forward)."""
    batch = tuple(t.to(model.device) for t in demonstration_batch(task, prompts))
    with record(model, weights=False) if bias else contextlib.nullcontext() as trace:
        loss = sft_loss(model, *batch, aux_loss_coef)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if bias is not None:
        bias.count(trace.indices, batch[1][:, :-1])
        bias.update()
    return loss.item()


def sampled_accuracy(model, task: Task, n: int) -> float:
    """Mean reward of one temperature-1 sample on n eval prompts (the eval set cycled if n exceeds it)."""
    prompts = list(itertools.islice(itertools.cycle(task.eval_prompts()), n))
    return accuracy(model, task, prompts, greedy=False, temperature=1.0)


# --------------------------------------------------------------------------- warm-up loop


def warm_up(model, task: Task, cfg: RunConfig, *, progress: bool = False) -> dict:
    """Train until sampled accuracy >= target_accuracy (checked every eval_every steps) or max_steps.

    Evaluates before the first step too, so a checkpoint that already meets the target is left untouched.
    """
    cs = cfg.coldstart
    rng = np.random.default_rng(cfg.model.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cs.lr)
    bias = ExpertBias(model, cs.bias_update_rate) if cs.bias_update_rate else None
    bar = tqdm(total=cs.max_steps, desc="cold start", leave=False, disable=not (progress and sys.stderr.isatty()))
    history, step, loss, t0 = [], 0, None, time.perf_counter()
    while True:
        if step % cs.eval_every == 0 or step == cs.max_steps:
            acc = sampled_accuracy(model, task, cs.eval_samples)
            history.append({"step": step, "accuracy": acc, "loss": loss})
            bar.set_postfix(loss=loss, acc=acc)
            if acc >= cs.target_accuracy or step == cs.max_steps:
                break
        loss = sft_step(model, optimizer, task, task.sample_prompts(cs.batch_size, rng), cs.aux_loss_coef, bias)
        step += 1
        bar.update()
    bar.close()
    if acc < cs.target_accuracy:
        warnings.warn(f"cold start stopped at coldstart.max_steps={cs.max_steps} with sampled accuracy {acc:.3f} "
                      f"< coldstart.target_accuracy={cs.target_accuracy}", RuntimeWarning, stacklevel=3)
    return {"steps": step, "accuracy": acc, "reached": acc >= cs.target_accuracy,
            "seconds": time.perf_counter() - t0, "history": history}


def _initial_model(cfg: RunConfig, task: Task):
    tok = task.tokenizer
    if cfg.model.checkpoint is None:
        return build_model(cfg.model, len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id)
    model = load_model(cfg.model.checkpoint, experts_impl=cfg.model.experts_impl)
    vocab = model.get_input_embeddings().num_embeddings
    if vocab < len(tok):
        raise ValueError(f"model.checkpoint={cfg.model.checkpoint!r}: its embedding has {vocab} tokens, fewer than "
                         f"its tokenizer's {len(tok)}; allowed: >= {len(tok)}")
    return model


def preflight(cfg: RunConfig) -> None:
    """What the cold start would refuse, checked without building a model (so before any work starts)."""
    ckpt = cfg.model.checkpoint
    if ckpt is not None and not Path(ckpt).expanduser().is_dir():
        raise ValueError(f"model.checkpoint={ckpt!r}: no such directory; allowed: a local checkpoint folder")
    _check_lengths(cfg, get_task(cfg.task, task_tokenizer(ckpt)))


def _check_lengths(cfg: RunConfig, task: Task) -> None:
    need = task.prompt_tokens + task.max_new_tokens
    if need > cfg.model.max_positions:
        raise ValueError(f"model.max_positions={cfg.model.max_positions}: task {task.name} with task.length="
                         f"{task.length} needs {need} positions (prompt + response); allowed: >= {need}")


# --------------------------------------------------------------------------- cache


TMP_PREFIX = ".tmp-"
# .tmp-<key16>-<pid>@<host>-<mkdtemp suffix>: who wrote it, so that the leftovers of dead writers can go
_TMP_NAME = re.compile(r"^\.tmp-[0-9a-f]{16}-(\d+)@(.*)-[a-z0-9_]+$")


def _tmp_prefix(key: str) -> str:
    return f"{TMP_PREFIX}{key[:16]}-{os.getpid()}@{socket.gethostname()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _local_writers(root: Path):
    """(folder, pid, alive) of each .tmp-* folder in root written by a process of this host."""
    if not Path(root).is_dir():
        return
    for p in Path(root).iterdir():
        m = _TMP_NAME.match(p.name)
        if m and p.is_dir() and m.group(2) == socket.gethostname():
            yield p, int(m.group(1)), _pid_alive(int(m.group(1)))


def clean_dead_tmp(root: Path) -> list[Path]:
    """Remove .tmp-* folders whose writer (on this host) is gone; returns them. Live writers are left alone."""
    removed = []
    for p, _, alive in list(_local_writers(root)):
        if not alive:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def live_builder(root: Path, key: str) -> int | None:
    """PID of another live process on this host now building key's entry (its .tmp folder), else None."""
    return next((pid for p, pid, alive in _local_writers(root)
                 if alive and pid != os.getpid() and p.name.startswith(f"{TMP_PREFIX}{key[:16]}-")), None)


BUILDER_POLL_S = 5.0


def wait_for_builder(root: Path, key: str) -> None:
    """Wait while another live process on this host builds the same entry, so that it is built once: a cold start
    takes up to an hour or two at 65 response tokens, and two runners (an experiment and a search, or a build
    started ahead of the run that needs it) would otherwise each train it. Returns when that builder has published
    or gone; two processes that arrive within the same instant both build, and the first to publish wins
    (``_publish``), as before. A writer's PID reused by an unrelated process would keep us waiting: the same
    assumption ``clean_dead_tmp`` makes."""
    while live_builder(root, key) is not None and not (Path(root) / key).exists():
        time.sleep(BUILDER_POLL_S)


def entry_problem(entry: Path, key: str) -> str:
    """'' when the cache entry is complete and every weight reads back; else what is wrong with it."""
    import safetensors

    meta_path = entry / META_FILE
    if not meta_path.is_file():
        return f"{META_FILE} is missing"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return f"{META_FILE} is not valid JSON"
    if not isinstance(meta, dict) or meta.get("key") != key:
        return f"{META_FILE} records key {meta.get('key') if isinstance(meta, dict) else None!r}, not {key}"
    for name in ("config.json", "tokenizer_config.json"):
        if not (entry / name).is_file():
            return f"{name} is missing"
    weights = sorted(entry.glob("*.safetensors"))
    if not weights:
        return "no *.safetensors weights"
    index = entry / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError):
            return f"{index.name} is unreadable"
        missing = sorted(s for s in shards if not (entry / s).is_file())
        if missing:
            return f"weight shard(s) {missing} missing"
    for path in weights:
        try:
            with safetensors.safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    fh.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - any failure to read back means the entry is unusable
            return f"{path.name} is unreadable ({type(exc).__name__}: {' '.join(str(exc).split())})"
    return ""


def _move_aside(entry: Path, why: str) -> None:
    aside = entry.with_name(f".broken-{entry.name[:16]}-{int(time.time())}-{os.getpid()}")
    try:
        os.rename(entry, aside)
    except FileNotFoundError:
        return  # another worker moved it first
    warnings.warn(f"cold-start cache entry {entry} is broken ({why}); moved to {aside} and rebuilding it",
                  RuntimeWarning, stacklevel=3)


def _seal(tmp: Path) -> None:
    """fsync the entry's files, make it readable like any result (mkdtemp makes it 0700)."""
    from moe_lab.store.files import fsync_path, public_mode

    for f in tmp.rglob("*"):
        if f.is_file():
            fsync_path(f)
    public_mode(tmp, directory=True)
    fsync_path(tmp)


def _publish(tmp: Path, final: Path) -> Path:
    """Rename tmp to final; if another worker got there first, drop ours and reuse theirs."""
    try:
        os.rename(tmp, final)
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not (final / META_FILE).is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        from moe_lab.store.files import fsync_path

        fsync_path(final.parent)
    return final


def recorded(cfg: RunConfig) -> dict:
    """What the run's manifest says of its cold start (``coldstart``): the cache entry's supervised steps, sampled
    accuracy, whether it reached the target, and key; {} when the entry holds no metadata. The step count is the
    first thing that differs between processors (`moe-lab verify` compares it)."""
    try:
        meta = json.loads((cache_root(cfg) / cache_key(cfg) / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: meta[k] for k in ("steps", "accuracy", "reached", "key") if k in meta}


def cold_start(cfg: RunConfig, *, cache: bool = True, progress: bool = True) -> Path:
    """Directory of the warmed-up model + tokenizer for cfg (load with models.load_model / from_pretrained).

    cache=True returns an existing entry at once or trains and publishes one; cache=False ignores the cache
    and trains into a new ``uncached-*`` folder beside it. Same config -> same weights: the init, the
    demonstrations and the evaluation samples are all seeded from cfg.model.seed. The caller's torch RNG
    state is left as it was.
    """
    validate(cfg)
    task = get_task(cfg.task, task_tokenizer(cfg.model.checkpoint))
    _check_lengths(cfg, task)
    key, root = cache_key(cfg), cache_root(cfg)
    final = root / key
    clean_dead_tmp(root)
    if cache and not final.exists():
        wait_for_builder(root, key)
    if cache and final.exists():
        problem = entry_problem(final, key)
        if not problem:
            return final
        _move_aside(final, problem)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=_tmp_prefix(key) if cache else f"uncached-{key[:16]}-"))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.model.seed)
            model = _initial_model(cfg, task).to(resolve_device(cfg.model.device))
            model.train(False)  # no dropout or router jitter: RL compares forwards of this same model
            meta = warm_up(model, task, cfg, progress=progress)
        model.to("cpu").save_pretrained(tmp)
        task.tokenizer.save_pretrained(tmp)
        meta.update(format=FORMAT_VERSION, key=key, task=task.name, model_seed=cfg.model.seed)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        _seal(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish(tmp, final) if cache else tmp
