"""moe_lab.analysis.results: loading experiment folders into tidy frames, intervals over seeds, summaries."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from synthetic import PAPER_ARMS, write_experiment

from moe_lab.analysis import results
from moe_lab.analysis import stability
from moe_lab.analysis import stats
from moe_lab.config import PAPER_CLIP
from moe_lab.launch.compose import arm_presets

ROOT = Path(__file__).resolve().parents[1]


def t_cdf_minus_half(q: float, df: int) -> float:
    """P(0 < T < q) for Student's t with df degrees of freedom, by integrating its density (Simpson)."""
    x = np.linspace(0.0, q, 200_001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    pdf = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    h = x[1] - x[0]
    return float(h / 3 * (pdf[0] + pdf[-1] + 4 * pdf[1:-1:2].sum() + 2 * pdf[2:-1:2].sum()))


# --------------------------------------------------------------------------- intervals


@pytest.mark.parametrize("df", sorted(results.T975))
def test_t_table_entries_are_975_quantiles(df):
    assert t_cdf_minus_half(results.T975[df], df) == pytest.approx(0.475, abs=2e-7)


def test_t_table_closed_forms_and_limit():
    p = 0.975
    assert results.t_quantile_975(1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert results.t_quantile_975(2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-9)
    assert results.t_quantile_975(1e9) == pytest.approx(statistics.NormalDist().inv_cdf(p), rel=1e-6)
    assert math.isnan(results.t_quantile_975(0))


def test_t_quantile_interpolation_between_rows_is_monotone_and_accurate():
    dfs = np.arange(1, 400)
    t = np.array([results.t_quantile_975(d) for d in dfs])
    assert (np.diff(t) < 0).all()
    for df in (35, 50, 90, 200):  # off-table rows: check the interpolation against the density itself
        assert t_cdf_minus_half(results.t_quantile_975(df), df) == pytest.approx(0.475, abs=5e-5)


def test_mean_ci_three_seeds_by_hand():
    values = [0.1, 0.4, 0.7]
    mean, lo, hi = results.mean_ci(values)
    t2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # closed form of t_{0.975, 2}
    half = t2 * statistics.stdev(values) / math.sqrt(3)
    assert mean == pytest.approx(statistics.mean(values))
    assert (lo, hi) == pytest.approx((mean - half, mean + half))


def test_mean_ci_one_value_has_nan_width_and_ignores_nan():
    mean, lo, hi = results.mean_ci([0.3, float("nan"), None])
    assert mean == 0.3 and math.isnan(lo) and math.isnan(hi)
    assert all(math.isnan(v) for v in results.mean_ci([]))


# --------------------------------------------------------------------------- summarize / per_step


def hand_frames(steps_by_seed: dict[int, int], arm: str = "a", minibatches: int = 2, failed=()):
    """Frames whose values are a known function of (seed, step, minibatch)."""
    rows, evals = [], []
    for seed, steps in steps_by_seed.items():
        info = {"run_id": f"{arm}-s{seed}", "arm": arm, "seed": seed, "experiment": "x",
                "status": "failed" if seed in failed else "done"}
        for step in range(steps):
            for mb in range(minibatches):
                value = 0.01 * (seed + 1) * (step + 1) + 0.001 * mb
                rows.append({**info, "step": step, "minibatch": mb, "reward/mean": value,
                             "clip_frac/active": value / 10})
        for step in range(0, steps + 1, 4):
            evals.append({**info, "step": step, "eval/acc_greedy": 0.1 * seed + 0.01 * step,
                          "eval/acc_sampled": 0.05 * seed + 0.01 * step})
    return pd.DataFrame(rows), pd.DataFrame(evals)


def test_summarize_matches_hand_computation():
    steps = {0: 8, 1: 8, 2: 4}  # seed 2 stopped early: its "last quarter" is its own last step
    metrics, evals = hand_frames(steps, failed=(2,))
    row = results.summarize(metrics, evals, last_frac=0.25).set_index("arm").loc["a"]
    per_seed = []
    for seed, n in steps.items():
        tail = range(n - math.ceil(0.25 * n), n)
        per_seed.append(statistics.mean(0.01 * (seed + 1) * (s + 1) + 0.001 * mb for s in tail for mb in range(2)))
    t2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    half = t2 * statistics.stdev(per_seed) / math.sqrt(3)
    assert row["reward/mean"] == pytest.approx(statistics.mean(per_seed))
    assert (row["reward/mean_lo"], row["reward/mean_hi"]) == pytest.approx((row["reward/mean"] - half,
                                                                             row["reward/mean"] + half))
    assert row["clip_frac/active"] == pytest.approx(statistics.mean(per_seed) / 10)
    final = [0.1 * seed + 0.01 * (n // 4 * 4) for seed, n in steps.items()]  # each run's last evaluation
    assert row["eval/acc_greedy"] == pytest.approx(statistics.mean(final))
    assert (row["seeds"], row["runs"], row["runs_done"]) == (3, 3, 2)
    assert np.isnan(row["routing/expert_change"])  # absent metric: NaN column, not an error


def test_summarize_one_seed_has_nan_interval_and_groups_by_arm():
    m1, e1 = hand_frames({0: 4, 1: 4}, arm="a")
    m2, e2 = hand_frames({0: 4}, arm="b")
    table = results.summarize(pd.concat([m1, m2]), pd.concat([e1, e2])).set_index("arm")
    assert list(table.index) == ["a", "b"]
    assert table.loc["b", "seeds"] == 1 and np.isnan(table.loc["b", "reward/mean_lo"])
    assert np.isfinite(table.loc["a", "reward/mean_lo"])


@pytest.mark.parametrize("kwargs, field", [({"last_frac": 0.0}, "last_frac"), ({"last_frac": 1.5}, "last_frac"),
                                           ({"by": ("nope",)}, "nope"), ({"by": ()}, "by")])
def test_summarize_rejects_bad_arguments(kwargs, field):
    metrics, evals = hand_frames({0: 4})
    with pytest.raises(ValueError, match=field):
        results.summarize(metrics, evals, **kwargs)


def test_per_step_averages_minibatches_then_seeds():
    metrics, _ = hand_frames({0: 3, 1: 3, 2: 3})
    table = results.per_step(metrics, "reward/mean")
    for _, row in table.iterrows():
        per_seed = [0.01 * (seed + 1) * (row["step"] + 1) + 0.0005 for seed in range(3)]
        ref = results.mean_ci(per_seed)
        assert (row["mean"], row["lo"], row["hi"]) == pytest.approx(ref)
        assert row["n"] == 3
    assert list(table["step"]) == [0, 1, 2]


def test_format_summary_lists_each_arm_with_intervals():
    m1, e1 = hand_frames({0: 4, 1: 4}, arm="grpo")
    m2, e2 = hand_frames({0: 4, 1: 4}, arm="gspo")
    text = results.format_summary(results.summarize(pd.concat([m1, m2]), pd.concat([e1, e2])))
    lines = text.splitlines()
    assert len(lines) == 3 and "grpo" in text and "gspo" in text
    assert "±" in lines[1] and "2/2" in lines[1]


# --------------------------------------------------------------------------- load_runs


@pytest.fixture
def experiment(tmp_path):
    arms = {"grpo": PAPER_ARMS["grpo"], "gspo": {"rl": {"algo": "gspo", "clip_low": 1e-4, "clip_high": 2e-4,
                                                        "router_lr_mult": 10.0, "rollout_dtype": "bfloat16"}}}
    return write_experiment(tmp_path / "exp", arms, seeds=(0, 1), steps=4, layers=2)


def test_load_runs_flattens_every_config_field(experiment):
    metrics, evals = results.load_runs(experiment)
    run_dir = experiment / "runs" / "gspo-s1"
    config = results.flatten(yaml.safe_load((run_dir / "config.yaml").read_text()))
    for frame in (metrics, evals):
        row = frame[frame["run_id"] == "gspo-s1"].iloc[0]
        for key, value in config.items():
            assert key in frame.columns
            assert (row[key] == value) or (value is None and pd.isna(row[key]))
        assert row["status"] == "done"
    assert set(metrics["rl.rollout_dtype"]) == {"float32", "bfloat16"}
    assert metrics["rl.router_lr_mult"].dtype == float and set(metrics["model.num_experts"]) == {8}
    assert len(metrics) == 4 * 4 * 2 and len(evals) == 4 * 2  # runs x steps x minibatches; runs x evals


def test_load_runs_resolves_paper_clip_defaults(experiment):
    metrics, _ = results.load_runs(experiment)
    by_arm = metrics.groupby("arm")[["rl.clip_low_resolved", "rl.clip_high_resolved"]].first()
    assert tuple(by_arm.loc["grpo"]) == PAPER_CLIP["grpo"]  # config None -> the paper's default
    assert tuple(by_arm.loc["gspo"]) == (1e-4, 2e-4)  # explicit values kept
    assert metrics.loc[metrics["arm"] == "grpo", "rl.clip_low"].isna().all()


def test_load_runs_accepts_each_folder_kind_and_lists(experiment):
    full, _ = results.load_runs(experiment)
    runs, _ = results.load_runs(experiment / "runs")
    one, _ = results.load_runs(experiment / "runs" / "grpo-s0")
    both, _ = results.load_runs([experiment / "runs" / "grpo-s0", experiment / "runs" / "gspo-s1"])
    pd.testing.assert_frame_equal(full, runs)
    assert set(one["run_id"]) == {"grpo-s0"} and set(both["run_id"]) == {"grpo-s0", "gspo-s1"}
    assert set(full["experiment"]) == {"exp"} and set(one["experiment"]) == {"exp"}
    assert set(full["arm_base"]) == {"grpo", "gspo"}


@pytest.mark.parametrize("damage", ["corrupt_parquet", "no_metrics", "bad_yaml", "bad_manifest"])
def test_load_runs_skips_a_broken_run_with_a_warning(experiment, damage):
    run_dir = experiment / "runs" / "gspo-s0"
    if damage == "corrupt_parquet":
        (run_dir / "metrics.parquet").write_bytes(b"PAR1 this is not parquet")
    elif damage == "no_metrics":
        (run_dir / "metrics.parquet").unlink()
    elif damage == "bad_yaml":
        (run_dir / "config.yaml").write_text("rl: [unclosed\n")
    else:
        (run_dir / "manifest.json").write_text("{not json")
    with pytest.warns(UserWarning, match="gspo-s0"):
        metrics, evals = results.load_runs(experiment)
    assert set(metrics["run_id"]) == {"grpo-s0", "grpo-s1", "gspo-s1"}
    assert "gspo-s0" not in set(evals["run_id"])


def test_load_runs_never_executes_yaml_tags(experiment, tmp_path):
    sentinel = tmp_path / "pwned"
    run_dir = experiment / "runs" / "grpo-s0"
    (run_dir / "config.yaml").write_text(f"!!python/object/apply:os.system ['touch {sentinel}']\n")
    with pytest.warns(UserWarning, match="grpo-s0"):
        metrics, _ = results.load_runs(experiment)
    assert not sentinel.exists() and "grpo-s0" not in set(metrics["run_id"])


def test_load_runs_running_run_is_kept_with_its_status(experiment):
    manifest = experiment / "runs" / "grpo-s1" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "status": "running"}))
    (experiment / "runs" / "grpo-s1" / "eval.parquet").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics, evals = results.load_runs(experiment)
    table = results.summarize(metrics, evals).set_index("arm")
    assert table.loc["grpo", "runs"] == 2 and table.loc["grpo", "runs_done"] == 1
    assert "grpo-s1" not in set(evals["run_id"])


def test_load_runs_empty_and_missing_paths(tmp_path):
    with pytest.raises(ValueError, match="path"):
        results.load_runs(tmp_path / "nowhere")
    (tmp_path / "empty" / "runs").mkdir(parents=True)
    with pytest.warns(UserWarning, match="no readable runs"):
        metrics, evals = results.load_runs(tmp_path / "empty")
    assert len(metrics) == 0 and len(evals) == 0 and "arm" in metrics.columns


def test_summary_of_loaded_experiment_has_one_row_per_arm(experiment):
    table = results.summarize(*results.load_runs(experiment))
    assert list(table["arm"]) == ["grpo", "gspo"] or list(table["arm"]) == ["gspo", "grpo"]
    assert (table["seeds"] == 2).all() and table["clip_frac/active"].notna().all()


# --------------------------------------------------------------------------- helpers


def test_reference_dir_env_var_then_walk_up(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ENV_RESULTS, str(tmp_path / "custom"))
    assert results.reference_dir("paper") == tmp_path / "custom" / "paper"
    monkeypatch.delenv(results.ENV_RESULTS)
    (tmp_path / "repo" / "results" / "reference").mkdir(parents=True)
    (tmp_path / "repo" / "notebooks").mkdir()
    found = results.reference_dir("paper", start=tmp_path / "repo" / "notebooks")
    assert found == (tmp_path / "repo" / "results" / "reference" / "paper").resolve()
    shutil.rmtree(tmp_path / "repo" / "results")
    with pytest.raises(ValueError, match=results.ENV_RESULTS):
        results.reference_dir(start=tmp_path / "repo" / "notebooks")


def test_base_arm_and_flatten():
    assert results.base_arm("grpo__rl.router_lr_mult=10") == "grpo" and results.base_arm("gspo_token") == "gspo_token"
    assert results.flatten({"rl": {"clip": {"low": 1}}, "seed": 0}) == {"rl.clip.low": 1, "seed": 0}


# --------------------------------------------------------------------------- collapse statistics


@pytest.mark.parametrize("k, n, expected", [(0, 5, (0.0, 0.4345)), (5, 10, (0.2366, 0.7634)), (1, 10, (0.0179, 0.4042)),
                                            (5, 5, (0.5655, 1.0)), (3, 3, (0.4385, 1.0))])
def test_wilson_interval_known_values(k, n, expected):
    assert stats.wilson_interval(k, n) == pytest.approx(expected, abs=5e-5)


def test_wilson_interval_symmetry_nan_and_bad_input():
    for n in (1, 4, 7):
        for k in range(n + 1):
            lo, hi = stats.wilson_interval(k, n)
            assert 0 <= lo <= k / n <= hi <= 1
            assert (1 - hi, 1 - lo) == pytest.approx(stats.wilson_interval(n - k, n))
    assert all(math.isnan(v) for v in stats.wilson_interval(0, 0))
    with pytest.raises(ValueError, match="k=6"):
        stats.wilson_interval(6, 5)


@pytest.fixture
def collapsing(tmp_path):
    """grpo-s0's reward is exactly 0 from step 6 (the zero-reward rule fires at step 10); grpo-s1 is healthy.
    The synthetic manifests predate collapsed_at, like every run folder written before this field."""
    exp = write_experiment(tmp_path / "exp", {"grpo": PAPER_ARMS["grpo"]}, seeds=(0, 1), steps=14, layers=2)
    f = exp / "runs" / "grpo-s0" / "metrics.parquet"
    df = pd.read_parquet(f)
    df.loc[df["step"] >= 6, "reward/mean"] = 0.0
    df.to_parquet(f)
    return exp


def test_old_manifest_collapse_is_recomputed_from_its_rows(collapsing):
    metrics, evals = results.load_runs(collapsing)
    runs = stability.collapse_runs(metrics).set_index("run_id")
    assert runs.loc["grpo-s0", "collapsed_at"] == 10 and runs.loc["grpo-s0", "collapse_rule"] == "zero_reward"
    assert np.isnan(runs.loc["grpo-s1", "collapsed_at"]) and runs.loc["grpo-s1", "collapse_rule"] == ""
    assert (runs["last_step"] == 13).all()
    assert "collapsed_at" in evals.columns


def test_manifest_collapse_wins_over_the_rows(collapsing):
    for run, value in (("grpo-s0", None), ("grpo-s1", 3)):
        manifest = collapsing / "runs" / run / "manifest.json"
        rule = None if value is None else "reward_drop"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "collapsed_at": value,
                                        "collapse_rule": rule}))
    runs = stability.collapse_runs(results.load_runs(collapsing)[0]).set_index("run_id")
    assert np.isnan(runs.loc["grpo-s0", "collapsed_at"]) and runs.loc["grpo-s0", "collapse_rule"] == ""
    assert runs.loc["grpo-s1", "collapsed_at"] == 3 and runs.loc["grpo-s1", "collapse_rule"] == "reward_drop"


