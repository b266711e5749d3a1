"""Data-parallel RL for one run: ``torchrun --nproc-per-node N -m moe_lab.train RUN.yaml --out DIR``.

Each rank rolls out its share of the step's prompt groups, computes their logp_old and routing traces
locally, and the minibatch updates all-reduce gradients through DDP (gloo on CPU, NCCL on GPU). Rank 0
gathers the metrics and alone writes the table, the evaluations and the checkpoints of DIR.

The table does not depend on the world size:
- every prompt group is sampled under its own seed, a function of (seed, step, prompt index), so a group
  gets the same responses on whichever rank it lands (this sampling mode is used for every torchrun run,
  world size 1 included; the plain ``train()`` path keeps its one-generator sampling);
- groups never straddle ranks (advantages are group-local), and minibatch m takes the same G/M responses
  of every group (a seeded per-group shuffle), so each rank holds the same number of sequences in every
  minibatch and DDP's mean of the per-rank seq-mean losses is the global seq-mean loss;
- every epoch (``rl.epochs``) reshuffles each group under its own seed, so epoch e's minibatch m is also
  the same sequences on any split; update indices follow step.py (step*epochs*M + epoch*M + m);
- metrics are combined with the weights that make them the global ones (tokens for token means, sequences
  for sequence means, law of total variance for variances, max for maxima, ``rollout_corr/ess`` recomputed
  from each part's weight sums).
The rest of the run is train.py's, through its helpers: the lag queue of ``rl.rollout_lag`` (every rank
keeps the same one, the checkpoint saves it), ``rl.train_dtype`` (inside step.update), the collapse rules
and the manifest's ``collapsed_at`` / ``collapse_rule`` (advanced on the same global rows on every rank).
Sums are reordered by the split (and matmuls see other batch shapes), so 1 and N ranks agree to float
rounding (~1e-6 relative), not bit for bit. Refused (one line each): ``rl.loss_agg=token-mean`` (a mean of
per-rank token means is not the global token mean), ``rl.whiten=batch`` (not group-local), a prompt count
that does not split evenly, and ``rl.group_size`` not a multiple of ``rl.minibatches``. Not exact, only
averaged over ranks: the KL loss term (``kl_mode=loss``), the aux loss, ``routing/load_*`` and
``ratio/logratio_var`` (see docs/metrics.md); router noise draws depend on the rank's batch shape.
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

from moe_lab import checkpoint
from moe_lab.config import ConfigError, RunConfig, apply_overrides, dump_yaml, from_dict, load_yaml, validate

SEQ_WEIGHTED = {"loss", "clip_frac/seq", "ratio/seq_mean", "reward/mean", "reward/zero_var_groups",
                "kl/ref_reward_penalty", "response/length_mean", "routing/aux_loss", "objective/seq_ratio_mean"}
# variance -> (its mean, weight kind): combined exactly by the law of total variance
VARIANCES = {"ratio/token_var": ("ratio/token_mean", "tok"), "ratio/seq_var": ("ratio/seq_mean", "seq")}
STDS = {"reward/std": ("reward/mean", "seq")}
SAME_ON_ALL_RANKS = {"optim/grad_norm", "optim/lr", "step", "epoch", "minibatch", "update"}


def check_data_parallel(cfg: RunConfig, world: int) -> None:
    """Refuse, in one line, what a split over ``world`` ranks cannot compute as the single-process step does."""
    rl = cfg.rl
    if rl.prompts_per_step % world:
        raise ConfigError(f"rl.prompts_per_step={rl.prompts_per_step} must be a multiple of the world size {world} "
                          "(prompt groups never straddle ranks)")
    if rl.group_size % rl.minibatches:
        raise ConfigError(f"rl.group_size={rl.group_size} must be a multiple of rl.minibatches={rl.minibatches} in a "
                          "data-parallel run (each minibatch takes group_size/minibatches responses of every group)")
    if rl.loss_agg == "token-mean":
        raise ConfigError("rl.loss_agg=token-mean is not supported data-parallel (a mean of per-rank token means is "
                          "not the global one); allowed: seq-mean-token-mean, seq-mean-token-sum, "
                          "seq-mean-token-sum-norm")
    if rl.whiten == "batch":
        raise ConfigError("rl.whiten=batch is not supported data-parallel (advantages must be group-local); "
                          "allowed: group")


def group_seed(seed: int, step: int, prompt_index: int) -> int:
    """Sampling seed of one prompt group: the same on whichever rank the group lands."""
    return (seed * 1_000_003 + step * 7919 + prompt_index * 104_729 + 12_345) % (2 ** 63)


def rank_groups(n_prompts: int, rank: int, world: int) -> range:
    """Contiguous block of prompt indices of one rank: rank order = global batch order."""
    per = n_prompts // world
    return range(rank * per, (rank + 1) * per)


def group_minibatch_indices(group_indices, group_size: int, minibatches: int, seed: int, step: int,
                         epoch: int = 0) -> list[torch.Tensor]:
    """Indices (into the rank's batch) of each minibatch: G/M responses of every local group.

    Each group's shuffle is seeded by its global index, so the global minibatch does not depend on the split;
    every epoch (rl.epochs) draws its own shuffle, epoch 0 the one single-epoch runs always drew.
    """
    parts: list[list[torch.Tensor]] = [[] for _ in range(minibatches)]
    for j, gi in enumerate(group_indices):
        gen = torch.Generator().manual_seed(group_seed(seed, step, gi) + 999_983 + epoch * 1_009)
        for m, chunk in enumerate(torch.randperm(group_size, generator=gen).chunk(minibatches)):
            parts[m].append(chunk + j * group_size)
    return [torch.cat(p) for p in parts]


# ----------------------------------------------------------------------------- joining groups' step data

def _prompt_len(response_mask_BT: torch.Tensor) -> int:
    # generate() emits at least one token, so column P-1 is a response column in every row
    return int(response_mask_BT[0].nonzero()[0]) + 1


def _pad_cols(x: torch.Tensor, left: int, right: int, value, dim: int = 1) -> torch.Tensor:
    if not left and not right:
        return x
    shape_l, shape_r = list(x.shape), list(x.shape)
    shape_l[dim], shape_r[dim] = left, right
    return torch.cat([x.new_full(shape_l, value), x, x.new_full(shape_r, value)], dim=dim)


def _pad_trace(trace, left: int, right: int):
    from moe_lab.routing import Trace

    if not left and not right:
        return trace
    ids = trace.indices
    K = ids.shape[-1]
    # pad positions get distinct ids 0..K-1: never read (masked), but a valid top-k for replay to force
    fill = torch.arange(K, dtype=ids.dtype, device=ids.device)
    def pad(x, filler):
        L, B, _, _ = x.shape
        blocks = [filler.expand(L, B, n, K) for n in (left, right)]
        return torch.cat([blocks[0], x, blocks[1]], dim=2)
    w, lp = trace.weights, trace.router_logp_LBTK
    zeros = torch.zeros(K, dtype=torch.float32, device=ids.device)  # never read either: masked positions
    return Trace(pad(ids, fill), None if w is None else pad(w, zeros), num_experts=trace.num_experts,
                 family=trace.family, router_logp=None if lp is None else pad(lp, zeros))


def join_step_data(parts: list, pad_token_id: int, replay: str):
    """One StepData from the StepData of single prompt groups (left-pad prompts, right-pad responses).

    ``replay``: the run's rl.replay, which decides the forced trace as in step.collect.
    """
    from moe_lab.rollout import RolloutBatch
    from moe_lab.routing import Trace
    from moe_lab.step import StepData

    if len(parts) == 1:
        return parts[0]
    d0 = parts[0]
    P = [_prompt_len(d.batch.response_mask_BT) for d in parts]
    N = [d.batch.input_ids_BS.shape[1] - p for d, p in zip(parts, P)]
    pads = [(max(P) - p, max(N) - n) for p, n in zip(P, N)]

    def cat(get, value, dim=1):
        return torch.cat([_pad_cols(get(d), l, r, value, dim) for d, (l, r) in zip(parts, pads)], dim=0)

    def cat_trace(get):
        traces = [get(d) for d in parts]
        if traces[0] is None:
            return None
        return Trace.cat([_pad_trace(t, l, r) for t, (l, r) in zip(traces, pads)])

    trace = cat_trace(lambda d: d.batch.trace)
    # Keep collect()'s sharing, which update() relies on (`old_trace is forced_trace` under R2): old_trace is
    # the rollout trace itself with old_logp=rollout, else its own (under R3 a copy carrying the old
    # router's log-probs); the forced trace is one of the two, chosen by rl.replay as in collect().
    old = trace if d0.old_trace is d0.batch.trace else cat_trace(lambda d: d.old_trace)
    forced = {"none": None, "old": old, "rollout": trace}[replay]
    # right padding mimics generate(): pad tokens after EOS with attention 1 (never attended: causal)
    ids = torch.cat([_pad_cols(_pad_cols(d.batch.input_ids_BS, l, 0, pad_token_id), 0, r, pad_token_id)
                     for d, (l, r) in zip(parts, pads)])
    attn = torch.cat([_pad_cols(_pad_cols(d.batch.attention_mask_BS, l, 0, 0), 0, r, 1)
                      for d, (l, r) in zip(parts, pads)])
    batch = RolloutBatch(prompts=[p for d in parts for p in d.batch.prompts],
                         completions=[c for d in parts for c in d.batch.completions], input_ids_BS=ids,
                         attention_mask_BS=attn, response_mask_BT=cat(lambda d: d.batch.response_mask_BT, False),
                         logp_rollout_BT=cat(lambda d: d.batch.logp_rollout_BT, 0.0), trace=trace,
                         response_len_B=torch.cat([d.batch.response_len_B for d in parts]))
    # rollout-correction weights are 0 off the response mask (as rollout_correction returns them)
    is_weights = None if d0.is_weights_BT is None else cat(lambda d: d.is_weights_BT, 0.0)
    return StepData(batch, torch.cat([d.rewards_B for d in parts]), torch.cat([d.adv_B for d in parts]),
                    cat(lambda d: d.logp_old_BT, 0.0), old, forced, {}, d0.norm_len, is_weights)


# ----------------------------------------------------------------------------- metrics across parts

def combine_metrics(parts: list[tuple[dict, float, float]]) -> dict[str, float]:
    """Global metrics from the metrics of disjoint parts of a batch: [(metrics, n_seq, n_tok)].

    Token means are weighted by tokens, sequence means by sequences, variances and stds combined by the
    law of total variance, maxima by max; perf/* take the slowest part. Parts list the same keys.
    """
    keys = list(parts[0][0])
    out: dict[str, float] = {}
    for k in keys:
        vals = [p[0][k] for p in parts]
        if k in SAME_ON_ALL_RANKS:
            out[k] = vals[0]
        elif k.startswith("perf/") or "max" in k.split("/")[-1]:
            out[k] = max(vals)
        elif "min" in k.split("/")[-1]:
            out[k] = min(vals)
        else:
            kind = "seq" if k in SEQ_WEIGHTED else VARIANCES.get(k, STDS.get(k, (None, "tok")))[1]
            w = [p[1] if kind == "seq" else p[2] for p in parts]
            out[k] = _weighted_mean(vals, w)
    if "rollout_corr/ess" in out:
        out["rollout_corr/ess"] = _combined_ess(parts)
    for table, is_std in ((VARIANCES, False), (STDS, True)):
        for k, (mean_key, kind) in table.items():
            if k in out and mean_key in out:
                w = [p[1] if kind == "seq" else p[2] for p in parts]
                second = [(p[0][k] ** 2 if is_std else p[0][k]) + p[0][mean_key] ** 2 for p in parts]
                var = max(_weighted_mean(second, w) - out[mean_key] ** 2, 0.0)
                out[k] = math.sqrt(var) if is_std else var
    return out


def _combined_ess(parts: list[tuple[dict, float, float]]) -> float:
    """ESS = (sum w)^2 / (n sum w^2) of the whole batch, exactly, from each part's weight mean, ESS and tokens.

    A part's sums are recovered as S = mean * n and Q = S^2 / (n ESS) (Q = 0 when its ESS is 0: all its
    weights are 0), so no extra gather is needed.
    """
    S = Q = N = 0.0
    for metrics, _, n in parts:
        if n <= 0:
            continue
        s_i, ess_i = metrics["rollout_corr/weight_mean"] * n, metrics["rollout_corr/ess"]
        S, N = S + s_i, N + n
        Q += s_i * s_i / (n * ess_i) if ess_i > 0 else 0.0
    return S * S / (N * Q) if Q > 0 else 0.0


def _weighted_mean(vals: list[float], w: list[float]) -> float:
    total = sum(wi for wi, v in zip(w, vals) if wi > 0)
    if total == 0:
        return math.nan
    return sum(wi * v for wi, v in zip(w, vals) if wi > 0) / total


# ----------------------------------------------------------------------------- the data-parallel step

def _collect_groups(policy, rollout_policy, ref_model, task, cfg: RunConfig, step: int, prompts: list[str],
                    groups: range):
    """Roll out this rank's groups one by one, each under its own seed; per-group metrics for the gather."""
    from moe_lab.step import collect

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
    from moe_lab.step import update

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
        metrics = update(ddp_policy, ref_model, optimizer, data, idx_B, cfg, step, u)
        local_rows.append(((epoch, m, u), (metrics, float(len(idx_B)), float(mask[idx_B].sum()))))
        if not math.isfinite(metrics["loss"]) or not math.isfinite(metrics["optim/grad_norm"]):
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
    from moe_lab.train import TrainState

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
    from moe_lab import train as T
    from moe_lab.runlog import STATUS_DONE, STATUS_FAILED, STATUS_RUNNING, RunLog
    from moe_lab.runner import quiet_transformers

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
        log.write_manifest(STATUS_RUNNING, resumed_from_step=state.step, world_size=world, **run_health.manifest())
    reason = _loop(cfg, task, ddp_policy, policy, rollout_policy, ref_model, optimizer, log, state, run_dir,
                   rank, world, lagged, run_health)
    status = STATUS_FAILED if reason else STATUS_DONE
    if log:
        log.flush()
        log.write_manifest(status, reason, steps_done=state.step, wall_s=state.wall_s, world_size=world,
                           **T._health(cfg, log).manifest())
    dist.barrier()
    return status


def _loop(cfg, task, ddp_policy, policy, rollout_policy, ref_model, optimizer, log, state, run_dir: Path,
          rank: int, world: int, lagged: collections.deque, run_health) -> str:
    """train._loop's step loop over the process group (same lag queue, health rules and checkpoints)."""
    from moe_lab import train as T
    from moe_lab.step import updates_per_step

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
        return 0 if status == "done" else 1
    except ValueError as exc:  # ConfigError included: one line (from rank 0), no traceback
        if rank == 0:
            print(f"moe-lab: error: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
