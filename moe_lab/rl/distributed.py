"""Data-parallel RL for one run: ``torchrun --nproc-per-node N -m moe_lab.train RUN.yaml --out DIR``.

Each rank rolls out its share of the step's prompt groups, computes their logp_old and routing traces
locally, and the minibatch updates all-reduce gradients through DDP (gloo on CPU, NCCL on GPU). Rank 0
gathers the metrics and alone writes the table, the evaluations and the checkpoints of DIR.

The table does not depend on the world size: per-group seeds, group-local minibatches and the exact
combination of the ranks' metrics are ``moe_lab.rl.dp_split``'s (its docstring says how).
The rest of the run is train.py's, through its helpers: the lag queue of ``rl.rollout_lag`` (every rank
keeps the same one, the checkpoint saves it), ``rl.train_dtype`` (inside step.update), the collapse rules
and the manifest's ``collapsed_at`` / ``collapse_rule`` (advanced on the same global rows on every rank).
Sums are reordered by the split (and matmuls see other batch shapes), so 1 and N ranks agree to float
rounding (~1e-6 relative), not bit for bit. Refused (one line each): ``rl.loss_agg=token-mean`` (a mean of
per-rank token means is not the global token mean), ``rl.whiten=batch`` (not group-local), a prompt count
that does not split evenly, and ``rl.group_size`` not a multiple of ``rl.minibatches``. Not exact, only
averaged over ranks: the KL loss term (``kl_mode=loss``), the aux loss, ``routing/load_*`` and
``ratio/logratio_var`` (see docs/metrics.md); router noise draws depend on the rank's batch shape
(``rl.rollout_router_noise`` is seeded per group, so its draws do not).

A non-finite loss or gradient norm on any rank ends the step's updates on every rank at the same update: after
each update the ranks all-reduce one flag (MAX of "this rank saw NaN/inf"), an extra collective that carries
no training data, so the numbers of a healthy run are unchanged. Without it a rank that stopped early would
wait in the metrics gather while the others wait in the next update's gradient all-reduce (a hang until the
process group's timeout). The run then ends ``collapsed`` (rule ``non_finite``) on every rank.
Test hook (not a config field): ``MOE_LAB_TEST_NAN_RANK=r`` makes rank r report a NaN loss for its first update
of step ``MOE_LAB_TEST_NAN_STEP`` (default 0), as if its loss alone had overflowed.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lab.rl import checkpoint
from moe_lab.config import ConfigError, RunConfig, apply_overrides, dump_yaml, from_dict, load_yaml, validate
from moe_lab.rl.dp_split import (check_data_parallel, combine_metrics, group_minibatch_indices, group_seed,
                              join_step_data, rank_groups)
from moe_lab.rl.runlog import FINISHED

# ----------------------------------------------------------------------------- the data-parallel step

def _collect_groups(policy, rollout_policy, ref_model, task, cfg: RunConfig, step: int, prompts: list[str],
                    groups: range):
    """Roll out this rank's groups one by one, each under its own seed; per-group metrics for the gather."""
    from moe_lab.rl.step import collect

    parts, group_metrics = [], []
    for gi in groups:
        torch.manual_seed(group_seed(cfg.seed, step, gi))
        data = collect(policy, rollout_policy, ref_model, task, cfg, step, [prompts[gi]])
        parts.append(data)
        group_metrics.append((data.batch_metrics, float(cfg.rl.group_size),
                              float(data.batch.response_mask_BT.sum())))
    return join_step_data(parts, task.tokenizer.pad_token_id, cfg.rl.replay), group_metrics


def dp_step(ddp_policy, policy, rollout_policy, ref_model, optimizer, task, cfg: RunConfig, step: int,
            prompts: list[str], first_update: int, rank: int, world: int) -> list[dict]:
    """One RL step over all ranks; every rank returns the same global rows (one per update)."""
    from moe_lab.rl.step import update

    t0 = time.perf_counter()
    groups = rank_groups(len(prompts), rank, world)
    data, group_metrics = _collect_groups(policy, rollout_policy, ref_model, task, cfg, step, prompts, groups)
    all_groups = _all_gather(group_metrics)
    batch_metrics = combine_metrics([g for per_rank in all_groups for g in per_rank])
    for k in [k for k in batch_metrics if k.startswith("perf/")]:  # a rank's groups run one after another
        batch_metrics[k] = max(sum(g[0][k] for g in per_rank) for per_rank in all_groups)
    mask = data.batch.response_mask_BT
    local_rows = []
    for epoch, m, u, idx_B in _schedule(groups, cfg, step, first_update):
        metrics = _test_nan(update(ddp_policy, ref_model, optimizer, data, idx_B, cfg, step, u), rank, step, u,
                            first_update)
        local_rows.append(((epoch, m, u), (metrics, float(len(idx_B)), float(mask[idx_B].sum()))))
        if not _finite_on_all_ranks(metrics, policy.device):
            break
    all_rows = _all_gather(local_rows)
    n_updates = min(len(r) for r in all_rows)
    wall = time.perf_counter() - t0
    tokens = sum(g[2] for per_rank in all_groups for g in per_rank)
    rows = []
    for i in range(n_updates):
        (epoch, m, u), _ = all_rows[0][i]
        metrics = combine_metrics([r[i][1] for r in all_rows])
        rows.append({"step": step, "epoch": epoch, "minibatch": m, "update": u, **batch_metrics, **metrics,
                     "perf/step_s": wall, "perf/tokens_per_s": tokens / wall})
    return rows