@pytest.mark.parametrize("status, traceback", [("running", None), ("failed", "Traceback ...")])
def test_unfinished_run_collapse_comes_from_its_rows(collapsing, status, traceback):
    # the manifest of a running (or crashed) attempt holds the value from its start; its rows went on
    manifest = collapsing / "runs" / "grpo-s0" / "manifest.json"
    extra = {"traceback": traceback} if traceback else {}
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "status": status, "collapsed_at": None,
                                    "collapse_rule": None, **extra}))
    runs = stability.collapse_runs(results.load_runs(collapsing)[0]).set_index("run_id")
    assert runs.loc["grpo-s0", "collapsed_at"] == 10 and runs.loc["grpo-s0", "collapse_rule"] == "zero_reward"


def test_summary_collapse_rate_wilson_and_median(collapsing):
    table = results.summarize(*results.load_runs(collapsing)).set_index("arm")
    row = table.loc["grpo"]
    assert (row["collapses"], row["collapse_rate"], row["collapse_step_median"]) == (1, 0.5, 10.0)
    assert (row["collapse_rate_lo"], row["collapse_rate_hi"]) == pytest.approx(stats.wilson_interval(1, 2))
    text = results.format_summary(table.reset_index())
    assert "1/2 [0.09, 0.91]" in text and "collapse step" in text.splitlines()[0]


