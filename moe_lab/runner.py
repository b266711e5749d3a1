"""Run every cell of an experiment in worker processes: cold starts first, then the RL runs.

Finished cells are skipped, unfinished ones resume from their last checkpoint, and a folder that holds
a run of a different config is never overwritten unless asked.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml

from moe_lab.config import ConfigError, dump_yaml
from moe_lab.experiment import Cell, expand
from moe_lab.runlog import STATUS_DONE, atomic_write_text, config_state, read_json


def _preflight(cells: list[Cell]) -> None:
    """Task size, sequence budget and checkpoint path of every distinct setup, before any folder is made."""
    from moe_lab.coldstart import preflight

    for cfg in _distinct_setups(cells):
        preflight(cfg)


def _distinct_setups(cells: list[Cell]) -> list:
    """One config per cold-start cache entry: the cells that share it need one cold start and one check."""
    from moe_lab.coldstart import cache_key

    return list({cache_key(c.config): c.config for c in cells}.values())


def default_jobs(threads_per_run: int = 1) -> int:
    return max(1, (os.cpu_count() or 1) // max(threads_per_run, 1))


def _cell_state(cell: Cell, run_dir: Path) -> str:
    """'new', 'done', 'resume', or 'conflict' (the folder holds another config)."""
    state = config_state(run_dir, dump_yaml(cell.config))
    if state != "same":
        return "conflict" if state == "other" else "new"
    return "done" if read_json(run_dir / "manifest.json").get("status") == STATUS_DONE else "resume"


def plan(cells: list[Cell], runs_dir: Path, *, overwrite: bool) -> dict[str, list[Cell]]:
    """Sort cells by what must happen to them; refuse to overwrite silently."""
    groups: dict[str, list[Cell]] = {"new": [], "done": [], "resume": [], "conflict": []}
    for c in cells:
        groups[_cell_state(c, runs_dir / c.run_id)].append(c)
    if groups["conflict"] and not overwrite:
        names = ", ".join(c.run_id for c in groups["conflict"][:5])
        raise ConfigError(f"--out: {runs_dir} already holds runs with a different config ({names}); "
                          f"choose another --out or pass --overwrite to replace them")
    for c in groups["conflict"]:
        shutil.rmtree(runs_dir / c.run_id)
    groups["new"] += groups.pop("conflict")
    return groups


def quiet_transformers() -> None:
    """transformers draws a progress bar per checkpoint load: noise in a batch of runs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _coldstart_worker(cfg) -> str:
    import torch

    from moe_lab.coldstart import cold_start

    quiet_transformers()
    torch.set_num_threads(cfg.threads)
    return str(cold_start(cfg, progress=False))


def _train_worker(cell: Cell, run_dir: str) -> tuple[str, str]:
    from moe_lab.runlog import RunLog, STATUS_FAILED
    from moe_lab.train import run_info, train

    quiet_transformers()
    try:
        return cell.run_id, train(cell.config, Path(run_dir), run_id=cell.run_id, arm=cell.arm)
    except Exception as exc:  # one broken cell must not take the batch down: record it and go on
        log = RunLog(Path(run_dir), run_info(cell.config, cell.run_id, cell.arm))
        log.write_manifest(STATUS_FAILED, f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return cell.run_id, STATUS_FAILED


def _pool(jobs: int) -> ProcessPoolExecutor:
    # spawn, not fork: torch's thread pools do not survive a fork, and workers start clean.
    return ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))


def _run_parallel(fn, items: list[tuple], jobs: int, desc: str, progress: bool) -> list:
    if jobs <= 1 or len(items) <= 1:
        return [fn(*it) for it in _bar(items, desc, progress)]
    results = []
    with _pool(min(jobs, len(items))) as pool:
        futures = [pool.submit(fn, *it) for it in items]
        for fut in _bar(as_completed(futures), desc, progress, total=len(futures)):
            results.append(fut.result())
    return results


def _bar(it, desc: str, progress: bool, total: int | None = None):
    if not progress:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, total=total, disable=not sys.stderr.isatty())


def run_experiment(exp: dict, out: Path, *, jobs: int | None = None, overrides: list[str] = (),
                   arms: list[str] | None = None, seeds: list[int] | None = None, overwrite: bool = False,
                   progress: bool = True, echo=print) -> dict[str, str]:
    """Run all cells; returns run_id -> status. Every config is validated before any work starts."""
    cells = expand(exp, overrides=overrides, arms=arms, seeds=seeds)
    quiet_transformers()
    _preflight(cells)
    out = Path(out)
    runs_dir = out / "runs"
    groups = plan(cells, runs_dir, overwrite=overwrite)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "experiment.yaml", yaml.safe_dump(exp, sort_keys=False))
    todo = groups["new"] + groups["resume"]
    jobs = jobs or default_jobs(max(c.config.threads for c in cells))
    echo(f"{len(cells)} runs: {len(groups['done'])} done, {len(groups['resume'])} to resume, "
         f"{len(groups['new'])} new; {jobs} worker(s) -> {out}")
    statuses = {c.run_id: STATUS_DONE for c in groups["done"]}
    if todo:
        _run_parallel(_coldstart_worker, [(cfg,) for cfg in _distinct_setups(todo)], jobs, "cold start", progress)
        items = [(c, str(runs_dir / c.run_id)) for c in todo]
        statuses.update(dict(_run_parallel(_train_worker, items, jobs, "runs", progress)))
    return statuses
