"""SGLang's routed experts: ``meta_info["routed_experts"]``, base64 of int32 ids (docs/traces.md, "SGLang").

The ids are flattened [positions, layers, top_k] (C order) over the positions [routed_experts_start_len,
seqlen - 1): the last token is never fed back, and a request may ask for the rows from a start on (the rest
being a prefix the caller already holds). The layer axis is the one the model's config allows and the buffer's
length fits (formats.layers); its rows are zero where no route was written.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
import torch

from moe_lab.formats.routes import Routes, decode, encode, unflatten


def _b64_int32(data: Any, what: str) -> torch.Tensor:
    if not isinstance(data, (str, bytes)):
        raise ValueError(f"{what}: expected a base64 string of int32 ids, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: not valid base64") from None
    if len(raw) % 4:
        raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of int32 ids")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int64))


def decode_sglang(routed_experts: Any, *, config: Any, num_tokens: int | None = None, start: int = 0,
                  layers: str = "auto") -> Routes:
    """SGLang's base64 string (or an int array [positions, layers, top_k]) covering [start, ...) -> Routes."""
    what = "routed_experts"
    if isinstance(routed_experts, (str, bytes)):
        flat = _b64_int32(routed_experts, what)
        expected = () if num_tokens is None else (num_tokens - 1 - start, num_tokens - start)
        rows = unflatten(flat, config, expected_rows=expected, what=what)
    else:
        rows = routed_experts
    routes = decode(rows, config, start=start, num_tokens=num_tokens, layers=layers, layout="sglang", what=what)
    return routes


def write_sglang(routes: Routes, *, config: Any, start: int = 0, stop: int | None = None,
                 layers: str = "moe") -> str:
    """Routes -> SGLang's base64 int32 string over positions [start, stop) (default stop: the last position,
    which SGLang never covers)."""
    stop = routes.num_positions - 1 if stop is None else stop
    rows = encode(routes, config, layers=layers, missing=0, start=start, stop=stop)
    return base64.b64encode(rows.numpy().astype("<i4").tobytes()).decode("ascii")
