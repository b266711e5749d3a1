"""One RL run: cold-started policy, the step loop, evaluation, checkpoints and a clean ending.

A run never raises on a training pathology: NaN/inf and a collapsed reward end it with status ``collapsed``
(final like ``done``: its last evaluation is of the policy it stopped with) and a reason in its manifest, so
that one bad cell never takes down a batch of runs. The manifest also records
``collapsed_at`` / ``collapse_rule``: the first step and rule of moe_lab/store/health.py that fired (soft rules
mark the run without stopping it unless rl.stop_on_collapse).

This is the one loop of every run. A plain run (``moe-lab run``) goes through it with step.SingleProcess;
torchrun (``python -m moe_lab.train``) with moe_lab.rl.distributed.DataParallel, which adds only what a
process group needs: setup on rank 0 first, the world-size check of a resume, the batch split, the
reduction of the ranks' metrics, and barriers. Only the writing process (rank 0) holds a run log.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_lab.config import ConfigError, RunConfig, dump_yaml, validate
from moe_lab.config.rl import RLCollapse, RLRollout
from moe_lab.models import load_model, resolve_device
from moe_lab.models.numerics_fast import rollout_numerics
from moe_lab.rl import checkpoint, seeds
from moe_lab.rl.coldstart import cold_start, recorded
from moe_lab.rl.components import Components, Trainee
from moe_lab.rl.optim import build_optimizer
from moe_lab.rl.rollout import accuracy
from moe_lab.rl.split import RunSplit
from moe_lab.rl.step import SingleProcess, rl_step
from moe_lab.store import harness, health
from moe_lab.store.files import atomic_write_text
from moe_lab.store.run_folder import RunFolder, first_segments
from moe_lab.store.runlog import RunLog, config_state, machine_info
from moe_lab.store.status import CONFIG_OTHER, STATUS_COLLAPSED, STATUS_DONE, STATUS_RUNNING
from moe_lab.tasks import get_task, load_tokenizer


@dataclass
class TrainState:
    """Where a run stands: the keys of the checkpoint's state.json (read and written unchanged, so every
    existing checkpoint resumes). rows/eval_rows count the rows of metrics.parquet/eval.parquet committed."""

    step: int = 0  # next RL step to run
    rows: int = 0
    eval_rows: int = 0
    wall_s: float = 0.0  # training wall time summed over sessions
    extra: dict = field(default_factory=dict)  # other state.json keys (world_size, tables), kept as read

    FIELDS = ("step", "rows", "eval_rows", "wall_s")

    @classmethod
    def from_dict(cls, state: dict | None) -> "TrainState":
        """The state of a checkpoint.load() result; None (no checkpoint) is a fresh run."""
        if state is None:
            return cls()
        return cls(**{k: state[k] for k in cls.FIELDS},
                   extra={k: v for k, v in state.items() if k not in cls.FIELDS})

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.FIELDS}, **self.extra}


def step_prompts(task, cfg: RunConfig, step: int) -> list[str]:
    """Prompts of one step, a pure function of (seed, step): a resumed run draws the same ones."""
    return task.sample_prompts(cfg.rl.prompts_per_step, seeds.prompt_rng(cfg.seed, step))


def _evaluate(policy, task, eval_prompts: list[str], cfg: RunConfig, step: int) -> dict:
    t0 = time.perf_counter()
    # Own seeded RNG stream: how often we evaluate must not change the rollouts that follow.
    devices = [policy.device] if policy.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seeds.eval_seed(cfg.seed, step))
        greedy = accuracy(policy, task, eval_prompts, greedy=True)
        sampled = accuracy(policy, task, eval_prompts, greedy=False, temperature=cfg.rl.temperature)
    return {"step": step, "eval/acc_greedy": greedy, "eval/acc_sampled": sampled,
            "perf/eval_s": time.perf_counter() - t0}


def _failure(rows: list[dict], state: health.HealthState, collapse: RLCollapse) -> tuple[str, health.HealthState]:
    """The reason to stop after this step's rows ('' to go on), and the run's health after them."""
    params, obs = health.CollapseParams.from_config(collapse), health.observe(rows)
    state = health.advance(state, params, obs)
    return health.stop_reason(state, obs, params, collapse.stop_on_collapse), state


def _health(cfg: RunConfig, log: RunLog) -> health.HealthState:
    """The health after the logged rows: recomputed, never checkpointed, so a resume needs no extra state."""
    return health.replay(health.CollapseParams.from_config(cfg.rl.section("collapse")), log.rows)


def _claim(folder: RunFolder, config_text: str) -> None:
    """Write the run's config, or check that the folder already holds this very config (a resume)."""
    if config_state(folder.path, config_text) == CONFIG_OTHER:
        raise ConfigError(f"run folder {folder.path} holds a run of a different config; resuming it would mix two "
                          "configs in one table: remove the folder or choose another")
    folder.path.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder.config_path, config_text)


