"""`moe-lab check-trace FILE --model DIR [--format auto|...]`: do a dump's R3 routes line up with this model?

FILE: a JSONL dump (one sequence a line: prompt_ids, completion_ids, routed_experts in any layout of
moe_lab.formats, detected or named with --format) or a moe_lab trace file; DIR: a transformers checkpoint of
a family moe_lab serves. The model runs teacher-forced on each sequence with its routing recorded; the report
gives, per MoE layer and overall, the fraction of routed slots whose expert set equals the model's own
choice, the missing fraction, ids out of range, duplicate ids, the router margins where they disagree, the
engine/trainer log-prob mismatch when FILE carries the engine's log-probs, and each diagnosed fault in one
line (``fault: <name>: ...``). Then it replays the routes (R3) and checks that the experts actually run equal
the trace's on every covered slot. The last line is ``agreement <fraction>`` (docs/traces.md).

Exit codes: 0 no fault; 1 some fault (also a layer axis two numberings fit when neither the layout nor
``--layers`` pins one: ``ambiguous-layer-axis``); 2 bad input (one line on stderr, before any model is loaded
where the input alone shows it: a missing file or folder, a file that is none of the layouts, a shape that
fits no layer numbering of the model, an unsupported family; and a checkpoint that cannot be loaded).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_lab.audit.trace_audit import check, check_inputs, report_lines  # torch-free at import
from moe_lab.config.constants import SEQ_ERROR_THRESHOLD, TIS_THRESHOLD

DTYPES = ("auto", "float32", "bfloat16", "float16")


def add_parser(sub) -> argparse.ArgumentParser:
    from moe_lab.formats.names import FORMATS, LAYER_NUMBERINGS  # torch-free: the parser is built for every command

    p = sub.add_parser("check-trace", help="do the routed experts of a rollout dump (vLLM, SGLang, NeMo-RL, prime-rl, "
                                           "verl, slime) line up with a checkpoint? agreement, faults, replay check "
                                           "(docs/traces.md)")
    p.add_argument("file", metavar="FILE", help="JSONL dump (prompt_ids, completion_ids, routed_experts a line) or "
                                                "a moe_lab trace file (.safetensors)")
    p.add_argument("--model", required=True, metavar="DIR", help="transformers checkpoint folder (config.json)")
    p.add_argument("--format", default="auto", choices=FORMATS, help="layout of FILE (default: detected)")
    p.add_argument("--layers", default="auto", choices=("auto", *LAYER_NUMBERINGS),
                   help="what the layout's layer axis numbers: the MoE layers, every decoder layer, either with the "
                        "MTP layers appended (default: what the producer writes, docs/traces.md)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, or auto: device_map='auto' "
                                                   "(accelerate spreads the layers over the GPUs, then CPU memory)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="model dtype (default auto: the checkpoint's own, config.json's dtype)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the whole report (agreement, faults, lines, the mismatch report) as JSON to PATH")
    p.add_argument("--tis-threshold", type=float, default=TIS_THRESHOLD, metavar="C",
                   help="the mismatch report's TIS threshold (verl's rollout_is_threshold; masking outside [1/C, C]; "
                        "default %(default)s)")
    p.add_argument("--seq-error-threshold", type=float, default=SEQ_ERROR_THRESHOLD, metavar="X",
                   help="NeMo-RL's seq_logprob_error_threshold for the outlier share of seq_mult_prob_error "
                        "(default %(default)s)")
    return p


def _options(args):
    """The mismatch report's thresholds (and --json's folder), checked before any work."""
    from moe_lab.audit.trace_mismatch import MismatchOptions

    for flag, value in (("--tis-threshold", args.tis_threshold), ("--seq-error-threshold", args.seq_error_threshold)):
        if not (1.0 < value < float("inf")):
            raise ValueError(f"{flag}={value}: allowed a finite number > 1")
    if args.json and not Path(args.json).expanduser().resolve().parent.is_dir():
        raise ValueError(f"--json={args.json}: its folder does not exist")
    return MismatchOptions(args.tis_threshold, args.seq_error_threshold)


def read_config(model_dir: str) -> dict:
    """The checkpoint's config.json, checked to be a family moe_lab serves, without loading any weights."""
    from moe_lab.formats.layers import moe_layer_indices
    from moe_lab.models.families import FAMILIES, family_of_model_type, served_config

    path = Path(model_dir).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model={model_dir}: no config.json there (expected a transformers checkpoint folder)")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model={model_dir}: config.json is not JSON ({exc.msg})") from None
    config = served_config(config)  # a multimodal checkpoint (qwen3_5_moe): its text model
    if family_of_model_type(config.get("model_type")) is None:
        raise ValueError(f"--model={model_dir}: model_type={config.get('model_type')!r} is not a family moe_lab "
                         f"serves; allowed {', '.join(s.model_type for s in FAMILIES.values())}")
    moe_layer_indices(config)  # a config without the fields the layer rule needs is refused here
    return config


