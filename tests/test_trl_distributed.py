"""MoEGRPOTrainer in a 2-process run (torchrun, gloo on CPU): replay holds on every rank, and the logged metrics
are the ranks' values combined as moe_lab declares them (token means weighted by tokens, the token-ratio
variance by the law of total variance), recomputed here from each rank's own values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
WORKER = """
import json, sys, tempfile, pathlib, torch
sys.path.insert(0, {tests!r})
import test_trl_integration as T
from moe_lab.integrations import metric_row
seen = []
combine = metric_row.combine_parts
def spying(parts):  # every rank's parts (gathered) and what they combine to
    out = combine(parts)
    seen.append(dict(parts=parts, out=out))
    return out
metric_row.combine_parts = spying
t = T.trainer(pathlib.Path(tempfile.mkdtemp()), "qwen3_moe", "old", learning_rate=0.5, max_steps=2)
spy = T.run(t)
equal = all(torch.equal(o[:, m], u[:, m]) for o, u, m in T.old_vs_loss(spy))
rank = t.accelerator.process_index
pathlib.Path({out!r}, f"rank{{rank}}.json").write_text(json.dumps(dict(
    world=t.accelerator.num_processes, equal=equal, seen=seen, log=t.state.log_history)))
"""


@pytest.mark.slow
def test_two_processes_replay_on_each_rank_and_combine_as_declared(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(ROOT / "tests"), out=str(tmp_path)))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["world"] == 2 and r["equal"] for r in ranks)
    for step in ranks[0]["seen"]:
        parts, out = step["parts"], step["out"]
        assert len(parts) == 2 and parts[0] != parts[1]
        n = [p[2] for p in parts]
        for key in ("routing/expert_change_latent", "ratio/token_mean", "mismatch/abs_diff"):
            assert out[key] == pytest.approx((parts[0][0][key] * n[0] + parts[1][0][key] * n[1]) / sum(n), rel=1e-9)
        mean = out["ratio/token_mean"]
        var = sum(p[0]["ratio/token_var"] * w + (p[0]["ratio/token_mean"] - mean) ** 2 * w
                  for p, w in zip(parts, n)) / sum(n)
        assert out["ratio/token_var"] == pytest.approx(var, rel=1e-9)
    logged = [row for row in ranks[0]["log"] if "routing/expert_change_latent" in row]
    assert [row["routing/expert_change_latent"] for row in logged] == pytest.approx(
        [s["out"]["routing/expert_change_latent"] for s in ranks[0]["seen"]])
