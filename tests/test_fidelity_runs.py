"""`moe-lab fidelity` on finished runs and the harness alarm: clip binding, update index, slope test, bands judged on
intervals, an experiment folder read per arm (--json round trip), the alarm rule, its manifest flag and the
report's list, bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moe_lab import cli
from moe_lab.analysis import run_fidelity as rf
from moe_lab.analysis.stats import ols_slope_ci
from moe_lab.audit import fidelity_runs
from moe_lab.audit import fidelity_table as ft
from moe_lab.store import harness

ROOT = Path(__file__).resolve().parents[1]
ROUTING_MATTERS = ROOT / "results" / "reference" / "routing_matters"


def frame(norms, clips=None, steps=None, algo="grpo", grad_clip=1.0, change=None) -> pd.DataFrame:
    n = len(norms)
    steps = steps or [i // 4 for i in range(n)]
    return pd.DataFrame({"step": steps, "minibatch": [i % 4 for i in range(n)], "update": range(n),
                         "optim/grad_norm": norms, "clip_frac/active": clips if clips is not None else [0.1] * n,
                         "routing/expert_change_latent": change if change is not None else [0.0] * n,
                         "response/length_mean": [17.0] * n, "mismatch/router_change": [0.1] * n,
                         "rl.grad_clip": grad_clip, "rl.algo": algo})


def test_the_clip_binding_share_counts_norms_above_the_clip():
    rng = np.random.default_rng(0)
    norms = list(rng.uniform(0.2, 1.8, 40)) + [math.nan, 1.0]  # a non-finite norm is no update; == clip: no bind
    expected = sum(g > 1.0 for g in norms[:40]) / 41
    row = rf.run_row(frame(norms))
    assert row["clip_binds"] == pytest.approx(expected)
    assert row["grad_norm_median"] == pytest.approx(float(np.nanmedian(norms)))
    assert math.isnan(rf.run_row(frame(norms, grad_clip=0.0))["clip_binds"])  # clip off: never binds, no share


def test_expert_change_after_m_updates_reads_the_m_th_update_of_each_batch():
    change = [0.0, 0.01, 0.02, 0.05, 0.0, 0.03, 0.04, 0.07]
    row = rf.run_row(frame([0.5] * 8, change=change).sample(frac=1, random_state=1))  # row order must not matter
    assert row["expert_change_u1"] == pytest.approx((0.01 + 0.03) / 2)
    assert row["expert_change_u3"] == pytest.approx((0.05 + 0.07) / 2)
    assert row["clip_frac_u0"] == pytest.approx(0.1)


def test_the_slope_test_is_ols_over_the_last_third_of_evaluations():
    x = np.arange(0, 70, 10.0)
    exact = ols_slope_ci(x, 0.3 + 0.002 * x)
    assert exact == pytest.approx((0.002, 0.002, 0.002))  # on a line: no residual, a zero-width interval
    y = np.array([0.1, 0.5, 0.6, 0.62, 0.7, 0.66, 0.73])
    evals = pd.DataFrame({"step": x, "eval/acc_greedy": y})
    assert list(rf.last_third(evals)["step"]) == [40.0, 50.0, 60.0]  # ceil(7/3) = 3
    slope, lo, hi = rf.curve_slope(evals)
    assert slope == pytest.approx(100 * np.polyfit(x[-3:], y[-3:], 1)[0])
    resid = y[-3:] - np.polyval(np.polyfit(x[-3:], y[-3:], 1), x[-3:])
    se = math.sqrt((resid ** 2).sum() / 1 / ((x[-3:] - x[-3:].mean()) ** 2).sum())
    assert hi - slope == pytest.approx(100 * 12.706204736 * se)  # t_{0.975, 1 df}


@pytest.mark.parametrize("stat, verdict, ok, point", [((0.1, 0.08, 0.12), "pass", True, True),
                                                      ((0.1, 0.01, 0.3), "edge", False, True),
                                                      ((0.3, 0.25, 0.5), "FAIL", False, False),
                                                      ((0.1, math.nan, math.nan), "-", None, True)])
def test_in_band_is_judged_on_the_interval(stat, verdict, ok, point):
    row = ft.router_row(stat, "units")  # band: within 2x of 10%, [0.05, 0.2]
    assert (row.verdict, row.ok, row.point_ok) == (verdict, ok, point)


def test_the_alarm_fires_above_a_quarter_of_updates_or_on_a_silent_clip():
    quarter = [1.5] * 10 + [0.5] * 30  # binds on exactly 25%: no alarm
    assert harness.alarm(frame(quarter).to_dict("records"), {"grad_clip": 1.0, "algo": "grpo"}) == []
    more = [1.5] * 11 + [0.5] * 29
    (line,) = harness.alarm(frame(more).to_dict("records"), {"grad_clip": 1.0, "algo": "grpo"})
    assert line.startswith("grad_clip_binds:") and "11 of 40" in line
    assert harness.alarm(frame(more).to_dict("records"), {"grad_clip": 0.0, "algo": "grpo"}) == []  # clip off
    silent = frame([0.5] * 8, clips=[0.0] * 8).to_dict("records")
    (line,) = harness.alarm(silent, {"grad_clip": 1.0, "algo": "grpo"})
    assert line.startswith("ratio_clip_silent:")
    assert harness.alarm(silent, {"grad_clip": 1.0, "algo": "sapo"}) == []  # no clipped surrogate: nothing to fire
    once = frame([0.5] * 8, clips=[0.0] * 7 + [1e-4]).to_dict("records")
    assert harness.alarm(once, {"grad_clip": 1.0, "algo": "grpo"}) == []


def _copy_runs(tmp_path: Path, names: list[str]) -> Path:
    out = tmp_path / "exp"
    (out / "runs").mkdir(parents=True)
    shutil.copy(ROUTING_MATTERS / "experiment.yaml", out / "experiment.yaml")
    for name in names:
        shutil.copytree(ROUTING_MATTERS / "runs" / name, out / "runs" / name)
    return out


PAIR = ["gspo_mb4-s7010", "grpo_r2_mb4-s7010", "grpo_mb4-s7010", "gspo_mb4-s7020", "grpo_r2_mb4-s7020",
        "grpo_mb4-s7020"]


def test_an_experiment_folder_gives_the_clip_ratio_over_grpo_r2_per_arm_and_json(tmp_path, capsys):
    folder = _copy_runs(tmp_path, PAIR)
    assert cli.main(["fidelity", str(folder), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    rows = {(r["arm"], r["key"]): r for r in record["rows"]}
    table = {n: pd.read_parquet(folder / "runs" / n / "metrics.parquet") for n in PAIR}

    def ratio(base: str, update: int | None = None) -> float:  # one run per cold start: the mean of run means
        def mean(arm):
            return np.mean([t.loc[t["minibatch"] == update if update is not None else slice(None),
                                  "clip_frac/active"].mean() for n, t in table.items() if n.startswith(arm + "-")])
        return mean("gspo_mb4") / mean(base)

    assert rows[("gspo_mb4 / grpo_r2_mb4", "clip_ratio_replay")]["value"] == pytest.approx(ratio("grpo_r2_mb4"))
    assert rows[("gspo_mb4 / grpo_r2_mb4", "clip_ratio_replay_u2")]["value"] == pytest.approx(ratio("grpo_r2_mb4", 2))
    assert rows[("gspo_mb4 / grpo_mb4", "clip_ratio")]["value"] == pytest.approx(ratio("grpo_mb4"))
    grpo = [table[f"grpo_mb4-s70{c}0"] for c in (1, 2)]
    share = np.mean([(t["optim/grad_norm"] > 1.0).mean() for t in grpo])
    assert rows[("grpo_mb4", "grad_clip_share")]["value"] == pytest.approx(share)
    assert rows[("grpo_mb4", "grad_clip_share")]["units"] == "2 cold starts"
    assert cli.main(["fidelity", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "-- gspo_mb4 / grpo_r2_mb4" in text and "clip_ratio_replay" in text


def test_the_report_lists_flagged_runs_and_a_manifest_flag_wins(tmp_path):
    folder = _copy_runs(tmp_path, ["grpo_r2_mb1-s7010", "grpo_r2_mb4-s7010"])
    from moe_lab.analysis.tables import load_runs

    metrics, _ = load_runs(folder)
    table = rf.alarms(metrics).set_index("run_id")
    mb1 = metrics[metrics["run_id"] == "grpo_r2_mb1-s7010"]
    assert table.loc["grpo_r2_mb1-s7010", "alarm"] == harness.alarm(mb1.to_dict("records"), {"algo": "grpo"})
    assert any(a.startswith("ratio_clip_silent") for a in table.loc["grpo_r2_mb1-s7010", "alarm"])  # on-policy
    lines = "\n".join(rf.format_alarms(rf.alarms(metrics)))
    assert "grpo_r2_mb1-s7010" in lines
    manifest = folder / "runs" / "grpo_r2_mb1-s7010" / "manifest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, harness.MANIFEST_KEY: []}))  # what the run itself recorded
    table = rf.alarms(metrics).set_index("run_id")
    assert table.loc["grpo_r2_mb1-s7010", "alarm"] == [] and table.loc["grpo_r2_mb1-s7010", "source"] == "manifest"


def test_a_run_writes_the_alarm_into_its_manifest_and_one_line(tmp_path, capsys):
    from test_train import tiny

    from moe_lab.rl.loop import train

    cfg = tiny(tmp_path, "rl.steps=2", "rl.minibatches=1", "rl.grad_clip=1e-9")
    train(cfg, tmp_path / "run", run_id="a")
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    rows_ = pd.read_parquet(tmp_path / "run" / "metrics.parquet").to_dict("records")
    assert manifest[harness.MANIFEST_KEY] == harness.alarm(rows_, cfg.rl)
    assert [a.split(":")[0] for a in manifest[harness.MANIFEST_KEY]] == ["grad_clip_binds", "ratio_clip_silent"]
    err = [line for line in capsys.readouterr().err.splitlines() if "harness alarm" in line]
    assert len(err) == 1 and "grad_clip_binds" in err[0]
    rows = {r.key: r for r in fidelity_runs.measure(tmp_path / "run")[0]}  # the finished run's own rows
    assert rows["grad_clip_share"].value == 1.0 and rows["grad_clip_share"].units == "2 steps"
    assert rows["grad_norm_median"].value == pytest.approx(np.mean([np.median([r["optim/grad_norm"] for r in rows_
                                                                             if r["step"] == s]) for s in (0, 1)]))


@pytest.mark.parametrize("case", ["overrides", "empty", "unfinished"])
def test_bad_folders_are_one_line_and_exit_2(tmp_path, capsys, case):
    folder = _copy_runs(tmp_path, ["grpo_mb4-s7010"])
    argv = ["fidelity", str(folder)]
    if case == "overrides":
        argv.append("rl.lr=0.1")
    elif case == "empty":
        shutil.rmtree(folder / "runs" / "grpo_mb4-s7010")
        (folder / "runs" / "x").mkdir()
    else:
        manifest = folder / "runs" / "grpo_mb4-s7010" / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "status": "running"}))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-lab fidelity: error:") and "\n" not in err
