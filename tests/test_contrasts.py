"""Declared contrasts (`moe-lab compare` on an experiment with ``blocks:`` and ``contrasts:``): the cold-start-
level interval is the one-sample t of the per-cold-start differences, the conditional one is Welch's on one cold
start and ignores checkpoint-specific effects; Holm and TOST equal statsmodels'; blocks expand into nested,
interleaved cells; bad blocks and contrasts get one line."""

from __future__ import annotations


import numpy as np
import pandas as pd
import pytest
from scipy import stats

from moe_lab.analysis.contrasts import declared_contrasts
from moe_lab.analysis.stats import block_cells, cold_start_level, conditional, holm, tost_p
from moe_lab.config import ConfigError, load_yaml
from moe_lab.launch.design import Contrast, blocks_spec, contrasts_spec
from moe_lab.launch.experiment import expand
from moe_lab.launch.runner import seed_major

multitest = pytest.importorskip("statsmodels.stats.multitest")
weightstats = pytest.importorskip("statsmodels.stats.weightstats")


def _blocked(seed: int, m: int = 4, n: int = 6, sd_v: float = 0.15) -> pd.DataFrame:
    """Two arms in m blocks of n runs each: a block intercept, a block x arm effect and run noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(m):
        u, v = rng.normal(0, 0.1), rng.normal(0, sd_v, 2)
        rows += [{"y": rng.normal(0.5 + u + v[0], 0.05), "arm": "A", "block": b} for _ in range(n)]
        rows += [{"y": rng.normal(0.45 + u + v[1], 0.05), "arm": "B", "block": b} for _ in range(n)]
    return pd.DataFrame(rows)


def _block_diffs(df: pd.DataFrame) -> np.ndarray:
    means = df.groupby(["block", "arm"])["y"].mean().unstack()
    return (means["A"] - means["B"]).to_numpy()


def _cells(df: pd.DataFrame):
    return block_cells(df["y"], df["arm"] == "A", df["block"])


@pytest.mark.parametrize("seed", [1, 2, 7, 8])
def test_cold_start_level_is_the_t_test_of_per_block_differences(seed):
    # The unit of generalisation is the cold start: every figure equals scipy's one-sample t-test of the m
    # per-cold-start differences, on m - 1 degrees of freedom, whatever the run counts inside each cold start.
    df = _blocked(seed)
    df = df.drop(df.index[: 1 + seed % 4])  # unbalanced: the per-block means still carry one value per cold start
    fit = cold_start_level(_cells(df))
    d = _block_diffs(df)
    ref = stats.ttest_1samp(d, 0.0)
    assert fit.diff == pytest.approx(d.mean(), abs=1e-12)
    assert fit.df == len(d) - 1
    assert fit.p == pytest.approx(ref.pvalue, rel=1e-9)
    lo, hi = ref.confidence_interval()
    assert (fit.lo, fit.hi) == (pytest.approx(lo, rel=1e-9), pytest.approx(hi, rel=1e-9))


def test_conditional_on_one_cold_start_is_welch():
    rng = np.random.default_rng(4)
    a, b = rng.normal(0.5, 0.05, 7), rng.normal(0.45, 0.12, 11)
    df = pd.DataFrame({"y": np.r_[a, b], "arm": ["A"] * 7 + ["B"] * 11, "block": 0})
    fit = conditional(_cells(df))
    ref = weightstats.CompareMeans(weightstats.DescrStatsW(a), weightstats.DescrStatsW(b))
    assert fit.p == pytest.approx(ref.ttest_ind(usevar="unequal")[1], rel=1e-9)
    assert (fit.lo, fit.hi) == tuple(pytest.approx(v, rel=1e-9) for v in ref.tconfint_diff(usevar="unequal"))
    assert np.isnan(cold_start_level(_cells(df)).lo)  # one cold start: nothing to generalise over


def test_a_cold_start_x_arm_shift_widens_the_cold_start_interval_only():
    # Shifting one arm by a constant within each cold start (a checkpoint-specific effect) moves the per-cold-
    # start differences apart: the cold-start-level interval widens, the conditional one keeps its width exactly
    # (it conditions on these cold starts), and both share one point estimate.
    df = _blocked(5, sd_v=0.0)
    shift = np.where(df["arm"] == "A", df["block"].map({0: 0.2, 1: -0.2, 2: 0.1, 3: -0.1}), 0.0)
    before, after = _cells(df), _cells(df.assign(y=df["y"] + shift))
    assert conditional(after).se == pytest.approx(conditional(before).se, rel=1e-12)
    assert cold_start_level(after).se > 3 * cold_start_level(before).se
    assert conditional(after).diff == pytest.approx(cold_start_level(after).diff, abs=1e-15)


def test_holm_is_statsmodels():
    ps = [0.01, 0.04, 0.03, 0.2, 0.005]
    ref = multitest.multipletests(ps, method="holm")[1]
    assert holm(ps) == pytest.approx(list(ref), abs=1e-15)
    assert holm([0.5, float("nan"), 0.01])[1] != holm([0.5, float("nan"), 0.01])[1]  # NaN stays NaN


def test_tost_is_statsmodels():
    rng = np.random.default_rng(2)
    a, b = rng.normal(0.5, 0.05, 12), rng.normal(0.49, 0.05, 9)
    n1, n2 = len(a), len(b)
    sp2 = ((n1 - 1) * a.var(ddof=1) + (n2 - 1) * b.var(ddof=1)) / (n1 + n2 - 2)
    se = np.sqrt(sp2 * (1 / n1 + 1 / n2))
    for margin in (0.02, 0.05, 0.1):
        ref = weightstats.ttost_ind(a, b, -margin, margin, usevar="pooled")[0]
        assert tost_p(a.mean() - b.mean(), se, n1 + n2 - 2, margin) == pytest.approx(ref, rel=1e-9)


def test_declared_contrasts_holm_over_primary_rows_with_tost_where_a_margin_is_declared():
    df = _blocked(3)
    runs = pd.DataFrame({"setting": "s", "arm_base": np.where(df["arm"] == "A", "r2", "grpo"),
                         "block": df["block"].astype(str), "primary": df["y"], "collapsed": False})
    extra = runs[runs["arm_base"] == "r2"].assign(arm_base="gspo", primary=lambda r: r["primary"] + 0.03)
    runs = pd.concat([runs, extra], ignore_index=True)
    contrasts = [Contrast("gspo", "r2", "primary"), Contrast("r2", "grpo", "primary", 0.05),
                 Contrast("gspo", "grpo", "secondary")]
    table = declared_contrasts(runs, contrasts)
    assert list(table["role"]) == ["primary", "primary", "secondary"]
    eq = table.iloc[1]
    assert eq["hypothesis_p"] == eq["tost_p"] == tost_p(eq["diff"], eq["se"], eq["df"], 0.05)
    assert table.iloc[0]["hypothesis_p"] == table.iloc[0]["p"]
    assert table["holm_p"].iloc[:2].tolist() == holm(table["hypothesis_p"].iloc[:2].tolist())
    assert np.isnan(table.iloc[2]["holm_p"])
    # the TOST p is below 0.05 exactly when the 90% interval lies inside (-margin, margin)
    assert (eq["tost_p"] < 0.05) == (-0.05 < eq["lo90"] and eq["hi90"] < 0.05)


def test_blocks_expand_nested_and_interleaved():
    exp = load_yaml("experiments/router_learns.yaml")
    cells = expand(exp)
    assert len(cells) == 8 * 30
    blocks = blocks_spec(exp)
    for c in cells:
        assert c.seed in blocks.seeds[c.config.model.seed]
    cold = {(c.arm.partition("__")[2], c.config.model.seed) for c in cells}
    assert len(cold) == 6  # 2 settings x 3 cold starts
    order = list(dict.fromkeys(c.seed for c in seed_major(cells)))
    assert order[:6] == [400, 410, 420, 401, 411, 421]
    assert [c.seed for c in expand(exp, seeds=[411])] == [411] * 8


@pytest.mark.parametrize("change,needle", [
    ({"seeds": [0]}, "'blocks' and 'seeds' exclude each other"),
    ({"blocks": {"field": "model.seed", "seeds": {1: [0], 2: [0]}}}, "a seed appears twice"),
    ({"blocks": {"field": "seed", "seeds": {1: [0]}}}, "blocks.field"),
    ({"contrasts": {"primary": [{"arm": "gspo", "vs": "nope"}]}}, "contrasts.primary.vs='nope': no such arm"),
    ({"contrasts": {"primary": [{"arm": "gspo", "vs": "grpo", "equivalence_margin": -1}]}},
     "contrasts.primary.equivalence_margin"),
    ({"contrasts": {"tertiary": []}}, "contrasts: expected a mapping with keys primary, secondary"),
    ({"contrasts": {"primary": [{"arm": "gspo", "vs": "grpo", "minus": {"arm": "gspo", "vs": "grpo_r2"}}]}},
     "an interaction names four different arms"),
    ({"contrasts": {"primary": [{"arm": "gspo", "vs": "grpo", "minus": {"arm": "grpo_r2w"}}]}},
     "contrasts.primary.minus: expected {arm: C, vs: D}"),
])
def test_bad_blocks_and_contrasts_get_one_line(change, needle):
    exp = {**load_yaml("experiments/router_learns.yaml"), **change}
    with pytest.raises(ConfigError, match=None) as err:
        blocks_spec(exp), contrasts_spec(exp)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_router_learns_declares_what_the_issue_fixed():
    contrasts = contrasts_spec(load_yaml("experiments/router_learns.yaml"))
    assert [(c.arm, c.vs, c.role, c.margin) for c in contrasts] == [
        ("gspo", "grpo_r2", "primary", None), ("grpo_r2", "grpo", "primary", 0.05),
        ("grpo_r2w", "grpo_r2", "secondary", None), ("grpo_r2w", "gspo", "secondary", None)]


def test_compare_prints_the_declared_contrasts_it_computes(capsys):
    from moe_lab.analysis.contrasts import format_declared, load_declared
    from moe_lab.cli import main

    folder = "results/reference/router_learns"
    assert main(["compare", folder]) == 0
    out = capsys.readouterr().out
    table = load_declared(folder)
    assert len(table) and format_declared(table) in out
    # every primary row carries a Holm p no smaller than the p of its declared hypothesis
    primary = table[table["role"] == "primary"]
    assert (primary["holm_p"] >= primary["hypothesis_p"] - 1e-15).all()



def _four_arms(seed: int, m: int = 6, n: int = 3) -> pd.DataFrame:
    """Four arms in m blocks: a block intercept, a block x arm effect per arm and run noise (unbalanced below)."""
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(m):
        u = rng.normal(0, 0.1)
        for arm, mu in {"A": 0.55, "B": 0.5, "C": 0.52, "D": 0.5}.items():
            v = rng.normal(0, 0.03)
            rows += [{"y": rng.normal(mu + u + v, 0.04), "arm": arm, "block": b, "collapsed": False}
                     for _ in range(n + (b + len(arm)) % 2)]
    return pd.DataFrame(rows)


INTERACTION = Contrast("A", "B", "primary", 0.02, ("C", "D"))


def _runs(df: pd.DataFrame) -> pd.DataFrame:
    return df.rename(columns={"arm": "arm_base", "y": "primary"}).assign(setting="")


@pytest.mark.parametrize("seed", [3, 9])
def test_interaction_is_the_t_test_of_per_cold_start_differences_of_differences(seed):
    # (A - B) - (C - D) at the cold-start level: scipy's one-sample t of the per-block difference of differences.
    df = _four_arms(seed)
    means = df.groupby(["block", "arm"])["y"].mean().unstack()
    d = ((means["A"] - means["B"]) - (means["C"] - means["D"])).to_numpy()
    row = declared_contrasts(_runs(df), [INTERACTION]).iloc[0]
    ref = stats.ttest_1samp(d, 0.0)
    assert row["diff"] == pytest.approx(d.mean(), abs=1e-12) and row["df"] == len(d) - 1
    assert row["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert (row["lo"], row["hi"]) == tuple(pytest.approx(v, rel=1e-9) for v in ref.confidence_interval())
    assert (row["arm"], row["vs"]) == ("(A − B)", "(C − D)")
    # TOST at the declared margin is the larger one-sided p of the same t
    assert row["tost_p"] == pytest.approx(tost_p(d.mean(), d.std(ddof=1) / np.sqrt(len(d)), len(d) - 1, 0.02),
                                          rel=1e-9)


def test_interaction_conditional_se_is_stratified_welch_over_four_groups():
    df = _four_arms(11)
    row = declared_contrasts(_runs(df), [INTERACTION]).iloc[0]
    g = df.groupby(["block", "arm"])["y"].agg(["var", "count"])
    m = df["block"].nunique()
    parts = (g["var"] / g["count"] / m ** 2).to_numpy()
    se2 = parts.sum()
    df_ws = se2 ** 2 / np.sum(parts ** 2 / (g["count"] - 1).to_numpy())
    assert row["cond_se"] == pytest.approx(np.sqrt(se2), rel=1e-12)
    assert row["cond_df"] == pytest.approx(df_ws, rel=1e-12)


def test_interaction_with_a_copied_arm_is_the_plain_contrast():
    # If C and D are the same runs (relabelled), (A - B) - (C - D) = A - B in every cold start up to rounding.
    df = _four_arms(5)
    copy = df[df["arm"] == "D"].assign(arm="C")
    df = pd.concat([df[df["arm"] != "C"], copy])
    inter = declared_contrasts(_runs(df), [INTERACTION]).iloc[0]
    plain = declared_contrasts(_runs(df), [Contrast("A", "B", "primary", 0.02)]).iloc[0]
    for key in ("diff", "se", "lo", "hi", "p", "tost_p"):
        assert inter[key] == pytest.approx(plain[key], rel=1e-9, abs=1e-12)
    assert inter["cond_se"] > plain["cond_se"]  # C and D add their own run noise to the conditional interval


def test_two_arm_contrasts_keep_their_formula_bit_for_bit():
    # The weighted cells reduce to mean(arm) - mean(vs) exactly: no rounding step was added for two arms.
    from moe_lab.analysis.stats import block_diffs
    df = _blocked(6)
    got = block_diffs(_cells(df))
    for b, part in df.groupby("block"):
        a, v = (part.loc[part["arm"] == arm, "y"].to_numpy() for arm in ("A", "B"))
        assert got[b] == a.mean() - v.mean()


def test_routing_matters_declares_what_issue_55_fixed():
    # R3 - R2 and R3 - TIS at 4 mini-batches and the interaction (R3 - R2 at 4) - (R3 - R2 at 1), each at +-0.02
    primary = [c for c in contrasts_spec(load_yaml("experiments/routing_matters.yaml")) if c.role == "primary"]
    assert [(c.arm, c.vs, c.minus, c.margin) for c in primary] == [
        ("grpo_r3_mb4", "grpo_r2_mb4", None, 0.02), ("grpo_r3_mb4", "grpo_tis_mb4", None, 0.02),
        ("grpo_r3_mb4", "grpo_r2_mb4", ("grpo_r3_mb1", "grpo_r2_mb1"), 0.02)]
    assert blocks_spec(load_yaml("experiments/routing_matters.yaml")).field == "model.seed"
