"""`moe-lab verify RESULTS_DIR [--cells N] [--steps K]`: re-run a few cells of a results folder and say, per
cell, whether this machine gives the same bits, and if not, whether a machine difference explains it.

Cells: the finished runs of RESULTS_DIR/runs/ (done or collapsed), ordered by arm name, then seed. The default
2 cells are the lowest-seed run of the first arm and of the last arm; ``--cells N`` takes, in this order, the
lowest-seed run of the first arm, of the last arm, of each other arm in turn, then each arm's next seed, and
so on; ``--cells all`` every finished run. Each cell re-runs from its own ``runs/<run_id>/config.yaml``
(read like any old config, moe_lab.config.legacy) for its first K RL steps (``--steps``, default 3;
``--steps all``, or K at least the run's rl.steps, for the whole run), with a fresh cold start, in a
temporary folder that is removed afterwards. Only the number of RL steps changes: a step's numbers do not
depend on how many steps follow it.

A reference made with ``--cpu-isa`` records its pins in ``machine.env``: verify re-executes itself with
exactly those pins (and without pins for an unpinned reference), so that the re-run uses the kernels the
reference chose.

Exit codes: 0 every cell bit-identical, or different on a machine (or packages) that differ from the recorded
ones, or where the reference does not record its processor; 1 some cell differs on the same machine (or failed
to re-run: its line says why); 2 bad input (one line, before any work: no folder, no finished run, a bad
--cells/--steps, a cell this machine cannot run such as a CUDA config without a GPU).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from moe_lab.config import ConfigError, from_dict, set_dotted, validate
from moe_lab.config.constants import MACHINE_ENV
from moe_lab.audit import verdicts
from moe_lab.launch.spec import Experiment, parse_experiment
from moe_lab.store.run_folder import ResultsFolder, RunFolder
from moe_lab.store.status import FINISHED

NOT_DONE = ("the reference's tables do not hold the rows its checkpoint or manifest committed (the runner would run "
            "it again)")
DEFAULT_CELLS = 2
DEFAULT_STEPS = 3
ALL = "all"


@dataclass(frozen=True)
class RefRun:
    run_id: str
    arm: str
    seed: int
    run_dir: Path
    manifest: dict
    config: dict  # the config.yaml as upgraded to the current fields
    done: bool = True  # what the runner says (RunFolder.finished): False when its tables lack what it committed
    recipe: dict | None = None  # its cold start's recipe in the folder (coldstart_recipe); None in older references
    recipe_path: Path | None = None

    @property
    def steps(self) -> int:
        return int(self.config.get("rl", {}).get("steps", 0))


def parse_count(text: str | None, flag: str, default: int) -> int | None:
    """An integer >= 1, or None for 'all'; a ConfigError naming the flag otherwise."""
    if text is None:
        return default
    if str(text).strip().lower() == ALL:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{flag}={text}: allowed an integer >= 1 or 'all'")
    return value


def _read_run(run: RunFolder) -> RefRun | None:
    """The run folder as a reference cell, or None when its manifest does not say finished (done or collapsed) or
    it lacks a table. A finished one whose tables no longer hold what it committed (the runner would run it again)
    is kept, marked not ``done``: its verdict names the rows that changed, and says so."""
    if not (run.manifest_path.is_file() and run.config_path.is_file() and run.metrics_path.is_file()):
        return None
    try:
        manifest = run.manifest
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        config = run.config()
        validate(from_dict(config))
    except (ValueError, OSError) as exc:  # ConfigError included
        raise ConfigError(f"{run.config_path}: not a config this code can run ({' '.join(str(exc).split())})") from None
    if run.status not in FINISHED:
        return None
    seed = manifest.get("seed", config.get("seed", 0))
    return RefRun(run.run_id, str(manifest.get("arm", run.run_id)), int(seed), run.path, manifest, config,
                  run.finished() is not None)


def load_reference(folder: Path) -> list[RefRun]:
    """The finished runs of a results folder, sorted by (arm, seed); a ConfigError when there are none."""
    results = ResultsFolder(folder)
    if not results.path.is_dir():
        raise ConfigError(f"RESULTS_DIR: {folder} is not a folder; expected a results folder holding runs/")
    if not results.runs_dir.is_dir():
        raise ConfigError(f"RESULTS_DIR: {folder} has no runs/ folder; expected the layout moe-lab run writes")
    runs = [r for r in map(_read_run, results.run_folders()) if r is not None]
    if not runs:
        raise ConfigError(f"RESULTS_DIR: {results.runs_dir} holds no finished run (config.yaml, manifest.json with "
                          f"status done or collapsed, metrics.parquet)")
    return sorted(runs, key=lambda r: (r.arm, r.seed, r.run_id))


def choose_cells(runs: list[RefRun], n: int | None) -> list[RefRun]:
    """The first n cells of the documented order (module docstring); all of them for n None."""
    if n is not None and n > len(runs):
        raise ConfigError(f"--cells={n}: the folder holds {len(runs)} finished runs; allowed 1..{len(runs)} or 'all'")
    by_arm = {arm: list(group) for arm, group in itertools.groupby(runs, key=lambda r: r.arm)}
    arms = list(by_arm)
    arm_order = [arms[0], *([arms[-1]] if len(arms) > 1 else []), *arms[1:-1]]
    order = [by_arm[a][i] for i in range(max(map(len, by_arm.values()))) for a in arm_order if i < len(by_arm[a])]
    return order if n is None else order[:n]


def recorded_pins(cells: list[RefRun]) -> dict[str, str] | None:
    """The kernel pins the cells were made with (machine.env); None when no cell records its machine."""
    pins = {json.dumps((c.manifest["machine"].get("env") or {}), sort_keys=True)
            for c in cells if isinstance(c.manifest.get("machine"), dict)}
    if not pins:
        return None
    if len(pins) > 1:
        raise ConfigError("--cells: the chosen runs were made with different kernel pins (machine.env: "
                          f"{', '.join(sorted(pins))}); verify them one at a time with --cells")
    return json.loads(pins.pop())


def pin_like_reference(pins: dict[str, str] | None, argv: list[str]) -> None:
    """Re-execute `moe-lab verify` with exactly the reference's pins when this process runs with others
    (the kernels are chosen once per process, at their first use: see launch/isa.py). Returns when they match."""
    if pins is None:
        return
    current = {k: os.environ[k] for k in MACHINE_ENV if k in os.environ}
    if current == pins:
        return
    env = {k: v for k, v in os.environ.items() if k not in MACHINE_ENV}
    print(f"moe-lab verify: re-running with the reference's kernel pins {pins or '(none)'}", file=sys.stderr)
    os.execve(sys.executable, [sys.executable, "-m", "moe_lab.cli", *argv], {**env, **pins})


def rerun(ref: RefRun, steps: int | None, out: Path, cache: Path) -> Path:
    """Train the reference cell's config again (first ``steps`` RL steps) in out/runs/<run_id>; its folder."""
    from moe_lab.launch.runner import quiet_transformers
    from moe_lab.rl.loop import train

    data = json.loads(json.dumps(ref.config))  # a deep copy
    set_dotted(data, "coldstart.cache_dir", str(cache))  # not hashed into the cold start: a fresh one, same key
    if steps is not None and steps < ref.steps:
        set_dotted(data, "rl.steps", steps)
    quiet_transformers()
    run_dir = ResultsFolder(out).run(ref.run_id).path
    train(validate(from_dict(data)), run_dir, run_id=ref.run_id, arm=ref.arm)
    return run_dir


