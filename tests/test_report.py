"""`moe-lab report`: every committed experiment's REPORT.md is what the command generates from its folder today;
the secondary endpoint's declared contrasts are at the cold-start level (the t over per-cold-start differences,
checked against scipy); a verdict may quote only numbers the tables print; a file naming TOST declares a margin;
the descriptive window means equal an independent computation."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from moe_lab.analysis.contrasts import declared_contrasts
from moe_lab.analysis.endpoints import load_comparison
from moe_lab.analysis.report import REPORT_FILE, build, check_verdict, window_means
from moe_lab.commands.run import read_experiment
from moe_lab.config import ConfigError, load_yaml
from moe_lab.launch.design import Describe, check_tost_named, contrasts_spec, describe_spec

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "results" / "reference"


def experiment_folders() -> list[Path]:
    """Every experiment under results/reference (a folder with experiment.yaml or runs/, one level down or, for
    golden/, two)."""
    found = [*REFERENCE.glob("*/"), *REFERENCE.glob("*/*/")]
    return sorted(p for p in found if p.is_dir() and p.name not in ("runs", "coldstarts", "figures")
                  and p.parent.name != "runs" and ((p / "experiment.yaml").is_file() or (p / "runs").is_dir()))


def _in_git() -> bool:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("folder", experiment_folders(), ids=lambda p: p.relative_to(REFERENCE).as_posix())
def test_every_committed_report_is_what_the_command_generates(folder, monkeypatch):
    if not _in_git():
        pytest.skip("the provenance section reads the experiment file's commit from git")
    monkeypatch.chdir(ROOT)
    where = folder.relative_to(ROOT).as_posix()
    committed = (folder / REPORT_FILE).read_text(encoding="utf-8")
    assert build(where, figures=False, shown_as=where).text == committed, \
        f"{where}/{REPORT_FILE} is stale: regenerate it with `moe-lab report {where}`"
    for line in committed.splitlines():  # every figure the page links is committed beside it
        if line.startswith("![") and line.endswith(")"):
            assert (folder / line[line.index("(") + 1:-1]).is_file(), line


def test_the_secondary_endpoint_is_compared_over_cold_starts():
    folder = REFERENCE / "expert_bias"
    _, per_run, _, _ = load_comparison(folder)
    table = declared_contrasts(per_run, contrasts_spec(load_yaml(str(folder / "experiment.yaml"))), "secondary")
    row = table.iloc[0]
    runs = per_run[per_run["setting"] == row["setting"]]
    means = runs.groupby(["block", "arm_base"])["secondary"].mean().unstack()
    diffs = (means[row["arm"]] - means[row["vs"]]).to_numpy()
    t = stats.ttest_1samp(diffs, 0.0)
    lo, hi = t.confidence_interval(0.95)
    assert len(diffs) == row["blocks"] == 6 and row["df"] == 5
    assert np.allclose([row["diff"], row["lo"], row["hi"], row["p"]], [diffs.mean(), lo, hi, t.pvalue])
    assert table["holm_p"].isna().all()  # Holm's family is the primary contrasts on the primary endpoint


def test_a_verdict_may_quote_only_numbers_the_tables_print():
    tables = "| a | -0.007 [-0.020, +0.006] | 0.4695 | 0/72 | 7.45e-4 |"
    check_verdict("R3 minus R2: -0.007 [-0.020, +0.006], Holm p 0.4695, 0/72 collapsed, k3 7.45e-4", tables, "x")
    check_verdict("an unsigned 0.007 matches either sign; R3 and k3 are names, not numbers", tables, "x")
    for wrong in ("Holm p 0.47", "k3 7.5e-4", "+0.007 better", "about 5%"):
        with pytest.raises(ConfigError, match="verdict: the number"):
            check_verdict(wrong, tables, "x")


def test_a_file_naming_tost_must_declare_its_margin(tmp_path):
    base = {"arms": {"a": {}, "b": {}}, "contrasts": {"primary": [{"arm": "a", "vs": "b"}]}}
    with pytest.raises(ConfigError, match=r"x\.yaml: names TOST .*equivalence_margin"):
        check_tost_named("# TOST on it\n", base, "x.yaml")
    check_tost_named("# a difference test\n", base, "x.yaml")
    with_margin = {**base, "contrasts": {"primary": [{"arm": "a", "vs": "b", "equivalence_margin": 0.05}]}}
    check_tost_named("# TOST at the margin below\n", with_margin, "x.yaml")
    path = tmp_path / "named.yaml"
    path.write_text("# TOST, no margin\nname: named\narms: {a: {}, b: {}}\ncontrasts: {primary: [{arm: a, vs: b}]}\n")
    with pytest.raises(ConfigError, match="named.yaml: names TOST"):
        read_experiment(str(path))
    for shipped in sorted((ROOT / "experiments").glob("*.yaml")):  # every shipped file passes the rule
        read_experiment(str(shipped))


def test_the_analysis_fields_of_a_results_copy_are_its_experiment_files():
    for name in ("expert_bias", "rollout_mismatch"):
        shipped = read_experiment(str(ROOT / "experiments" / f"{name}.yaml"))
        copy = load_yaml(str(REFERENCE / name / "experiment.yaml"))
        assert {k: shipped[k] for k in ("describe", "verdict")} == {k: copy[k] for k in ("describe", "verdict")}


def test_window_means_average_each_step_then_the_window():
    rows = []
    for run, offset in (("a-s0", 0.0), ("b-s0", 10.0)):
        for step in range(6):
            for update in range(2):  # a per-update metric: two rows a step
                rows.append({"run_id": run, "step": step, "m": offset + step + update * 0.5})
    metrics = pd.DataFrame(rows)
    per_run = pd.DataFrame({"run_id": ["a-s0", "b-s0"], "setting": "", "arm_base": ["a", "b"], "block": "all"})
    got = window_means(metrics, per_run, Describe(("m",), {"w": (2, 4)}), "w").set_index("run_id")["m"]
    assert got.to_dict() == {"a-s0": 3.25, "b-s0": 13.25}  # steps 2..4: means 2.25, 3.25, 4.25


def test_a_malformed_describe_block_is_one_line():
    with pytest.raises(ConfigError, match="describe.windows"):
        describe_spec({"describe": {"metrics": ["m"], "windows": {"w": [5, 2]}}})
    with pytest.raises(ConfigError, match="describe.metrics"):
        describe_spec({"describe": {"metrics": [], "windows": {"w": [0, 1]}}})
    assert describe_spec({}) is None


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from moe_lab.cli import main

    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "RESULTS=" in err and "no such folder" in err
    assert not (tmp_path / "missing").exists()  # nothing written before the input was checked


def test_the_detectable_difference_is_where_a_t_test_has_80_percent_power():
    from moe_lab.analysis.stats import detectable_difference

    se, df = 0.006, 5.0
    delta = detectable_difference(se, df)
    crit = stats.t.ppf(0.975, df)
    # the approximation's power: P(T > crit) for T ~ t_df shifted by delta/se (the skew of the non-central t ignored)
    assert stats.t.sf(crit - delta / se, df) == pytest.approx(0.8, abs=1e-12)
    exact = stats.nct.sf(crit, df, delta / se)  # the non-central t's power at that difference: close, not equal
    assert 0.75 < exact < 0.85
