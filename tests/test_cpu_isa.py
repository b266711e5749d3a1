"""moe-lab run --cpu-isa: the kernels pinned for the whole invocation (it re-executes itself with the pins set),
recorded in every manifest, with a cold start of its own; bad values refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from moe_lab.config import apply_overrides, from_dict, load_yaml, validate
from moe_lab.launch.isa import PINS
from moe_lab.rl.coldstart import cache_key

ROOT = Path(__file__).resolve().parents[1]
SMOKE = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
UNPINNED = {k: v for k, v in os.environ.items() if k not in PINS["avx2"]}


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**UNPINNED, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "moe_lab.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs an AVX2 CPU")
def test_a_pinned_run_records_its_pins_and_cold_starts_apart(tmp_path, monkeypatch):
    base = apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.steps=1"])
    exp = tmp_path / "one.yaml"
    exp.write_text(yaml.safe_dump({"name": "one", "base": base, "arms": {"grpo": {}}, "seeds": [0]}), encoding="utf-8")
    proc = cli("run", str(exp), "--out", str(tmp_path / "out"), "--no-progress", "--jobs", "1", "--cpu-isa", "avx2")
    assert proc.returncode == 0, proc.stderr
    machine = json.loads((tmp_path / "out" / "runs" / "grpo-s0" / "manifest.json").read_text())["machine"]
    assert machine["cpu_capability"] == "AVX2" and machine["env"] == PINS["avx2"]
    cfg = validate(from_dict(base))
    for key, value in PINS["avx2"].items():
        monkeypatch.setenv(key, value)
    pinned = cache_key(cfg)
    for key in PINS["avx2"]:
        monkeypatch.delenv(key)
    assert pinned != cache_key(cfg)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()) == [pinned]


def test_an_unknown_isa_is_refused_in_one_line(tmp_path):
    proc = cli("run", "smoke", "--out", str(tmp_path / "out"), "--cpu-isa", "sse4")
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert proc.stderr.strip() == "moe-lab: error: --cpu-isa=sse4: allowed avx2, avx512"
