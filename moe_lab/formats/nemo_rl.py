"""NeMo-RL's routed-experts envelope: ``nrlre1:<dtype>:<S>x<L>x<K>:<base64>`` (docs/traces.md, "NeMo-RL").

The payload is the C-order bytes of an integer array [S positions, L layers, K top_k] of the given dtype
(little-endian), positions from 0; ``-1`` marks a missing route. The layer axis follows one of the model's
numberings NeMo-RL writes (formats.layers.LAYOUT_AXES), decided by its length. NeMo-RL aligns the rows to the
padded sequence and fills the positions past the engine's routes (the final token, padding) with the
placeholder route 0, 1, ..., K-1 in every layer, and the rows of dense layers with it too: those are read
as missing, not as routes.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import numpy as np
import torch

from moe_lab.formats.layers import LAYOUT_AXES, layer_map
from moe_lab.formats.routes import Routes, decode

PREFIX = "nrlre1"
DTYPES = ("int8", "int16", "int32")  # NeMo-RL's wire dtypes (signed: -1 must be representable)
_ENVELOPE = re.compile(rf"^{PREFIX}:([a-z0-9]+):(\d+)x(\d+)x(\d+):([A-Za-z0-9+/=_-]*)$")


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


def placeholder_route(k: int) -> torch.Tensor:
    """The route NeMo-RL writes where it has none: experts 0, 1, ..., k-1."""
    return torch.arange(k)


def _placeholder_SA(rows_SAK: torch.Tensor) -> torch.Tensor:
    """(position, layer row) cells holding NeMo-RL's placeholder route."""
    K = rows_SAK.shape[2]
    return (rows_SAK == placeholder_route(K)).all(-1) if K > 1 else torch.zeros(rows_SAK.shape[:2], dtype=torch.bool)


def decode_nemo_rl(envelope: str, *, config: Any, num_tokens: int | None = None, layers: str = "auto") -> Routes:
    """The envelope -> Routes. NeMo-RL's placeholder route is "no route" where NeMo-RL writes it: in the rows
    of layers the config says are not MoE (dense, MTP) and in the trailing positions past the engine's routes
    (the final token, padding) - there in every layer."""
    rows = parse_envelope(envelope)
    lmap = layer_map(config, rows.shape[1], layers, allowed=LAYOUT_AXES["nemo_rl"])
    held = _placeholder_SA(rows)
    if rows.shape[0] and rows.shape[2] > 1:
        rows = rows.clone()
        dropped = list(lmap.dropped)
        rows[:, dropped] = rows[:, dropped].masked_fill(held[:, dropped, None], -1)
        tail = int(held.all(1).flip(0).long().cumprod(0).sum())  # trailing positions placeholder in every layer
        rows[rows.shape[0] - tail:] = -1
    return decode(rows, config, num_tokens=num_tokens, layers=lmap.kind, layout="nemo_rl")
