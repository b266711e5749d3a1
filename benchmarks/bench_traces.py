"""Cost of `moe-lab check-trace` against the bare forwards it needs, and the bytes per token of each routed-
expert layout (prints figures; not a test).

check-trace runs two forwards per sequence (free routing recorded, then the trace replayed); the bare cost is
those two forwards with no hooks, on the same sequences, one sequence at a time as check-trace runs them.
The goal is within 1.3x. Layout sizes: the wire form (what a JSONL line or a response body carries) and the
decoded array each layout hands its consumer, per token, next to moe_lab's Routes and Trace.

    OMP_NUM_THREADS=2 python benchmarks/bench_traces.py [--seqs 16] [--len 128] [--hidden 256] [--experts 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from moe_lab.audit.trace_audit import run_check
from moe_lab.formats.routes import Routes, RoutedSequence
from moe_lab.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' trace writers
from trace_writers import write_nemo_rl, write_prime_rl, write_sglang, write_vllm  # noqa: E402


def checkpoint(path: Path, hidden: int, experts: int, layers: int = 4) -> Path:
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, num_experts=experts, num_experts_per_tok=4,
                            moe_intermediate_size=hidden // 2, mlp_only_layers=[0], max_position_embeddings=1024,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def sequences(model, n: int, length: int) -> list[RoutedSequence]:
    """Random tokens; routes from a teacher-forced forward through plain forward hooks on the routers."""
    gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    out = []
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        tokens = torch.randint(3, 512, (length,), generator=g)
        seen: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda _m, _a, o: seen.append(o[2].detach().long())) for m in gates]
        with torch.no_grad():
            model(input_ids=tokens[None])
        for h in hooks:
            h.remove()
        ids = torch.stack(seen)
        mask = torch.ones(ids.shape[:2], dtype=torch.bool)
        mask[:, -1] = False  # the last token is never fed to an engine
        out.append(RoutedSequence(tokens, length // 4, Routes(ids.masked_fill(~mask[..., None], -1), mask)))
    return out


def interleaved(fns: dict, rounds: int) -> dict[str, float]:
    """Fastest of ``rounds`` runs of each function, the functions taking turns: on a shared machine the
    minimum is the figure least disturbed by other processes (the median is printed too)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: (min(ts), statistics.median(ts)) for name, ts in times.items()}


def bare(model, seqs) -> None:
    with torch.no_grad():
        for s in seqs:
            model(input_ids=s.tokens[None])
            model(input_ids=s.tokens[None])


def layout_sizes(seq: RoutedSequence, config: dict) -> list[tuple[str, float, float]]:
    """(layout, wire bytes per token, decoded bytes per token)."""
    r, S = seq.routes, seq.num_tokens
    stop = S - 1
    dec = write_vllm(r, config=config, stop=stop)
    sg = write_sglang(r, config=config)
    nr = write_nemo_rl(r, config=config, stop=stop)
    pr = write_prime_rl(r, config=config, stop=stop)
    moe_rows = r.num_layers * r.top_k
    return [
        ("vllm CompletionOutput (int32, every decoder layer)", float("nan"), dec.shape[1] * r.top_k * 4),
        ("vllm JSON lists (every decoder layer; decoded as int16)", len(json.dumps(dec.tolist())) / stop,
         dec.shape[1] * r.top_k * 2),
        ("sglang base64 int32 (written with MoE layers only)", len(sg) / stop, moe_rows * 4),
        ("nemo_rl nrlre1 int16 (MoE layers)", len(nr) / stop, moe_rows * 2),
        ("prime_rl base64 uint8 (MoE layers)", len(pr["data"]) / stop, moe_rows * 1),
        ("moe_lab Routes (int64 ids + bool mask)", float("nan"), moe_rows * 8 + r.num_layers),
        ("moe_lab Trace (uint8 ids)", float("nan"), moe_rows * 1),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp) / "ckpt", args.hidden, args.experts)
        model = load_model(path)
        config = json.loads((path / "config.json").read_text())
        seqs = sequences(model, args.seqs, args.len)
        device = torch.device("cpu")
        lines, faults, agreement = run_check(seqs, model, config, device)  # warm-up, and a sanity check
        assert agreement == 1.0 and not faults, (agreement, faults)
        t = interleaved({"bare": lambda: bare(model, seqs),
                         "check": lambda: run_check(seqs, model, config, device)}, args.repeats)
    tokens = args.seqs * args.len
    (b_min, b_med), (c_min, c_med) = t["bare"], t["check"]
    print(f"check-trace on {args.seqs} sequences x {args.len} tokens, qwen3_moe hidden {args.hidden}, "
          f"{args.experts} experts top 4, 4 layers (layer 0 dense), cpu, {torch.get_num_threads()} threads, "
          f"{args.repeats} interleaved rounds")
    print(f"  bare forwards (2 per sequence): min {b_min:.3f} s (median {b_med:.3f})   check-trace (model loaded): "
          f"min {c_min:.3f} s (median {c_med:.3f})   ratio of minima {c_min / b_min:.2f}x (goal <= 1.3x)   "
          f"{tokens / c_min:.0f} tokens/s")
    print("bytes per token (wire: what a line or response carries; decoded: the array handed to the consumer)")
    for name, wire, decoded in layout_sizes(seqs[0], config):
        print(f"  {name:<56} wire {'-' if wire != wire else f'{wire:.1f}':>7}   decoded {decoded:.0f}")


if __name__ == "__main__":
    main()