def run_info(cfg: RunConfig, run_id: str, arm: str) -> dict:
    return {"run_id": run_id, "arm": arm, "algo": cfg.rl.algo, "replay": cfg.rl.replay, "seed": cfg.seed}


def _setup(cfg: RunConfig, progress: bool) -> tuple:
    """(task, Trainee): the cold-started policy (and its tokenizer's task), its step components installed, the
    rollout copy, reference model and optimizer."""
    device = resolve_device(cfg.model.device)
    model_dir = cold_start(cfg, progress=progress)
    task = get_task(cfg.task, load_tokenizer(str(model_dir)))
    policy = load_model(model_dir, experts_impl=cfg.model.experts_impl).to(device)
    policy.train(False)  # no dropout: the old and new forwards must be comparable
    components = Components.build(cfg.rl)
    components.install(policy)  # before any copy and before a resume loads the saved state
    ref_model = None
    if cfg.rl.kl_coef > 0:
        ref_model = copy.deepcopy(policy).requires_grad_(False)
    return task, Trainee(policy, make_rollout_policy(policy, cfg.rl.section("rollout")), ref_model,
                         build_optimizer(policy, cfg.rl.section("schedule")), components)


def make_rollout_policy(policy, rollout: RLRollout):
    """The model the rollouts sample from: ``policy`` itself, or a copy of it in the rollout dtype (bf16, or fp32
    with float8 GEMMs), lagged (rollout_lag) or with batch-variant kernels (rollout_kernels). The numerics
    (moe_lab/models/numerics.py) replace the copy's forwards only, never the policy's. ``rollout``: the run's
    rollout section (the whole rl settings carry the same fields)."""
    numerics = rollout_numerics(rollout.rollout_dtype, rollout.rollout_kernels)
    if rollout.rollout_dtype == "float32" and rollout.rollout_lag == 0 and not numerics.active:
        return policy
    dtype = torch.bfloat16 if rollout.rollout_dtype == "bfloat16" else torch.float32
    return numerics.install(copy.deepcopy(policy).to(dtype).requires_grad_(False))


class PlainRun(SingleProcess):
    """The run-level part of a plain run (moe_lab/rl/split.py RunSplit): one process, which sets up, resumes and
    writes alone."""

    writer = True

    def check(self, cfg: RunConfig) -> None:
        """Refuse what this split cannot run (a plain run runs every valid config)."""

    def setup(self, claim, setup):
        claim()
        return setup()

    def resume_state(self, folder: RunFolder, policy, optimizer) -> TrainState:
        return TrainState.from_dict(checkpoint.load(folder.checkpoint_dir, policy, optimizer))

    def broadcast(self, obj):
        """The writer's object on every process."""
        return obj

    def barrier(self) -> None:
        """Every process waits here for the others."""

    def manifest_extra(self) -> dict:
        return {}


