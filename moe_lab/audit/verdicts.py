"""What `moe-lab verify` says of one re-run cell against its reference: the first differing row and column of
its tables, whether the machine (or the packages) differ from the recorded ones, and the cold start.

Bit-identical means every deterministic column equal bit for bit (NaN equal to NaN, -0.0 not equal to 0.0):
every column but the timings (``perf/*``: wall-clock seconds, the only columns that differ between two runs of
the same config on one machine, docs/metrics.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from moe_lab.store.cpuinfo import identity_differences, processor_name

TIMING_PREFIX = "perf/"
# the machine keys that change kernels besides the processor (runlog.machine_info)
SOFTWARE_KEYS = ("cpu_capability", "blas", "mkl", "mkldnn", "threads", "machine", "env")
# packages whose version changes numbers (moe_lab's own version is the code: reported, never an excuse)
PACKAGES = ("python", "torch", "transformers", "numpy", "safetensors")
UNKNOWN_PROCESSOR = "machine unknown (the manifest records no processor)"
UNKNOWN_MACHINE = "machine unknown (the manifest records no machine)"


@dataclass(frozen=True)
class Difference:
    """The first row (in table order) where the tables disagree, and how."""
    table: str
    step: int | None
    update: int | None
    column: str  # '' when the tables differ in length only
    reference: object
    rerun: object
    columns_differing: int = 0
    columns_compared: int = 0

    def describe(self) -> str:
        where = f"step {self.step}" + (f" (update {self.update})" if self.update is not None else "")
        if not self.column:
            return (f"first difference in {self.table} at {where}: the reference has "
                    f"{self.reference} rows there, the re-run {self.rerun}")
        return (f"first difference in {self.table} at RL {where}, column {self.column}: {_show(self.reference)} "
                f"(reference) vs {_show(self.rerun)} (re-run); {self.columns_differing} of "
                f"{self.columns_compared} columns differ in that row")


def _show(value: object) -> str:
    if isinstance(value, (float, np.floating)):
        return repr(float(value))  # shortest text that reads back to the same double
    if isinstance(value, (np.integer,)):
        return str(int(value))
    return repr(value)


def deterministic_columns(frame: pd.DataFrame) -> list[str]:
    return [c for c in frame.columns if not str(c).startswith(TIMING_PREFIX)]


def _equal(a: pd.Series, b: pd.Series) -> np.ndarray:
    """Elementwise bit equality of two columns of equal length (NaN == NaN; the sign of zero counts)."""
    x, y = a.to_numpy(), b.to_numpy()
    if pd.api.types.is_numeric_dtype(a) and pd.api.types.is_numeric_dtype(b):
        x, y = x.astype(float), y.astype(float)
        both_nan = np.isnan(x) & np.isnan(y)
        return both_nan | ((x == y) & (np.signbit(x) == np.signbit(y)))
    return np.array([(pd.isna(u) and pd.isna(v)) or (not pd.isna(u) and not pd.isna(v) and u == v)
                     for u, v in zip(x, y)], dtype=bool)


def first_difference(table: str, ref: pd.DataFrame, new: pd.DataFrame) -> Difference | None:
    """None when the two tables hold the same rows in their shared deterministic columns; else the first
    differing row (or the first row one table has and the other lacks)."""
    ref, new = ref.reset_index(drop=True), new.reset_index(drop=True)
    cols = [c for c in deterministic_columns(ref) if c in new.columns]
    n = min(len(ref), len(new))
    unequal = {c: ~_equal(ref[c].iloc[:n], new[c].iloc[:n]) for c in cols}
    rows = [int(np.argmax(u)) for u in unequal.values() if u.any()]
    if rows:
        i = min(rows)
        differing = [c for c in cols if unequal[c][i]]
        c = differing[0]
        return Difference(table, _get(ref, i, "step"), _get(ref, i, "update"), c, ref[c].iloc[i], new[c].iloc[i],
                          len(differing), len(cols))
    if len(ref) != len(new):
        longer = ref if len(ref) > len(new) else new
        step = _get(longer, n, "step")
        count = (lambda f: int((f["step"] == step).sum()) if "step" in f else len(f) - n)
        return Difference(table, step, None, "", count(ref), count(new))
    return None


def _get(frame: pd.DataFrame, i: int, col: str) -> int | None:
    if col not in frame or pd.isna(frame[col].iloc[i]):
        return None
    return int(frame[col].iloc[i])


def column_note(ref: pd.DataFrame, new: pd.DataFrame) -> str:
    """'' when both tables have the same deterministic columns; else which ones only one of them has (code
    that logs more, or less, than the reference's did: those columns are not compared)."""
    a, b = set(deterministic_columns(ref)), set(deterministic_columns(new))
    parts = [f"only in the reference: {', '.join(sorted(a - b))}" if a - b else "",
             f"only in the re-run: {', '.join(sorted(b - a))}" if b - a else ""]
    return "; ".join(p for p in parts if p)


def machine_state(recorded: dict, current: dict) -> tuple[str, str]:
    """('same' | 'differs' | 'unknown', text): the re-run's manifest against the reference's, on the machine
    (processor where recorded, else the kernels and pins) and the package versions."""
    ref_m, new_m = recorded.get("machine"), current.get("machine") or {}
    reasons = [f"{k}: {ref_m.get(k)!r} vs {new_m.get(k)!r}" for k in SOFTWARE_KEYS
               if ref_m and ref_m.get(k) != new_m.get(k)]
    if ref_m and "cpu" in ref_m:
        reasons += identity_differences(ref_m["cpu"] or {}, new_m.get("cpu") or {})
    ref_v, new_v = recorded.get("versions") or {}, current.get("versions") or {}
    packages = [f"{p} {ref_v[p]} vs {new_v.get(p)}" for p in PACKAGES if p in ref_v and ref_v[p] != new_v.get(p)]
    parts = [f"machine differs from the recorded one ({'; '.join(reasons)})" if reasons else "",
             f"packages differ from the recorded ones ({'; '.join(packages)})" if packages else ""]
    if reasons or packages:
        return "differs", "; ".join(p for p in parts if p)
    if not ref_m:
        return "unknown", UNKNOWN_MACHINE
    if "cpu" not in ref_m:
        return "unknown", UNKNOWN_PROCESSOR
    return "same", f"same machine as recorded ({processor_name(ref_m['cpu'])})"


def coldstart_text(recorded: dict, current: dict) -> str:
    """The cold start's supervised step count against the reference's (manifest ``coldstart.steps``)."""
    ref = (recorded.get("coldstart") or {}).get("steps")
    new = (current.get("coldstart") or {}).get("steps")
    if new is None:
        return "cold start steps unknown"
    if ref is None:
        return f"cold start {new} supervised steps (the reference did not record its own)"
    if ref == new:
        return f"cold start {new} supervised steps, as recorded"
    return f"cold start {new} supervised steps against the reference's {ref}"


def endpoint_text(value: float, spread: list[float], arm: str, metric: str) -> str:
    """Whether the re-run's primary endpoint lies within the reference arm's seed spread (min..max)."""
    finite = [v for v in spread if not math.isnan(v)]
    if math.isnan(value) or not finite:
        return f"primary endpoint {metric}: not available"
    lo, hi = min(finite), max(finite)
    where = "within" if lo <= value <= hi else "outside"
    return (f"primary endpoint {metric} {value:.4g} {where} the reference's {arm} seed spread "
            f"{lo:.4g}..{hi:.4g} ({len(finite)} seeds)")
