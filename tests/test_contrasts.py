"""Declared contrasts (`moe-lab compare` on an experiment with ``blocks:`` and ``contrasts:``): the mixed model
equals the one-sample t-test of the per-cold-start differences where the math says it must and statsmodels'
REML fit elsewhere; Holm and TOST equal statsmodels'; blocks expand into nested, interleaved cells; bad blocks
and contrasts get one line."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from moe_lab.analysis.contrasts import declared_contrasts, holm, mixed_contrast, tost_p
from moe_lab.config import ConfigError, load_yaml
from moe_lab.launch.design import Contrast, blocks_spec, contrasts_spec
from moe_lab.launch.experiment import expand
from moe_lab.launch.runner import seed_major

sm_formula = pytest.importorskip("statsmodels.formula.api")
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


@pytest.mark.parametrize("seed", [1, 2, 7, 8])
def test_balanced_mixed_contrast_is_the_t_test_of_per_block_differences(seed):
    # Balanced, with both block variances estimated above 0 (on a boundary REML pools sums of squares):
    # the contrast's variance is s_d^2 / m on m - 1 degrees of freedom (the summary-statistics identity), so
    # every figure equals the one-sample t-test's.
    df = _blocked(seed)
    fit = mixed_contrast(df["y"], df["arm"] == "A", df["block"])
    assert fit["s2_v"] > 0 and fit["s2_b"] > 0
    d = _block_diffs(df)
    ref = stats.ttest_1samp(d, 0.0)
    assert fit["diff"] == pytest.approx(d.mean(), abs=1e-12)
    assert fit["se"] == pytest.approx(d.std(ddof=1) / np.sqrt(len(d)), rel=1e-6)
    assert fit["df"] == pytest.approx(len(d) - 1, rel=1e-6)
    assert fit["p"] == pytest.approx(ref.pvalue, rel=1e-5)
    lo, hi = ref.confidence_interval()
    assert (fit["lo"], fit["hi"]) == (pytest.approx(lo, rel=1e-5), pytest.approx(hi, rel=1e-5))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unbalanced_mixed_contrast_matches_statsmodels_reml(seed):
    df = _blocked(seed)
    df = df[np.random.default_rng(seed + 10).random(len(df)) > 0.25]
    fit = mixed_contrast(df["y"], df["arm"] == "A", df["block"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = sm_formula.mixedlm("y ~ 0 + C(arm)", df, groups="block", re_formula="1",
                                 vc_formula={"cell": "0 + C(arm)"}).fit(reml=True)
    c = np.array([1.0, -1.0])
    se = float(np.sqrt(c @ ref.cov_params().iloc[:2, :2].to_numpy() @ c))
    assert fit["diff"] == pytest.approx(float(ref.fe_params.to_numpy() @ c), abs=1e-6)
    # statsmodels stops its optimiser earlier than ours: variance components agree to ~1e-4 relative
    assert fit["se"] == pytest.approx(se, rel=2e-3)
    assert fit["s2_e"] == pytest.approx(ref.scale, rel=2e-3)


def test_without_block_x_arm_variance_the_contrast_pools_within_blocks():
    # Identical arm effect in every block (s2_v on the boundary): the random-intercept model, whose balanced
    # contrast is the within-block pooled two-sample test on N - m - 1 degrees of freedom.
    rng = np.random.default_rng(5)
    df = pd.DataFrame([{"e": rng.normal(0, 0.05), "arm": arm, "block": b}
                       for b in range(3) for arm in "AB" for _ in range(10)])
    # cell means exactly 0.5 + 0.2 b + 0.05 [arm A]: the per-block differences are all 0.05
    df["y"] = (0.5 + 0.2 * df["block"] + 0.05 * (df["arm"] == "A") + df["e"]
               - df.groupby(["block", "arm"])["e"].transform("mean"))
    d = _block_diffs(df)
    assert np.allclose(d, 0.05)
    fit = mixed_contrast(df["y"], df["arm"] == "A", df["block"])
    resid = df["y"] - df.groupby(["block", "arm"])["y"].transform("mean")
    ss_e = float((resid ** 2).sum())
    ss_i = 10 / 2 * float(((d - d.mean()) ** 2).sum())  # block x arm sum of squares, 2 arms of n = 10
    s2 = (ss_e + ss_i) / (60 - 3 - 1)
    assert fit["s2_v"] == 0.0
    assert fit["se"] == pytest.approx(np.sqrt(2 * s2 / 30), rel=1e-6)
    assert fit["df"] == pytest.approx(60 - 3 - 1, rel=1e-6)


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

