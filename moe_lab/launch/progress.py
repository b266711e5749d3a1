"""`moe-lab progress RESULTS_DIR`: how far a (resumable) experiment has got, without unblinding it.

A long experiment runs over several sessions, and its analysis is fixed before the first run (docs/findings.md);
looking at part of its results is what that rule forbids. So this command reads only what the runner
bookkeeps — each cell's state as the runner sees it (moe_lab/store/run_folder.py: a run counts as finished only when
its tables hold the rows it committed), its steps done, its wall time and the pid in its `.lock` — and never
an endpoint: a collapsed run counts as finished like a done one (the collapse rate is the tertiary endpoint),
and the pace is pooled over all finished runs, never per arm (a collapsed run stops early, so wall time per arm
would leak it).

Exit codes: 0 every cell finished; 1 some cell has not (not started, running, stopped, interrupted,
failed or unverified); 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from moe_lab.config import ConfigError, dump_yaml
from moe_lab.launch.coldstart_origin import mixed_notes
from moe_lab.launch.experiment import Cell
from moe_lab.launch.spec import Experiment, parse_experiment
from moe_lab.store.run_folder import ResultsFolder, RunFolder, as_results
from moe_lab.store.status import (CELL_CONFLICT, CELL_DONE, PROGRESS_CONFLICT, PROGRESS_FINISHED, PROGRESS_NEW,
                                  PROGRESS_STATES, STATUS_FAILED, STATUS_INTERRUPTED, STATUS_RUNNING, STATUS_STOPPED,
                                  STATUS_UNVERIFIED)

# the states a cell can be in, in the order they are printed (declared in runlog with every status word): the runner's
# (run_folder.CELL_STATES) in words, its 'resume' told apart by what the manifest and the .lock say ('unverified': the
# manifest says finished, but the tables do not hold the rows the run committed, so the runner runs it again)
STATES = PROGRESS_STATES
# why a cell in each of these states is not finished, printed after its line
WHY = {STATUS_STOPPED: "no live process holds it: the runner resumes it from its last checkpoint",
       STATUS_UNVERIFIED: "its manifest says finished, but its tables do not hold the rows it committed: "
                          "the runner runs it again",
       PROGRESS_CONFLICT: "its folder holds a run of another config: the runner refuses it without --overwrite"}
# the states listed one line per cell
LISTED = (STATUS_FAILED, STATUS_INTERRUPTED, STATUS_STOPPED, STATUS_UNVERIFIED, PROGRESS_CONFLICT)


@dataclass(frozen=True)
class CellProgress:
    run_id: str
    arm: str
    block: object
    """the cell's block value (e.g. its model.seed), None without `blocks:`"""
    state: str
    """one of STATES; 'running' = its manifest says running and the pid in its .lock is alive, 'stopped' = it
    says running but no live process holds it (the runner was killed: it resumes from its last checkpoint)"""
    steps_done: int
    steps: int
    wall_s: float
    pid: int | None


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("progress", help="how far a results folder's experiment has got: finished, running and "
                                        "remaining runs per arm and block, and the time left (no endpoint)")
    p.add_argument("results", metavar="RESULTS_DIR", help="the --out folder of `moe-lab run`")
    p.add_argument("--jobs", type=int, default=None,
                   help="workers to assume for the time left (default: the live runs' count, else 1)")
    return p


def cell_progress(cell: Cell, run_dir: Path, block: object) -> CellProgress:
    folder = RunFolder(run_dir)
    runner = folder.cell_state(dump_yaml(cell.config))
    status = folder.status
    pid = folder.live_pid() if status == STATUS_RUNNING else None
    if runner == CELL_CONFLICT:  # the runner refuses it without --overwrite
        state = PROGRESS_CONFLICT
    elif runner == CELL_DONE:
        state = PROGRESS_FINISHED
    elif status == STATUS_RUNNING:
        state = STATUS_RUNNING if pid else STATUS_STOPPED
    elif status in (STATUS_INTERRUPTED, STATUS_FAILED):
        state = status
    elif folder.verified_status() == STATUS_UNVERIFIED:
        state = STATUS_UNVERIFIED
    else:
        state = PROGRESS_NEW
    steps_done = int(folder.manifest.get("steps_done", 0)) if state == PROGRESS_FINISHED else folder.steps_logged()
    return CellProgress(cell.run_id, cell.arm, block, state, steps_done, cell.config.rl.steps,
                        float(folder.manifest.get("wall_s", 0.0)), pid)


