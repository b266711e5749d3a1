"""The runner's schedule: seed by seed, so an experiment stopped part-way holds the same seeds in every arm."""

from __future__ import annotations

from moe_lab.cli import read_experiment
from moe_lab.launch.runner import run_experiment


class RecordingBackend:
    """A backend at the runner's seam: records the order it is handed the cells in, trains nothing."""

    def __init__(self):
        self.order: list[str] = []

    def describe(self) -> str:
        return "recording backend"

    def run(self, todo, runs_dir, setups, progress):
        self.order = [c.run_id for c in todo]
        return {c.run_id: "done" for c in todo}


def test_cells_are_handed_out_seed_by_seed_every_arm_of_a_seed_together(tmp_path):
    exp = {**read_experiment("golden"), "seeds": [3, 1, 2]}
    backend = RecordingBackend()
    run_experiment(exp, tmp_path / "out", backend=backend, progress=False, echo=lambda *_: None)
    assert backend.order == [f"{arm}-s{seed}" for seed in (3, 1, 2) for arm in ("grpo", "grpo_r3")]
