"""Data-parallel RL for one run: ``torchrun --nproc-per-node N -m moe_lab.train RUN.yaml --out DIR``.

Each rank rolls out its share of the step's prompt groups, computes their logp_old and routing traces
locally, and the minibatch updates all-reduce gradients through DDP (gloo on CPU, NCCL on GPU). Rank 0
gathers the metrics and alone writes the table, the evaluations and the checkpoints of DIR.

The table does not depend on the world size: per-group seeds, group-local minibatches and the exact
combination of the ranks' metrics are ``moe_lab.rl.dp_split``'s (its docstring says how).
The rest of the run is the one loop of moe_lab.rl.loop, which ``DataParallel`` plugs into: the lag queue of
``rl.rollout_lag`` (every rank keeps the same one, the checkpoint saves it), ``rl.train_dtype`` (inside
step.update), the collapse rules and the manifest's ``collapsed_at`` / ``collapse_rule`` (advanced on the same
global rows on every rank).
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
import datetime
import math
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lab.config import ConfigError, RunConfig, apply_overrides, from_dict, load_yaml, validate
from moe_lab.rl import checkpoint
from moe_lab.rl.dp_split import check_data_parallel, combine_metrics, rank_groups
from moe_lab.rl.groups import group_minibatch_indices
from moe_lab.rl.collect import collect
from moe_lab.rl.loop import TrainState, train
from moe_lab.store.run_folder import RunFolder
from moe_lab.store.status import FINISHED

# ----------------------------------------------------------------------------- the split of a process group

class DataParallel:
    """What a process group adds to the one loop (moe_lab.rl.loop.train) and step (step.rl_step), the members
    of moe_lab/rl/split.py's RunSplit: setup on rank 0 first, the world-size check of a resume, the batch split
    (per-group seeds, group-local minibatches), the exact reduction of the ranks' metrics, and barriers. Rank 0
    alone writes."""

    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ddp_policy = None

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def check(self, cfg: RunConfig) -> None:
        check_data_parallel(cfg, self.world)
        from transformers.utils import logging as hf_logging  # a progress bar per checkpoint load: noise

        hf_logging.disable_progress_bar()

    def setup(self, claim, setup):
        """The claim and the cold start on rank 0 while the others wait; then every rank loads the model."""
        result = _on_rank0_first(lambda: (claim(), setup())[1])
        return result if self.rank == 0 else setup()

    def resume_state(self, folder: RunFolder, policy, optimizer) -> TrainState:
        state = _resume_state(folder.checkpoint_dir, policy, optimizer, self.world)
        device_ids = [policy.device.index] if policy.device.type == "cuda" else None
        # unselected experts get no gradient in a step: DDP must look for unused parameters
        self.ddp_policy = torch.nn.parallel.DistributedDataParallel(policy, device_ids=device_ids,
                                                                    find_unused_parameters=True)
        self.ddp_policy.train(False)
        return state

    def broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def manifest_extra(self) -> dict:
        return {"world_size": self.world}

    def trained(self, policy):
        return self.ddp_policy

    def collect(self, policy, rollout_policy, ref_model, task, cfg: RunConfig, step: int, prompts: list[str]):
        """This rank's groups (each rolled out under its own seed, moe_lab.rl.groups), and the batch metrics of
        all ranks' groups."""
        groups = rank_groups(len(prompts), self.rank, self.world)
        data = collect(policy, rollout_policy, ref_model, task, cfg, step, [prompts[g] for g in groups],
                       first_group=groups.start)
        mine = (data.batch_metrics, float(len(groups) * cfg.rl.group_size), float(data.batch.response_mask_BT.sum()))
        parts = _all_gather(mine)
        return data, combine_metrics(parts), sum(p[2] for p in parts)

    def schedule(self, data, cfg: RunConfig, step: int, first_update: int):
        """(epoch, minibatch, update index, local idx_B), in SingleProcess.schedule's order."""
        rl, groups = cfg.rl, rank_groups(cfg.rl.prompts_per_step, self.rank, self.world)
        for epoch in range(rl.epochs):
            for m, idx_B in enumerate(group_minibatch_indices(groups, rl.group_size, rl.minibatches, cfg.seed,
                                                              step, epoch)):
                yield epoch, m, first_update + epoch * rl.minibatches + m, idx_B

    def checked(self, metrics: dict, step: int, update_idx: int, first_update: int) -> dict:
        """Tests only: MOE_LAB_TEST_NAN_RANK=r gives rank r a NaN loss at the first update of step
        MOE_LAB_TEST_NAN_STEP (default 0); unset (always, outside tests) it returns metrics untouched."""
        nan_rank = os.environ.get("MOE_LAB_TEST_NAN_RANK")
        if nan_rank is None or int(nan_rank) != self.rank or update_idx != first_update \
                or step != int(os.environ.get("MOE_LAB_TEST_NAN_STEP", "0")):
            return metrics
        return {**metrics, "loss": math.nan}

    def all_finite(self, metrics: dict, device: torch.device) -> bool:
        """Whether every rank's update had a finite loss and gradient norm: one all-reduced flag, so that every
        rank stops the step's updates at the same one."""
        local = math.isfinite(metrics["loss"]) and math.isfinite(metrics["optim/grad_norm"])
        flag = torch.tensor([0.0 if local else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return float(flag.item()) == 0.0

    def reduce(self, updates: list, data) -> list[tuple[tuple, dict]]:
        """Every rank's updates, combined into the global metrics; as many as the rank that stopped first."""
        mask = data.batch.response_mask_BT
        local = [(key, (metrics, float(len(idx_B)), float(mask[idx_B].sum()))) for key, metrics, idx_B in updates]
        all_rows = _all_gather(local)
        n_updates = min(len(r) for r in all_rows)
        return [(all_rows[0][i][0], combine_metrics([r[i][1] for r in all_rows])) for i in range(n_updates)]


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


def _resume_state(ckpt_dir: Path, policy, optimizer, world: int) -> TrainState:
    state = checkpoint.load(ckpt_dir, policy, optimizer)
    if state is None:
        return TrainState(extra={"world_size": world})
    saved = state.get("world_size")
    if saved != world:
        what = "a single-process run" if saved is None else f"world size {saved}"
        raise ConfigError(f"{ckpt_dir} was written by {what}; resuming it with world size {world} "
                          f"would change the sampling split: resume with --nproc-per-node {saved or 1}"
                          f"{'' if saved else ' through moe-lab run'} or use another --out")
    return TrainState.from_dict(state)


def train_data_parallel(cfg: RunConfig, run_dir: Path, *, run_id: str, arm: str = "default") -> str:
    """Run (or resume) one run over the process group; rank 0 writes run_dir. Returns the final status."""
    return train(cfg, run_dir, run_id=run_id, arm=arm, progress=False, split=DataParallel())


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
