"""The analysis notebooks: in sync with their generator, outputs cleared, and they execute end to end.

They run against a synthetic reference (MOE_LAB_RESULTS) always, and against the repository's
results/reference once it exists. The kernel is "python3", which jupyter_client launches with this
interpreter (sys.executable), so the notebooks see the same environment as the tests.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest
from synthetic import write_reference

from moe_lab.analysis import results

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
REFERENCE = REPO / "results" / "reference"
CELL_TIMEOUT_S = 60


def load_generator():
    spec = importlib.util.spec_from_file_location("make_notebooks", NOTEBOOKS / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = load_generator()
NAMES = sorted(GENERATOR.NOTEBOOKS)


def test_every_notebook_matches_its_generator_with_outputs_cleared():
    assert NAMES == sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) and len(NAMES) == 7
    for name, built in GENERATOR.build_all().items():
        on_disk = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(on_disk)
        assert [(c.cell_type, c.source) for c in on_disk.cells] == [(c.cell_type, c.source) for c in built.cells], \
            f"{name} differs from notebooks/make_notebooks.py: rerun it"
        code = [c for c in on_disk.cells if c.cell_type == "code"]
        assert all(c.outputs == [] and c.execution_count is None for c in code)


def execute(name: str) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def check_outputs(nb: nbformat.NotebookNode) -> None:
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(o.output_type != "error" for c in code for o in c.outputs)
    figure_cells = [c for c in code if any(c.source.startswith(m) or f"\n{m}" in c.source
                                           for m in ("plots.", "stability_plots.", "replay_plots.",
                                                    "endpoint_plots."))]
    assert figure_cells
    for cell in figure_cells:  # every figure cell really drew a figure
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), cell.source


@pytest.fixture(scope="module")
def synthetic_reference(tmp_path_factory):
    return write_reference(tmp_path_factory.mktemp("reference"), seeds=(0, 1))


@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_on_synthetic_reference(name, synthetic_reference, monkeypatch):
    monkeypatch.setenv(results.ENV_RESULTS, str(synthetic_reference))
    nb = execute(name)
    check_outputs(nb)
    assert str(synthetic_reference) in nb.cells[1].outputs[0]["text"]  # read what we pointed it at


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="results/reference not generated yet (see results/README.md)")
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_on_repository_reference(name, monkeypatch):
    monkeypatch.delenv(results.ENV_RESULTS, raising=False)
    nb = execute(name)
    check_outputs(nb)
    assert str(REFERENCE) in nb.cells[1].outputs[0]["text"]
