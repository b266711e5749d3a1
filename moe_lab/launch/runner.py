"""Run every cell of an experiment in worker processes: cold starts first, then the RL runs.

Finished cells are skipped, unfinished ones resume from their last checkpoint, and a folder that holds
a run of a different config is never overwritten unless asked.

Faults: a worker holds its run folder's lock (runlog.RunLock) for the whole run, so a second runner on the
same --out skips that cell with a message; workers exit when their parent dies (even by SIGKILL), and a
Ctrl-C stops every worker and marks the unfinished runs ``interrupted`` before KeyboardInterrupt goes on up.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml

from moe_lab.config import ConfigError, dump_yaml
from moe_lab.launch.experiment import Cell
from moe_lab.launch.spec import Experiment, parse_experiment
from moe_lab.launch.coldstart_origin import warmed_here_notes
from moe_lab.store.run_folder import ResultsFolder, RunFolder
from moe_lab.store.runlog import RunLock, RunLocked
from moe_lab.store.status import (CELL_CONFLICT, CELL_DONE, CELL_NEW, CELL_RESUME, CELL_STATES, STATUS_DONE,
                                  STATUS_FAILED, STATUS_LOCKED)

PARENT_POLL_S = 0.5


def _preflight(cells: list[Cell]) -> None:
    """Task size, sequence budget and checkpoint path of every distinct setup, before any folder is made."""
    from moe_lab.rl.coldstart import preflight

    for cfg in _distinct_setups(cells):
        preflight(cfg)


def _distinct_setups(cells: list[Cell]) -> list:
    """One config per cold-start cache entry: the cells that share it need one cold start and one check."""
    from moe_lab.rl.coldstart import cache_key

    return list({cache_key(c.config): c.config for c in cells}.values())


def default_jobs(threads_per_run: int = 1) -> int:
    """Cores this process may run on (its CPU affinity, not the machine's count) / threads per run."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(threads_per_run, 1))


def plan(cells: list[Cell], runs_dir: Path, *, overwrite: bool) -> dict[str, list[Cell]]:
    """Sort cells by what must happen to them (RunFolder.cell_state: new, done, resume, conflict); refuse to
    overwrite silently."""
    groups: dict[str, list[Cell]] = {state: [] for state in CELL_STATES}
    for c in cells:
        groups[RunFolder(runs_dir / c.run_id).cell_state(dump_yaml(c.config))].append(c)
    if groups[CELL_CONFLICT] and not overwrite:
        names = ", ".join(c.run_id for c in groups[CELL_CONFLICT][:5])
        raise ConfigError(f"--out: {runs_dir} already holds runs with a different config ({names}); "
                          f"choose another --out or pass --overwrite to replace them")
    for c in groups[CELL_CONFLICT]:
        shutil.rmtree(runs_dir / c.run_id)
    groups[CELL_NEW] += groups.pop(CELL_CONFLICT)
    return groups


def quiet_transformers() -> None:
    """transformers draws a progress bar per checkpoint load: noise in a batch of runs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def coldstart_worker(cfg) -> str:
    import torch

    from moe_lab.rl.coldstart import cold_start

    quiet_transformers()
    torch.set_num_threads(cfg.threads)
    return str(cold_start(cfg, progress=False))


def train_worker(cell: Cell, run_dir: str) -> tuple[str, str]:
    """(run_id, status); status 'locked: <why>' when another runner holds the folder (nothing is written then)."""
    from moe_lab.rl.loop import run_info, train

    quiet_transformers()
    run_dir = Path(run_dir)
    try:
        lock = RunLock(run_dir).acquire()
    except RunLocked as exc:
        return cell.run_id, f"{STATUS_LOCKED}: {exc}"
    with lock:
        # The other runner may have finished this cell between our plan and our lock.
        folder = RunFolder(run_dir)
        if folder.cell_state(dump_yaml(cell.config)) == CELL_DONE:
            return cell.run_id, folder.finished()
        try:
            return cell.run_id, train(cell.config, run_dir, run_id=cell.run_id, arm=cell.arm)
        except Exception as exc:  # one broken cell must not take the batch down: record it and go on
            folder.record(STATUS_FAILED, run_info(cell.config, cell.run_id, cell.arm), f"{type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc(), **_machine_or_nothing())
            return cell.run_id, STATUS_FAILED


def _machine_or_nothing() -> dict:
    try:  # the manifest of a run that failed still says where; never a second error on the way
        from moe_lab.store.runlog import machine_info

        return {"machine": machine_info()}
    except Exception:
        return {}


def _exit_with_parent(parent: int) -> None:
    """Worker: exit at once when the parent is gone (SIGKILLed runners must not leave workers training)."""
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(PARENT_POLL_S)


def _worker_init(parent: int) -> None:
    # Ctrl-C reaches the whole foreground process group: the parent alone handles it (stops the workers
    # and marks their runs), so a worker neither dies mid-write with a traceback nor races the parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="parent-watch").start()


def _pool(jobs: int) -> ProcessPoolExecutor:
    # spawn, not fork: torch's thread pools do not survive a fork, and workers start clean.
    return ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                               initargs=(os.getpid(),))


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Kill every worker now (shutdown() alone waits for the running tasks to finish)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())  # the executor has no public handle
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
    pool.shutdown(wait=False, cancel_futures=True)


def _run_parallel(fn, items: list[tuple], jobs: int, desc: str, progress: bool) -> list:
    if jobs <= 1 or len(items) <= 1:
        return [fn(*it) for it in _bar(items, desc, progress)]
    results = []
    pool = _pool(min(jobs, len(items)))
    try:
        futures = [pool.submit(fn, *it) for it in items]
        for fut in _bar(as_completed(futures), desc, progress, total=len(futures)):
            results.append(fut.result())
    except BaseException:
        _stop_workers(pool)
        raise
    pool.shutdown(wait=True)
    return results


def _mark_interrupted(cells: list[Cell], runs_dir: Path) -> list[str]:
    """Unfinished runs that had started get manifest status 'interrupted' (RunFolder.mark_interrupted: not those
    another runner holds); returns their ids."""
    from moe_lab.rl.loop import run_info

    return [c.run_id for c in cells
            if RunFolder(runs_dir / c.run_id).mark_interrupted(run_info(c.config, c.run_id, c.arm))]


def _bar(it, desc: str, progress: bool, total: int | None = None):
    if not progress:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, total=total, disable=not sys.stderr.isatty())


def _reason(run_dir: Path) -> str:
    try:
        return str(RunFolder(run_dir).manifest.get("reason", ""))
    except ValueError as exc:
        return str(exc)


def check_out_dir(out: Path) -> None:
    """--out must be a folder we can create and write into; checked before anything is written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is a file; expected a folder (existing or to be created)")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"--out: {parent} is a file, so {out} cannot be created; choose another --out")
    try:  # os.access lies for root and on read-only mounts: try it
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as exc:
        raise ConfigError(f"--out: cannot write in {parent} ({exc.strerror}); choose another --out") from None


def _experiment_id(exp: dict) -> str:
    return str(exp.get("name") or yaml.safe_dump(exp, sort_keys=True))


def check_same_experiment(exp: Experiment, out: Path, *, overwrite: bool) -> bool:
    """True when out holds another experiment and --overwrite replaces its runs; refuses without it."""
    old = ResultsFolder(out).experiment()
    if old is None:
        return False
    if _experiment_id(old) == _experiment_id(exp.explicit):
        return False
    if not overwrite:
        raise ConfigError(f"--out: {out} holds experiment {old.get('name', '(unnamed)')!r}, not "
                          f"{exp.name or '(unnamed)'!r}; its summary would mix both: choose another --out "
                          "or pass --overwrite to replace its runs")
    return True


def _run_cells(todo: list[Cell], results: ResultsFolder, jobs: int, backend, progress: bool,
               echo=print) -> dict[str, str]:
    """Cold starts, then the runs of ``todo``, on ``backend`` or local workers; their run_id -> status. Before the
    cold starts, a line for each that is re-made from the folder's recipe; after them (local workers; on a backend
    after the runs), each one's recipe written or its digest compared (coldstart_recipe.after_cold_starts) and a line
    for each cold start this machine warmed into another model than the folder's runs began from.

    On KeyboardInterrupt the unfinished runs are marked 'interrupted' and the interrupt is re-raised.
    """
    from moe_lab.rl.coldstart_recipe import after_cold_starts, before_cold_starts

    runs_dir = results.runs_dir
    try:
        setups = _distinct_setups(todo)
        for line in before_cold_starts(results, setups):
            echo(line)
        if backend is not None:
            statuses = backend.run(todo, runs_dir, setups, progress)
            for line in after_cold_starts(results, setups):
                echo(line)
            return statuses
        _run_parallel(coldstart_worker, [(cfg,) for cfg in setups], jobs, "cold start", progress)
        for line in after_cold_starts(results, setups) + warmed_here_notes(setups, runs_dir):
            echo(line)
        items = [(c, str(runs_dir / c.run_id)) for c in todo]
        return dict(_run_parallel(train_worker, items, jobs, "runs", progress))
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the bookkeeping short
        try:
            _mark_interrupted(todo, runs_dir)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        raise


def seed_major(cells: list[Cell]) -> list[Cell]:
    """The cells in running order: every arm of the first seed, then of the next (stable within a seed).

    Why: a long experiment stopped part-way (or still running) then holds the same seeds in every arm, so
    `moe-lab compare` compares like with like; arm by arm it would hold whole arms and none of others.
    """
    first = {}
    for c in cells:
        first.setdefault(c.seed, len(first))
    return sorted(cells, key=lambda c: first[c.seed])


def run_experiment(exp: dict | Experiment, out: Path, *, jobs: int | None = None, overrides: list[str] = (),
                   arms: list[str] | None = None, seeds: list[int] | None = None, overwrite: bool = False,
                   progress: bool = True, echo=print, report_to: str | None = None, backend=None) -> dict[str, str]:
    """Run all cells; returns run_id -> status. Every input is validated before anything is written.

    ``backend`` runs the cold starts and cells: None = local worker processes (``jobs`` of them), or an
    object with ``describe()`` and ``run(todo, runs_dir, setups, progress)`` (ray_backend.RayCells).

    A cell another runner holds gets status 'locked: <why>' and is skipped. On KeyboardInterrupt the
    workers are stopped, unfinished runs are marked 'interrupted', and the interrupt is re-raised.
    """
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ConfigError(f"--jobs={jobs!r}: allowed an integer >= 1")
    if report_to is not None:
        from moe_lab.launch.tracking import check_report_to

        check_report_to(report_to)
    exp = parse_experiment(exp)  # parsed once; its explicit form is what the results folder keeps
    cells = exp.cells(overrides=overrides, arms=arms, seeds=seeds)
    quiet_transformers()
    _preflight(cells)
    out = Path(out)
    results = ResultsFolder(out)
    runs_dir = results.runs_dir
    check_out_dir(out)
    replace_other = check_same_experiment(exp, out, overwrite=overwrite)
    groups = plan(cells, runs_dir, overwrite=overwrite) if not replace_other else {
        CELL_NEW: list(cells), CELL_DONE: [], CELL_RESUME: []}
    if replace_other:
        shutil.rmtree(runs_dir, ignore_errors=True)
    results.write_experiment(exp.explicit)
    todo = seed_major(groups[CELL_RESUME] + groups[CELL_NEW])
    jobs = jobs or default_jobs(max(c.config.threads for c in cells))
    where = f"{jobs} worker(s)" if backend is None else backend.describe()
    echo(f"{len(cells)} runs: {len(groups[CELL_DONE])} done, {len(groups[CELL_RESUME])} to resume, "
         f"{len(groups[CELL_NEW])} new; {where} -> {out}")
    statuses = {c.run_id: RunFolder(runs_dir / c.run_id).finished() or STATUS_DONE for c in groups[CELL_DONE]}
    tracker = _tracker(report_to, [runs_dir / c.run_id for c in cells], out, exp.name)
    try:
        if todo:
            statuses.update(_run_cells(todo, results, jobs, backend, progress, echo))
    except BaseException:
        if tracker is not None:
            tracker.stop()  # what was sent is recorded: the next invocation sends the rest
        raise
    for run_id, status in statuses.items():
        if status.startswith(STATUS_LOCKED):
            echo(f"{run_id}: {status}")
        elif status == STATUS_FAILED:
            echo(f"{run_id}: failed: {_reason(runs_dir / run_id)}")
    if tracker is not None:
        tracker.finish()
    return statuses


def _tracker(report_to: str | None, run_dirs: list[Path], out: Path, group: str | None):
    """The tracker stream of ``--report-to`` (None without), already following the run folders: each run's rows
    reach the tracker as its checkpoints commit them, not when its cell ends (launch/tracking.py)."""
    if report_to is None:
        return None
    from moe_lab.launch.tracking import TrackerStream

    return TrackerStream(report_to, run_dirs, out / report_to, group=group).start()