def test_summary_without_collapse_column_says_unknown():
    metrics, evals = hand_frames({0: 4, 1: 4})
    row = results.summarize(metrics, evals).iloc[0]
    assert all(np.isnan(row[c]) for c in stability.COLLAPSE_COLUMNS)
    assert "collapsed" not in results.format_summary(results.summarize(metrics, evals))


def test_reference_runs_never_collapse_under_the_default_rules():
    # the committed reference runs are healthy learning curves: the defaults must not call them collapsed
    metrics, _ = results.load_runs([results.reference_dir(s, start=ROOT) for s in ("paper", "clip_sweep")])
    runs = stability.collapse_runs(metrics)
    assert len(runs) >= 30 and runs["collapsed_at"].isna().all()


def survival_frame() -> pd.DataFrame:
    """Arm a: collapses at 3 and 5, censored at 4 and 9; arm b: one run censored at 2."""
    rows = []
    for arm, run, last, at in (("a", "r1", 3, 3), ("a", "r2", 5, 5), ("a", "r3", 4, None), ("a", "r4", 9, None),
                               ("b", "r5", 2, None)):
        rows += [{"arm": arm, "run_id": run, "experiment": "x", "step": s, "collapsed_at": at} for s in range(last + 1)]
    return pd.DataFrame(rows).astype({"collapsed_at": float})


