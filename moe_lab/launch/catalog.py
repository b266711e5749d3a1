"""`moe-lab list`: every built-in experiment (experiments/*.yaml, shipped as ``moe_lab.experiments``) with its
description's first sentence, its number of cells and a runtime measured on 2 cores.

Nothing here is a hand-kept list: the names are the package's YAML files, the cell count is
``experiment.expand`` (arms x points x seeds, or arms x distinct factor levels x seeds), and the runtime is
- ``reference``: derived from the committed reference of the same name (results/reference/<name>/, present in
  a checkout, not in a wheel) when its runs are exactly the experiment's cells: the runs' training wall time
  (manifest ``wall_s``, summed over each run's sessions) summed over runs and divided by the 2 workers that
  ran them on the 2-core machine. Cold starts and model loading are not in ``wall_s``: a run from an empty
  cold-start cache takes about a minute more per distinct setup;
- ``yaml``: else the experiment's ``minutes_2cores:`` field, a measurement written down by hand (where it was
  measured is said beside it in the YAML);
- ``not measured``: neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from moe_lab.config import load_yaml
from moe_lab.store.run_folder import ResultsFolder

if TYPE_CHECKING:
    from moe_lab.launch.spec import Experiment

BUILTIN = "moe_lab.experiments"
REFERENCE_DIR = Path(__file__).resolve().parents[2] / "results" / "reference"
WORKERS_2CORES = 2  # one thread per run (config `threads`), so a 2-core machine runs 2 cells at a time


def builtin_names() -> list[str]:
    """Names of the experiments shipped with the package: every experiments/*.yaml, sorted."""
    return sorted(p.name[:-len(".yaml")] for p in resources.files(BUILTIN).iterdir()
                  if p.name.endswith(".yaml") and p.is_file())


def first_sentence(text: str | None) -> str:
    """The description's first sentence, on one line (a period followed by a space and a capital ends it)."""
    flat = " ".join(str(text or "").split())
    return re.split(r"(?<=[.!?])\s+(?=[A-Z0-9])", flat, maxsplit=1)[0]


@dataclass(frozen=True)
class Runtime:
    minutes: float | None
    source: str  # 'reference', 'yaml' or 'not measured'
    detail: str = ""

    def __str__(self) -> str:
        if self.minutes is None:
            return "not measured"
        amount = f"{self.minutes:.0f} min" if self.minutes >= 1 else f"{self.minutes * 60:.0f} s"
        return f"{amount} ({self.source})"


def reference_minutes(run_ids: list[str], folder: Path) -> float | None:
    """Summed training wall time of the reference's runs / 2 workers, in minutes; None unless the folder's
    runs are exactly ``run_ids``, each finished as the runner sees it (RunFolder.finished), and every manifest
    records ``wall_s``."""
    results = ResultsFolder(folder)
    if not results.runs_dir.is_dir() or sorted(run.run_id for run in results.run_folders()) != sorted(run_ids):
        return None
    walls = []
    for run_id in run_ids:
        run = results.run(run_id)
        try:
            wall = run.manifest.get("wall_s") if run.finished() else None
        except (OSError, ValueError):
            return None
        if not isinstance(wall, (int, float)):
            return None
        walls.append(float(wall))
    return sum(walls) / WORKERS_2CORES / 60.0


def runtime(name: str, exp: Experiment, run_ids: list[str], reference_dir: Path = REFERENCE_DIR) -> Runtime:
    minutes = reference_minutes(run_ids, Path(reference_dir) / name)
    if minutes is not None:
        return Runtime(minutes, "reference", f"results/reference/{name}: sum of runs' wall_s / {WORKERS_2CORES}")
    if exp.minutes_2cores is not None:
        return Runtime(exp.minutes_2cores, "yaml", f"experiments/{name}.yaml minutes_2cores")
    return Runtime(None, "not measured")


@dataclass(frozen=True)
class Entry:
    name: str
    cells: int | None  # None: the file does not expand (its error is the description)
    runtime: Runtime
    description: str


def catalog(reference_dir: Path = REFERENCE_DIR) -> list[Entry]:
    """One entry per built-in experiment, in name order."""
    from moe_lab.launch.spec import parse_experiment

    entries = []
    for name in builtin_names():
        try:
            exp = parse_experiment(load_yaml(str(resources.files(BUILTIN).joinpath(f"{name}.yaml"))))
            run_ids = [c.run_id for c in exp.cells()]
        except ValueError as exc:  # one broken file must not hide the others: listed with its error
            entries.append(Entry(name, None, Runtime(None, "not measured"), f"invalid: {' '.join(str(exc).split())}"))
            continue
        entries.append(Entry(name, len(run_ids), runtime(name, exp, run_ids, reference_dir),
                             first_sentence(exp.description)))
    return entries


def format_catalog(entries: list[Entry]) -> str:
    width = max([len("experiment"), *(len(e.name) for e in entries)])
    lines = [f"{'experiment':<{width}}  {'cells':>5}  runtime on 2 cores"]
    for e in entries:
        lines.append(f"{e.name:<{width}}  {'?' if e.cells is None else e.cells:>5}  {e.runtime}")
        lines.append(f"{'':<{width}}  {'':>5}  {e.description}")
    lines.append("runtime: (reference) = the committed results/reference/<name>/ runs' training wall_s summed and "
                 f"divided by {WORKERS_2CORES} workers, cold starts excluded; (yaml) = the experiment's minutes_2cores "
                 "field, measured by hand")
    return "\n".join(lines)
