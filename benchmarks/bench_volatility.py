"""Cost of `moe-lab volatility` against the bare work it needs (prints figures; not a test).

Two checkpoints of a tiny family (default qwen3_moe: 4 layers, hidden 128, 16 experts, top-4), loaded once.
volatility = OLD's seeded generate() + per batch three teacher-forced forwards (OLD recorded, NEW recorded
with its router log-probs probed at OLD's experts, NEW with OLD's routing replayed) + the metrics. The bare
work = the same generate() (same sampler, same completions) and three plain forwards of the same sequences,
no hooks, no metrics. Modes alternate within each repeat so machine drift hits both alike; medians are
reported. Goal: volatility within 1.3x of the bare work. Run with:

    OMP_NUM_THREADS=1 python benchmarks/bench_volatility.py [--family qwen3_moe] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe_lab.audit.volatility_run import generate, measure
from moe_lab.config import ModelConfig
from moe_lab.models import build_model, moe_layers
from moe_lab.rl.rollout import forward_logits

VOCAB, PROMPTS, PROMPT_LEN, NEW_TOKENS, BATCH = 64, 64, 16, 32, 32


def _pair(family: str):
    cfg = ModelConfig(family=family, num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, num_experts=16,
                      top_k=4, moe_intermediate_size=64, intermediate_size=256, max_positions=128)
    old, new = build_model(cfg, VOCAB), build_model(cfg, VOCAB)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in moe_layers(new):  # NEW: OLD's weights with every router moved
            layer.router.weight.copy_(layer.router.weight + 0.3 * torch.randn(layer.router.weight.shape,
                                                                                generator=gen))
    return old, new


@torch.no_grad()
def _bare(old, new, prompts) -> None:
    generator = torch.Generator().manual_seed(0)
    for start in range(0, len(prompts), BATCH):
        batch = generate(old, prompts[start:start + BATCH], max_new_tokens=NEW_TOKENS, temperature=1.0,
                         generator=generator)
        for model in (old, new, new):
            forward_logits(model, batch.seq_BS, batch.attn_BS)


def _volatility(old, new, prompts) -> None:
    measure(old, new, prompts, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0, batch_size=BATCH)


def _time(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwen3_moe")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    old, new = _pair(args.family)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist() for _ in range(PROMPTS)]
    _bare(old, new, prompts[:BATCH])  # warm-up
    _volatility(old, new, prompts[:BATCH])
    times = {"bare": [], "volatility": []}
    for _ in range(args.repeats):
        times["bare"].append(_time(_bare, old, new, prompts))
        times["volatility"].append(_time(_volatility, old, new, prompts))
    bare, vol = statistics.median(times["bare"]), statistics.median(times["volatility"])
    print(f"{args.family}: {PROMPTS} prompts x {PROMPT_LEN} tokens, {NEW_TOKENS} new, batch {BATCH}, "
          f"threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"bare generate + 3 forwards  {bare * 1e3:8.1f} ms")
    print(f"volatility                  {vol * 1e3:8.1f} ms   ratio {vol / bare:.2f}x (goal <= 1.3x)")


if __name__ == "__main__":
    main()