def test_survival_table_is_the_kaplan_meier_step_function():
    table = stability.survival_table(survival_frame())
    a = table[table["arm"] == "a"]
    assert list(a["step"]) == list(range(10))
    # S(3) = 1 - 1/4; S(5) = 0.75 * (1 - 1/2): r3 (censored at 4) is no longer at risk at 5
    assert list(a["survival"]) == pytest.approx([1, 1, 1, 0.75, 0.75, 0.375, 0.375, 0.375, 0.375, 0.375])
    assert list(a["at_risk"]) == [4, 4, 4, 4, 3, 2, 1, 1, 1, 1]
    assert list(a["collapsed"]) == [0, 0, 0, 1, 0, 1, 0, 0, 0, 0]
    b = table[table["arm"] == "b"]
    assert list(b["survival"]) == [1, 1, 1] and list(b["at_risk"]) == [1, 1, 1]


# --------------------------------------------------------------------------- stability atlas


def test_arm_factor_level_parses_labels_and_load_runs_adds_them(experiment):
    assert results.arm_factor_level("grpo__updates=16") == ("updates", "16")
    assert results.arm_factor_level("grpo_r2__rl.router_noise=0.1") == ("rl.router_noise", "0.1")
    assert results.arm_factor_level("gspo__rl.clip_low=0.1__rl.clip_high=0.13") == \
        ("rl.clip_low+rl.clip_high", "0.1,0.13")
    assert results.arm_factor_level("grpo") == (None, None)
    metrics, _ = results.load_runs(experiment)
    assert metrics["factor"].isna().all() and metrics["level"].isna().all()


