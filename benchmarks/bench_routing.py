"""Overhead of routing record/replay hooks (prints figures; not a test).

Default ModelConfig (4 layers, hidden 128, 8 experts, top-2), batch 128 x 34 tokens:
- forward+backward on input_ids[:, :-1] (the trainer's teacher-forced pass) with hooks off / recording /
  replaying;
- generate() of 17 new tokens after a 17-token prompt with the KV cache, hooks off / recording.
Modes are interleaved within each repeat so that machine drift hits them alike; medians are reported.
Target: overhead <= 2%. Run with OMP_NUM_THREADS=1:

    OMP_NUM_THREADS=1 python benchmarks/bench_routing.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from moe_lab.config import ModelConfig
from moe_lab.models import build_model
from moe_lab.routing import record, replay

VOCAB, BATCH, PROMPT, NEW = 64, 128, 17, 17


def _fwd_bwd(model, ids_BS, ctx) -> None:
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = model(ids_BS[:, :-1], labels=ids_BS[:, :-1]).loss
        loss.backward()


def _generate(model, prompt_BP, ctx) -> None:
    torch.manual_seed(0)
    with torch.no_grad(), ctx:
        model.generate(prompt_BP, attention_mask=torch.ones_like(prompt_BP), max_new_tokens=NEW,
                       min_new_tokens=NEW, do_sample=True)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(repeats: int) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = ModelConfig()
    model = build_model(cfg, VOCAB)
    gen = torch.Generator().manual_seed(0)
    ids_BS = torch.randint(3, VOCAB, (BATCH, PROMPT + NEW), generator=gen)
    with torch.no_grad(), record(model) as trace:
        model(ids_BS[:, :-1])
    model.train()
    fb = {"off": lambda: _fwd_bwd(model, ids_BS, contextlib.nullcontext()),
          "record": lambda: _fwd_bwd(model, ids_BS, record(model)),
          "replay": lambda: _fwd_bwd(model, ids_BS, replay(model, trace))}
    ge = {"off": lambda: _generate(model, ids_BS[:, :PROMPT], contextlib.nullcontext()),
          "record": lambda: _generate(model, ids_BS[:, :PROMPT], record(model))}
    for table in (fb, ge):  # warm-up
        for fn in table.values():
            fn()
    times = {(name, mode): [] for name, table in (("fwd+bwd", fb), ("generate", ge)) for mode in table}
    for _ in range(repeats):
        for name, table in (("fwd+bwd", fb), ("generate", ge)):
            model.train(name == "fwd+bwd")
            for mode, fn in table.items():
                times[(name, mode)].append(_time(fn))
    _report(cfg, times, trace, repeats)


def _report(cfg: ModelConfig, times: dict, trace, repeats: int) -> None:
    print(f"model: {cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts, "
          f"top-{cfg.top_k}, experts_impl={cfg.experts_impl}; batch {BATCH} x {PROMPT + NEW} tokens; "
          f"threads {torch.get_num_threads()}; median of {repeats}")
    print(f"{'pass':<10}{'hooks':<8}{'median s':>10}{'overhead':>10}")
    for (name, mode), ts in times.items():
        med, base = statistics.median(ts), statistics.median(times[(name, "off")])
        print(f"{name:<10}{mode:<8}{med:>10.4f}{100 * (med / base - 1):>9.2f}%")
    tokens = trace.batch_size * trace.seq_len
    ids_only = trace.indices.nbytes
    print(f"trace bytes per token: {trace.nbytes / tokens:.0f} with gate weights, {ids_only / tokens:.0f} ids only "
          f"({trace.num_layers} layers x top-{trace.top_k}, {trace.indices.dtype})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    run(parser.parse_args().repeats)