def collect(results: Path | ResultsFolder) -> tuple[Experiment, list[CellProgress]]:
    """(the experiment, one CellProgress per cell in running order); ConfigError names a bad folder."""
    folder = as_results(results)
    exp = folder.experiment()
    if exp is None:
        raise ConfigError(f"RESULTS_DIR={folder.path}: no {folder.experiment_path.name} (not an output folder of "
                          "`moe-lab run`)")
    exp = parse_experiment(exp)
    blocks = exp.blocks
    block_of = {s: v for v, seeds in blocks.seeds.items() for s in seeds} if blocks else {}
    cells = exp.cells()
    return exp, [cell_progress(c, folder.run(c.run_id).path, block_of.get(c.seed)) for c in cells]


def finished_of(results: Path | ResultsFolder) -> tuple[Experiment, int, int] | None:
    """(the experiment, runs finished, runs in all: never-started cells included, which the tables cannot see),
    or None for a folder without the runner's experiment.yaml (nothing to count against)."""
    try:
        exp, cells = collect(results)
    except ConfigError:
        return None
    return exp, sum(c.state == PROGRESS_FINISHED for c in cells), len(cells)


def time_left(cells: list[CellProgress], jobs: int) -> tuple[float, float] | None:
    """(seconds per RL step pooled over the finished runs, hours left at ``jobs`` workers) or None before any
    run finished. Unfinished runs are counted at full length: collapsed ones stop early, so it is an upper
    bound."""
    done = [c for c in cells if c.state == PROGRESS_FINISHED]
    steps = sum(c.steps_done for c in done)
    if not steps:
        return None
    per_step = sum(c.wall_s for c in done) / steps
    left = sum(max(c.steps - c.steps_done, 0) for c in cells if c.state != PROGRESS_FINISHED)
    return per_step, per_step * left / max(jobs, 1) / 3600


def _grid(cells: list[CellProgress]) -> list[str]:
    """Finished / total per arm (rows) and block (columns)."""
    blocks = list(dict.fromkeys(c.block for c in cells))
    arms = list(dict.fromkeys(c.arm for c in cells))
    width = max(len(a) for a in arms)
    head = "arm".ljust(width) + "".join(f"  {'all' if b is None else b!s:>7}" for b in blocks)
    lines = [head]
    for arm in arms:
        row = arm.ljust(width)
        for b in blocks:
            mine = [c for c in cells if c.arm == arm and c.block == b]
            row += f"  {sum(c.state == PROGRESS_FINISHED for c in mine):>3}/{len(mine):<3}"
        lines.append(row.rstrip())
    return lines


def report(results: Path, exp: Experiment, cells: list[CellProgress], jobs: int | None) -> list[str]:
    counts = {s: sum(c.state == s for c in cells) for s in STATES}
    live = sorted(c.pid for c in cells if c.state == STATUS_RUNNING)
    name = exp.name or results.name
    lines = [f"{name}: {len(cells)} runs: "
             + ", ".join(f"{n} {s}" for s, n in counts.items() if n or s == PROGRESS_FINISHED)]
    if live:
        lines.append("running now (pid): " + ", ".join(f"{c.run_id} ({c.pid}, step {c.steps_done}/{c.steps})"
                                                         for c in cells if c.state == STATUS_RUNNING))
    blocks = exp.blocks
    lines.append("finished per arm" + (f" and {blocks.field}" if blocks else "") + ":")
    lines += ["  " + line for line in _grid(cells)]
    for c in cells:
        if c.state in LISTED:
            lines.append(f"{c.run_id}: {c.state} at step {c.steps_done}/{c.steps}"
                         + (f" ({WHY[c.state]})" if c.state in WHY else ""))
    workers = jobs or len(live) or 1
    pace = time_left(cells, workers)
    if pace and counts[PROGRESS_FINISHED] < len(cells):
        per_step, hours = pace
        lines.append(f"pace {per_step:.2f} s per RL step (finished runs, all arms pooled): at most {hours:.1f} h "
                     f"left with {workers} worker(s)")
    if counts[PROGRESS_FINISHED] < len(cells) and not live:
        lines.append(f"resume: moe-lab run {ResultsFolder(results).experiment_path} --out {results}")
    return lines


def main(args) -> int:
    results = Path(args.results).expanduser()
    try:
        if args.jobs is not None and args.jobs < 1:
            raise ConfigError(f"--jobs={args.jobs}: allowed an integer >= 1")
        folder = ResultsFolder(results)
        exp, cells = collect(folder)
    except ConfigError as exc:
        print(f"moe-lab progress: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print("\n".join(report(results, exp, cells, args.jobs) + mixed_notes(folder.runs_dir)))
    return 0 if all(c.state == PROGRESS_FINISHED for c in cells) else 1