ATLAS_CELLS = {("noise", "2"): 1, ("noise", "10"): 2, ("depth", "4"): 1}  # cell -> seeds


def atlas_frames():
    """Arms grpo and grpo_r2 per cell; values a known function of (arm, factor, level, seed, update)."""
    rows, evals = [], []
    for (factor, level), seeds in ATLAS_CELLS.items():
        for base in ("grpo", "grpo_r2"):
            arm = f"{base}__{factor}={level}"
            for seed in range(seeds):
                scale = float(level) * (2 if base == "grpo" else 1) + seed
                info = {"arm": arm, "run_id": f"{arm}-s{seed}", "experiment": "atlas", "seed": seed,
                        **{f"rl.{k}": v for k, v in arm_presets()[base].overrides["rl"].items()}}
                for update in range(8):
                    forced = 0.0 if base == "grpo_r2" else 0.01 * scale * (update + 1)
                    rows.append({**info, "step": update // 2, "minibatch": update % 2, "update": update,
                                 "routing/expert_change": forced,
                                 "routing/expert_change_latent": 0.01 * scale * (update + 1),
                                 "ratio/token_var": scale * (update + 1) ** 2})
                for step in (0, 4):
                    evals.append({**info, "step": step, "eval/acc_greedy": 0.1 * step / 4 * scale / 10})
    return pd.DataFrame(rows), pd.DataFrame(evals)


