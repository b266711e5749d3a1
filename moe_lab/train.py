"""One RL run: cold-started policy, the step loop, evaluation, checkpoints and a clean ending.

A run never raises on a training pathology: NaN/inf and a collapsed reward end it with a status and a
reason in its manifest, so that one bad cell never takes down a batch of runs.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import numpy as np
import torch

from moe_lab import checkpoint
from moe_lab.coldstart import cold_start
from moe_lab.config import ConfigError, RunConfig, dump_yaml, validate
from moe_lab.models import load_model, resolve_device
from moe_lab.optim import build_optimizer
from moe_lab.rollout import accuracy
from moe_lab.runlog import STATUS_DONE, STATUS_FAILED, STATUS_RUNNING, RunLog, atomic_write_text, config_state
from moe_lab.step import rl_step
from moe_lab.tasks import get_task, load_tokenizer

# A reward that stays exactly 0 for this many consecutive steps means the policy has collapsed:
# every advantage is 0 from then on, so further steps only burn time.
COLLAPSE_STEPS = 5


def step_prompts(task, cfg: RunConfig, step: int) -> list[str]:
    """Prompts of one step, a pure function of (seed, step): a resumed run draws the same ones."""
    rng = np.random.default_rng([cfg.seed, step])
    return task.sample_prompts(cfg.rl.prompts_per_step, rng)


def _sync_rollout_policy(policy, rollout_policy):
    """The rollout copy follows the trained weights, cast to the rollout dtype (bf16 mismatch knob)."""
    if rollout_policy is policy:
        return
    with torch.no_grad():
        for dst, src in zip(rollout_policy.parameters(), policy.parameters()):
            dst.copy_(src)


def _evaluate(policy, task, eval_prompts: list[str], cfg: RunConfig, step: int) -> dict:
    t0 = time.perf_counter()
    # Own seeded RNG stream: how often we evaluate must not change the rollouts that follow.
    devices = [policy.device] if policy.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.seed * 1_000_003 + step + 7)
        greedy = accuracy(policy, task, eval_prompts, greedy=True)
        sampled = accuracy(policy, task, eval_prompts, greedy=False, temperature=cfg.rl.temperature)
    return {"step": step, "eval/acc_greedy": greedy, "eval/acc_sampled": sampled,
            "perf/eval_s": time.perf_counter() - t0}


def _failure(rows: list[dict], zero_reward_steps: int) -> str:
    """The reason to stop, or '' to go on."""
    for r in rows:
        if not math.isfinite(r["loss"]) or not math.isfinite(r["optim/grad_norm"]):
            return f"non-finite loss or gradient at step {r['step']} minibatch {r['minibatch']}"
    if zero_reward_steps >= COLLAPSE_STEPS:
        return f"reward collapsed: exactly 0 for {COLLAPSE_STEPS} consecutive steps"
    return ""


def _claim(run_dir: Path, config_text: str) -> None:
    """Write the run's config, or check that the folder already holds this very config (a resume)."""
    if config_state(run_dir, config_text) == "other":
        raise ConfigError(f"run folder {run_dir} holds a run of a different config; resuming it would mix two "
                          "configs in one table: remove the folder or choose another")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", config_text)


def run_info(cfg: RunConfig, run_id: str, arm: str) -> dict:
    return {"run_id": run_id, "arm": arm, "algo": cfg.rl.algo, "replay": cfg.rl.replay, "seed": cfg.seed}


def _setup(cfg: RunConfig, progress: bool):
    """Cold-started policy (and its tokenizer's task), rollout copy, reference model, optimizer."""
    device = resolve_device(cfg.model.device)
    model_dir = cold_start(cfg, progress=progress)
    task = get_task(cfg.task, load_tokenizer(str(model_dir)))
    policy = load_model(model_dir, experts_impl=cfg.model.experts_impl).to(device)
    policy.train(False)  # no dropout: the old and new forwards must be comparable
    ref_model = None
    if cfg.rl.kl_coef > 0:
        ref_model = copy.deepcopy(policy).requires_grad_(False)
    rollout_policy = policy
    if cfg.rl.rollout_dtype == "bfloat16":
        rollout_policy = copy.deepcopy(policy).to(torch.bfloat16).requires_grad_(False)
    return task, policy, rollout_policy, ref_model, build_optimizer(policy, cfg.rl)


def train(cfg: RunConfig, run_dir: Path, *, run_id: str, arm: str = "default", progress: bool = False) -> str:
    """Run (or resume) one RL run in run_dir; returns its final status."""
    validate(cfg)
    torch.set_num_threads(cfg.threads)
    run_dir = Path(run_dir)
    _claim(run_dir, dump_yaml(cfg))
    log = RunLog(run_dir, run_info(cfg, run_id, arm))
    task, policy, rollout_policy, ref_model, optimizer = _setup(cfg, progress)
    torch.manual_seed(cfg.seed)  # after setup: loading or warming up the model may consume random numbers
    state = checkpoint.load(run_dir / "checkpoint", policy, optimizer) or {"step": 0, "rows": 0, "eval_rows": 0,
                                                                          "zero_reward_steps": 0, "wall_s": 0.0}
    log.load(state["rows"], state["eval_rows"])
    log.write_manifest(STATUS_RUNNING, resumed_from_step=state["step"])
    reason = _loop(cfg, task, policy, rollout_policy, ref_model, optimizer, log, state, run_dir, progress)
    status = STATUS_FAILED if reason else STATUS_DONE
    log.flush()
    log.write_manifest(status, reason, steps_done=state["step"], wall_s=state["wall_s"])
    return status


def _loop(cfg, task, policy, rollout_policy, ref_model, optimizer, log: RunLog, state: dict, run_dir: Path,
          progress: bool) -> str:
    eval_prompts = task.eval_prompts()
    steps = range(state["step"], cfg.rl.steps)
    bar = _progress(steps, progress, log.info["run_id"])
    for step in bar:
        t0 = time.perf_counter()
        if step % cfg.rl.eval_every == 0:
            log.add_eval(_evaluate(policy, task, eval_prompts, cfg, step))
        _sync_rollout_policy(policy, rollout_policy)
        rows = rl_step(policy, rollout_policy, ref_model, optimizer, task, cfg, step, step_prompts(task, cfg, step),
                       first_update=step * cfg.rl.minibatches)
        state["wall_s"] += time.perf_counter() - t0
        for r in rows:
            log.add({**r, "perf/wall_s": state["wall_s"]})
        state["zero_reward_steps"] = state["zero_reward_steps"] + 1 if rows[0]["reward/mean"] == 0 else 0
        state["step"] = step + 1
        reason = _failure(rows, state["zero_reward_steps"])
        if reason:
            return reason
        if state["step"] % cfg.rl.checkpoint_every == 0 or state["step"] == cfg.rl.steps:
            if state["step"] == cfg.rl.steps:
                log.add_eval(_evaluate(policy, task, eval_prompts, cfg, state["step"]))
            state["rows"], state["eval_rows"] = log.flush()
            checkpoint.save(run_dir / "checkpoint", policy, optimizer, state)
    return ""


def _progress(steps, enabled: bool, label: str):
    if not enabled:
        return steps
    from tqdm.auto import tqdm

    return tqdm(steps, desc=label, leave=False)


if __name__ == "__main__":  # torchrun [--nproc-per-node N] -m moe_lab.train RUN.yaml --out DIR
    import sys

    from moe_lab.distributed import main

    sys.exit(main())
