"""`moe-lab volatility OLD NEW --prompts FILE [--out DIR]`: how much the routing moved between two checkpoints.

The routing-volatility figure of the paper for any two checkpoints of a supported family (two steps of a run,
a base model and its fine-tune). OLD generates a completion for every prompt of FILE (sampling seeded by an
explicit generator, ``--seed``); OLD and NEW then run teacher-forced on the same sequences, and over the
response positions (where the next token is a completion token, EOS included) it reports, per MoE layer and
overall:

- ``expert_change``: the fraction of activated experts that changed, mean over positions and layers of
  1 - |K_old ∩ K_new| / k (``moe_lab.routing.routing_metrics``; the paper's figure);
- ``any_change``: the share of positions with any changed expert (in that layer / in any layer);
- ``router_shift``: RSPO's mean |log p_new(e) - log p_old(e)| over OLD's chosen experts;
- ``logratio_var``: the variance of the token log-ratio log p_new(y) - log p_old(y), and ``routing_share``,
  the part of it routing explains (``moe_lab.algos.ratio_metrics.ratio_decomposition``: NEW with OLD's
  routing replayed separates the routing change from the weight change).

It prints a summary (its last line ``expert_change <fraction>``) and writes to DIR (default
``volatility/``): ``volatility.parquet`` (one row per MoE layer and one ``all`` row), ``volatility.png``
and ``sequences.jsonl`` (the prompt and completion ids it evaluated). Identical checkpoints give exactly 0.

FILE is JSONL: one object per line with ``prompt_ids`` (a list of token ids), or ``text`` when OLD has a
tokenizer saved beside it. Exit codes: 0 done; 2 bad input (one line on stderr, checked before any model is
loaded where it can be: files, families, expert counts, prompt lines, device).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

# the short names, and torch's (as `moe-lab check-trace --dtype` takes them); auto: the checkpoint's own
DTYPES = {"auto": "auto", "fp32": "float32", "bf16": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Checked:
    """What the input checks established, before any model is loaded."""

    family: str
    prompts: list  # list[list[int]] of token ids, or list[str] of texts to tokenize with OLD's tokenizer
    vocab_size: int
    out: Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("volatility", help="routing volatility between two checkpoints: experts changed per MoE "
                                          "layer, router shift, log-ratio variance and its routing share")
    p.add_argument("old", metavar="OLD", help="checkpoint directory that generates the completions")
    p.add_argument("new", metavar="NEW", help="checkpoint directory compared with OLD (same family and experts)")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help="JSONL: one {\"prompt_ids\": [...]} (or {\"text\": ...} with a tokenizer) per line")
    p.add_argument("--out", default="volatility", metavar="DIR", help="output folder (default: volatility)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="completion length limit (default 32)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of OLD (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward (default 16)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="auto",
                   help="weights' dtype (default auto: OLD's own, config.json's dtype, for both)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    return p


def _read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text(encoding="utf-8"))


def check_pair(old: Path, new: Path) -> tuple[str, int]:
    """(family, vocab size) of two checkpoints that volatility can compare; ValueError otherwise."""
    from moe_lab.formats import layers
    from moe_lab.models import checkpoint_family

    fam_old, fam_new = checkpoint_family(old), checkpoint_family(new)
    if fam_old.name != fam_new.name:
        raise ValueError(f"OLD and NEW: expected checkpoints of one family, got {fam_old.name} vs {fam_new.name}")
    cfg_old, cfg_new = _read_config(old), _read_config(new)
    pairs = [("num_experts", layers.num_experts(cfg_old), layers.num_experts(cfg_new)),
             ("top_k", layers.top_k(cfg_old), layers.top_k(cfg_new)),
             ("MoE layers", layers.moe_layer_indices(cfg_old), layers.moe_layer_indices(cfg_new)),
             ("vocab_size", cfg_old.get("vocab_size"), cfg_new.get("vocab_size"))]
    diffs = [f"{name} {a} vs {b}" for name, a, b in pairs if a != b]
    if diffs:
        raise ValueError(f"OLD and NEW: expected the same routing shape, got {'; '.join(diffs)}")
    return fam_old.name, int(cfg_old["vocab_size"])


def _prompt(line: str, where: str, vocab_size: int, has_tokenizer: bool) -> list[int] | str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        obj = None
    ids = obj.get("prompt_ids") if isinstance(obj, dict) else None
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        if not all(0 <= t < vocab_size for t in ids):
            raise ValueError(f"{where}: prompt_ids: expected token ids in [0, {vocab_size}) (the vocabulary)")
        return ids
    text = obj.get("text") if isinstance(obj, dict) else None
    if isinstance(text, str) and text and has_tokenizer and ids is None:
        return text
    hint = "" if has_tokenizer else " (text needs a tokenizer saved with OLD)"
    raise ValueError(f"{where}: expected a JSON object with prompt_ids, a non-empty list of token ids{hint}")


def read_prompts(path: Path, vocab_size: int, has_tokenizer: bool) -> list:
    """The prompts of a JSONL file: token-id lists (or texts); ValueError naming the first bad line."""
    if not path.is_file():
        raise ValueError(f"--prompts {str(path)!r}: expected a JSONL file; it does not exist")
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"--prompts {str(path)!r}: expected one JSON object per line; the file is empty")
    prompts = [_prompt(line, f"--prompts {path.name} line {n}", vocab_size, has_tokenizer) for n, line in lines]
    if len({type(p) for p in prompts}) > 1:
        raise ValueError(f"--prompts {path.name}: expected prompt_ids on every line or text on every line, not both")
    return prompts


def check_args(args) -> Checked:
    """Every check that needs no model: ValueError (one line) on the first failure."""
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--batch-size", args.batch_size, 1),
                             ("--seed", args.seed, 0)):
        if value < low:
            raise ValueError(f"{flag}={value}: expected an integer >= {low}")
    if not args.temperature > 0:
        raise ValueError(f"--temperature={args.temperature}: expected a number > 0")
    from moe_lab.models import resolve_device

    resolve_device(args.device)  # 'cuda' without one is refused here, before anything is loaded
    old, new = Path(args.old).expanduser(), Path(args.new).expanduser()
    family, vocab_size = check_pair(old, new)
    if args.dtype == "auto":
        from moe_lab.models import checkpoint_dtype

        checkpoint_dtype(old)  # a dtype torch has no name for is refused here
    has_tokenizer = any((old / name).is_file() for name in TOKENIZER_FILES)
    prompts = read_prompts(Path(args.prompts).expanduser(), vocab_size, has_tokenizer)
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r}: expected a folder; a file of that name exists")
    return Checked(family, prompts, vocab_size, out)


def summary_lines(summary: dict, per_layer: list[dict]) -> list[str]:
    """The printed summary: one line per MoE layer, then the overall figures, ``expert_change`` last."""
    lines = [f"layer {row['layer']:>3}  expert_change {row['expert_change']:.6f}  any_change "
             f"{row['any_change']:.6f}  router_shift {row['router_shift']:.6f}" for row in per_layer]
    for key in ("family", "sequences", "response_tokens", "any_change", "router_shift", "logratio_var",
                "routing_share"):
        value = summary[key]
        lines.append(f"{key} {value:.6g}" if isinstance(value, float) else f"{key} {value}")
    lines.append(f"expert_change {summary['expert_change']:.6g}")
    return lines


def plot(per_layer: list[dict], summary: dict, path: Path) -> None:
    """The figure: per MoE layer, the share of activated experts that changed (the paper's routing-volatility
    figure) and of positions with any change, and the router shift beside it."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display backend

    layers = [row["layer"] for row in per_layer]
    x = list(range(len(layers)))
    fig = Figure(figsize=(max(6.0, 0.35 * len(layers) + 3.0), 5.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    width = 0.4
    top.bar([i - width / 2 for i in x], [row["expert_change"] for row in per_layer], width, label="expert_change")
    top.bar([i + width / 2 for i in x], [row["any_change"] for row in per_layer], width, label="any_change")
    top.axhline(summary["expert_change"], color="black", lw=1, ls="--",
                label=f"expert_change, all layers: {summary['expert_change']:.4f}")
    top.set_ylabel("share changed")
    top.set_ylim(0, 1.3)  # room above the bars for the legend
    top.legend(fontsize=8, ncols=3, loc="upper center")
    top.set_title(f"{summary['family']}: routing volatility over {summary['response_tokens']} response tokens\n"
                  f"log-ratio variance {summary['logratio_var']:.3g}, routing share of it "
                  f"{summary['routing_share']:.2f}", fontsize=9)
    bottom.bar(x, [row["router_shift"] for row in per_layer], 0.6, color="tab:green")
    bottom.set_ylabel("router shift")
    bottom.set_xlabel("decoder layer (MoE layers)")
    bottom.set_xticks(x, [str(layer) for layer in layers])
    fig.savefig(path, dpi=120)


def _tokenize(old: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(old, local_files_only=True)
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def main(args) -> int:
    try:
        checked = check_args(args)
    except ValueError as exc:
        print(f"moe-lab volatility: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    from moe_lab.audit import volatility_run

    prompts = checked.prompts
    if prompts and isinstance(prompts[0], str):
        prompts = _tokenize(Path(args.old).expanduser(), prompts)
    result = volatility_run.run(args.old, args.new, prompts, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, seed=args.seed, batch_size=args.batch_size,
                                dtype=DTYPES[args.dtype], device=args.device)
    checked.out.mkdir(parents=True, exist_ok=True)
    volatility_run.write(result, checked.out)
    plot(result.per_layer, result.summary, checked.out / "volatility.png")
    print("\n".join(summary_lines(result.summary, result.per_layer)))
    return 0
