"""TRL's GRPOTrainer against moe_lab's RL step on the same model, prompts and group size (prints; not a test).

One process, interleaved: TRL trains with a callback that, at each of its generation boundaries (one rollout
batch = `minibatches` optimizer steps), stops TRL's clock and times one moe_lab full step (routing recorded,
every metric) and one bare step (bench_step.bare_step: generate + old forward + the updates, no hooks) on
moe_lab's own copy of the same initial weights. Machine noise therefore hits the three alike.

Matched: the policy (Qwen3-MoE from moe_lab's config, random init), 16 prompts x 8 responses of the sort task,
temperature 1, the task's response budget, 4 optimizer steps per rollout batch (TRL: per_device_train_batch_size
= 128 / 4, steps_per_generation = 4), GRPO clip 0.2/0.27, no KL term, loss aggregated per sequence then
over sequences (TRL loss_type="grpo"), no router load-balancing loss, grad clip 1.0, AdamW lr 1e-4, fp32 on CPU. TRL is an optional extra:
``pip install -e ".[bench]"``.

    OMP_NUM_THREADS=1 python benchmarks/bench_vs_trl.py [--steps 6] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import bare_step, full_step  # noqa: E402

from moe_lab.config import from_dict, resolved_clip, validate  # noqa: E402
from moe_lab.models import build_model  # noqa: E402
from moe_lab.rl.optim import build_optimizer  # noqa: E402
from moe_lab.tasks import get_task  # noqa: E402


def trl_trainer(model, task, cfg, prompts: list[str], steps: int, out_dir: str, callback):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rl = cfg.rl
    low, high = resolved_clip(rl)
    batch = rl.prompts_per_step * rl.group_size

    def reward(prompts, completions, **_):
        return [task.reward(p, c) for p, c in zip(prompts, completions)]

    # TRL samples prompts itself: one rollout batch = prompts_per_step distinct prompts x group_size.
    data = Dataset.from_dict({"prompt": prompts * (steps + 2)})
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=batch // rl.minibatches,
                      steps_per_generation=rl.minibatches, num_generations=rl.group_size, num_iterations=1,
                      max_completion_length=task.max_new_tokens, temperature=rl.temperature, top_p=1.0, top_k=0,
                      learning_rate=rl.lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=rl.grad_clip,
                      beta=0.0, epsilon=low, epsilon_high=high, loss_type="grpo", scale_rewards="group",
                      router_aux_loss_coef=rl.aux_loss_coef, disable_tqdm=True,
                      max_steps=(steps + 1) * rl.minibatches, logging_steps=10_000, save_strategy="no",
                      report_to="none", use_cpu=True, bf16=False, fp16=False, disable_dropout=True,
                      shuffle_dataset=False, seed=0, dataloader_num_workers=0, remove_unused_columns=False)
    return GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                       processing_class=task.tokenizer, callbacks=[callback])


def main() -> None:
    from transformers import TrainerCallback

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=6, help="timed RL steps of each (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = validate(from_dict({}))
    task = get_task(cfg.task)
    torch.manual_seed(0)
    ours = build_model(cfg.model, len(task.tokenizer), pad_token_id=task.tokenizer.pad_token_id,
                       bos_token_id=task.tokenizer.bos_token_id, eos_token_id=task.tokenizer.eos_token_id)
    init = {k: v.clone() for k, v in ours.state_dict().items()}
    theirs = build_model(cfg.model, len(task.tokenizer), pad_token_id=task.tokenizer.pad_token_id,
                         bos_token_id=task.tokenizer.bos_token_id, eos_token_id=task.tokenizer.eos_token_id)
    theirs.load_state_dict(init)
    prompts = task.sample_prompts(cfg.rl.prompts_per_step, np.random.default_rng(0))
    times: dict[str, list[float]] = {"trl": [], "moe_lab full": [], "moe_lab bare": []}

    class Interleave(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.rl_step = 0

        def on_step_begin(self, state_args, state, control, **kw):
            if self.t0 is None:
                self.t0 = time.perf_counter()

        def on_step_end(self, state_args, state, control, **kw):
            if state.global_step % cfg.rl.minibatches:
                return
            times["trl"].append(time.perf_counter() - self.t0)
            for name, step in (("moe_lab full", lambda *a: full_step(*a, self.rl_step)), ("moe_lab bare", bare_step)):
                ours.load_state_dict(init)  # same weights every time: identical rollouts, only the work differs
                torch.manual_seed(100 + self.rl_step)
                times[name].append(step(ours, build_optimizer(ours, cfg.rl.section("schedule")), task, cfg, prompts)["total_s"])
            self.rl_step += 1
            self.t0 = time.perf_counter()

    with tempfile.TemporaryDirectory() as out_dir:
        trl_trainer(theirs, task, cfg, prompts, args.steps, out_dir, Interleave()).train()
    import trl

    print(f"threads={args.threads}, {args.steps} timed RL steps after 1 warm-up (median seconds per RL step: "
          f"{cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} responses, {cfg.rl.minibatches} optimizer steps); "
          f"trl {trl.__version__}")
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    for name, value in med.items():
        print(f"{name:14s} {value:.3f} s  x bare {value / med['moe_lab bare']:.3f}")
    print(f"trl / moe_lab full = {med['trl'] / med['moe_lab full']:.3f}")


if __name__ == "__main__":
    main()
