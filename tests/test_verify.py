"""`moe-lab verify` and the processor record: a fresh run verifies bit-identical; a perturbed table is found at
its step and column; the machine recorded decides the exit code; old manifests stay readable; bad input is one
line, exit 2, before any work."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moe_lab.cli import main
from moe_lab.config import apply_overrides, load_yaml
from moe_lab.audit import verdicts, verify
from moe_lab.launch.runner import run_experiment
from moe_lab.store import cpuinfo
from moe_lab.store.runlog import machine_info

ROOT = Path(__file__).resolve().parents[1]
SMOKE = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
STEPS = 2


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """A just-made experiment folder: 2 arms x 2 seeds, 2 RL steps, a cold start that trains a few steps."""
    tmp = tmp_path_factory.mktemp("verify")
    base = apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp / 'cache'}", f"rl.steps={STEPS}",
                                           "coldstart.target_accuracy=0.05", "coldstart.max_steps=40",
                                           "coldstart.batch_size=8", "coldstart.eval_samples=16"])
    exp = {"name": "verify_test", "base": base, "arms": {"grpo": {"rl": {"algo": "grpo"}},
                                                          "gspo": {"rl": {"algo": "gspo"}}}, "seeds": [0, 1]}
    statuses = run_experiment(exp, tmp / "exp", jobs=1, progress=False, echo=lambda *_: None)
    assert set(statuses.values()) == {"done"}, statuses
    return tmp / "exp"


def _copy(fresh: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(fresh, out)
    return out


def _perturb(run_dir: Path, table: str, step: int, column: str) -> tuple[float, float, int | None]:
    """Move one value of one row (the first of ``step``) to the next double up; (old, new, the row's update)."""
    path = run_dir / table
    frame = pd.read_parquet(path)
    i = int(np.flatnonzero(frame["step"].to_numpy() == step)[0])
    old = float(frame.at[i, column])
    frame.loc[i, column] = np.nextafter(old, math.inf)
    frame.to_parquet(path, index=False)
    return old, float(frame.at[i, column]), int(frame.at[i, "update"]) if "update" in frame else None


def _edit_manifest(run_dir: Path, edit) -> None:
    path = run_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _verify(capsys, *argv: str) -> tuple[int, list[str], str]:
    code = main(["verify", *argv])
    out = capsys.readouterr()
    return code, out.out.splitlines(), out.err


def test_a_fresh_run_verifies_bit_identical_on_the_cells_of_the_documented_choice(fresh, capsys):
    code, lines, _ = _verify(capsys, str(fresh))
    # default: the lowest seed of the first and of the last arm, sorted by name
    assert code == 0 and [ln.split(":")[0] for ln in lines] == ["grpo-s0", "gspo-s0"]
    assert all("bit-identical (whole run" in ln for ln in lines)  # the default 3 steps cover these 2-step runs
    recorded = json.loads((fresh / "runs" / "grpo-s0" / "manifest.json").read_text())["coldstart"]["steps"]
    assert f"cold start {recorded} supervised steps, as recorded" in lines[0]


def test_a_perturbed_value_is_reported_at_its_step_and_column_and_fails_on_the_same_machine(fresh, tmp_path,
                                                                                            capsys):
    ref = _copy(fresh, tmp_path)
    old, new, update = _perturb(ref / "runs" / "grpo-s0", "metrics.parquet", 1, "loss")
    code, lines, _ = _verify(capsys, str(ref), "--cells", "1", "--steps", "all")
    assert code == 1 and len(lines) == 1
    line = lines[0]
    assert line.startswith("grpo-s0: different (whole run)") and "same machine as recorded" in line
    assert f"RL step 1 (update {update}), column loss: {new!r} (reference) vs {old!r} (re-run)" in line
    assert "primary endpoint eval/acc_greedy" in line  # a whole cell: its endpoint against the seed spread


def test_a_different_recorded_processor_explains_the_difference(fresh, tmp_path, capsys):
    ref = _copy(fresh, tmp_path)
    run = ref / "runs" / "gspo-s0"
    _perturb(run, "metrics.parquet", 0, "reward/mean")
    _edit_manifest(run, lambda m: m["machine"]["cpu"].update(model_name="Other CPU 9000"))
    _edit_manifest(ref / "runs" / "grpo-s0", lambda m: m["machine"]["cpu"].update(flags=["avx2"]))
    code, lines, _ = _verify(capsys, str(ref), "--cells", "2", "--steps", "1")
    assert code == 0
    # the same bits on another processor: said, not hidden
    assert "grpo-s0: bit-identical (first 1 RL step:" in lines[0] and "machine differs" in lines[0]
    assert "flags: only" in lines[0]  # this processor's flags are not exactly ['avx2']
    assert "machine differs from the recorded one (model_name: 'Other CPU 9000' vs" in lines[1]
    assert "RL step 0 (update 0), column reward/mean" in lines[1]


def test_a_manifest_without_the_processor_reads_and_says_the_machine_is_unknown(fresh, tmp_path, capsys):
    ref = _copy(fresh, tmp_path)
    run = ref / "runs" / "grpo-s0"
    _perturb(run, "eval.parquet", 0, "eval/acc_greedy")
    _edit_manifest(run, lambda m: (m["machine"].pop("cpu"), m.pop("coldstart")))
    code, lines, _ = _verify(capsys, str(ref), "--cells", "1")
    assert code == 0 and verdicts.UNKNOWN_PROCESSOR in lines[0]
    assert "first difference in eval at RL step 0" in lines[0] and "column eval/acc_greedy" in lines[0]
    assert "(the reference did not record its own)" in lines[0]


def test_a_committed_reference_written_before_the_processor_record_is_readable():
    folder = ROOT / "results" / "reference" / "replay_rescue"
    runs = verify.load_reference(folder)
    assert [r.run_id for r in verify.choose_cells(runs, None)[:2]] == ["grpo-s0", "gspo_token-s0"]
    manifest = runs[0].manifest
    assert "cpu" not in manifest["machine"]
    state, text = verdicts.machine_state(manifest, {"machine": machine_info(), "versions": manifest["versions"]})
    assert state in ("unknown", "differs") and text  # never 'same': the reference does not name its processor


def test_cells_are_chosen_first_and_last_arm_first_then_round_robin():
    runs = [verify.RefRun(f"{a}-s{s}", a, s, Path("."), {}, {}) for a in "abc" for s in (0, 1)]
    ids = [r.run_id for r in verify.choose_cells(runs, None)]
    assert ids == ["a-s0", "c-s0", "b-s0", "a-s1", "c-s1", "b-s1"]
    assert [r.run_id for r in verify.choose_cells(runs, 2)] == ids[:2]


@pytest.mark.parametrize("argv,field", [(["/no/such/folder"], "RESULTS_DIR"), (["{tmp}"], "runs/"),
                                        (["{fresh}", "--cells", "0"], "--cells"),
                                        (["{fresh}", "--cells", "x"], "--cells"),
                                        (["{fresh}", "--cells", "99"], "--cells=99"),
                                        (["{fresh}", "--steps", "-1"], "--steps")])
def test_bad_input_is_one_line_and_exit_2_before_any_work(fresh, tmp_path, capsys, monkeypatch, argv, field):
    monkeypatch.setattr(verify, "rerun", lambda *a: pytest.fail("re-ran a cell on bad input"))
    code, lines, err = _verify(capsys, *(a.format(tmp=tmp_path, fresh=fresh) for a in argv))
    assert code == 2 and not lines and field in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_an_empty_runs_folder_is_bad_input(tmp_path, capsys):
    (tmp_path / "runs" / "x").mkdir(parents=True)
    code, _, err = _verify(capsys, str(tmp_path))
    assert code == 2 and "no finished run" in err


def test_first_difference_is_bit_exact():
    a = pd.DataFrame({"step": [0, 1], "x": [0.0, math.nan], "perf/step_s": [1.0, 2.0]})
    same = a.assign(**{"perf/step_s": [5.0, 6.0]})  # timings are not compared
    assert verdicts.first_difference("metrics", a, same) is None
    signed = a.assign(x=[-0.0, math.nan])
    diff = verdicts.first_difference("metrics", a, signed)
    assert (diff.step, diff.column, diff.columns_differing, diff.columns_compared) == (0, "x", 1, 2)
    short = verdicts.first_difference("metrics", a, a.iloc[:1])
    assert (short.step, short.column, short.reference, short.rerun) == (1, "", 1, 0)


X86 = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
stepping\t: 8
flags\t\t: fpu sse4_2 avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 ht

processor\t: 1
vendor_id\t: OtherVendor
"""


def test_cpuinfo_names_the_processor_and_only_the_kernel_flags():
    got = cpuinfo.parse_cpuinfo(X86)
    assert got == {"vendor": "GenuineIntel", "family": "6", "model": "143", "model_name":
                   "Intel(R) Xeon(R) Platinum 8480+", "stepping": "8",
                   "flags": ["sse4_2", "fma", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]}
    arm = cpuinfo.parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n")
    assert arm == {"vendor": "0x41", "flags": ["asimd", "sve"]}


def test_without_proc_cpuinfo_the_record_falls_back_to_platform(monkeypatch, tmp_path):
    monkeypatch.setattr(cpuinfo, "CPUINFO", tmp_path / "missing")
    cpuinfo.processor_info.cache_clear()
    try:
        got = cpuinfo.processor_info()
    finally:
        cpuinfo.processor_info.cache_clear()
    assert got["source"] == "platform" and "flags" not in got


def test_every_manifest_records_the_processor_and_the_cold_start(fresh):
    manifest = json.loads((fresh / "runs" / "gspo-s1" / "manifest.json").read_text())
    assert manifest["machine"]["cpu"] == cpuinfo.processor_info() == machine_info()["cpu"]
    meta = json.loads(next((fresh.parent / "cache").glob("*/coldstart.json")).read_text())
    assert manifest["coldstart"]["steps"] == meta["steps"] and manifest["coldstart"]["key"] == meta["key"]


class _Reexec(Exception):
    pass


def test_a_pinned_reference_is_re_run_with_its_own_pins(fresh, tmp_path, capsys, monkeypatch):
    from moe_lab.launch.isa import PINS

    ref = _copy(fresh, tmp_path)
    for run in (ref / "runs").iterdir():
        _edit_manifest(run, lambda m: m["machine"].update(env=PINS["avx2"]))
    for key in PINS["avx2"]:
        monkeypatch.delenv(key, raising=False)
    calls = []

    def execve(path, args, env):
        calls.append((args, env))
        raise _Reexec

    monkeypatch.setattr(verify.os, "execve", execve)
    with pytest.raises(_Reexec):
        main(["verify", str(ref), "--cells", "1"])
    args, env = calls[0]
    assert args[-3:] == [str(ref), "--cells", "1"] and "verify" in args
    assert {k: env.get(k) for k in PINS["avx2"]} == PINS["avx2"]
    # runs made with different pins cannot share one process: bad input, before any work
    _edit_manifest(ref / "runs" / "gspo-s0", lambda m: m["machine"].update(env={}))
    code, _, err = _verify(capsys, str(ref))
    assert code == 2 and "different kernel pins" in err and len(calls) == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA config runs on this machine")
def test_a_cell_this_machine_cannot_run_is_bad_input(fresh, tmp_path, capsys):
    ref = _copy(fresh, tmp_path)
    config = ref / "runs" / "grpo-s0" / "config.yaml"
    config.write_text(config.read_text().replace("device: cpu", "device: cuda"))
    assert "device: cuda" in config.read_text()
    code, lines, err = _verify(capsys, str(ref))
    assert code == 2 and not lines and "grpo-s0/config.yaml: cannot re-run here: model.device" in err


def test_a_cell_that_fails_to_re_run_says_why_and_the_others_still_run(fresh, capsys, monkeypatch):
    real = verify.rerun

    def rerun(ref, *args):
        if ref.run_id == "grpo-s0":
            raise RuntimeError("out of\nmemory")
        return real(ref, *args)

    monkeypatch.setattr(verify, "rerun", rerun)
    code, lines, _ = _verify(capsys, str(fresh), "--steps", "1")
    assert code == 1 and lines[0] == "grpo-s0: not re-run (RuntimeError: out of memory)"
    assert lines[1].startswith("gspo-s0: bit-identical")


def test_a_bad_endpoints_block_is_bad_input_for_a_whole_cell(fresh, tmp_path, capsys, monkeypatch):
    ref = _copy(fresh, tmp_path)
    (ref / "experiment.yaml").write_text((ref / "experiment.yaml").read_text() + "endpoints: {primary: 3}\n")
    monkeypatch.setattr(verify, "rerun", lambda *a: pytest.fail("re-ran a cell on bad input"))
    code, _, err = _verify(capsys, str(ref), "--steps", "all")
    assert code == 2 and "endpoints.primary" in err


def test_the_committed_golden_run_names_its_processor_and_its_pins():
    from moe_lab.launch.isa import PINS

    golden = ROOT / "results" / "reference" / "golden"
    default, avx2 = verify.load_reference(golden / "default"), verify.load_reference(golden / "avx2")
    assert [r.run_id for r in default] == [r.run_id for r in avx2] and len(default) == 4
    for run in (*default, *avx2):
        cpu = run.manifest["machine"]["cpu"]
        assert cpu["model_name"] and set(cpu["flags"]) <= set(cpuinfo.KERNEL_FLAGS)
        assert run.manifest["coldstart"]["steps"] > 0
    assert verify.recorded_pins(default) == {} and verify.recorded_pins(avx2) == PINS["avx2"]


def test_ctrl_c_leaves_nothing_behind(fresh, capsys, monkeypatch):
    def interrupted(ref, steps, out, cache):
        made.append(out)
        raise KeyboardInterrupt

    made = []
    monkeypatch.setattr(verify, "rerun", interrupted)
    code, lines, err = _verify(capsys, str(fresh))
    assert code == 130 and not lines and "nothing to resume" in err
    assert made and not made[0].exists()  # the temporary folder is gone
