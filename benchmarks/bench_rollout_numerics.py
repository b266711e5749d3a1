"""Rollout numerics' cost: one rollout-sized generate of an organism (default rollout_mismatch: qwen3_moe, 8
layers, hidden 128, 64 experts of width 16, top-8; 16 prompts x 8 samples; --experiment routing_matters: its
glm4_moe) in each rollout setting (prints figures; not a test).

Settings: fp32 (the policy itself), bf16, float8, float8 + batch_variant (the committed runs'), float8 +
batch_variant_fast (moe_lab/models/numerics_fast.py), each the copy ``make_rollout_policy`` makes. The
processor's bf16 support is printed beside the ratios: on one without native bf16 GEMMs (no AMX) a bf16 rollout
is no yardstick. Every setting generates the same shapes (greedy, exactly the task's
max_new_tokens, from the same randomly initialised weights: the cost, not the samples, is measured), one thread
(config ``threads``), the settings interleaved round by round. Prints per setting the median process CPU time and
wall time over the repeats and the ratios of the CPU time to bf16's and fp32's (CPU time: the machine is shared
and a busy neighbour stretches the wall time, much less the CPU time of a one-thread process).

Then, per emulated setting, what stands in the way of its cost: the seconds inside the one-row kernel that fixes
its bits (numerics.row_gemm, timed per call in the last repeat), that kernel's GFLOP/s, the same GEMMs (every
call's M x K x N) through torch.mm (the platform's GEMM: other bits, batch-dependent), and the rollout as it would
cost with the row kernel at torch.mm's speed, against bf16.

    python benchmarks/bench_rollout_numerics.py [--repeats 5] [--experiment routing_matters] [--trained]

--trained: the organism's cold-start weights (results/reference/<experiment>/coldstarts when it holds them, else
moe-lab's cache, warmed if missing) instead of random ones, so the experts get the rows a trained router sends them.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from moe_lab.cli import builtin_experiment
from moe_lab.launch.experiment import expand
from moe_lab.models import build_model, load_model, numerics
from moe_lab.rl.coldstart import cold_start
from moe_lab.rl.loop import make_rollout_policy
from moe_lab.store.cpuinfo import processor_info
from moe_lab.tasks import get_task, load_tokenizer

SETTINGS = {"fp32": {"rollout_dtype": "float32"}, "bf16": {"rollout_dtype": "bfloat16"},
            "float8": {"rollout_dtype": "float8"},
            "float8+batch_variant": {"rollout_dtype": "float8", "rollout_kernels": "batch_variant"},
            "float8+batch_variant_fast": {"rollout_dtype": "float8", "rollout_kernels": "batch_variant_fast"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--experiment", default="rollout_mismatch")
    ap.add_argument("--trained", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = expand(builtin_experiment(args.experiment))[0].config
    if args.trained:
        committed = Path(__file__).resolve().parents[1] / "results" / "reference" / args.experiment / "coldstarts"
        if committed.is_dir():  # the experiment's committed cold starts, when its first cell's is among them
            cfg = dataclasses.replace(cfg, coldstart=dataclasses.replace(cfg.coldstart, cache_dir=str(committed)))
        model_dir = cold_start(cfg)
        task = get_task(cfg.task, load_tokenizer(str(model_dir)))
        policy = load_model(model_dir, experts_impl=cfg.model.experts_impl).eval()
    else:
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
    kernel = RowKernelTimer()
    for repeat in range(args.repeats):
        for name, model in models.items():
            kernel.start(name if repeat == args.repeats - 1 else None)
            c0, w0 = time.process_time(), time.perf_counter()
            with torch.no_grad():
                model.generate(**enc, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                               pad_token_id=task.tokenizer.pad_token_id, eos_token_id=task.tokenizer.eos_token_id)
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    kernel.start(None)
    med = {name: statistics.median(v) for name, v in cpu.items()}
    flags = processor_info().get("flags", [])
    bf16 = [f for f in ("avx512_bf16", "amx_bf16", "bf16") if f in flags]
    print(f"{args.experiment} ({cfg.model.family}, {'cold-start' if args.trained else 'random'} weights): "
          f"{len(prompts)} sequences, prompt {enc['input_ids'].shape[1]} + {new} new tokens, "
          f"{args.repeats} interleaved repeats, 1 thread")
    print(f"processor: {processor_info().get('model_name', '?')}; bf16 support: {', '.join(bf16) or 'none'}"
          f" ({'native bf16 GEMMs (AMX)' if 'amx_bf16' in flags else 'no native bf16 GEMMs'})")
    print(f"{'setting':<26} {'cpu s':>6} {'wall s':>6} {'/ bf16':>6} {'/ fp32':>6}")
    for name in SETTINGS:
        print(f"{name:<26} {med[name]:6.2f} {statistics.median(wall[name]):6.2f} {med[name] / med['bf16']:6.2f} "
              f"{med[name] / med['fp32']:6.2f}")
    print(f"\n{'setting':<26} {'row kernel s':>12} {'GFLOP':>6} {'GFLOP/s':>8} {'as torch.mm s':>13} {'GFLOP/s':>8} "
          f"{'mm-speed / bf16':>15}")
    for name, (secs, shapes) in kernel.seen.items():
        gflop = sum(2 * m * k * n * c for (m, k, n), c in shapes.items()) / 1e9
        mm = mm_seconds(shapes)
        print(f"{name:<26} {secs:12.3f} {gflop:6.2f} {gflop / secs:8.1f} {mm:13.3f} {gflop / mm:8.1f} "
              f"{(med[name] - secs + mm) / med['bf16']:15.2f}")


class RowKernelTimer:
    """Times numerics.row_gemm and counts its (M, K, N) calls for one named setting at a time. A benchmark's
    instrument: it swaps the module's function (the emulated forwards look it up per call) and puts it back."""

    def __init__(self):
        self.kernel, self.name = numerics.row_gemm, None
        self.seen: dict[str, tuple[float, Counter]] = {}

    def start(self, name: str | None) -> None:
        self.name = name
        numerics.row_gemm = self.timed if name else self.kernel

    def timed(self, x_RK, w_NK):
        t0 = time.perf_counter()
        y = self.kernel(x_RK, w_NK)
        secs, shapes = self.seen.get(self.name, (0.0, Counter()))
        shapes[(x_RK.shape[0], x_RK.shape[1], w_NK.shape[0])] += 1
        self.seen[self.name] = (secs + time.perf_counter() - t0, shapes)
        return y


def mm_seconds(shapes: Counter, repeats: int = 3) -> float:
    """The seconds torch.mm takes for these GEMMs (fp32, each shape timed ``repeats`` times, the fastest kept)."""
    total = 0.0
    for (m, k, n), count in shapes.items():
        x, w = torch.randn(m, k), torch.randn(n, k)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(count):
                x @ w.t()
            best = min(best, time.perf_counter() - t0)
        total += best
    return total


if __name__ == "__main__":
    main()
