"""Which processor a run ran on: the part of ``runlog.machine_info`` that names the chip (``machine["cpu"]``).

MKL and oneDNN choose their code paths by processor model as well as by instruction set, so two machines with
the same ``cpu_capability`` can give different bits; without the processor in the manifest nobody can tell
from a reference why it does not reproduce. Read from /proc/cpuinfo (Linux; ``lscpu`` may be
missing), else from ``platform`` (macOS, Windows: vendor and model name only, no flags).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
# The instruction-set extensions that decide which kernels ATen, MKL and oneDNN run (x86: /proc's "flags";
# arm64: its "Features"). A fixed list, so the record is comparable across kernels and short to read.
KERNEL_FLAGS = ("sse4_1", "sse4_2", "avx", "f16c", "fma", "avx2", "avx512f", "avx512dq", "avx512cd", "avx512bw",
                "avx512vl", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
                "asimd", "asimddp", "sve", "sve2", "bf16", "i8mm")
# /proc/cpuinfo key -> record key (x86 first, then arm64's names for the same things)
FIELDS = {"vendor_id": "vendor", "model name": "model_name", "cpu family": "family", "model": "model",
          "stepping": "stepping", "CPU implementer": "vendor", "CPU part": "model", "CPU variant": "stepping"}
# the keys that identify the processor: two records differ as machines when one of these does
IDENTITY = ("vendor", "model_name", "family", "model", "stepping", "flags")


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """The first processor's block of /proc/cpuinfo as {vendor, model_name, family, model, stepping, flags}."""
    record: dict[str, Any] = {}
    flags: set[str] = set()
    for line in text.splitlines():
        if not line.strip():
            if record or flags:
                break  # one block is enough: the processors of one machine are alike
            continue
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key in FIELDS and FIELDS[key] not in record:
            record[FIELDS[key]] = value
        elif key in ("flags", "Features"):
            flags.update(value.split())
    if flags:
        record["flags"] = [f for f in KERNEL_FLAGS if f in flags]
    return record


@functools.lru_cache(maxsize=1)
def processor_info() -> dict[str, Any]:
    """vendor, model_name, family/model/stepping where known, flags (those of KERNEL_FLAGS present), source."""
    try:
        record = parse_cpuinfo(CPUINFO.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        record = {}
    if record.get("model_name") or record.get("flags"):
        return {**record, "source": str(CPUINFO)}
    # no /proc (macOS, Windows) or an unreadable one: what platform knows, no flags
    return {"vendor": None, "model_name": platform.processor() or platform.machine() or None,
            "source": "platform"}


def processor_name(cpu: dict) -> str:
    """'vendor model name' of a processor record, for a verdict line."""
    return " ".join(str(cpu[k]) for k in ("vendor", "model_name") if cpu.get(k)) or "processor unnamed"


def identity_differences(recorded: dict, current: dict) -> list[str]:
    """'key: recorded vs current' for each identifying key the two processor records disagree on."""
    out = []
    for key in IDENTITY:
        a, b = recorded.get(key), current.get(key)
        if a == b:
            continue
        if key == "flags" and isinstance(a, list) and isinstance(b, list):
            if set(a) == set(b):
                continue
            gone, new = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            out.append("flags: " + "; ".join(p for p in (gone and f"only recorded {' '.join(gone)}",
                                                         new and f"only here {' '.join(new)}") if p))
        else:
            out.append(f"{key}: {a!r} vs {b!r}")
    return out
