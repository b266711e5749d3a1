"""Benchmark one RL step against the bare work it contains (prints figures; not a test).

Bare work, same model and batch: generate with the KV cache + one no-grad forward + the minibatch
updates (forward, GRPO loss, backward, AdamW), no hooks. Full step: moe_lab's rl_step with routing
recorded and replay on, every metric computed. Target: full <= 1.05 x bare. The "no ratio decomposition"
variants (rl.decomp_every=0) measure the cost of the decomposition's extra no-grad forward per update.

    OMP_NUM_THREADS=1 python benchmarks/bench_step.py [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np
import torch

from moe_lab.config import RunConfig, apply_overrides, from_dict, resolved_clip, validate
from moe_lab.algos.losses import policy_loss
from moe_lab.models import build_model
from moe_lab.rl.optim import build_optimizer
from moe_lab.rl.rollout import forward_logits, generate, token_logprobs
from moe_lab.rl.components import Trainee, installed
from moe_lab.rl.step import minibatch_indices, rl_step
from moe_lab.tasks import get_task


def bare_step(model, opt, task, cfg: RunConfig, prompts: list[str]) -> dict[str, float]:
    rl = cfg.rl
    t0 = time.perf_counter()
    group = [p for p in prompts for _ in range(rl.group_size)]
    batch = generate(model, task.tokenizer, group, max_new_tokens=task.max_new_tokens, temperature=rl.temperature)
    t1 = time.perf_counter()
    with torch.no_grad():
        old = token_logprobs(forward_logits(model, batch.input_ids_BS, batch.attention_mask_BS).logits,
                             batch.input_ids_BS)
    t2 = time.perf_counter()
    adv = torch.randn(len(group))
    low, high = resolved_clip(rl)
    for idx_B in minibatch_indices(len(group), rl.minibatches, 0, 0):
        opt.zero_grad(set_to_none=True)
        logits = forward_logits(model, batch.input_ids_BS[idx_B], batch.attention_mask_BS[idx_B]).logits
        loss, _ = policy_loss(token_logprobs(logits, batch.input_ids_BS[idx_B]), old[idx_B], adv[idx_B],
                              batch.response_mask_BT[idx_B], algo=rl.algo, clip_low=low, clip_high=high)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), rl.grad_clip)  # every trainer clips (TRL included)
        opt.step()
    t3 = time.perf_counter()
    return {"rollout_s": t1 - t0, "old_s": t2 - t1, "update_s": t3 - t2, "total_s": t3 - t0,
            "tokens": float(batch.response_len_B.sum())}


def full_step(model, opt, task, cfg: RunConfig, prompts: list[str], step: int) -> dict[str, float]:
    t0 = time.perf_counter()
    rows = rl_step(Trainee(model, model, None, opt, installed(model, cfg.rl)), task, cfg, step, prompts)
    total = time.perf_counter() - t0
    r = rows[0]
    return {"rollout_s": r["perf/rollout_s"], "old_s": r["perf/old_s"],
            "update_s": sum(x["perf/update_s"] for x in rows), "total_s": total,
            "tokens": r["perf/tokens_per_s"] * r["perf/step_s"]}


def _median(results: list[dict]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = {"bare work": None,
                "grpo, replay=old (R2)": ["rl.replay=old"],
                "grpo, R2, no ratio decomposition": ["rl.replay=old", "rl.decomp_every=0"],
                "grpo, replay=rollout (R3)": ["rl.replay=rollout"],
                "grpo, no replay (routing recorded)": [],
                "grpo, no replay, no ratio decomposition": ["rl.decomp_every=0"],
                "gspo, logp_old from rollout (5.4)": ["rl.algo=gspo", "rl.old_logp=rollout"]}
    print(f"threads={args.threads} repeats={args.repeats} (median seconds per RL step; 16 prompts x 8 responses; "
          "variants interleaved so that machine noise hits them alike)")
    setups = {}
    for name, overrides in variants.items():
        cfg = validate(from_dict(apply_overrides({}, overrides or [])))
        task = get_task(cfg.task)
        torch.manual_seed(0)
        model = build_model(cfg.model, len(task.tokenizer))
        init = {k: v.clone() for k, v in model.state_dict().items()}
        prompts = task.sample_prompts(cfg.rl.prompts_per_step, np.random.default_rng(0))
        setups[name] = (overrides, cfg, task, model, init, prompts)
    runs: dict[str, list] = {name: [] for name in variants}
    for i in range(args.repeats + 1):  # the first round warms up allocators and kernels
        for name, (overrides, cfg, task, model, init, prompts) in setups.items():
            # Same weights and sampling seed in every variant and repeat: identical rollouts, so the
            # variants differ only in the work they add.
            model.load_state_dict(init)
            opt = build_optimizer(model, cfg.rl.section("schedule"))
            torch.manual_seed(100 + i)
            step = bare_step if overrides is None else lambda *a: full_step(*a, i)
            runs[name].append(step(model, opt, task, cfg, prompts))
    base = _median(runs["bare work"][1:])["total_s"]
    for name in variants:
        m = _median(runs[name][1:])
        print(f"{name:42s} total {m['total_s']:.3f}s  rollout {m['rollout_s']:.3f}  old {m['old_s']:.3f}  "
              f"update {m['update_s']:.3f}  tokens/s {m['tokens'] / m['total_s']:.0f}  x bare {m['total_s'] / base:.3f}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