def _tables(run_dir: Path, steps: int | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(metrics, eval) of a run, cut to the rows of steps < ``steps`` (an eval at step K follows step K-1
    in a run cut at K, but precedes step K in a longer one: not comparable)."""
    frames = []
    run = RunFolder(run_dir)
    for path in (run.metrics_path, run.eval_path):
        frame = pd.read_parquet(path) if path.exists() else pd.DataFrame({"step": []})
        frames.append(frame[frame["step"] < steps].reset_index(drop=True) if steps is not None else frame)
    return frames[0], frames[1]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _whole(ref: RefRun, steps: int | None) -> bool:
    return steps is None or steps >= ref.steps


def cell_verdict(ref: RefRun, new_dir: Path, steps: int | None, runs: list[RefRun], exp: Experiment) -> tuple[str, bool]:
    """(one verdict line, whether it counts against the machine: different bits on the same machine)."""
    whole = _whole(ref, steps)
    cut = None if whole else steps
    (ref_m, ref_e), (new_m, new_e) = _tables(ref.run_dir, cut), _tables(new_dir, cut)
    diff = verdicts.first_difference("metrics", ref_m, new_m) or verdicts.first_difference("eval", ref_e, new_e)
    current = RunFolder(new_dir).manifest
    span = "whole run" if whole else f"first {_count(steps, 'RL step')}"
    note = verdicts.column_note(ref_m, new_m)
    coldstart = verdicts.coldstart_text(ref.manifest, current)
    state, machine = verdicts.machine_state(ref.manifest, current)
    if diff is None:  # the same bits on another machine is worth saying too
        rows = f"{_count(len(new_m), 'metric row')}, {_count(len(new_e), 'eval row')}"
        notes = [coldstart, *([note] if note else []), *([machine] if state == "differs" else [])]
        return f"{ref.run_id}: bit-identical ({span}: {rows}; {'; '.join(notes)})", False
    parts = [machine, coldstart, diff.describe(), *([note] if note else [])]
    if whole:
        parts.append(_endpoint(ref, new_dir, runs, exp))
    if state == "same" and ref.manifest.get("git_commit") != current.get("git_commit"):
        parts.append(f"code differs: reference at {str(ref.manifest.get('git_commit'))[:10]}, "
                     f"re-run at {str(current.get('git_commit'))[:10]}")
    return f"{ref.run_id}: different ({span}): " + "; ".join(parts), state == "same"


def _endpoint(ref: RefRun, new_dir: Path, runs: list[RefRun], exp: Experiment) -> str:
    """The re-run's primary endpoint against the min..max over the reference's seeds of its arm."""
    from moe_lab.analysis.endpoints import run_endpoints
    from moe_lab.analysis.tables import load_runs

    spec = exp.endpoints
    ref_ep = run_endpoints(*load_runs([r.run_dir for r in runs if r.arm == ref.arm]), spec)
    new_ep = run_endpoints(*load_runs(new_dir), spec)
    value = float(new_ep["primary"].iloc[0]) if len(new_ep) else float("nan")
    return verdicts.endpoint_text(value, [float(v) for v in ref_ep.get("primary", [])], ref.arm, spec.primary_metric)


def prepare(folder: str, cells: str | None, steps: str | None) -> tuple[list[RefRun], list[RefRun], int | None, Experiment]:
    """Every input checked before any work: (all reference runs, chosen cells, steps or None, experiment)."""
    n_cells = parse_count(cells, "--cells", DEFAULT_CELLS)
    n_steps = parse_count(steps, "--steps", DEFAULT_STEPS)
    runs = load_reference(Path(folder))
    chosen = choose_cells(runs, n_cells)
    for ref in chosen:
        _runnable_here(ref)
    exp = parse_experiment(ResultsFolder(folder).experiment())  # a bad block is bad input, now
    return runs, [_with_recipe(ref, ResultsFolder(folder)) for ref in chosen], n_steps, exp


def _with_recipe(ref: RefRun, results: ResultsFolder) -> RefRun:
    """The cell with the recipe of the cold start it began from. A folder with a coldstarts/ folder must hold, for
    each cell's cold start, its recipe or (references made before recipes) its weights; older folders hold neither."""
    from moe_lab.launch.coldstart_origin import began_from
    from moe_lab.rl.coldstart_recipe import read_recipe

    key = began_from(ref.manifest).get("key")
    if not key or not results.coldstarts_dir.is_dir():
        return ref
    recipe = read_recipe(results, key)
    if recipe is None and not (results.coldstarts_dir / key).is_dir():
        raise ConfigError(f"{results.coldstart_recipe(key)}: missing: run {ref.run_id} began from cold start "
                          f"{key[:12]} and {results.coldstarts_dir} holds neither its recipe nor its weights")
    return dataclasses.replace(ref, recipe=recipe, recipe_path=results.coldstart_recipe(key))


def _runnable_here(ref: RefRun) -> None:
    """What the re-run would refuse (a CUDA config on a machine without one, a missing checkpoint, a task too
    long for the model), as bad input naming the run, before any cell starts."""
    from moe_lab.models import resolve_device
    from moe_lab.rl.coldstart import preflight

    try:
        cfg = validate(from_dict(ref.config))
        resolve_device(cfg.model.device)
        preflight(cfg)
    except ValueError as exc:
        raise ConfigError(f"{RunFolder(ref.run_dir).config_path}: cannot re-run here: {exc}") from None


def verify(runs: list[RefRun], chosen: list[RefRun], steps: int | None, exp: Experiment, echo=print) -> int:
    """Re-run each chosen cell, echo one verdict line per cell; the exit code (module docstring)."""
    failed = False
    with tempfile.TemporaryDirectory(prefix="moe_lab_verify_") as tmp:
        for ref in chosen:
            cache = Path(tmp) / "coldstart"
            _say_remaking(ref, cache)
            try:
                new_dir = rerun(ref, steps, Path(tmp), cache)
            except Exception as exc:  # noqa: BLE001 - one cell that cannot re-run must not hide the others' verdicts
                echo(f"{ref.run_id}: not re-run ({type(exc).__name__}: {' '.join(str(exc).split())})")
                failed = True
                continue
            line, bad = cell_verdict(ref, new_dir, steps, runs, exp)
            if ref.recipe is not None:
                line, bad = _digest_verdict(ref, new_dir, cache, line, bad)
            echo(line if ref.done else f"{line}; {NOT_DONE}")
            failed = failed or bad
    return 1 if failed else 0


def _say_remaking(ref: RefRun, cache: Path) -> None:
    """The progress line (stderr) of a cold start re-made from the folder's recipe, once per cold start."""
    if ref.recipe is not None and not (cache / ref.recipe["key"]).is_dir():
        from moe_lab.rl.coldstart_recipe import remaking_line

        print(f"moe-lab verify: {remaking_line(ref.recipe_path, ref.recipe, 'weights not committed')}", file=sys.stderr)


def _digest_verdict(ref: RefRun, new_dir: Path, cache: Path, line: str, bad: bool) -> tuple[str, bool]:
    """The cell's line with its re-made cold start's digest against the recipe's: other weights on the recorded
    processor count against the machine, as other bits do."""
    from moe_lab.rl.coldstart_recipe import DIFFERS, compare, weights_digest

    key = (RunFolder(new_dir).manifest.get("coldstart") or {}).get("key") or ref.recipe["key"]
    state, text = compare(ref.recipe, weights_digest(cache / key))
    return f"{line}; {text}", bad or state == DIFFERS
