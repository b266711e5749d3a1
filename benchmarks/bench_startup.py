"""CLI start-up: `moe-lab --help`, `moe-lab list` and `moe-lab config` against `python -c "import torch"`
(prints figures; not a test).

Each command runs as a fresh process, the commands interleaved round by round (the machine is shared: the
interleaving spreads its load over all of them); prints each one's median wall time, its excess over
`import torch` and the ratio. `import moe_lab.rl.loop` (what every training process loads: transformers'
modeling code) is timed beside them for scale.

    python benchmarks/bench_startup.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "import torch": ["-c", "import torch"],
    "moe-lab --help": ["-m", "moe_lab.cli", "--help"],
    "moe-lab list": ["-m", "moe_lab.cli", "list"],
    "moe-lab config": ["-m", "moe_lab.cli", "config"],
    "import moe_lab.rl.loop": ["-c", "import moe_lab.rl.loop"],
}


def wall_s(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, cmd in COMMANDS.items():
            times[name].append(wall_s(cmd))
    base = statistics.median(times["import torch"])
    print(f"{'command':<24} {'median s':>8} {'- torch s':>9} {'/ torch':>7}   ({args.repeats} interleaved repeats)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<24} {med:8.2f} {med - base:9.2f} {med / base:7.2f}")


if __name__ == "__main__":
    main()
