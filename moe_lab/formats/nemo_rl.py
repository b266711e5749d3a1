"""NeMo-RL's routed-experts envelope: ``nrlre1:<dtype>:<S>x<L>x<K>:<base64>`` (docs/traces.md, "NeMo-RL").

The payload is the C-order bytes of an integer array [S positions, L layers, K top_k] of the given dtype
(little-endian), positions from 0; ``-1`` marks a missing route. The layer axis follows one of the model's
numberings (formats.layers), decided by its length. NeMo-RL aligns the rows to the padded sequence and fills
the positions past the engine's routes (the final token, padding) with the placeholder route 0, 1, ..., K-1
in every layer: a final row that is exactly that placeholder is read as missing, not as a route.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import numpy as np
import torch

from moe_lab.formats.routes import Routes, decode, encode

PREFIX = "nrlre1"
DTYPES = ("int8", "int16", "int32")  # NeMo-RL's wire dtypes (signed: -1 must be representable)
_ENVELOPE = re.compile(r"^nrlre1:([a-z0-9]+):(\d+)x(\d+)x(\d+):([A-Za-z0-9+/=_-]*)$")


def is_envelope(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX + ":")


def parse_envelope(value: str, what: str = "routed_experts") -> torch.Tensor:
    """The envelope -> int64 rows [S, L, K]."""
    match = _ENVELOPE.match(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{what}: not a NeMo-RL envelope; expected 'nrlre1:<dtype>:<S>x<L>x<K>:<base64>'")
    dtype, S, L, K, payload = match.group(1), *map(int, match.group(2, 3, 4)), match.group(5)
    if dtype not in DTYPES:
        raise ValueError(f"{what}: envelope dtype {dtype!r}; allowed {', '.join(DTYPES)}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: envelope payload is not valid base64") from None
    want = S * L * K * np.dtype(dtype).itemsize
    if len(raw) != want:
        raise ValueError(f"{what}: envelope says {S}x{L}x{K} {dtype} ({want} bytes), payload has {len(raw)}")
    return torch.from_numpy(np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(np.int64)
                            .reshape(S, L, K))


def decode_nemo_rl(envelope: str, *, config: Any, num_tokens: int | None = None, layers: str = "auto") -> Routes:
    rows = parse_envelope(envelope)
    if rows.shape[0] and rows.shape[2] > 1 and torch.equal(rows[-1], torch.arange(rows.shape[2]).expand_as(rows[-1])):
        rows = rows.clone()
        rows[-1] = -1  # NeMo-RL's placeholder for the final token (see the module docstring)
    return decode(rows, config, num_tokens=num_tokens, layers=layers, layout="nemo_rl")


def write_nemo_rl(routes: Routes, *, config: Any, dtype: str = "int16", layers: str = "moe",
                  stop: int | None = None) -> str:
    """Routes -> the envelope, -1 where a route is missing."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed {', '.join(DTYPES)}")
    rows = encode(routes, config, layers=layers, missing=-1, stop=stop).numpy()
    rows = rows.astype(np.dtype(dtype).newbyteorder("<"))
    S, L, K = rows.shape
    return f"{PREFIX}:{dtype}:{S}x{L}x{K}:{base64.b64encode(rows.tobytes()).decode('ascii')}"