def _finite_on_all_ranks(metrics: dict, device: torch.device) -> bool:
    """Whether every rank's update had a finite loss and gradient norm: one all-reduced flag, so that every
    rank stops the step's updates at the same one."""
    local = math.isfinite(metrics["loss"]) and math.isfinite(metrics["optim/grad_norm"])
    flag = torch.tensor([0.0 if local else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return float(flag.item()) == 0.0


def _test_nan(metrics: dict, rank: int, step: int, update_idx: int, first_update: int) -> dict:
    """Tests only: MOE_LAB_TEST_NAN_RANK=r gives rank r a NaN loss at the first update of step
    MOE_LAB_TEST_NAN_STEP (default 0); unset (always, outside tests) it returns metrics untouched."""
    nan_rank = os.environ.get("MOE_LAB_TEST_NAN_RANK")
    if nan_rank is None or int(nan_rank) != rank or update_idx != first_update \
            or step != int(os.environ.get("MOE_LAB_TEST_NAN_STEP", "0")):
        return metrics
    return {**metrics, "loss": math.nan}


def _schedule(groups: range, cfg: RunConfig, step: int, first_update: int):
    """(epoch, minibatch, update index, local idx_B) of every update of one step, in step._schedule's order."""
    rl = cfg.rl
    for epoch in range(rl.epochs):
        for m, idx_B in enumerate(group_minibatch_indices(groups, rl.group_size, rl.minibatches, cfg.seed, step, epoch)):
            yield epoch, m, first_update + epoch * rl.minibatches + m, idx_B


def _all_gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- the run

def _init_process_group(device_name: str) -> tuple[int, int, int]:
    """Join torchrun's group; a plain ``python -m moe_lab.train`` is a group of one."""
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                           "LOCAL_RANK": "0"})
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local_rank)
    # a timeout, so that a rank that dies or diverges ends the run instead of hanging it
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    return dist.get_rank(), dist.get_world_size(), local_rank


