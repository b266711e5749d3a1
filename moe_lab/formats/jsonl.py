"""The `moe-lab check-trace` input: a JSONL dump (one sequence a line) or a moe_lab trace file, layout detected.

A line holds ``prompt_ids`` and ``completion_ids`` (lists of ints) and ``routed_experts`` in any layout of
moe_lab.formats; optionally ``prompt_routed_experts`` (vLLM's OpenAI server splits the prompt's rows off),
``routed_experts_start_len`` (or ``start``: SGLang's first position covered; prime-rl carries its own
``start`` inside its object), and the engine's log-probs of the completion tokens under any stack's own name
(formats.logprobs.FIELDS: ``completion_logprobs``, verl's and slime's ``rollout_log_probs``, ...).
``format`` on a line, or ``--format``, names the layout;
else it is detected from the value:

  "nrlre1:..."                        nemo_rl     {"data", "shape", ...}      prime_rl
  any other string (base64)           sglang      nested lists [S][L][K]     vllm (verl: the same rows)

Everything here runs before a model is loaded: a file that is not one of these gets one line naming the
file, the line and what was expected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from moe_lab.formats import nemo_rl, prime_rl
from moe_lab.formats.layers import AmbiguousLayerAxis
from moe_lab.formats.logprobs import engine_logprobs
from moe_lab.formats.names import FILE_FORMATS, FORMATS, LINE_FORMATS
from moe_lab.formats.routes import Routes, RoutedSequence, decode
from moe_lab.formats.sglang import decode_sglang, file_layers, ids_count
from moe_lab.formats.vllm import decode_vllm

# what json.loads returns for a line that is not an object, as JSON names it
_JSON_KINDS = {int: "number", float: "number", bool: "boolean", str: "string", list: "array", type(None): "null"}


def detect_line(line: dict) -> str:
    """The layout of one line's routed_experts (see the module docstring)."""
    if isinstance(line.get("format"), str):
        return line["format"]
    value = line.get("routed_experts")
    if "prompt_routed_experts" in line:
        return "vllm"
    if nemo_rl.is_envelope(value):
        return "nemo_rl"
    if prime_rl.is_prime_rl(value):
        return "prime_rl"
    if isinstance(value, (str, bytes)):
        return "sglang"
    if isinstance(value, list):
        return "vllm"
    raise ValueError(f"routed_experts: {type(value).__name__} is none of the layouts; allowed an 'nrlre1:' "
                     "envelope (NeMo-RL), a {data, shape, start, dtype} object (prime-rl), a base64 string "
                     "(SGLang) or nested lists [positions][layers][top_k] (vLLM, verl)")


def _start(line: dict) -> int:
    start = line.get("routed_experts_start_len", line.get("start", 0))
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"routed_experts_start_len={start!r}; allowed an int >= 0")
    return start


def _read_vllm(line: dict, config: Any, n: int, layers: str) -> Routes:
    value = line.get("routed_experts")
    return decode_vllm(value if value is not None else [], config=config, num_tokens=n, layers=layers,
                       prompt_routed_experts=line.get("prompt_routed_experts"))


def _read_sglang(line: dict, config: Any, n: int, layers: str) -> Routes:
    return decode_sglang(line.get("routed_experts"), config=config, num_tokens=n, start=_start(line), layers=layers)


def _read_nemo_rl(line: dict, config: Any, n: int, layers: str) -> Routes:
    return nemo_rl.decode_nemo_rl(line.get("routed_experts"), config=config, num_tokens=n, layers=layers)


def _read_prime_rl(line: dict, config: Any, n: int, layers: str) -> Routes:
    value = line.get("routed_experts")
    if not prime_rl.is_prime_rl(value):
        raise ValueError("routed_experts: expected a prime-rl object with data and shape")
    return prime_rl.decode_prime_rl(value, config=config, num_tokens=n, layers=layers)


def _read_verl(line: dict, config: Any, n: int, layers: str) -> Routes:
    return decode(line.get("routed_experts"), config, num_tokens=n, layout="verl", layers=layers)


# Each JSONL layout's reader: (the line, the model's config, the sequence's number of tokens, the layer
# numbering: --layers or "auto") -> Routes. formats.names.LINE_FORMATS holds the same names for the command
# line's parser, which must not import torch: a name in one and not in the other fails on import.
LINE_READERS: dict[str, Callable[[dict, Any, int, str], Routes]] = {
    "vllm": _read_vllm,
    "sglang": _read_sglang,
    "nemo_rl": _read_nemo_rl,
    "prime_rl": _read_prime_rl,
    "verl": _read_verl,
}
if set(LINE_READERS) != set(LINE_FORMATS):
    raise ImportError(f"moe_lab.formats: layouts with a reader {sorted(LINE_READERS)} are not the layouts "
                      f"formats.names.LINE_FORMATS names {sorted(LINE_FORMATS)}")


def _decode_line(layout: str, line: dict, config: Any, n: int, layers: str) -> Routes:
    if layout not in LINE_READERS:
        raise ValueError(f"format={layout!r}; allowed {', '.join(LINE_FORMATS)} on a JSONL line")
    return LINE_READERS[layout](line, config, n, layers)


