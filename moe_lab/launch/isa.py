"""``moe-lab run/reproduce --cpu-isa ISA``: pin the CPU kernels for the whole invocation (docs/guide.md, "Results
that depend on the machine"). A pinned run repeats itself bit for bit on one machine and differs from an unpinned
one; it does not make the bits processor-independent: MKL and oneDNN still choose code paths by processor model
(the main job's cold start pinned to avx2: 195 supervised steps on an AMD EPYC, 230 on an Intel Xeon).

PyTorch (ATen), MKL and oneDNN pick their code paths once per process, at their first use, from the processor
and these environment variables: they must be set before torch does any work, so the CLI re-executes itself
with them set (the spawned workers inherit them) instead of setting them in a process that already computed.
The pin costs time (measured ~1.5x per RL step and 3.7-4.3x for a cold start here, benchmarks/bench_isa.py), so
it is a choice, not the default. A pinned invocation cold-starts into its own cache entry
(moe_lab.rl.coldstart.cache_key hashes the pins).
"""

from __future__ import annotations

import os
import sys

from moe_lab.config import ConfigError

# what each choice sets: ATen's kernels, MKL's conditional numerical reproducibility branch, oneDNN's ISA cap
PINS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
}


def pin_or_reexec(isa: str | None, argv: list[str]) -> None:
    """Nothing when ``isa`` is None or already in force; else re-execute this command with the pins set (does not
    return). Refuses, in one line, an unknown ISA or one the processor does not offer (checked once pinned)."""
    if isa is None:
        return
    if isa not in PINS:
        raise ConfigError(f"--cpu-isa={isa}: allowed {', '.join(PINS)}")
    pins = PINS[isa]
    if any(os.environ.get(k) != v for k, v in pins.items()):
        os.execve(sys.executable, [sys.executable, "-m", "moe_lab.cli", *argv], {**os.environ, **pins})
    import torch

    got = torch.backends.cpu.get_cpu_capability()
    if got.lower() != isa:
        raise ConfigError(f"--cpu-isa={isa}: this processor runs torch's {got} kernels, not {isa.upper()}; "
                          f"choose an ISA it offers (allowed: {', '.join(PINS)})")
