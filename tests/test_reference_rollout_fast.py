"""results/reference/rollout_fast, the committed reference cell of rl.rollout_kernels=batch_variant_fast: its runs
are rollout_mismatch's cells of model.seed 606 under the fast emulation and a shorter schedule, begun from the same
cold start (the same weights, by digest), so that the two references differ in the emulation, not the model."""

from __future__ import annotations

from pathlib import Path

from moe_lab.analysis.tables import flatten
from moe_lab.audit import verify
from moe_lab.rl.coldstart_recipe import read_recipe, weights_digest
from moe_lab.store.run_folder import ResultsFolder

ROOT = Path(__file__).resolve().parents[1]
FAST = ROOT / "results" / "reference" / "rollout_fast"
MISMATCH = ROOT / "results" / "reference" / "rollout_mismatch"
# what the fast reference changes in rollout_mismatch's cells (experiments/rollout_fast.yaml): the emulation, and a
# schedule short enough for `moe-lab verify`
CHANGED = {"rl.rollout_kernels", "rl.steps", "rl.eval_every"}


def test_each_cell_is_a_rollout_mismatch_cell_with_the_fast_emulation():
    runs = verify.load_reference(FAST)
    assert len(verify.choose_cells(runs, verify.DEFAULT_CELLS)) == len(runs) >= 2  # verify's default re-runs them all
    mismatch = {r.run_id: r for r in verify.load_reference(MISMATCH)}  # configs read as today's fields
    for run in runs:
        twin = mismatch[run.run_id]
        new, old = flatten(run.config), flatten(twin.config)
        assert {k for k in new.keys() | old.keys() if new.get(k) != old.get(k)} == CHANGED
        assert (new["rl.rollout_kernels"], old["rl.rollout_kernels"]) == ("batch_variant_fast", "batch_variant")


def test_its_cold_start_is_the_one_rollout_mismatch_committed():
    keys = {run.manifest["coldstart"]["key"] for run in verify.load_reference(FAST)}
    for key in keys:
        recipe = read_recipe(ResultsFolder(FAST), key)
        assert recipe is not None, f"{FAST}/coldstarts/{key}.json missing"
        assert recipe["digest"] == weights_digest(MISMATCH / "coldstarts" / key)
