"""The replay map's table equals per-run reductions computed by hand; Welch intervals match scipy's."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from moe_lab.analysis import figures
from moe_lab.analysis import replay_map
from moe_lab.analysis import replay_plots
from moe_lab.analysis import stats as lab_stats
from moe_lab.launch.compose import arm_presets


def _frames(cells: dict[str, tuple[list[float], list[float]]], steps: int = 3):
    """cells: arm -> (per-seed routing share, per-seed final accuracy). Shares vary within a run around the
    given mean (so the per-run mean is what is tested), accuracies are the value at the last eval step. Each arm
    runs the config of the preset its base name is (the map finds its reference and treatments there)."""
    metrics, evals = [], []
    for arm, (shares, accs) in cells.items():
        config = {f"rl.{k}": v for k, v in arm_presets()[arm.split("__")[0]].overrides["rl"].items()}
        for seed, (share, acc) in enumerate(zip(shares, accs)):
            for step in range(steps):
                for mb, delta in enumerate((-0.01, 0.01)):
                    metrics.append({"arm": arm, **config, "seed": seed, "run_id": f"{arm}-s{seed}", "step": step,
                                    "minibatch": mb, replay_map.SHARE: share + delta,
                                    "ratio/token_var": 1.0, "optim/grad_norm": 1.0})
            for step, value in ((0, 0.5), (steps, acc)):  # the final evaluation is the one that counts
                evals.append({"arm": arm, "seed": seed, "run_id": f"{arm}-s{seed}", "step": step,
                              "eval/acc_greedy": value})
    return pd.DataFrame(metrics), pd.DataFrame(evals)


CELLS = {"grpo__base": ([0.50, 0.60, 0.55], [0.10, 0.20, 0.00]),
         "grpo_r2__base": ([0.0, 0.0, 0.0], [0.60, 0.65, 0.62]),
         "gspo__base": ([0.3, 0.3, 0.3], [0.50, 0.70, 0.60]),
         "grpo__top_k=2": ([0.10, 0.20, 0.15], [0.70, 0.72, 0.74]),
         "grpo_r2__top_k=2": ([0.0, 0.0, 0.0], [0.70, 0.71, 0.75])}


def test_welch_interval_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    a, b = [0.60, 0.65, 0.62, 0.58], [0.10, 0.20, 0.00]
    diff, lo, hi = lab_stats.welch_diff_ci(a, b)
    test = stats.ttest_ind(a, b, equal_var=False)
    assert diff == pytest.approx(np.mean(a) - np.mean(b), abs=1e-12)
    se = math.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b))
    half = stats.t.ppf(0.975, math.floor(test.df)) * se  # Welch's df, floored (documented: conservative)
    assert (lo, hi) == pytest.approx((diff - half, diff + half), rel=1e-9)
    ci = test.confidence_interval(0.95)
    assert lo <= ci.low and hi >= ci.high  # never narrower than the exact-df interval


def test_welch_interval_is_antisymmetric_and_nan_without_spread():
    a, b = [0.1, 0.4, 0.3], [0.5, 0.9]
    d1, lo1, hi1 = lab_stats.welch_diff_ci(a, b)
    d2, lo2, hi2 = lab_stats.welch_diff_ci(b, a)
    assert (d1, lo1, hi1) == pytest.approx((-d2, -hi2, -lo2))
    assert math.isnan(lab_stats.welch_diff_ci([0.3], [0.1, 0.2])[1])


def test_table_is_the_per_run_mean_share_and_the_final_accuracy_gap():
    metrics, evals = _frames(CELLS)
    table = replay_map.replay_map_table(metrics, evals).set_index(["factor", "level", "treatment"])
    base_r2 = table.loc[("base", "", "grpo_r2")]
    assert base_r2["share"] == pytest.approx(np.mean([0.50, 0.60, 0.55]))
    assert base_r2["gap"] == pytest.approx(np.mean([0.60, 0.65, 0.62]) - np.mean([0.10, 0.20, 0.00]))
    assert base_r2["gap_lo"] < base_r2["gap"] < base_r2["gap_hi"]
    assert table.loc[("base", "", "gspo")]["gap"] == pytest.approx(0.6 - 0.1)
    top2 = table.loc[("top_k", "2", "grpo_r2")]
    assert top2["share"] == pytest.approx(0.15)
    assert top2["gap"] == pytest.approx(np.mean([0.70, 0.71, 0.75]) - 0.72)
    assert ("top_k", "2", "gspo") not in table.index  # no GSPO cell there: no point invented
    assert set(table["n_ref"]) == {3}


def test_replay_figures_are_planned_only_with_the_decomposition():
    metrics, evals = _frames(CELLS)
    metrics = metrics.assign(arm_base=metrics["arm"].str.split("__").str[0])
    design = {"factors": {"top_k": {"1": {}, "2": {"model.top_k": 2}}}}
    assert "replay_map" in figures.planned_figures(metrics, evals, design)
    assert "rescue" in figures.planned_figures(metrics.assign(arm=metrics["arm_base"]), evals)
    assert not figures.is_replay_comparison(metrics.drop(columns=[replay_map.SHARE]))
    fig = replay_plots.replay_map_figure(metrics, evals)
    points = [len(c.lines[0].get_xdata()) for c in fig.axes[0].containers if c.get_label().endswith("- GRPO")]
    assert sorted(points) == [1, 2]  # GSPO at one setting, R2 at both


def test_a_stopped_run_holds_its_last_evaluation_in_the_rescue_curves():
    evals = pd.DataFrame([{"arm": "grpo", "run_id": "a", "seed": 0, "step": s, "eval/acc_greedy": v}
                          for s, v in ((0, 0.6), (10, 0.5), (13, 0.0))]  # stopped by a collapse after step 12
                         + [{"arm": "grpo", "run_id": "b", "seed": 1, "step": s, "eval/acc_greedy": v}
                            for s, v in ((0, 0.6), (10, 0.7), (20, 0.8))])
    held = replay_plots.held_evals(evals).set_index(["run_id", "step"])["eval/acc_greedy"]
    assert held[("a", 20)] == 0.0 and held[("b", 13)] == 0.7  # held forward, never backward
    assert ("a", 5) not in held.index and len(held) == 8  # only observed steps, on the union grid
