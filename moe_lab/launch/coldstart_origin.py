"""Which cold start each run of a results folder began from, and where one cache key names two models.

A cold start's cache key hashes its config, not the processor: warmed on another processor, the same key holds
another model (other supervised steps, other weights; docs/guide.md, "Results that depend on the machine"). An
experiment resumed on another machine starts its remaining runs from that other model, and a design that blocks
on the cold start (`blocks:`, experiments/router_learns.yaml) then mixes two models in one block without a word.
router_learns did (results/reference/router_learns/LOG.md). These functions find it from the manifests alone and never read an
endpoint, so `moe-lab progress` may print them before the analysis: the runner prints `warmed_here_notes` before
its first RL run, `progress` and `compare` print `mixed_notes` beside their tables.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from moe_lab.store.run_folder import RunFolder, run_dirs

NOTE = "moe-lab: note: "


def _first_segment(manifest: dict) -> dict:
    """The run's first start (moe_lab.rl.loop.provenance) in a manifest as RunFolder reads it (a manifest
    without segments gets one from its top level: run_folder.upgrade_manifest); {} for one without a cold start."""
    return (manifest.get("segments") or [{}])[0]


def began_from(manifest: dict) -> dict:
    """The cold-start record a run's weights descend from (``manifest``: RunFolder.manifest)."""
    return _first_segment(manifest).get("coldstart") or {}


def _processor(manifest: dict) -> str:
    machine = _first_segment(manifest).get("machine") or {}
    return (machine.get("cpu") or {}).get("model_name") or "processor unknown"


def _model(record: dict) -> tuple:
    """What tells two warmed models of one key apart in a manifest: supervised steps and sampled accuracy."""
    return record.get("steps"), record.get("accuracy")


def coldstart_records(runs_dir: Path) -> dict[str, dict[tuple, list[tuple[str, str]]]]:
    """key -> (steps, accuracy) -> [(run_id, processor)] over every run folder holding a manifest."""
    records: dict = defaultdict(lambda: defaultdict(list))
    for run in map(RunFolder, run_dirs(runs_dir, with_manifest=True)):
        record = began_from(run.manifest)
        if record.get("key"):
            records[record["key"]][_model(record)].append((run.run_id, _processor(run.manifest)))
    return records


def _describe(model: tuple, runs: list[tuple[str, str]]) -> str:
    steps, accuracy = model
    processors = ", ".join(sorted({p for _, p in runs}))
    acc = f"{accuracy:.3f}" if isinstance(accuracy, (int, float)) else "?"
    return f"{len(runs)} run(s) from one warmed in {steps} supervised steps (sampled accuracy {acc}; {processors})"


def mixed_notes(runs_dir: Path, shown: int = 4) -> list[str]:
    """One line per cache key whose runs began from more than one model; [] when every key names one."""
    lines = []
    for key, models in coldstart_records(runs_dir).items():
        if len(models) < 2:
            continue
        ranked = sorted(models.items(), key=lambda item: -len(item[1]))
        minority = [run for _, runs in ranked[1:] for run, _ in runs]
        more = f" and {len(minority) - shown} more" if len(minority) > shown else ""
        lines.append(f"{NOTE}cold start {key[:12]} names {len(models)} models in this folder: "
                     + "; ".join(_describe(m, runs) for m, runs in ranked)
                     + f" (warmed on different processors; docs/guide.md). Runs of the smaller group(s): "
                     + ", ".join(minority[:shown]) + more)
    return lines


def warmed_here_notes(cfgs: list, runs_dir: Path) -> list[str]:
    """One line per config whose cold start, as this machine's cache holds it, is not the model this folder's
    runs of the same key began from: the runs started now begin from another model."""
    from moe_lab.rl.coldstart import recorded

    folder = coldstart_records(runs_dir)
    lines = []
    for cfg in cfgs:
        here = recorded(cfg)
        theirs = folder.get(here.get("key"), {})
        if theirs and _model(here) not in theirs:
            lines.append(f"{NOTE}cold start {here['key'][:12]} warmed here in {here.get('steps')} supervised steps; "
                         f"this folder's runs of that key began from "
                         + "; ".join(_describe(m, runs) for m, runs in theirs.items())
                         + ": the runs started now begin from a different model under the same key (another "
                           "processor warmed theirs; docs/guide.md, 'Results that depend on the machine')")
    return lines