def train(cfg: RunConfig, run_dir: Path, *, run_id: str, arm: str = "default", progress: bool = False,
          split: RunSplit | None = None) -> str:
    """Run (or resume) one RL run in run_dir; returns its final status. ``split``: PlainRun() by default,
    moe_lab.rl.distributed.DataParallel under torchrun."""
    split = split or PlainRun()
    validate(cfg)
    split.check(cfg)
    torch.set_num_threads(cfg.threads)
    folder = RunFolder(run_dir)
    log = RunLog(folder.path, run_info(cfg, run_id, arm)) if split.writer else None
    task, trainee = split.setup(lambda: _claim(folder, dump_yaml(cfg)), lambda: _setup(cfg, progress))
    # the run-long sampling stream of rl.rollout_seeding=sequential (per_group draws from its own generators); after
    # setup: loading or warming up the model may draw numbers
    torch.manual_seed(seeds.run_seed(cfg.seed))
    state = split.resume_state(folder, trainee.policy, trainee.optimizer)
    trainee.components.resume(folder.checkpoint_dir, trainee.policy.device)
    if log:
        log.load(state.rows, state.eval_rows)
    # the health after the logged rows (only the writer holds them); from then on every process advances it
    # on the same global rows, so that all stop at the same step
    run_health = split.broadcast(_health(cfg, log) if log else None)
    extra = {**split.manifest_extra(), **provenance(folder.manifest if log else {}, cfg, state.step)}
    extra["machine"] = extra["segments"][-1]["machine"]  # this start's, as the last segment records it
    if log:
        log.write_manifest(STATUS_RUNNING, resumed_from_step=state.step, **extra, **run_health.manifest())
    reason = _loop(cfg, task, trainee, log, state, folder.checkpoint_dir, run_health, split,
                   _progress(range(state.step, cfg.rl.steps), progress, run_id))
    status = STATUS_COLLAPSED if reason else STATUS_DONE  # every stop reason is a collapse rule's
    if log:
        log.flush()
        alarm = harness.manifest(log.rows, cfg.rl)  # the rule's one owner: moe_lab/store/harness.py
        if alarm[harness.MANIFEST_KEY]:
            print(f"moe-lab run {run_id}: harness alarm: {'; '.join(alarm[harness.MANIFEST_KEY])}", file=sys.stderr)
        log.write_manifest(status, reason, steps_done=state.step, wall_s=state.wall_s, **extra,
                           **_health(cfg, log).manifest(), **alarm)
    split.barrier()
    return status


def provenance(prior: dict, cfg: RunConfig, step: int) -> dict:
    """The manifest's ``coldstart`` and ``segments`` for a run (re)starting at ``step``; ``prior``: its manifest so far.

    Why: one cache key names a different model on another processor (its cold start takes other supervised steps,
    docs/guide.md "Results that depend on the machine"), and a resumed run's weights come from its checkpoint, which
    descends from the cold start it began from, not from what this machine's cache now holds under that key. So
    ``coldstart`` stays the first segment's record, and each (re)start appends its step, machine and cache entry
    to ``segments`` with its start time: a run finished elsewhere says so (with ``rl.kl_coef`` > 0 its reference model after the
    resume is the later segment's cold start). A manifest without segments gives the
    first segment what it recorded (its last start and machine: run_folder.first_segments)."""
    # started: when this segment began (UNIX time), so a run can be dated against its experiment file's commit;
    # manifests written before it have none (their start is only inferred, updated - wall_s)
    here = {"from_step": step, "started": time.time(), "machine": machine_info(), "coldstart": recorded(cfg)}
    if step == 0:  # a run (re)started from scratch: nothing before it survives
        return {"coldstart": here["coldstart"], "segments": [here]}
    segments = first_segments(prior)
    segments.append(here)
    return {"coldstart": segments[0]["coldstart"], "segments": segments}


def _loop(cfg, task, trainee: Trainee, log: RunLog | None, state: TrainState, ckpt_dir: Path, run_health, split,
          steps) -> str:
    policy, parts = trainee.policy, trainee.components
    eval_prompts = task.eval_prompts()
    for step in steps:
        t0 = time.perf_counter()
        if log and step % cfg.rl.eval_every == 0:
            log.add_eval(_evaluate(policy, task, eval_prompts, cfg, step))
        parts.step_start(policy)
        parts.sync_rollout_policy(policy, trainee.rollout_policy)
        rows = rl_step(trainee, task, cfg, step, step_prompts(task, cfg, step), split=split)
        parts.step_end()
        state.wall_s += time.perf_counter() - t0
        for r in rows if log else ():
            log.add({**r, "perf/wall_s": state.wall_s})
        state.step = step + 1
        reason, run_health = _failure(rows, run_health, cfg.rl.section("collapse"))  # the same rows on every process
        if reason:
            # The final accuracy of a stopped run must be the policy it stopped with, not its last
            # scheduled evaluation from before the collapse.
            if log:
                log.add_eval(_evaluate(policy, task, eval_prompts, cfg, state.step))
            return reason
        if state.step % cfg.rl.checkpoint_every == 0 or state.step == cfg.rl.steps:
            if log:
                if state.step == cfg.rl.steps:
                    log.add_eval(_evaluate(policy, task, eval_prompts, cfg, state.step))
                state.rows, state.eval_rows = log.flush()
                checkpoint.save(ckpt_dir, policy, trainee.optimizer, state.to_dict(), **parts.saved())
            split.barrier()  # no process runs ahead of a checkpoint it might have to resume from
    return ""


def _progress(steps, enabled: bool, label: str):
    if not enabled:
        return steps
    from tqdm.auto import tqdm

    return tqdm(steps, desc=label, leave=False)
