"""How far an RL step is from this CPU's FLOP limit, per experts path and rollout dtype (prints figures; not a test).

For the main job's organism (experiments/paper.yaml, `moe-lab reproduce`), rollout_mismatch and expert_bias (their
base config and first arm; a randomly initialised model of that shape, no cold start, so responses run to about
max_new_tokens):
- FLOPs of the rollout (prefill + one decode step per generated column), the old-logprob forward and the update
  (forward + backward = 3x the forward's), counted from the model's modules (linears, routers, top-k of the routed
  experts, attention's QK^T and AV over the causal context);
- the GEMM rate measured in this run at those shapes (torch.mm in the phase's dtype; float8 emulation runs fp32
  GEMMs; each expert's rows = tokens x top-k / experts; the backward's GEMMs at the forward's rate);
- limit = sum over GEMMs of FLOPs / rate at its shape; measured = median over repeats, paths interleaved;
- the whole logged step (rl_step with every metric on, timed around it) against the sum of the three limits.
Machine noise (other processes on the cores) hits the interleaved paths alike; compare ratios, not seconds.
``--clock cpu`` times by the process's CPU time instead of the wall clock (less noise on a shared machine; with
one thread).

Long responses (``--responses``, routing_matters by default: its organism at 17 response tokens, the sort task's
16 digits + EOS, and at 64 and 128, long_copy's 8 or 16 letters written 8 times, + EOS): the rollout's decode loop
apart. Per decode step (one token for each of B sequences): its FLOPs and limit, the model's forward split by
module hooks into the experts, the linears (emulated under rl.rollout_dtype=float8), attention's own work (SDPA,
rotary, KV cache) and the rest of the model (norms, routers, embeddings, residuals), and generate()'s own
per-token work outside the model (sampling, stopping, cache and mask bookkeeping, routing record). Then one
logged step at that length against its limit, with what stands in the way of the goal (3x; 2.5x for the
main job, printed by the organism runs above).

    OMP_NUM_THREADS=1 python benchmarks/bench_limit.py [--repeats 3] [--organisms paper,rollout_mismatch,expert_bias]
        [--paths grouped_mm,fused] [--dtypes own|float32,bfloat16,float8] [--threads 1] [--clock wall|cpu]
        [--responses routing_matters:17,64,128] [--kernels own,batch_variant_fast]
        [--organisms none --responses ...: the long responses alone]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch import nn

from moe_lab.algos.losses import policy_loss
from moe_lab.commands.run import builtin_experiment
from moe_lab.config import resolved_clip
from moe_lab.launch.experiment import expand
from moe_lab.models import build_model, moe_layers
from moe_lab.rl.components import Trainee, installed
from moe_lab.rl.loop import make_rollout_policy
from moe_lab.rl.optim import build_optimizer
from moe_lab.rl.rollout import forward_logits, generate, token_logprobs
from moe_lab.rl.step import minibatch_indices, rl_step
from moe_lab.tasks import get_task

PHASES = ("rollout", "old", "update")
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
now = time.perf_counter  # --clock sets it
GOAL = {"paper": 2.5}  # x the FLOP limit: the main job's goal; every other organism's is DEFAULT_GOAL
DEFAULT_GOAL = 3.0
CALLS = {"decode": 20, "prefill": 2, "train": 3}  # calls per timed sample of the experts alone


def gemms(model, M: int, ctx: float) -> tuple[list[tuple[int, int, int, int]], float]:
    """One forward over M tokens with mean causal context ctx: ([(rows, k, n, count)], attention FLOPs)."""
    out, attn = [], 0.0
    for layer in moe_layers(model):
        experts = next(m for m in model.model.layers[layer.layer_idx].modules() if hasattr(m, "down_proj")
                       and getattr(m, "down_proj").dim() == 3)
        E, K = experts.num_experts, model.config.num_experts_per_tok
        rows = max(1, round(M * K / E))
        H = model.config.hidden_size
        up, down = experts.gate_up_proj[0].numel() // H, experts.down_proj[0].numel() // H
        out += [(rows, H, up, E), (rows, down, H, E),
                (M, layer.router.weight.shape[1], layer.router.weight.shape[0], 1)]
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.numel():
            out.append((M, m.in_features, m.out_features, 1))
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 4.0 * M * ctx * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers  # QK^T and AV
    return out, attn


def flops(shapes) -> float:
    return sum(2.0 * m * k * n * c for m, k, n, c in shapes)


class Rates:
    """torch.mm's time at a shape, measured once per (shape, dtype) in this run (median of 5 after a warm-up)."""

    def __init__(self):
        self.seen: dict = {}

    def seconds(self, m: int, k: int, n: int, dtype) -> float:
        key = (m, k, n, dtype)
        if key not in self.seen:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            reps = max(3, int(2e6 / (m * k * n) + 1))
            times = []
            for _ in range(6):
                t0 = now()
                for _ in range(reps):
                    torch.mm(a, b)
                times.append((now() - t0) / reps)
            self.seen[key] = statistics.median(times[1:])
        return self.seen[key]

    def limit(self, shapes, attn: float, dtype) -> tuple[float, float]:
        """(FLOPs, seconds at the measured rates); attention at the phase's overall GEMM rate."""
        f, s = flops(shapes), sum(c * self.seconds(m, k, n, dtype) for m, k, n, c in shapes)
        return f + attn, s * (f + attn) / f