def _ids(line: dict, key: str) -> torch.Tensor:
    value = line.get(key)
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{key}: expected a list of token ids (ints)")
    return torch.tensor(value, dtype=torch.int64)


def _checked(line: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(line, dict):
        raise ValueError("expected a JSON object with prompt_ids, completion_ids and routed_experts")
    prompt, completion = _ids(line, "prompt_ids"), _ids(line, "completion_ids")
    if "routed_experts" not in line:
        raise ValueError("routed_experts: missing")
    return prompt, completion


def parse_line(line: dict, config: Any, layout: str = "auto", where: str = "", layers: str = "auto") -> RoutedSequence:
    prompt, completion = _checked(line)
    layout = detect_line(line) if layout == "auto" else layout
    tokens = torch.cat([prompt, completion])
    routes = _decode_line(layout, line, config, tokens.numel(), layers)
    logp = engine_logprobs(line, prompt.tolist(), completion.tolist())
    return RoutedSequence(tokens, prompt.numel(), routes, logp, where)


def _sglang_layers(lines: list[tuple[str, Any]], config: Any, layout: str, layers: str) -> str:
    """SGLang's layer numbering decided once for the file (formats.sglang.file_layers), else ``layers``."""
    buffers = []
    for where, line in lines:
        try:
            if layers != "auto" or (layout if layout != "auto" else detect_line(line)) != "sglang":
                continue
            prompt, completion = _checked(line)
        except ValueError:
            continue  # reported with its line when the line is read
        value = line["routed_experts"]
        if isinstance(value, (str, bytes)):
            buffers.append((ids_count(value), (prompt.numel() + completion.numel() - 1 - _start(line),
                                               prompt.numel() + completion.numel() - _start(line))))
    return file_layers(buffers, config) if buffers else layers


def _where(where: str, exc: ValueError) -> ValueError:
    """The error again, prefixed with FILE line N (an ambiguous layer axis stays one)."""
    if isinstance(exc, AmbiguousLayerAxis):
        return AmbiguousLayerAxis(f"{where}: routed_experts", exc.axis_len, exc.kinds)
    return ValueError(f"{where}: {exc}")


def read_jsonl(path: str | Path, config: Any, layout: str = "auto", layers: str = "auto") -> list[RoutedSequence]:
    """Every line of a JSONL dump; a bad line raises ValueError naming FILE line N. ``layers``: the layer
    numbering (``--layers``; "auto": the one the layout writes, for SGLang decided once for the file)."""
    lines = []
    with open(path, encoding="utf-8") as fh:
        for n, text in enumerate(fh, 1):
            if not text.strip():
                continue
            where = f"{path} line {n}"
            try:
                line = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg}); expected one JSON object a line") from None
            if not isinstance(line, dict):  # before any reader calls line.get
                raise ValueError(f"{where}: a JSON {_JSON_KINDS.get(type(line), type(line).__name__)}, expected a "
                                 "JSON object (prompt_ids, completion_ids, routed_experts) a line")
            lines.append((where, line))
    if not lines:
        raise ValueError(f"{path}: no sequences (expected JSONL, one object a line, or a moe_lab trace file)")
    try:
        sg_layers = _sglang_layers(lines, config, layout, layers)
    except ValueError as exc:
        raise _where(f"{path}", exc) from None
    out = []
    for where, line in lines:
        try:
            kind = layout if layout != "auto" else detect_line(line)
            out.append(parse_line(line, config, layout, where, sg_layers if kind == "sglang" else layers))
        except ValueError as exc:
            raise _where(where, exc) from None
    return out


def file_format(path: Path, layout: str) -> str:
    """'trace', 'slime' or 'jsonl' for a file and a --format value."""
    if layout not in FORMATS:
        raise ValueError(f"--format={layout!r}; allowed {', '.join(FORMATS)}")
    if layout in FILE_FORMATS:
        return layout
    if layout == "auto" and path.suffix == ".safetensors":
        return "trace"
    if layout == "auto" and path.suffix in (".pt", ".pth"):
        return "slime"
    return "jsonl"


def read_input(path: str | Path, config: Any, layout: str = "auto", layers: str = "auto") -> list[RoutedSequence]:
    """Any check-trace input -> its sequences (nothing loaded but the file)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"FILE={str(path)!r}: no such file (expected a JSONL dump or a moe_lab trace file)")
    kind = file_format(path, layout)
    readers: dict[str, Callable[[], list[RoutedSequence]]] = {
        "trace": lambda: _read_trace(path, config),
        "slime": lambda: _read_slime(path, config, layers),
        "jsonl": lambda: read_jsonl(path, config, layout, layers),
    }
    return readers[kind]()


def _read_trace(path: Path, config: Any) -> list[RoutedSequence]:
    from moe_lab.formats.native import read_trace_file

    try:
        return read_trace_file(path, config)
    except Exception as exc:  # safetensors raises its own types on a file that is not one
        if isinstance(exc, ValueError) and str(exc).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a moe_lab trace file ({type(exc).__name__}: {exc})") from None


def _read_slime(path: Path, config: Any, layers: str) -> list[RoutedSequence]:
    from moe_lab.formats.slime import read_slime

    return read_slime(path, config, layers)