def _device(name: str):
    """The placement asked for: a torch.device, or "auto" (a device_map accelerate computes)."""
    import importlib.util

    import torch

    if name == "auto":
        if importlib.util.find_spec("accelerate") is None:
            raise ValueError("--device=auto: places the model with accelerate's device_map='auto', and accelerate is "
                             "not installed (pip install accelerate); allowed without it: cpu, cuda, cuda:N")
        return "auto"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device={name}: not a device; allowed cpu, cuda, cuda:N, auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={name}: torch sees no CUDA device here; allowed cpu, auto")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device={name}: allowed cpu, cuda, cuda:N, auto")
    return dev


def _load(model_dir: str, device, dtype: str):
    """The model in ``dtype`` read straight onto ``device`` (a device_map: never built whole in CPU memory first)."""
    import torch
    from transformers.utils import logging as hf_logging

    from moe_lab.models import load_model

    hf_logging.disable_progress_bar()  # one bar per load: noise in a report meant to be read or parsed
    device_map = device if device == "auto" else None if device.type == "cpu" else {"": str(device)}
    return load_model(model_dir, dtype=dtype if dtype == "auto" else getattr(torch, dtype), device_map=device_map)


def _load_checkpoint(model_dir: str, device, dtype: str):
    """``_load``, a checkpoint that cannot be loaded (config only, truncated or mismatched weights) refused as
    bad input in one line naming the folder and its weight files."""
    try:
        return _load(model_dir, device, dtype)
    except Exception as exc:  # noqa: BLE001 - safetensors and transformers raise types of their own
        files = sorted(p.name for p in Path(model_dir).expanduser().glob("*.safetensors")) or \
            sorted(p.name for p in Path(model_dir).expanduser().glob("*.bin"))
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ValueError(f"--model={model_dir}: cannot load the checkpoint from "
                         f"{', '.join(files) if files else 'no weight file (config.json only)'} "
                         f"({type(exc).__name__}: {first})") from None


def main(args) -> int:
    from moe_lab.audit.trace_run import input_device
    from moe_lab.formats.jsonl import read_input
    from moe_lab.formats.layers import AmbiguousLayerAxis
    from moe_lab.models import checkpoint_dtype

    config = read_config(args.model)
    options = _options(args)
    device = _device(args.device)
    if not Path(args.file).is_file():
        raise ValueError(f"FILE={args.file}: no such file (expected a JSONL dump or a moe_lab trace file)")
    try:
        sequences = read_input(args.file, config, args.format, args.layers)
    except AmbiguousLayerAxis as exc:  # a fault of the dump, not unreadable input: exit 1 naming the flag
        faults = [("ambiguous-layer-axis", str(exc))]
        lines = report_lines([], faults, float("nan"))
        print(f"check-trace: {args.file}: layer axis not decided")
        print("\n".join(lines))
        if args.json:
            _write_json(args.json, {"file": args.file, "layout": None, "layer_axis": None}, faults, float("nan"),
                        lines, None)
        return 1
    check_inputs(sequences, config)
    if args.dtype == "auto":
        checkpoint_dtype(args.model)  # a dtype torch has no name for is refused before the model is loaded
    model = _load_checkpoint(args.model, device, args.dtype)
    kind = sequences[0].routes
    print(f"check-trace: {args.file}: {len(sequences)} sequences, layout {kind.layout}, layer axis {kind.layer_kind}")
    report = check(sequences, model, config, input_device(model), options)
    lines = report_lines(report.lines, report.faults, report.agreement)
    print("\n".join(lines))
    if args.json:
        _write_json(args.json, {"file": args.file, "layout": kind.layout, "layer_axis": kind.layer_kind},
                    report.faults, report.agreement, lines, report.mismatch)
    return 1 if report.faults else 0


def _write_json(path: str, header: dict, faults: list, agreement: float, lines: list[str], mismatch) -> None:
    """The report as one JSON object (docs/traces.md, "The mismatch report"); agreement null when not measured."""
    Path(path).write_text(json.dumps({
        **header, "agreement": agreement if agreement == agreement else None,
        "faults": [{"name": n, "detail": d} for n, d in faults], "lines": lines, "mismatch": mismatch},
        indent=1) + "\n", encoding="utf-8")