def phase_limits(model, rates: Rates, cfg, B: int, P: int, T: int) -> dict[str, tuple[float, float]]:
    """(FLOPs, limit seconds) of rollout (B rows, prompt P, T generated), old forward and update."""
    roll_dtype = torch.bfloat16 if cfg.rl.rollout_dtype == "bfloat16" else torch.float32
    prefill = rates.limit(*gemms(model, B * P, P / 2), roll_dtype)
    decode = [rates.limit(*gemms(model, B, P + t), roll_dtype) for t in range(T)]
    S = P + T - 1
    old = rates.limit(*gemms(model, B * S, S / 2), torch.float32)
    mb = B // cfg.rl.minibatches
    one = rates.limit(*gemms(model, mb * S, S / 2), torch.float32)
    n = cfg.rl.minibatches * cfg.rl.epochs
    return {"rollout": (prefill[0] + sum(d[0] for d in decode), prefill[1] + sum(d[1] for d in decode)),
            "old": old, "update": (3 * n * one[0], 3 * n * one[1])}


def organism(name: str, path: str, dtype: str | None, extra: list[str] = ()):
    """The experiment's first cell with model.experts_impl=path (and rl.rollout_dtype=dtype unless None)."""
    over = [f"model.experts_impl={path}"] + ([f"rl.rollout_dtype={dtype}"] if dtype else []) + list(extra)
    cfg = expand(builtin_experiment(name), overrides=over)[0].config
    task = get_task(cfg.task)
    model = build_model(cfg.model, len(task.tokenizer))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = task.sample_prompts(cfg.rl.prompts_per_step, np.random.default_rng(0))
    return cfg, task, model, init, prompts


def bare(model, opt, task, cfg, prompts) -> tuple[dict[str, float], tuple[int, int, int]]:
    """The three phases alone (no hooks, no metrics): seconds each, and the batch's (B, prompt width, generated)."""
    rl, group = cfg.rl, [p for p in prompts for _ in range(cfg.rl.group_size)]
    rollout_policy = make_rollout_policy(model, rl)
    t0 = now()
    batch = generate(rollout_policy, task.tokenizer, group, max_new_tokens=task.max_new_tokens,
                     temperature=rl.temperature)
    t1 = now()
    with torch.no_grad():
        old = token_logprobs(forward_logits(model, batch.input_ids_BS, batch.attention_mask_BS).logits,
                             batch.input_ids_BS)
    t2 = now()
    adv, (low, high) = torch.randn(len(group)), resolved_clip(rl)
    for epoch in range(rl.epochs):
        for idx_B in minibatch_indices(len(group), rl.minibatches, 0, 0, epoch):
            opt.zero_grad(set_to_none=True)
            logits = forward_logits(model, batch.input_ids_BS[idx_B], batch.attention_mask_BS[idx_B]).logits
            loss, _ = policy_loss(token_logprobs(logits, batch.input_ids_BS[idx_B]), old[idx_B], adv[idx_B],
                                  batch.response_mask_BT[idx_B], algo=rl.algo, clip_low=low, clip_high=high)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), rl.grad_clip)
            opt.step()
    t3 = now()
    T = int(batch.response_len_B.max())
    shape = (len(group), batch.input_ids_BS.shape[1] - T, T)
    return {"rollout": t1 - t0, "old": t2 - t1, "update": t3 - t2}, shape


def logged(model, opt, task, cfg, prompts, step: int) -> float:
    """Seconds of moe_lab's rl_step with every metric on (routing recorded, the run's replay)."""
    trainee = Trainee(model, make_rollout_policy(model, cfg.rl), None, opt, installed(model, cfg.rl))
    t0 = now()
    rl_step(trainee, task, cfg, step, prompts)
    return now() - t0


