"""Endpoints fixed before the runs and the pairwise comparison (`moe-lab compare`): the intervals and p-values
equal independent computations (scipy), a stopped run's last evaluation is carried forward on the schedule,
bad endpoint blocks get one line, and the CLI prints what the library computes."""

from __future__ import annotations

import io
import itertools
import math

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from moe_lab.analysis import stats as lab_stats
from moe_lab.analysis.stats import permutation_p
from moe_lab.analysis.endpoints import (EndpointSpec, compare_arms, eval_schedule, run_endpoints,
                                        unfinished_runs)
from moe_lab.cli import main
from moe_lab.config import ConfigError
from moe_lab.launch.experiment import check_shape, endpoint_spec

RESCUE = "results/reference/replay_rescue"


def test_welch_interval_is_scipys():
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.6, 0.05, 10), rng.normal(0.3, 0.25, 7)
    per_run = pd.DataFrame({"arm_base": ["x"] * 10 + ["y"] * 7, "setting": "", "primary": np.r_[a, b],
                            "secondary": np.r_[b[:5], a[:5], a[:7]], "collapsed": False})
    row = compare_arms(per_run, baseline="y").iloc[0]
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval()
    assert row["primary_diff"] == pytest.approx(a.mean() - b.mean(), abs=1e-12)
    # t quantiles between table rows are interpolated in 1/df (stats.t_quantile_975): ~1e-4 of the half-width
    half = (ci.high - ci.low) / 2
    assert row["primary_lo"] == pytest.approx(ci.low, abs=1e-3 * half)
    assert row["primary_hi"] == pytest.approx(ci.high, abs=1e-3 * half)


@pytest.mark.parametrize("n_a,n_b", [(3, 4), (5, 5), (6, 4)])
def test_permutation_p_is_the_exact_share_of_splits(n_a, n_b):
    rng = np.random.default_rng(n_a * 10 + n_b)
    a, b = rng.normal(0.5, 0.2, n_a), rng.normal(0.3, 0.2, n_b)
    p, exact = permutation_p(a, b)
    # two-sided as |difference| >= observed (scipy's "two-sided" doubles the smaller tail instead, which
    # differs for unequal group sizes): scipy's one-sided test of the absolute difference
    ref = stats.permutation_test((a, b), lambda x, y: abs(np.mean(x) - np.mean(y)), permutation_type="independent",
                                 alternative="greater", n_resamples=math.comb(n_a + n_b, n_a) * 2)
    assert exact and p == pytest.approx(ref.pvalue, abs=1e-12)


def test_permutation_p_of_fully_separated_groups_is_the_smallest_possible():
    p, _ = permutation_p([1.0, 1.1, 1.2, 1.3, 1.4], [0.0, 0.1, 0.2, 0.3, 0.4])
    assert p == pytest.approx(2 / math.comb(10, 5))  # the observed split and its mirror


def _evals(steps_acc: dict[str, dict[int, float]], steps: int = 150, every: int = 10) -> pd.DataFrame:
    rows = [{"experiment": "e", "arm": arm, "seed": 0, "run_id": f"{arm}-s0", "step": st, "eval/acc_greedy": v,
             "rl.steps": steps, "rl.eval_every": every, "collapsed_at": math.nan, "status": "done"}
            for arm, acc in steps_acc.items() for st, v in acc.items()]
    return pd.DataFrame(rows)


def test_a_stopped_run_carries_its_last_evaluation_forward_on_the_schedule():
    full = {s: 0.5 for s in range(0, 151, 10)}
    stopped = {**{s: 0.6 for s in range(0, 120, 10)}, 119: 0.0}  # a collapse rule stopped it at step 119
    out = run_endpoints(pd.DataFrame(), _evals({"a": full, "b": stopped})).set_index("arm")
    assert out.loc["a", "primary"] == pytest.approx(0.5)
    # schedule 110..150: 110 -> 0.6 (logged), 120..150 -> 0.0 (the policy it stopped with)
    assert out.loc["b", "primary"] == pytest.approx(0.6 / 5)
    assert eval_schedule(150, 10)[-5:] == [110, 120, 130, 140, 150]
    assert eval_schedule(25, 10) == [0, 10, 20, 25]


def test_secondary_is_the_mean_over_the_last_quarter_of_scheduled_steps():
    ev = _evals({"a": {0: 0.1, 8: 0.2}, "b": {0: 0.1, 5: 0.0}}, steps=8, every=4)
    metrics = pd.DataFrame({"experiment": "e", "arm": ["a"] * 4 + ["b"] * 2, "seed": 0,
                            "run_id": ["a-s0"] * 4 + ["b-s0"] * 2, "step": [5, 6, 6, 7, 4, 5],
                            "reward/mean": [0.5, 0.2, 0.4, 0.9, 0.7, 0.1]})
    out = run_endpoints(metrics, ev).set_index("arm")["secondary"]
    # an 8-step run logs steps 0..7: the last ceil(0.25 * 8) = 2 are steps 6 (mean 0.3) and 7
    assert out["a"] == pytest.approx((0.3 + 0.9) / 2)
    # b stopped after step 5: its last reward carried over steps 6 and 7
    assert out["b"] == pytest.approx(0.1)


def test_runs_not_finished_have_no_endpoint_yet():
    ev = _evals({"a": {0: 0.5, 10: 0.6}, "b": {0: 0.5}})
    ev.loc[ev["arm"] == "b", "status"] = "running"
    assert run_endpoints(pd.DataFrame(), ev)["arm"].tolist() == ["a"]
    assert unfinished_runs(ev) == ["b-s0"]


