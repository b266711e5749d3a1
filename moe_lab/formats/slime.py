"""slime's ``--save-debug-rollout-data`` files (docs/traces.md, "slime").

slime saves ``torch.save({"rollout_id": ..., "samples": [Sample.to_dict(), ...]})``; a sample's dict holds
``tokens`` (prompt then response), ``response_length``, ``rollout_log_probs`` (one per response token) and,
under R3, ``rollout_routed_experts``: SGLang's ids reshaped to [len(tokens) - 1, num_layers, top_k] (the last
token never fed back). The file is read with ``torch.load(weights_only=True)``: it must not run code, so a
dump holding other Python objects is refused with one line rather than unpickled.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from moe_lab.formats.logprobs import sample_logprobs
from moe_lab.formats.routes import RoutedSequence, as_int_tensor, decode


def _load(path: Path) -> list[dict]:
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, AttributeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: not a slime debug rollout file readable without running code ({first})") from None
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise ValueError(f"{path}: expected slime's dict with a 'samples' list (--save-debug-rollout-data)")
    return data["samples"]


def _sequence(sample: Any, config: Any, where: str, layers: str = "auto") -> RoutedSequence:
    if not isinstance(sample, dict) or "tokens" not in sample or "response_length" not in sample:
        raise ValueError(f"{where}: expected a sample dict with tokens and response_length")
    if sample.get("rollout_routed_experts") is None:
        raise ValueError(f"{where}: no rollout_routed_experts (was the rollout run with R3 on?)")
    tokens = as_int_tensor(sample["tokens"], f"{where}: tokens").reshape(-1)
    response = int(sample["response_length"])
    routes = decode(sample["rollout_routed_experts"], config, num_tokens=tokens.numel(), layout="slime",
                    layers=layers, what=f"{where}: rollout_routed_experts")
    logp = sample_logprobs(sample.get("rollout_log_probs"), f"{where}: rollout_log_probs", response)
    return RoutedSequence(tokens, tokens.numel() - response, routes, logp, where)


def read_slime(path: str | Path, config: Any, layers: str = "auto") -> list[RoutedSequence]:
    path = Path(path)
    samples = _load(path)
    if not samples:
        raise ValueError(f"{path}: no samples")
    return [_sequence(s, config, f"{path} sample {i}", layers) for i, s in enumerate(samples)]
