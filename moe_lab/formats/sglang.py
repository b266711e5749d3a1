"""SGLang's routed experts: ``meta_info["routed_experts"]``, base64 of int32 ids (docs/traces.md, "SGLang").

The ids are flattened [positions, layers, top_k] (C order) over the positions [routed_experts_start_len,
seqlen - 1): the last token is never fed back, and a request may ask for the rows from a start on (the rest
being a prefix the caller already holds). The layer axis is one of the numberings SGLang writes
(formats.layers.LAYOUT_AXES), decided once for a whole file by the buffers' lengths (``file_layers``); its
rows are zero where no route was written.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
import torch

from moe_lab.formats.layers import LAYOUT_AXES, AmbiguousLayerAxis, layer_maps, top_k
from moe_lab.formats.routes import Routes, decode

ID_DTYPE = "<i4"  # SGLang's capture buffer: little-endian int32 expert ids


def _b64_int32(data: Any, what: str) -> torch.Tensor:
    if not isinstance(data, (str, bytes)):
        raise ValueError(f"{what}: expected a base64 string of int32 ids, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: not valid base64") from None
    if len(raw) % 4:
        raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of int32 ids")
    return torch.from_numpy(np.frombuffer(raw, dtype=ID_DTYPE).astype(np.int64))


def ids_count(routed_experts: Any) -> int:
    """How many int32 ids a base64 buffer holds (without decoding it)."""
    text = routed_experts.strip() if isinstance(routed_experts, str) else routed_experts.decode("ascii", "replace")
    return (len(text) * 3 // 4 - text.count("=")) // 4


def file_layers(buffers: list[tuple[int, tuple[int, ...]]], config: Any, what: str = "routed_experts") -> str:
    """One layer numbering for every SGLang buffer of a file, from (ids, the row counts its tokens allow) per
    line: the numbering (of those SGLang writes) under which most lines hold exactly the rows their tokens
    need, then most lines hold whole rows, then those rows are nearest the tokens'. Decided once for the
    file, a truncated line reads as truncated under it, never as another numbering its length happens to fit."""
    k, maps = top_k(config), layer_maps(config)
    fits = {m.rows: m for kind, m in maps.items() if kind in LAYOUT_AXES["sglang"]}

    def score(width: int) -> tuple[int, int, int]:  # exact lines, whole-row lines, -(rows off the tokens')
        whole = [(n // width, exp) for n, exp in buffers if n % width == 0]
        return (sum(rows in exp for rows, exp in whole), len(whole),
                -sum(min((abs(rows - e) for e in exp), default=0) for rows, exp in whole))

    scores = {rows: score(m.axis_len * k) for rows, m in fits.items()}
    best = max(scores.values())
    top = [fits[rows].kind for rows, sc in scores.items() if sc == best]
    if best[1] == 0:
        sizes = ", ".join(f"{m.axis_len} ({m.kind})" for m in fits.values())
        raise ValueError(f"{what}: {buffers[0][0]} ids fit no layer numbering SGLang writes for this model (layer "
                         f"rows allowed: {sizes}; top_k {k}); --layers names another")
    if len(top) > 1:
        raise AmbiguousLayerAxis(what, maps[top[0]].axis_len, top)
    return top[0]


def _expected(num_tokens: int | None, start: int) -> tuple[int, ...]:
    return () if num_tokens is None else (num_tokens - 1 - start, num_tokens - start)


def decode_sglang(routed_experts: Any, *, config: Any, num_tokens: int | None = None, start: int = 0,
                  layers: str = "auto") -> Routes:
    """SGLang's base64 string (or an int array [positions, layers, top_k]) covering [start, ...) -> Routes.
    ``layers``: the file's numbering (``file_layers``); "auto" decides it from this buffer alone. Ids past the
    last whole row (a line cut short) are dropped: the positions they would cover read as missing."""
    what = "routed_experts"
    if not isinstance(routed_experts, (str, bytes)):
        return decode(routed_experts, config, start=start, num_tokens=num_tokens, layers=layers, layout="sglang",
                      what=what)
    flat = _b64_int32(routed_experts, what)
    if layers == "auto":
        layers = file_layers([(flat.numel(), _expected(num_tokens, start))], config, what)
    maps, k = layer_maps(config), top_k(config)
    if layers not in maps:
        raise ValueError(f"{what}: --layers={layers} is not a layer numbering this model has; allowed "
                         f"{', '.join(maps)}")
    width = maps[layers].axis_len * k
    rows = flat[: flat.numel() // width * width].reshape(-1, maps[layers].axis_len, k)
    return decode(rows, config, start=start, num_tokens=num_tokens, layers=layers, layout="sglang", what=what)
