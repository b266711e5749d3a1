"""TRL's GRPOTrainer alone against moe_lab's integration (metrics only, R2, R3) on CPU (prints; not a test).

One process, interleaved: every round runs each arm (in a rotated order) for ``--cycles`` RL steps from the
same initial weights and seed, so the arms generate the same first batch and machine noise hits them alike.
An RL step = one generation + 4 optimizer steps (steps_per_generation=4, one microbatch each: off-policy, so TRL
runs its old-policy pass in every arm and R2 has something to replay). The policy is moe_lab's default model
(Qwen3-MoE, 4 MoE layers, width 128, 8 experts, top-2, random init), 16 sort prompts x 8 responses, TRL's default
gradient checkpointing, fp32, one thread. CPU seconds per RL step (``time.process_time``: robust to other jobs on
the machine) = median over rounds and cycles (the first cycle of each run, a warm-up, dropped).

``--width`` sets the model's hidden size (default 128, moe_lab's default model; the overhead is a larger share
of a step at smaller widths, where TRL's own work per token is smaller).

    OMP_NUM_THREADS=1 python benchmarks/bench_trl_replay.py [--rounds 3] [--cycles 3] [--threads 1] [--width 128]

``--profile "R3 + metrics"`` runs that one arm under cProfile instead and prints the share of the process's CPU
time spent inside moe_lab's routing hooks, batch routing and metrics (robust where the interleaved timing is not
resolved: a machine shared with other jobs).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time

import numpy as np
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from moe_lab.config import from_dict, validate
from moe_lab.integrations.trl import MoEGRPOConfig, MoEGRPOTrainer
from moe_lab.models import build_model
from moe_lab.tasks import get_task

STEPS_PER_GENERATION = 4
ARMS = {  # name -> (trainer, config, extra config fields)
    "trl alone": (GRPOTrainer, GRPOConfig, {}),
    "metrics only": (MoEGRPOTrainer, MoEGRPOConfig, {"routing_replay": "none"}),
    "R2 + metrics": (MoEGRPOTrainer, MoEGRPOConfig, {"routing_replay": "old"}),
    "R3 + metrics": (MoEGRPOTrainer, MoEGRPOConfig, {"routing_replay": "rollout"}),
    "R3, no metrics": (MoEGRPOTrainer, MoEGRPOConfig, {"routing_replay": "rollout", "moe_metrics": False}),
}


class CycleClock(TrainerCallback):
    """CPU seconds of this process for each RL step, between generation boundaries (every STEPS_PER_GENERATION
    optimizer steps). CPU time, not wall time: on a machine shared with other jobs the wall clock mostly measures
    them (one thread: CPU time = the work this step did)."""

    def __init__(self):
        self.t0, self.cycles = None, []

    def on_train_begin(self, args, state, control, **kw):
        self.t0 = time.process_time()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step % STEPS_PER_GENERATION == 0:
            now = time.process_time()
            self.cycles.append(now - self.t0)
            self.t0 = now


def policy(cfg, tok, init: dict | None = None):
    """moe_lab's default policy for the task's tokenizer; ``init``: its weights (else the seeded random init)."""
    special = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = build_model(cfg.model, len(tok), **special)
    if init is not None:
        model.load_state_dict(init)
    return model


def run_arm(name: str, init: dict, cfg, task, prompts: list[str], cycles: int, out_dir: str) -> list[float]:
    trainer_cls, config_cls, extra = ARMS[name]
    tok = task.tokenizer
    model = policy(cfg, tok, init)

    def reward(prompts, completions, **_):
        return [task.reward(p, c) for p, c in zip(prompts, completions)]

    args = config_cls(output_dir=out_dir, per_device_train_batch_size=len(prompts) * 8 // STEPS_PER_GENERATION,
                      steps_per_generation=STEPS_PER_GENERATION, num_generations=8,
                      max_completion_length=task.max_new_tokens, temperature=1.0, learning_rate=1e-4, beta=0.0,
                      max_steps=(cycles + 1) * STEPS_PER_GENERATION, logging_steps=10_000, save_strategy="no",
                      report_to="none", use_cpu=True, disable_tqdm=True, seed=0, shuffle_dataset=False, **extra)
    clock = CycleClock()
    data = Dataset.from_dict({"prompt": prompts * (cycles + 2)})
    trainer_cls(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                callbacks=[clock]).train()
    return clock.cycles[1:]


# moe_lab's entry points called from TRL's and torch's code: their cumulative time is what the integration adds
ENTRIES = {("routing/hooks.py", "_router_hook"), ("routing/hooks.py", "_pre_call"), ("routing/hooks.py", "finish"),
           ("routing/hooks.py", "__init__"), ("integrations/trl/trainer.py", "_moe_measure"),
           ("integrations/batch_routing.py", "hook"), ("integrations/batch_routing.py", "finish"),
           ("integrations/batch_routing.py", "_add_position_ids"), ("integrations/trl/trainer.py", "_moe_batch_routing"),
           ("integrations/metric_row.py", "take"), ("integrations/trl/state.py", "old_reference"),
           ("integrations/trl/state.py", "batch")}


def profile_arm(name: str, init: dict, cfg, task, prompts: list[str], cycles: int) -> None:
    profiler = cProfile.Profile()
    with tempfile.TemporaryDirectory() as out_dir:
        torch.manual_seed(0)
        profiler.enable()
        run_arm(name, init, cfg, task, prompts, cycles, out_dir)
        profiler.disable()
    stats = pstats.Stats(profiler)
    ours = sum(v[3] for (path, _, fn), v in stats.stats.items()
               if "moe_lab/" in path and (path.split("moe_lab/")[-1], fn) in ENTRIES)
    print(f"{name}: {ours:.2f} of {stats.total_tt:.2f} CPU s in moe_lab's hooks, batch routing and metrics "
          f"({100 * ours / stats.total_tt:.1f}%)")


def options() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=3, help="timed RL steps per run (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--width", type=int, default=128, help="the model's hidden_size")
    ap.add_argument("--profile", default=None, choices=list(ARMS), help="profile this arm instead of timing")
    return ap.parse_args()


def main() -> None:
    opts = options()
    cfg = validate(from_dict({"model": {"hidden_size": opts.width}}))
    torch.set_num_threads(opts.threads)
    task = get_task(cfg.task)
    init = policy(cfg, task.tokenizer).state_dict()  # build_model seeds its own init (cfg.model.seed)
    prompts = task.sample_prompts(16, np.random.default_rng(0))
    if opts.profile:
        return profile_arm(opts.profile, init, cfg, task, prompts, opts.cycles)
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    names = list(ARMS)
    with tempfile.TemporaryDirectory() as out_dir:
        for r in range(opts.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                torch.manual_seed(0)
                times[name] += run_arm(name, init, cfg, task, prompts, opts.cycles, out_dir)
    import trl

    print(f"trl {trl.__version__}, torch {torch.__version__}, threads={opts.threads}, width {opts.width}, "
          f"{opts.rounds} rounds x "
          f"{opts.cycles} timed RL steps per arm (16 prompts x 8 responses, 4 optimizer steps each)")
    base = statistics.median(times["trl alone"])
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:16s} {med:7.3f} CPU s per RL step  x trl {med / base:.3f}  "
              f"(min {min(values):.3f}, max {max(values):.3f})")


if __name__ == "__main__":
    main()
