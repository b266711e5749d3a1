"""Rollout numerics' cost: one rollout-sized generate of the rollout_mismatch organism (qwen3_moe, 8 layers,
hidden 128, 64 experts of width 16, top-8; 16 prompts x 8 samples) in each rollout setting (prints figures; not a
test).

Settings: fp32 (the policy itself), bf16, float8, float8 + batch_variant (rollout_mismatch's), each the copy
``make_rollout_policy`` makes. Every setting generates the same shapes (greedy, exactly the task's
max_new_tokens, from the same randomly initialised weights: the cost, not the samples, is measured), one thread
(config ``threads``), the settings interleaved round by round. Prints per setting the median process CPU time and
wall time over the repeats and the ratios of the CPU time to bf16's and fp32's (CPU time: the machine is shared
and a busy neighbour stretches the wall time, much less the CPU time of a one-thread process).

    python benchmarks/bench_rollout_numerics.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch

from moe_lab.cli import builtin_experiment
from moe_lab.launch.experiment import expand
from moe_lab.models import build_model
from moe_lab.rl.loop import make_rollout_policy
from moe_lab.tasks import get_task

SETTINGS = {"fp32": {"rollout_dtype": "float32"}, "bf16": {"rollout_dtype": "bfloat16"},
            "float8": {"rollout_dtype": "float8"},
            "float8+batch_variant": {"rollout_dtype": "float8", "rollout_kernels": "batch_variant"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = expand(builtin_experiment("rollout_mismatch"))[0].config
    task = get_task(cfg.task)
    policy = build_model(cfg.model, len(task.tokenizer)).eval()
    base_rl = dataclasses.replace(cfg.rl, rollout_kernels="batch_invariant")
    models = {name: make_rollout_policy(policy, dataclasses.replace(base_rl, **over))
              for name, over in SETTINGS.items()}
    prompts = [p for p in task.sample_prompts(cfg.rl.prompts_per_step, np.random.default_rng(0))
               for _ in range(cfg.rl.group_size)]
    enc = task.tokenizer(prompts, return_tensors="pt", padding=True)
    new = task.max_new_tokens
    cpu: dict[str, list[float]] = {name: [] for name in SETTINGS}
    wall: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, model in models.items():
            c0, w0 = time.process_time(), time.perf_counter()
            with torch.no_grad():
                model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=task.tokenizer.pad_token_id, eos_token_id=task.tokenizer.eos_token_id)
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    med = {name: statistics.median(v) for name, v in cpu.items()}
    print(f"rollout: {len(prompts)} sequences, prompt {enc['input_ids'].shape[1]} + {new} new tokens, "
          f"{args.repeats} interleaved repeats, 1 thread")
    print(f"{'setting':<22} {'cpu s':>6} {'wall s':>6} {'/ bf16':>6} {'/ fp32':>6}")
    for name in SETTINGS:
        print(f"{name:<22} {med[name]:6.2f} {statistics.median(wall[name]):6.2f} {med[name] / med['bf16']:6.2f} "
              f"{med[name] / med['fp32']:6.2f}")


if __name__ == "__main__":
    main()