def _on_rank0_first(fn):
    """fn() on rank 0 (the claim, the cold start) while the others wait; its error ends every rank."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as exc:  # told to the other ranks, then raised here
            error = exc
    told = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(told, src=0)
    if error is not None:
        raise error
    if told[0] is not None:
        raise RuntimeError(f"rank 0 failed: {told[0]}")
    return result


def _resume_state(run_dir: Path, policy, optimizer, world: int):
    from moe_lab.rl.loop import TrainState

    state = checkpoint.load(run_dir / "checkpoint", policy, optimizer)
    if state is None:
        return TrainState(extra={"world_size": world})
    saved = state.get("world_size")
    if saved != world:
        what = "a single-process run" if saved is None else f"world size {saved}"
        raise ConfigError(f"{run_dir / 'checkpoint'} was written by {what}; resuming it with world size {world} "
                          f"would change the sampling split: resume with --nproc-per-node {saved or 1}"
                          f"{'' if saved else ' through moe-lab run'} or use another --out")
    return TrainState.from_dict(state)


def train_data_parallel(cfg: RunConfig, run_dir: Path, *, run_id: str, arm: str = "default") -> str:
    """Run (or resume) one run over the process group; rank 0 writes run_dir. Returns the final status."""
    from moe_lab.rl import loop as T
    from moe_lab.rl.runlog import STATUS_COLLAPSED, STATUS_DONE, STATUS_RUNNING, RunLog, machine_info
    from moe_lab.launch.runner import quiet_transformers

    rank, world = dist.get_rank(), dist.get_world_size()
    validate(cfg)
    check_data_parallel(cfg, world)
    quiet_transformers()
    torch.set_num_threads(cfg.threads)
    run_dir = Path(run_dir)
    setup = _on_rank0_first(lambda: (T._claim(run_dir, dump_yaml(cfg)), T._setup(cfg, False))[1])
    task, policy, rollout_policy, ref_model, optimizer = setup if rank == 0 else T._setup(cfg, False)
    state = _resume_state(run_dir, policy, optimizer, world)
    device_ids = [policy.device.index] if policy.device.type == "cuda" else None
    # unselected experts get no gradient in a step: DDP must look for unused parameters
    ddp_policy = torch.nn.parallel.DistributedDataParallel(policy, device_ids=device_ids,
                                                           find_unused_parameters=True)
    ddp_policy.train(False)
    # every rank reads the lag queue of the shared checkpoint: ranks hold the same weights, hence the same queue
    lagged = collections.deque(checkpoint.load_snapshots(run_dir / "checkpoint", policy.device))
    log = RunLog(run_dir, T.run_info(cfg, run_id, arm)) if rank == 0 else None
    if log:
        log.load(state.rows, state.eval_rows)
    # the health after the logged rows: only rank 0 holds them; from then on every rank advances it on the
    # same global rows, so all ranks stop at the same step
    health_box = [T._health(cfg, log) if log else None]
    dist.broadcast_object_list(health_box, src=0)
    run_health = health_box[0]
    if log:
        log.write_manifest(STATUS_RUNNING, resumed_from_step=state.step, world_size=world, machine=machine_info(),
                           **run_health.manifest())
    reason = _loop(cfg, task, ddp_policy, policy, rollout_policy, ref_model, optimizer, log, state, run_dir,
                   rank, world, lagged, run_health)
    status = STATUS_COLLAPSED if reason else STATUS_DONE  # as train(): every stop reason is a collapse rule's
    if log:
        log.flush()
        log.write_manifest(status, reason, steps_done=state.step, wall_s=state.wall_s, world_size=world,
                           machine=machine_info(), **T._health(cfg, log).manifest())
    dist.barrier()
    return status


def _loop(cfg, task, ddp_policy, policy, rollout_policy, ref_model, optimizer, log, state, run_dir: Path,
          rank: int, world: int, lagged: collections.deque, run_health) -> str:
    """train._loop's step loop over the process group (same lag queue, health rules and checkpoints)."""
    from moe_lab.rl import loop as T
    from moe_lab.rl.step import updates_per_step

    eval_prompts = task.eval_prompts()
    for step in range(state.step, cfg.rl.steps):
        t0 = time.perf_counter()
        if log and step % cfg.rl.eval_every == 0:
            log.add_eval(T._evaluate(policy, task, eval_prompts, cfg, step))
        snapshot = T._snapshot(policy) if cfg.rl.rollout_lag else None
        T._sync_rollout_policy(policy, rollout_policy, lagged)
        rows = dp_step(ddp_policy, policy, rollout_policy, ref_model, optimizer, task, cfg, step,
                       T.step_prompts(task, cfg, step), step * updates_per_step(cfg), rank, world)
        T._push_snapshot(lagged, snapshot, cfg.rl.rollout_lag)
        state.wall_s += time.perf_counter() - t0
        if log:
            for r in rows:
                log.add({**r, "perf/wall_s": state.wall_s})
        state.step = step + 1
        reason, run_health = T._failure(rows, run_health, cfg.rl)  # same rows on every rank: all stop together
        if reason:
            if log:  # as train._loop: the final accuracy is the stopped policy's
                log.add_eval(T._evaluate(policy, task, eval_prompts, cfg, state.step))
            return reason
        if state.step % cfg.rl.checkpoint_every == 0 or state.step == cfg.rl.steps:
            if log:
                if state.step == cfg.rl.steps:
                    log.add_eval(T._evaluate(policy, task, eval_prompts, cfg, state.step))
                state.rows, state.eval_rows = log.flush()
                checkpoint.save(run_dir / "checkpoint", policy, optimizer, state.to_dict(), snapshots=list(lagged))
            dist.barrier()  # no rank runs ahead of a checkpoint it might have to resume from
    return ""


def load_run_config(path: str, overrides: list[str]) -> RunConfig:
    return validate(from_dict(apply_overrides(load_yaml(path), overrides)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_lab.train",
                                description="one RL run, data-parallel under torchrun (a RunConfig YAML)")
    p.add_argument("config", help="RunConfig YAML (model, task, coldstart, rl, seed, threads)")
    p.add_argument("overrides", nargs="*", metavar="FIELD=VALUE", help="override any config field, e.g. rl.steps=5")
    p.add_argument("--out", required=True, help="run folder: metrics.parquet, eval.parquet, checkpoint/ go here")
    p.add_argument("--run-id", default=None, help="run id in the table (default: the --out folder's name)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # FIELD=VALUE may follow --out
    try:
        cfg = load_run_config(args.config, args.overrides)
    except (ValueError, OSError) as exc:
        print(f"moe-lab: error: {exc}", file=sys.stderr)
        return 2
    rank, world, _ = _init_process_group(cfg.model.device)
    try:
        out = Path(args.out)
        status = train_data_parallel(cfg, out, run_id=args.run_id or out.resolve().name)
        return 0 if status in FINISHED else 1
    except ValueError as exc:  # ConfigError included: one line (from rank 0), no traceback
        if rank == 0:
            print(f"moe-lab: error: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
