"""prime-rl's routed experts: ``{"data": <base64>, "shape": [S, L, K], "start": <int>, "dtype": "uint8"|"uint16"}``
(docs/traces.md, "prime-rl").

The bytes are the C-order ids [S positions, L layers, K top_k]; ``start`` is the first position the rows cover.
Unsigned ids cannot say -1: a missing route is an all-zero row, as in vLLM's buffer.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
import torch

from moe_lab.formats.routes import Routes, decode

DTYPES = ("uint8", "uint16", "int16", "int32")
KEYS = ("data", "shape")


def is_prime_rl(value: Any) -> bool:
    return isinstance(value, dict) and all(k in value for k in KEYS)


def _rows(value: dict, what: str) -> torch.Tensor:
    dtype, shape = value.get("dtype", "uint8"), value.get("shape")
    if dtype not in DTYPES:
        raise ValueError(f"{what}.dtype={dtype!r}; allowed {', '.join(DTYPES)}")
    if not (isinstance(shape, (list, tuple)) and len(shape) == 3 and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise ValueError(f"{what}.shape={shape!r}; expected [positions, layers, top_k] of ints >= 0")
    try:
        raw = base64.b64decode(value["data"], validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValueError(f"{what}.data: not valid base64") from None
    want = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if len(raw) != want:
        raise ValueError(f"{what}: shape {shape} of {dtype} needs {want} bytes, data has {len(raw)}")
    return torch.from_numpy(np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).astype(np.int64)
                            .reshape(shape))


def decode_prime_rl(value: dict, *, config: Any, num_tokens: int | None = None, layers: str = "auto") -> Routes:
    what = "routed_experts"
    start = value.get("start", 0)
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"{what}.start={start!r}; allowed an int >= 0")
    return decode(_rows(value, what), config, start=start, num_tokens=num_tokens, layers=layers,
                  layout="prime_rl", what=what)
