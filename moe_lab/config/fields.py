"""One config field: its declaration (``param``: help text, allowed values, bounds), its check, the line that
names what is allowed, and a walk over a nested config's fields. Apart from moe_lab.config (the dataclasses and the
cross-field checks) so that each stays small; no torch."""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import field
from typing import Any

from moe_lab.config.errors import ConfigError

FLOAT32_MAX = 3.4028234663852886e38

_HASHED = object()  # param(unhashed=...) unset: the field is always part of the cold-start cache key


def param(default: Any, help: str, *, choices: tuple | None = None, ge: float | None = None,
          gt: float | None = None, le: float | None = None, lt: float | None = None, unhashed: Any = _HASHED) -> Any:
    """A dataclass field with its help text and allowed values (read by validate() and the docs). ``unhashed``: the
    value at which the cold-start cache key leaves the field out, the one that cold starts committed before the field
    existed ran with (their keys stay valid): the field's history, not its default."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if unhashed is not _HASHED:
        meta["unhashed"] = unhashed
    if isinstance(default, list):
        meta["is_list"] = True  # choices then constrain every element
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(type_ok(v, typing.get_args(tp)[0]) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def allowed(meta: dict) -> str:
    if meta.get("choices"):
        return ("a list of " if meta.get("is_list") else "one of ") + ", ".join(map(str, meta["choices"]))
    parts = [f"{op} {meta[k]}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if meta.get(k) is not None]
    return " and ".join(parts) or "any value of the declared type"


def check_field(name: str, value: Any, tp: Any, meta: dict, why: str = "") -> None:
    """Refuse ``value`` outside the field's declared type, choices and bounds; ``why``: where the bounds come
    from when not the field's own (an objective's), said in the error."""
    if not type_ok(value, tp):
        raise ConfigError(f"{name}: expected {tp}, got {value!r}")
    if value is None:
        return
    if isinstance(value, list):
        bad = [v for v in value if meta.get("choices") and v not in meta["choices"]]
        if bad:
            raise ConfigError(f"{name}={value!r}: {bad[0]!r} is not allowed: allowed {allowed(meta)}")
        return
    if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        # training is fp32: a larger value is inf there and fails only after the cold start
        raise ConfigError(f"{name}={value!r} is out of range: allowed a finite float32 number ({allowed(meta)})")
    bad = (meta.get("choices") and value not in meta["choices"]) \
        or (meta.get("ge") is not None and value < meta["ge"]) or (meta.get("gt") is not None and value <= meta["gt"]) \
        or (meta.get("le") is not None and value > meta["le"]) or (meta.get("lt") is not None and value >= meta["lt"])
    if bad:
        raise ConfigError(f"{name}={value!r} is out of range{why}: allowed {allowed(meta)}")


# resolving string annotations costs ~0.3 ms a class, and `moe-lab list` validates ~1000 cells of 8 classes each
hints = functools.cache(typing.get_type_hints)


def walk(cfg: Any, prefix: str = ""):
    field_hints = hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from walk(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value, field_hints[f.name], dict(f.metadata)