@pytest.mark.parametrize("block,field", [
    ({"primary": {"metric": "eval/acc_greedy", "last_evals": 0}}, "endpoints.primary.last_evals"),
    ({"secondary": {"last_frac": 1.5}}, "endpoints.secondary.last_frac"),
    ({"primary": {"n": 5}}, "endpoints.primary"),
    ({"quaternary": {}}, "endpoints: unknown key"),
    ({"tertiary": "accuracy"}, "endpoints.tertiary"),
    ("last 5", "endpoints"),
])
def test_a_bad_endpoints_block_is_one_line_naming_the_field(block, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        check_shape({"name": "x", "endpoints": block})


def test_experiment_files_of_the_confirmation_runs_fix_the_default_endpoints():
    from moe_lab.cli import read_experiment

    for name in ("replay_rescue_confirm", "router_controls", "learning_rescue"):
        assert endpoint_spec(read_experiment(name)) == EndpointSpec()


def test_compare_prints_the_library_table(capsys):
    assert main(["compare", RESCUE, "--baseline", "grpo", "--csv"]) == 0
    printed = pd.read_csv(io.StringIO(capsys.readouterr().out))
    from moe_lab.analysis.endpoints import load_comparison

    _, per_run, _, pairs = load_comparison(RESCUE, "grpo")
    assert printed["arm"].tolist() == pairs["arm"].tolist() == ["grpo_r2", "grpo_r3", "gspo", "gspo_token"]
    np.testing.assert_allclose(printed["primary_diff"], pairs["primary_diff"], rtol=1e-12)
    means = per_run.groupby("arm_base")["primary"].mean()
    np.testing.assert_allclose(pairs["primary_diff"], [means[a] - means["grpo"] for a in pairs["arm"]], atol=1e-12)


def test_compare_pairs_every_arm_within_a_setting_only():
    per_run = pd.DataFrame({"arm_base": ["g", "r", "s"] * 2, "setting": ["c=1"] * 3 + ["c=2"] * 3,
                            "primary": np.arange(6.0), "secondary": np.arange(6.0), "collapsed": False})
    pairs = compare_arms(per_run)
    assert list(zip(pairs["setting"], pairs["arm"], pairs["vs"])) == [
        (s, a, b) for s in ("c=1", "c=2") for a, b in itertools.combinations("grs", 2)]


@pytest.mark.parametrize("argv,needle", [(["compare", "/no/such/folder"], "RESULTS_DIR=/no/such/folder"),
                                         (["compare", RESCUE, "--baseline", "ppo"], "--baseline=ppo")])
def test_compare_bad_input_is_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


# The findings are an index of generated reports (tests/test_report.py regenerates each): what compare prints of an
# experiment's declared contrasts, on both endpoints, is in its REPORT.md as printed.
@pytest.mark.parametrize("reference", ["expert_bias", "rollout_mismatch"])
def test_compare_prints_both_endpoints_declared_contrasts_as_the_report_does(reference, capsys):
    folder = Path(__file__).resolve().parents[1] / "results" / "reference" / reference
    assert main(["compare", str(folder)]) == 0
    printed = capsys.readouterr().out
    report = (folder / "REPORT.md").read_text(encoding="utf-8")
    for column in ("primary", "secondary"):
        head = f"declared contrasts on the {column} endpoint"
        assert head in printed
        block = printed[printed.index(head):].split("\n\n")[:2]  # the header line and its table
        assert "\n\n".join(block).strip() in report


def test_a_monte_carlo_permutation_p_is_never_zero_and_ignores_which_arm_comes_first():
    from moe_lab.analysis import endpoints

    # 30 vs 30: past the exact limit, and every split drawn is less extreme than the observed one
    low, high = np.arange(30.0), np.arange(30.0) + 100
    p, exact = permutation_p(low, high)
    assert not exact and p == 1 / (lab_stats.MC_SAMPLES + 1)
    rng = np.random.default_rng(7)
    a, b = rng.normal(0, 1, 30), rng.normal(0.5, 1, 31)
    assert permutation_p(a, b) == permutation_p(b, a)


def test_the_monte_carlo_p_estimates_the_exact_one(monkeypatch):
    from moe_lab.analysis import endpoints

    rng = np.random.default_rng(11)
    a, b = rng.normal(0, 1, 9), rng.normal(0.8, 1, 8)  # 24,310 splits: enumerable, and small enough to sample
    exact_p, exact = permutation_p(a, b)
    monkeypatch.setattr(lab_stats, "EXACT_LIMIT", 100)
    mc_p, mc_exact = permutation_p(a, b)
    assert exact and not mc_exact
    assert abs(mc_p - exact_p) < 5 * math.sqrt(exact_p * (1 - exact_p) / lab_stats.MC_SAMPLES) + 1e-5


def test_a_p_value_below_a_thousandth_keeps_its_digits():
    from moe_lab.analysis.endpoints import format_p

    p, exact = permutation_p(np.arange(10.0), np.arange(10.0) + 100)  # every seed of one arm above the other's
    assert exact and p == pytest.approx(2 / math.comb(20, 10))
    assert format_p(p) == "1.1e-05" and format_p(0.0019) == "0.0019" and format_p(1.0) == "1.0000"
