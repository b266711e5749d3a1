"""The user-facing pieces around MoEGRPOTrainer: the quick start of docs/trl.md runs as written; the example with
a model from AutoModelForCausalLM and a tokenizer built locally runs R3 and prints the metrics; the
trainer_state.json plot reads the routing columns it draws."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from moe_lab.integrations import trainer_state_plot as TSP  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_transformers_model_example_runs_r3_and_prints_the_metrics(tmp_path):
    plot = tmp_path / "routing.png"
    done = subprocess.run([sys.executable, "examples/trl_transformers_model.py", "--steps", "8", "--plot", str(plot)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MPLCONFIGDIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    table = done.stdout[done.stdout.index("routing_replay=rollout"):].splitlines()
    assert table[1].split()[:3] == ["step", "reward", "latent_chg"]
    assert [line.split()[0] for line in table[2:4]] == ["4", "8"]
    values = [float(v) for v in table[2].split()[1:]]
    assert 0 < values[2] and 0 < values[3] <= 1  # router shift moved, confidence a probability
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def quick_start() -> str:
    """The first Python block of docs/trl.md: the quick start, which the docs say runs as written."""
    text = (ROOT / "docs" / "trl.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_quick_start_in_the_docs_runs_as_written_on_cpu_and_moves_routing(tmp_path):
    (tmp_path / "quickstart.py").write_text(quick_start())
    done = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    table = done.stdout[done.stdout.index("step  reward  latent_change  router_shift"):].splitlines()[1:]
    rows = [[float(v) for v in line.split()] for line in table]
    assert [int(r[0]) for r in rows] == [4, 8, 12, 16]
    # R3 forces generation's experts; the router's own choice drifts from them within each generation
    assert all(0 < r[2] <= 1 and r[3] > 0 for r in rows)


def log_rows() -> list[dict]:
    return [{"step": 4, "loss": 0.1, "routing/layer_1/expert_change": 0.0, "routing/layer_3/expert_change": 0.25,
             "routing/layer_1/router_shift": 0.5, "routing/layer_3/router_shift": 0.125, "mismatch/k3": 1e-4,
             "routing/expert_change_latent": 0.2},
            {"step": 8, "routing/layer_1/expert_change": 0.5, "routing/layer_3/expert_change": 0.75,
             "routing/layer_1/router_shift": 0.25, "routing/layer_3/router_shift": 0.0625, "mismatch/k3": 2e-4,
             "routing/expert_change_latent": 0.1},
            {"step": 8, "train_runtime": 1.0}]


def test_the_plot_reads_each_routing_column_over_steps_and_writes_an_image(tmp_path):
    cols = TSP.series(log_rows())
    assert cols["routing/layer_3/expert_change"] == ([4, 8], [0.25, 0.75])
    assert cols["mismatch/k3"] == ([4, 8], [1e-4, 2e-4]) and "loss" not in cols and "train_runtime" not in cols
    ckpt = tmp_path / "checkpoint-8"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"log_history": log_rows()}))
    assert TSP.main([str(ckpt)]) == 0
    assert (ckpt / "routing.png").read_bytes()[:4] == b"\x89PNG"


def test_the_plot_refuses_a_log_without_routing_columns_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="no routing/layer_<i>/\\* or mismatch/k3 columns"):
        TSP.draw([{"step": 1, "loss": 0.3}], tmp_path / "x.png")
    with pytest.raises(ValueError, match="no trainer_state.json there"):
        TSP.read_log(tmp_path)


def test_the_callback_writes_the_plot_into_the_output_folder_on_the_main_process(tmp_path):
    import types

    cb = TSP.RoutingPlotCallback()
    for main, folder in ((True, tmp_path / "main"), (False, tmp_path / "other")):
        folder.mkdir()
        state = types.SimpleNamespace(is_world_process_zero=main, log_history=log_rows())
        cb.on_train_end(types.SimpleNamespace(output_dir=str(folder)), state, None)
        assert (folder / "routing.png").exists() == main
