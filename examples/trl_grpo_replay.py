"""Routing Replay inside TRL's GRPOTrainer on moe_lab's sort task, on CPU in about a minute (docs/trl.md).

A tiny Qwen3-MoE (random init, 2 MoE layers, 4 experts, top-2) learns to sort digits with partial credit. TRL
generates, scores and updates as usual; moe_lab records the routing, replays it (R2: the old pass's experts,
R3: the generation's) and logs its routing metrics in TRL's log. Off-policy on purpose
(steps_per_generation=4, one microbatch per optimizer step): otherwise TRL's ratio is 1 and R2 has nothing to do.

    pip install -e ".[trl]"
    python examples/trl_grpo_replay.py [--replay none|old|rollout] [--steps 16]
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
from datasets import Dataset

from moe_lab.config import from_dict, validate
from moe_lab.integrations.trl import MoEGRPOConfig, MoEGRPOTrainer
from moe_lab.models import build_model
from moe_lab.tasks import get_task

# TRL's reward and moe_lab's metrics (docs/metrics.md), with the short column labels printed
SHOWN = {"reward": "reward", "routing/expert_change": "change", "routing/expert_change_latent": "latent_change",
         "routing/router_shift": "router_shift", "routing/confidence": "confidence", "ratio/token_var": "token_var",
         "mismatch/k3": "mismatch_k3", "mismatch/abs_diff": "mismatch_|d|", "mismatch/expert_change": "mismatch_chg"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replay", default="rollout", choices=["none", "old", "rollout"])
    ap.add_argument("--steps", type=int, default=64, help="optimizer steps (4 per generation)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = validate(from_dict({"model": {"family": "qwen3_moe", "num_layers": 2, "hidden_size": 64, "num_heads": 4,
                                        "num_kv_heads": 2, "num_experts": 4, "top_k": 2, "moe_intermediate_size": 64,
                                        "intermediate_size": 128},
                              "task": {"name": "sort", "length": 4, "partial_credit": True, "eval_size": 16}}))
    task = get_task(cfg.task)
    tok = task.tokenizer
    model = build_model(cfg.model, len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id)
    prompts = task.sample_prompts(64, np.random.default_rng(0))
    data = Dataset.from_dict({"prompt": prompts})

    def sort_reward(prompts, completions, **_):  # TRL's reward-function signature, moe_lab's task reward
        return [task.reward(p, c) for p, c in zip(prompts, completions)]

    with tempfile.TemporaryDirectory() as out_dir:
        config = MoEGRPOConfig(output_dir=out_dir, routing_replay=args.replay, per_device_train_batch_size=8,
                               num_generations=8, steps_per_generation=4, max_completion_length=task.max_new_tokens,
                               learning_rate=3e-3, max_steps=args.steps, logging_steps=8, beta=0.0,
                               report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
        trainer = MoEGRPOTrainer(model=model, reward_funcs=sort_reward, args=config, train_dataset=data,
                                 processing_class=tok)
        trainer.train()
    print(f"routing_replay={args.replay}: each logging window of 8 optimizer steps, combined by token counts")
    print("step " + " ".join(f"{label:>13s}" for label in SHOWN.values()))
    for row in trainer.state.log_history:
        if "routing/confidence" in row:
            print(f"{row['step']:4d} " + " ".join(f"{row.get(name, float('nan')):13.4g}" for name in SHOWN))


if __name__ == "__main__":
    main()