def test_atlas_table_matches_hand_computation():
    table = stability.atlas_table(*atlas_frames())
    assert list(zip(table["factor"], table["level"], table["arm_base"])) == [
        ("depth", "4", "grpo"), ("depth", "4", "grpo_r2"), ("noise", "2", "grpo"), ("noise", "2", "grpo_r2"),
        ("noise", "10", "grpo"), ("noise", "10", "grpo_r2")]  # levels in numeric order, not as strings
    assert list(table["level_index"]) == [0, 0, 0, 0, 1, 1]
    for _, row in table.iterrows():
        seeds = ATLAS_CELLS[(row["factor"], row["level"])]
        scales = [float(row["level"]) * (2 if row["arm_base"] == "grpo" else 1) + s for s in range(seeds)]
        # last 25% of 8 updates = updates 6 and 7 (values 7 and 8 x 0.01 x scale); latent for both arms
        assert row["expert_change"] == pytest.approx(statistics.mean(0.01 * sc * 7.5 for sc in scales))
        p99 = [float(np.percentile([sc * (u + 1) ** 2 for u in range(8)], 99)) for sc in scales]
        assert row["ratio_var_p99"] == pytest.approx(statistics.mean(p99))
        acc = statistics.mean(0.1 * sc / 10 for sc in scales)
        ref_scales = [float(row["level"]) + s for s in range(seeds)]
        assert row["acc_greedy"] == pytest.approx(acc) and row["runs"] == seeds
        assert row["acc_gap"] == pytest.approx(acc - statistics.mean(0.1 * sc / 10 for sc in ref_scales))
    assert (table.loc[table["arm_base"] == "grpo_r2", "acc_gap"] == 0).all()


def test_atlas_table_level_order_given_and_checked():
    metrics, evals = atlas_frames()
    table = stability.atlas_table(metrics, evals, levels={"noise": ["10", "2"]})
    assert list(table["factor"])[:4] == ["noise"] * 4  # the given factor first
    assert list(table.loc[table["factor"] == "noise", "level"]) == ["10", "10", "2", "2"]
    with pytest.raises(ValueError, match="levels"):
        stability.atlas_table(metrics, evals, levels={"noise": ["2"]})
    assert np.isnan(stability.atlas_table(metrics, evals, reference="nope")["acc_gap"]).all()
