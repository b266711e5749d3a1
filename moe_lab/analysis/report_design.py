"""The question, design and provenance sections of `moe-lab report`, read from a results folder alone.

The design is the folder's own experiment.yaml (what the runner ran); the command-line overrides are the fields
where every run's config.yaml differs from that file's expansion; the provenance is the manifests (code commits,
start and end times) and, where the folder sits in a git checkout, the commit that added the experiment file.
"""

from __future__ import annotations

import collections
import datetime as dt
import subprocess
from pathlib import Path

import yaml

from moe_lab.analysis.tables import flatten
from moe_lab.config import ConfigError, dump_yaml
from moe_lab.launch.spec import Experiment
from moe_lab.store.run_folder import ResultsFolder, first_segments


def utc(t: float | None) -> str:
    return "unknown" if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def inline(value) -> str:
    """One line of YAML flow style (a mapping as ``{a: 1, b: 2}``)."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip()


def question(exp: Experiment) -> list[str]:
    text = " ".join(str(exp.description or "").split())
    return ["## Question", "", text or "The experiment file states no question (no `description:`)."]


def _overrides(folder: ResultsFolder, exp: Experiment) -> dict:
    """Dotted fields where every finished run's config differs from the experiment's expansion, with the value
    they all share (a command-line override, or a default changed since the runs); {} when none or unknown."""
    try:
        cells = {c.run_id: flatten(yaml.safe_load(dump_yaml(c.config))) for c in exp.cells()}
    except ConfigError:
        return {}
    common = None
    for run in folder.run_folders(with_manifest=True):
        if run.run_id not in cells:
            continue
        ran = flatten(run.config())
        diff = {k: v for k, v in ran.items() if k in cells[run.run_id] and cells[run.run_id][k] != v}
        common = diff if common is None else {k: v for k, v in common.items() if diff.get(k) == v}
    return dict(sorted((common or {}).items()))


def design(folder: ResultsFolder, exp: Experiment, n_runs: int, where: str) -> list[str]:
    """Organism, schedule, arms, cold starts or seeds, the command (``where``: the folder as the page names it)."""
    if not exp.explicit:
        return ["## Design", "", f"No experiment.yaml in this folder: {n_runs} runs, their design unknown here."]
    base = exp.base
    lines = ["## Design", "",
             f"- organism: `model: {inline(base.get('model') or {})}`, `task: {inline(base.get('task') or {})}`"
             + (f", `coldstart: {inline(base['coldstart'])}`" if base.get("coldstart") else ""),
             f"- RL: `rl: {inline(base.get('rl') or {})}` (other fields at their defaults)"]
    for key in ("sweep", "factors"):
        if exp.setting(key):
            lines.append(f"- {key}: `{inline(exp.setting(key))}`")
    blocks = exp.blocks
    if blocks:
        lines.append(f"- cold starts: {len(blocks.seeds)} values of `{blocks.field}` "
                     f"({', '.join(map(str, blocks.seeds))}), RL seeds of their own: `{inline(blocks.seeds)}`")
    else:
        lines.append(f"- seeds: `{inline(exp.setting('seeds') or [0])}` (one cold start per model config)")
    lines += ["", "| arm | overrides of base |", "|---|---|"]
    lines += [f"| {arm} | `{inline(spec or {})}` |" for arm, spec in exp.arms.items()]
    over = _overrides(folder, exp)
    command = f"moe-lab run {exp.name or folder.path.name} --out {where}"
    command += "".join(f" {k}={v}" for k, v in over.items())
    lines += ["", f"Command: `{command}`" + (" (the fields after the folder are where every run's config differs "
                                             "from the experiment file's expansion at today's code)" if over else "")
              + f"; {n_runs} run folders."]
    return lines


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def file_committed(folder: ResultsFolder, exp: Experiment) -> str:
    """When the experiment file (experiments/<name>.yaml, else the folder's experiment.yaml) was first committed:
    its adding commit and date from git log; "unknown" without git or without such a file in the history."""
    root = _git(folder.path, "rev-parse", "--show-toplevel")
    if root is None:
        return "unknown (no git checkout)"
    name = exp.name
    candidates = [Path(root) / "experiments" / f"{name}.yaml"] if name else []
    for path in [*candidates, folder.experiment_path.resolve()]:
        log = _git(Path(root), "log", "--diff-filter=A", "--format=%H %ct", "--", str(path))
        if log:  # the full hash cut to 7, as git_commit above: %h's length depends on the clone's object count
            commit, when = log.splitlines()[-1].split()
            return f"{utc(float(when))} ({commit[:7]}, `{Path(path).relative_to(root).as_posix()}`)"
    return "unknown (not in the git history)"


def provenance(folder: ResultsFolder, exp: Experiment) -> list[str]:
    """Code commits, when the first run started and the last ended, when the experiment file was committed."""
    commits, starts, inferred, ends = collections.Counter(), [], [], []
    for run in folder.run_folders(with_manifest=True):
        m = run.manifest
        commits[(m.get("git_commit") or "unknown")[:7]] += 1
        starts += [s["started"] for s in first_segments(m)[:1] if s.get("started") is not None]
        if m.get("updated") is not None:
            ends.append(float(m["updated"]))
            inferred.append(float(m["updated"]) - float(m.get("wall_s") or 0.0))
    first = (utc(min(starts)) if starts else
             f"not recorded (manifests before start times); at the latest {utc(min(inferred))} (updated − wall_s)"
             if inferred else "unknown")
    code = ", ".join(f"{c} ({n} runs)" for c, n in commits.most_common()) or "none"
    return ["## Provenance", "", f"- code (manifests' git_commit): {code}",
            f"- experiment file first committed: {file_committed(folder, exp)}",
            f"- first run started: {first}", f"- last manifest written: {utc(max(ends) if ends else None)}"]