def experts_only(name: str, paths: list[str], repeats: int) -> None:
    """The first MoE layer's experts alone at the organism's shapes (decode: one token per sequence; prefill: every
    token; train: forward + backward over one minibatch), paths interleaved: less noisy than whole steps."""
    setups = {path: organism(name, path, None) for path in paths}
    cfg, task, model, _, _ = setups[paths[0]]
    B, S = cfg.rl.prompts_per_step * cfg.rl.group_size, task.max_new_tokens * 2
    layer = moe_layers(model)[0]
    gen = torch.Generator().manual_seed(0)
    cases = {"decode": B, "prefill": B * S, "train": B * S // cfg.rl.minibatches}
    inputs = {}
    for case, N in cases.items():
        h = torch.randn(N, cfg.model.hidden_size, generator=gen)
        with torch.no_grad():
            weights, ids = layer.family.select(layer.router, torch.nn.functional.linear(h, layer.router.weight))
        inputs[case] = (h, ids, weights)
    experts = {p: next(m for m in setups[p][2].modules() if hasattr(m, "gate_up_proj")) for p in paths}
    times = {(c, p): [] for c in cases for p in paths}
    for _ in range(repeats + 1):
        for case, (h, ids, w) in inputs.items():
            for path, mod in experts.items():
                t0 = now()
                for _ in range(CALLS[case]):
                    if case == "train":
                        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
                        mod(hh, ids, ww).square().sum().backward()
                    else:
                        with torch.no_grad():
                            mod(h, ids, w)
                times[(case, path)].append((now() - t0) / CALLS[case])
    line = []
    for case, N in cases.items():
        med = {p: statistics.median(times[(case, p)][1:]) for p in paths}
        line.append(f"{case} (N={N}) " + " ".join(f"{p} {med[p] * 1e3:.2f} ms" for p in paths)
                    + f" -> {med[paths[0]] / med[paths[-1]]:.2f}x")
    print(f"{name}: experts only, one layer: " + "; ".join(line))


def measure(name: str, paths: list[str], dtype: str | None, repeats: int, rates: Rates) -> None:
    setups = {path: organism(name, path, dtype) for path in paths}
    runs = {path: [] for path in paths}
    for i in range(repeats + 1):  # round 0 warms allocators and kernels up, and is dropped
        for path, (cfg, task, model, init, prompts) in setups.items():
            for kind in ("bare", "logged"):
                model.load_state_dict(init)  # the same weights and sampling seed in every path and round
                opt = build_optimizer(model, cfg.rl.section("schedule"))
                torch.manual_seed(100 + i)
                if kind == "bare":
                    times, shape = bare(model, opt, task, cfg, prompts)
                else:
                    times = {"step": logged(model, opt, task, cfg, prompts, i)}
                runs[path].append((kind, times, shape if kind == "bare" else None))
    cfg, _, model, _, _ = setups[paths[0]]
    m = cfg.model
    print(f"\n{name}: {m.family}, {m.num_layers} layers, hidden {m.hidden_size}, {m.num_experts} experts of width "
          f"{m.moe_intermediate_size}, top-{m.top_k}; {cfg.rl.prompts_per_step} x {cfg.rl.group_size} sequences, "
          f"{cfg.rl.minibatches} minibatches; rollout {cfg.rl.rollout_dtype} ({cfg.rl.rollout_kernels})")
    base = {}
    for path in paths:
        kept = runs[path][2:]  # round 0 (bare + logged) dropped
        shape = max(r[2] for r in kept if r[0] == "bare")
        limits = phase_limits(model, rates, cfg, *shape)
        med = {k: statistics.median(r[1][k] for r in kept if k in r[1]) for k in (*PHASES, "step")}
        base.setdefault("step", med["step"])
        for ph in PHASES:
            f, lim = limits[ph]
            print(f"  {path:10s} {ph:8s} {f / 1e9:7.2f} GFLOP  rate {f / lim / 1e9:6.1f} GFLOP/s  limit {lim:6.3f}s  "
                  f"measured {med[ph]:6.3f}s  x limit {med[ph] / lim:5.2f}")
        core = sum(limits[ph][1] for ph in PHASES)
        print(f"  {path:10s} core     measured {sum(med[ph] for ph in PHASES):6.3f}s  x limit "
              f"{sum(med[ph] for ph in PHASES) / core:5.2f}   (B, prompt, generated) = {shape}")
        print(f"  {path:10s} logged   step {med['step']:6.3f}s  x limit {med['step'] / core:5.2f}  "
              f"x {paths[0]} {base['step'] / med['step']:5.2f} faster  (goal {GOAL.get(name, DEFAULT_GOAL)}x: "
              f"{'met' if med['step'] / core <= GOAL.get(name, DEFAULT_GOAL) else 'not met'})")


def response_overrides(cfg, tokens: int) -> list[str]:
    """The task overrides that give ``tokens`` response tokens before EOS: the organism's own task when its
    responses are that long (sort: 16 digits + EOS = 17 tokens), else long_copy's block of tokens / 8 letters."""
    task = get_task(cfg.task)
    if task.max_new_tokens in (tokens, tokens + 1):
        return []
    if tokens % 8:
        raise SystemExit(f"--responses: {tokens} tokens: allowed the organism's own length or a multiple of 8")
    return ["task.name=long_copy", f"task.length={tokens // 8}"]


class Split:
    """Exclusive time per module kind inside the model's forwards (forward pre/post hooks on its modules)."""

    def __init__(self, model):
        self.seconds, self.calls, self.stack, self.handles = {}, 0, [], []
        for name, module in model.named_modules():
            kind = ("model" if module is model else "experts" if getattr(getattr(module, "gate_up_proj", None),
                                                                        "dim", lambda: 0)() == 3
                    else "attention" if name.endswith("self_attn")
                    else ("linears (emulated)" if "forward" in vars(module) else "linears")
                    if isinstance(module, nn.Linear) else None)
            if kind:
                self.handles += [module.register_forward_pre_hook(lambda m, a, k=kind: self._push(k)),
                                 module.register_forward_hook(lambda m, a, o: self._pop())]

    def _push(self, kind: str) -> None:
        self.stack.append([kind, now(), 0.0])

    def _pop(self) -> None:
        kind, t0, inner = self.stack.pop()
        spent = now() - t0
        self.seconds[kind] = self.seconds.get(kind, 0.0) + spent - inner
        if self.stack:
            self.stack[-1][2] += spent
        else:
            self.calls += 1
            self.seconds["model total"] = self.seconds.get("model total", 0.0) + spent

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def rollout_once(cfg, task, model, prompts, timed: bool) -> tuple[float, dict, dict, tuple[int, int, int]]:
    """One rollout as rl_step samples it (the rollout copy, routing recorded): (seconds, the decode steps' and the
    prefill's seconds by module kind, (B, prompt, generated))."""
    policy = make_rollout_policy(model, cfg.rl)
    split, prefill = Split(policy) if timed else None, {}
    if timed:  # the prefill is the first model call: its time is kept apart from the decode steps'
        split.handles.append(policy.register_forward_hook(lambda m, a, o: None if prefill else
                                                          prefill.update(split.seconds)))
    group = [p for p in prompts for _ in range(cfg.rl.group_size)]
    torch.manual_seed(0)
    t0 = now()
    batch = generate(policy, task.tokenizer, group, max_new_tokens=task.max_new_tokens, temperature=cfg.rl.temperature,
                     record_routing=True)
    spent = now() - t0
    decode = {}
    if timed:
        split.remove()
        decode = {k: v - prefill.get(k, 0.0) for k, v in split.seconds.items()}
        decode["generate() outside the model"] = spent - split.seconds["model total"]
    P = task.prompt_tokens
    return spent, decode, prefill, (len(group), P, batch.input_ids_BS.shape[1] - P)


def long_responses(name: str, tokens: list[int], repeats: int, rates: Rates, kernels: str | None) -> None:
    """The organism's rollout at each response length: its decode loop apart, then one logged step (module
    docstring); each figure the median over ``repeats`` rounds after a dropped warm-up round. ``kernels``: an
    rl.rollout_kernels value in place of the organism's own."""
    base = expand(builtin_experiment(name))[0].config
    goal = GOAL.get(name, DEFAULT_GOAL)
    for n in tokens:
        extra = response_overrides(base, n) + ([f"rl.rollout_kernels={kernels}"] if kernels else [])
        cfg, task, model, init, prompts = organism(name, base.model.experts_impl, None, extra)
        rounds = []
        for i in range(repeats + 1):
            plain, _, _, shape = rollout_once(cfg, task, model, prompts, timed=False)
            timed, decode, prefill, _ = rollout_once(cfg, task, model, prompts, timed=True)
            model.load_state_dict(init)
            torch.manual_seed(100 + i)
            step = logged(model, build_optimizer(model, cfg.rl.section("schedule")), task, cfg, prompts, i)
            rounds.append((plain, timed, decode, prefill["model total"], step))
        kept = rounds[1:]
        plain, timed, prefill, step = (statistics.median(r[k] for r in kept) for k in (0, 1, 3, 4))
        decode = {k: statistics.median(r[2][k] for r in kept) for k in kept[0][2]}
        decode_report(name, cfg, task, model, rates, shape, (plain, timed, prefill), decode)
        limits = phase_limits(model, rates, cfg, *shape)
        core = sum(v[1] for v in limits.values())
        roll = limits["rollout"][1]
        print(f"  logged step {step:7.3f}s  limit {core:6.3f}s (rollout {roll:.3f}s + old {limits['old'][1]:.3f}s + "
              f"update {limits['update'][1]:.3f}s)  x limit {step / core:5.2f}  (goal {goal}x: "
              f"{'met' if step / core <= goal else 'not met'})")
        if step / core > goal:
            print(f"  in the way: the step must lose {step - goal * core:.3f}s; its rollout takes {plain:.3f}s "
                  f"({plain / roll:.1f}x its limit, {plain / step:.0%} of the step), the old forward and the updates "
                  f"{step - plain:.3f}s ({(step - plain) / (core - roll):.1f}x theirs)")


def decode_report(name, cfg, task, model, rates: Rates, shape, rollout: tuple, decode: dict) -> None:
    """Per decode step: FLOPs and limit against the model's time by module kind and generate()'s own."""
    (B, P, T), (plain, timed, prefill) = shape, rollout
    roll_dtype = torch.bfloat16 if cfg.rl.rollout_dtype == "bfloat16" else torch.float32
    steps = [rates.limit(*gemms(model, B, P + t), roll_dtype) for t in range(1, T)]  # T - 1 decode calls
    flop, limit = sum(f for f, _ in steps) / len(steps), sum(s for _, s in steps) / len(steps)
    names = {"model": "rest of the model"}
    ms = {names.get(k, k): v / (T - 1) * 1e3 for k, v in decode.items() if k != "model total"}
    total = sum(ms.values())
    print(f"\n{name}, {task.name} {cfg.task.length}: B={B}, prompt {P}, {T} generated tokens (EOS included); "
          f"rollout {cfg.rl.rollout_dtype} ({cfg.rl.rollout_kernels}), experts {cfg.model.experts_impl}")
    print(f"  rollout {plain:7.3f}s (with module timers {timed:.3f}s): prefill {prefill:.3f}s, {T - 1} decode steps")
    print(f"  per decode step ({B} tokens): {flop / 1e9:.3f} GFLOP, limit {limit * 1e3:.2f} ms; measured "
          f"{total:.2f} ms = {total / (limit * 1e3):.0f}x: " + ", ".join(
              f"{k} {v:.2f} ms ({v / total:.0%})" for k, v in sorted(ms.items(), key=lambda kv: -kv[1])))
    print(f"  per generated token: model FLOPs {flop / B / 1e6:.2f} MFLOP ({limit / B * 1e6:.2f} us at the limit) "
          f"against {total / B * 1e3:.1f} us, {(total - limit * 1e3) / total:.0%} of it overhead")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="rounds after the warm-up (median)")
    ap.add_argument("--organisms", default="paper,rollout_mismatch,expert_bias")
    ap.add_argument("--paths", default="grouped_mm,fused")
    ap.add_argument("--dtypes", default="own", help="own (the organism's rl.rollout_dtype) or a list")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=tuple(CLOCK), default="wall", help="cpu: the process's CPU time")
    ap.add_argument("--responses", default="routing_matters:17,64,128",
                    help="ORGANISM:TOKENS,...: the long-response runs (none to skip)")
    ap.add_argument("--kernels", default="own", help="rl.rollout_kernels of the long-response runs (own: the "
                                                     "organism's; e.g. batch_variant_fast)")
    args = ap.parse_args()
    global now
    now = CLOCK[args.clock]
    torch.set_num_threads(args.threads)
    rates = Rates()
    print(f"threads={args.threads} repeats={args.repeats} clock={args.clock} (medians; paths interleaved in each round)")
    for name in [] if args.organisms == "none" else args.organisms.split(","):
        experts_only(name, args.paths.split(","), args.repeats * 3)
        for dtype in [None] if args.dtypes == "own" else args.dtypes.split(","):
            measure(name, args.paths.split(","), dtype, args.repeats, rates)
    if args.responses != "none":
        name, _, tokens = args.responses.partition(":")
        for kernels in args.kernels.split(","):
            long_responses(name, [int(t) for t in tokens.split(",")], args.repeats, rates,
                           None if kernels == "own" else kernels)


if __name__ == "__main__":
    main()
