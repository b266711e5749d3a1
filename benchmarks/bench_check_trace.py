"""Peak memory and time of `moe-lab check-trace` against a bare forward, for a checkpoint of >= 1 GB on CPU
(prints figures; not a test).

The checkpoint is a qwen3_moe of a tiny architecture but wide (3 decoder layers, the first dense, many wide
experts, a 32k vocabulary), built on the meta device and materialised once in bf16 (no float32 copy), saved
with save_pretrained: about 1.2 GB of bf16 safetensors. The dump: its own routes (recorded teacher-forced) of
a few long sequences, in vLLM's layout, written twice: without and with the engine's log-probs.

Each figure comes from a fresh process (peak RSS is a per-process high-water mark: resource.getrusage):

- bare: transformers' from_pretrained in the checkpoint's dtype, then two plain forwards per sequence
  (``model(input_ids)``, logits included): the forwards check-trace needs (free, then replayed), without it;
- check-trace: ``moe-lab check-trace DUMP --model CKPT`` in-process (defaults: --dtype auto, --device cpu).

Time is the work after imports (load + forwards, or the whole command: reading the dump, loading, both
passes, the report). The goal is peak memory within 1.3x; time is printed beside it.

    OMP_NUM_THREADS=2 python benchmarks/bench_check_trace.py [--seqs 2] [--len 512] [--experts 40]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def build(path: Path, experts: int) -> None:
    """The wide checkpoint, materialised straight in bf16 from the meta device (seeded)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=3,
                            num_attention_heads=8, num_key_value_heads=8, head_dim=128, num_experts=experts,
                            num_experts_per_tok=2, moe_intermediate_size=2048, mlp_only_layers=[0],
                            max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:  # routers spread (std 1): choices are not near ties
                p.normal_(0.0, 1.0 if name.endswith("mlp.gate.weight") else 0.02, generator=gen)
    model.save_pretrained(path)


def dump(ckpt: Path, out: Path, seqs: int, length: int) -> None:
    """Its own routes of ``seqs`` random sequences, vLLM's layout; one file without, one with log-probs."""
    import torch

    from moe_lab.formats.routes import Routes
    from moe_lab.models import load_model
    from moe_lab.routing import record

    sys.path.insert(0, str(ROOT / "tests"))  # the tests' trace writers (tests/ is not installed)
    from trace_writers import write_vllm

    model, config = load_model(ckpt, dtype="auto"), json.loads((ckpt / "config.json").read_text())
    gen = torch.Generator().manual_seed(1)
    plain, with_logp = [], []
    for _ in range(seqs):
        tokens = torch.randint(3, config["vocab_size"], (length,), generator=gen)
        with torch.no_grad(), record(model, weights=False) as trace:
            logits = model(input_ids=tokens[None]).logits[0]
        ids_LSK = trace.indices[:, 0].long()
        routes = Routes(ids_LSK, torch.ones(ids_LSK.shape[:2], dtype=torch.bool))
        prompt = length // 8
        line = {"prompt_ids": tokens[:prompt].tolist(), "completion_ids": tokens[prompt:].tolist(),
                "routed_experts": write_vllm(routes, config=config, stop=length - 1).tolist()}
        logp = torch.log_softmax(logits[prompt - 1:-1].float(), -1).gather(1, tokens[prompt:, None])[:, 0]
        plain.append(json.dumps(line))
        with_logp.append(json.dumps({**line, "completion_logprobs": logp.tolist()}))
    (out / "plain.jsonl").write_text("\n".join(plain) + "\n")
    (out / "logp.jsonl").write_text("\n".join(with_logp) + "\n")


def bare(ckpt: Path, dump_file: Path) -> dict:
    import torch
    from transformers import Qwen3MoeForCausalLM

    lines = [json.loads(line) for line in dump_file.read_text().splitlines()]
    start = time.perf_counter()
    model = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype="auto").eval()
    loaded = time.perf_counter()
    with torch.no_grad():
        for line in lines:
            ids = torch.tensor([line["prompt_ids"] + line["completion_ids"]])
            for _ in range(2):
                model(input_ids=ids)
    end = time.perf_counter()
    return dict(load_s=loaded - start, work_s=end - loaded, total_s=end - start, peak_mb=_peak_mb())


def check(ckpt: Path, dump_file: Path) -> dict:
    import contextlib
    import io

    import moe_lab.audit.trace_report  # noqa: F401  (the command's own imports, outside the timed work, as
    import moe_lab.formats.jsonl  # noqa: F401  transformers' are for the bare run)
    import moe_lab.models  # noqa: F401
    from moe_lab.cli import main

    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = main(["check-trace", str(dump_file), "--model", str(ckpt)])
    end = time.perf_counter()
    last = out.getvalue().strip().splitlines()[-1]
    return dict(total_s=end - start, peak_mb=_peak_mb(), exit=code, last=last)


def _child(*argv: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"child {argv} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--experts", type=int, default=40)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, *rest = args.child
        paths = [Path(p) for p in rest]
        if what == "build":
            build(paths[0], args.experts)
            result = dict(peak_mb=_peak_mb())
        elif what == "dump":
            dump(paths[0], paths[1], args.seqs, args.len)
            result = dict(peak_mb=_peak_mb())
        else:
            result = (bare if what == "bare" else check)(paths[0], paths[1])
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, out = Path(tmp) / "ckpt", Path(tmp)
        built = _child("build", str(ckpt), "--experts", str(args.experts))
        size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 1e9
        _child("dump", str(ckpt), str(out), "--seqs", str(args.seqs), "--len", str(args.len))
        runs = {"bare (from_pretrained + 2 forwards/seq)": _child("bare", str(ckpt), str(out / "plain.jsonl")),
                "check-trace, no engine log-probs": _child("check", str(ckpt), str(out / "plain.jsonl")),
                "check-trace, engine log-probs": _child("check", str(ckpt), str(out / "logp.jsonl"))}
    print(f"checkpoint: qwen3_moe, 3 layers (layer 0 dense), {args.experts} experts top 2, hidden 1024, vocab 32000, "
          f"bf16 safetensors {size:.2f} GB (built from meta in bf16: peak RSS {built['peak_mb']:.0f} MB)")
    print(f"dump: {args.seqs} sequences x {args.len} tokens, vLLM layout; cpu, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    base = runs["bare (from_pretrained + 2 forwards/seq)"]
    for name, r in runs.items():
        extra = f"   exit {r['exit']}, {r['last']}" if "exit" in r else ""
        print(f"  {name:<42} peak RSS {r['peak_mb']:7.0f} MB ({r['peak_mb'] / base['peak_mb']:.2f}x)   "
              f"time {r['total_s']:6.1f} s ({r['total_s'] / base['total_s']:.2f}x){extra}")
    print("goal: peak memory <= 1.3x the bare forward's")


if __name__ == "__main__":
    main()
