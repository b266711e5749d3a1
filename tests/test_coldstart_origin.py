"""Which cold start a run began from, across resumes and processors: the manifest's segments, the folder-level
note when one cache key names two models, and the runner's line when this machine warms another model than the
folder's runs began from (moe_lab.rl.loop.provenance, moe_lab.launch.coldstart_origin)."""

from __future__ import annotations

import json
from pathlib import Path

from moe_lab.config import apply_overrides, load_yaml
from moe_lab.launch import coldstart_origin
from moe_lab.launch.runner import run_experiment
from moe_lab.rl import loop
from moe_lab.rl.coldstart import META_FILE, cache_key, cache_root

ROOT = Path(__file__).resolve().parents[1]
INTEL = {"cpu": {"model_name": "Intel(R) Xeon(R) Processor"}}
AMD = {"cpu": {"model_name": "AMD EPYC"}}
WARM_A = {"steps": 250, "accuracy": 0.453125, "reached": True, "key": "k" * 64}
WARM_B = {**WARM_A, "steps": 270, "accuracy": 0.3125}


def _fake_machine(monkeypatch, machine: dict, record: dict, started: float = 1.0e9) -> None:
    monkeypatch.setattr(loop, "machine_info", lambda: machine)
    monkeypatch.setattr(loop, "recorded", lambda cfg: record)
    monkeypatch.setattr(loop.time, "time", lambda: started)  # the segment's start, as its manifest records it


def test_a_resume_keeps_the_cold_start_it_began_from_and_records_each_segment(monkeypatch):
    _fake_machine(monkeypatch, INTEL, WARM_A)
    first = loop.provenance({}, None, 0)
    assert first == {"coldstart": WARM_A,
                     "segments": [{"from_step": 0, "started": 1.0e9, "machine": INTEL, "coldstart": WARM_A}]}
    _fake_machine(monkeypatch, AMD, WARM_B, 2.0e9)  # the run goes on elsewhere, whose cache holds another model
    resumed = loop.provenance({**first, "machine": INTEL, "resumed_from_step": 0}, None, 130)
    assert resumed["coldstart"] == WARM_A
    assert resumed["segments"] == first["segments"] + [
        {"from_step": 130, "started": 2.0e9, "machine": AMD, "coldstart": WARM_B}]
    # a restart from scratch keeps nothing of the earlier attempt
    assert loop.provenance(resumed, None, 0)["segments"] == [
        {"from_step": 0, "started": 2.0e9, "machine": AMD, "coldstart": WARM_B}]


def test_a_manifest_from_before_segments_gives_the_first_segment_what_it_recorded(monkeypatch):
    _fake_machine(monkeypatch, AMD, WARM_B)
    legacy = {"coldstart": WARM_A, "machine": INTEL, "resumed_from_step": 40}
    got = loop.provenance(legacy, None, 130)
    assert got["coldstart"] == WARM_A
    assert [s["from_step"] for s in got["segments"]] == [40, 130]
    assert got["segments"][0]["machine"] == INTEL
    assert "started" not in got["segments"][0] and got["segments"][1]["started"] == 1.0e9  # never invented


def _manifest(runs: Path, run_id: str, **fields) -> None:
    (runs / run_id).mkdir(parents=True)
    (runs / run_id / "manifest.json").write_text(json.dumps(fields))


def test_the_folder_note_names_a_key_that_holds_two_models_and_the_runs_of_the_smaller_group(tmp_path):
    runs = tmp_path / "runs"
    for seed in range(3):
        _manifest(runs, f"grpo-s{seed}", coldstart=WARM_A, machine=INTEL)
    assert coldstart_origin.mixed_notes(runs) == []
    _manifest(runs, "gspo-s9", coldstart=WARM_A, machine=AMD,  # overwritten by a resume: segments tell the truth
              segments=[{"from_step": 0, "machine": INTEL, "coldstart": WARM_A},
                        {"from_step": 5, "machine": AMD, "coldstart": WARM_B}])
    assert coldstart_origin.mixed_notes(runs) == []
    _manifest(runs, "gspo-s3", segments=[{"from_step": 0, "machine": AMD, "coldstart": WARM_B}])
    (note,) = coldstart_origin.mixed_notes(runs)
    assert "4 run(s) from one warmed in 250" in note and "1 run(s) from one warmed in 270" in note
    assert "AMD EPYC" in note and note.endswith(": gspo-s3")


def test_the_runner_says_when_this_machine_warmed_another_model_under_the_folders_key(tmp_path):
    smoke = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
    base = apply_overrides(smoke["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.steps=1"])
    exp = {"base": base, "arms": {"grpo": {}}, "seeds": [0, 1]}
    lines: list[str] = []
    run_experiment(exp, tmp_path / "e", jobs=1, progress=False, seeds=[0], echo=lines.append)
    assert not [line for line in lines if "note" in line]
    # what another processor does: the same key, warmed in other steps. Rewrite the entry's record as it would read
    from moe_lab.launch.experiment import expand

    cfg = expand(exp)[0].config
    meta_path = cache_root(cfg) / cache_key(cfg) / META_FILE
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "steps": meta["steps"] + 5}))
    run_experiment(exp, tmp_path / "e", jobs=1, progress=False, echo=lines.append)
    (note,) = [line for line in lines if "note" in line]
    assert f"warmed here in {meta['steps'] + 5} supervised steps" in note and f"in {meta['steps']} supervised" in note
    assert len(coldstart_origin.mixed_notes(tmp_path / "e" / "runs")) == 1
