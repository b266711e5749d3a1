"""A declared contrast of collapse rates (``endpoint: collapse``): the sign-flip p over cold starts is the brute-force
share of all 2^m sign vectors, its interval is every shift the same test does not reject, swapping the arms mirrors
it; the score interval is Newcombe's (the formula written out, the published values) and its p's invert it; the row's
interval is the union of the two and its TOST passes only where the 90% union lies inside the margin (0/16 vs 0/16
does not pass at 0.1); its primary rows join Holm with the primary endpoint's, bad declarations get one line, and
`moe-lab compare` prints the row it computes on an experiment folder."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from moe_lab.analysis.contrasts import declared_contrasts, declared_tables, format_declared, load_declared_tables
from moe_lab.analysis.stats import RateCombination
from moe_lab.analysis.stats import SignFlips, holm
from moe_lab.config import ConfigError
from moe_lab.launch.design import COLLAPSE, Contrast, contrasts_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic import PAPER_ARMS, write_run  # noqa: E402


def brute_p(d, shift: float = 0.0, side: str = "two") -> float:
    """The sign-flip p of the mean of d - shift by listing every sign vector (no shortcut shared with the code)."""
    x = np.asarray(d, float) - shift
    obs = x.sum()
    sums = np.array([np.dot(s, x) for s in itertools.product((1.0, -1.0), repeat=len(x))])
    if side == "two":
        return float(np.mean(np.abs(sums) >= abs(obs) - 1e-12))
    return float(np.mean(sums >= obs - 1e-12) if side == "above" else np.mean(sums <= obs + 1e-12))


def subset_means(d) -> np.ndarray:
    d = np.asarray(d, float)
    subsets = (list(c) for r in range(1, len(d) + 1) for c in itertools.combinations(range(len(d)), r))
    return np.unique([d[c].mean() for c in subsets])


EXAMPLES = [[0.5, 0.5, 0.0, 1.0, -0.5, 0.5], [1 / 3, 2 / 3, 0.0, -1 / 3, 1.0], [0.25, -0.75, 0.5, 0.5, 0.0, 0.25, 1.0],
            [-0.5, -1.0, 0.0, 0.0, -0.5]]


@pytest.mark.parametrize("d", EXAMPLES)
def test_the_p_is_the_share_of_all_sign_vectors(d):
    test = SignFlips(d)
    assert test.exact and test.p() == pytest.approx(brute_p(d), abs=1e-12)
    assert test.diff == pytest.approx(np.mean(d), abs=1e-15)


def test_no_difference_anywhere_gives_p_1_and_the_interval_0():
    # The sign-flip test alone: it sees no spread, so its interval is one point. The declared contrast's interval is
    # wider (the union with Newcombe's: test_no_collapse_in_either_arm_is_no_evidence_of_equivalence).
    test = SignFlips([0.0] * 7)
    assert (test.diff, test.p(), test.interval()) == (0.0, 1.0, (0.0, 0.0))


@pytest.mark.parametrize("d", EXAMPLES[:3])
def test_the_interval_is_every_shift_the_test_does_not_reject(d):
    # Between consecutive subset means no count changes: probe each gap's midpoint and points beyond the ends.
    means = subset_means(d)
    probes = [means[0] - 0.1, *((means[1:] + means[:-1]) / 2), means[-1] + 0.1]
    lo, hi = SignFlips(d).interval(0.95)
    for shift in probes:
        assert (lo <= shift <= hi) == (brute_p(d, shift) > 0.05), shift
    lo90, hi90 = SignFlips(d).interval(0.90)
    assert lo <= lo90 <= hi90 <= hi
    assert (SignFlips(d).p() <= 0.05) == (not lo <= 0 <= hi)


def test_with_five_cold_starts_or_fewer_the_interval_is_the_whole_range():
    # 2/32 = 0.0625 is the smallest two-sided p over 5 cold starts: no shift is rejected, the bounds are the range's
    test = SignFlips([1.0, 1.0, 0.5, 1.0, 0.5])
    assert test.p() == pytest.approx(2 / 32) and test.interval(0.95, (-1.0, 1.0)) == (-1.0, 1.0)


def test_tost_is_the_larger_one_sided_p_at_the_margins():
    d = EXAMPLES[2]
    test = SignFlips(d)
    for margin in (0.1, 0.3, 0.6, 0.9):
        ref = max(brute_p(d, -margin, "above"), brute_p(d, margin, "below"))
        assert test.tost(margin) == pytest.approx(ref, abs=1e-12)
        lo90, hi90 = test.interval(0.90)
        assert (test.tost(margin) < 0.05) == (-margin < lo90 and hi90 < margin)


def test_past_the_exact_limit_a_monte_carlo_p_estimates_the_exact_one():
    d = np.random.default_rng(0).choice([-0.5, 0.0, 0.5, 1.0], size=21)
    sums = np.zeros(1)
    for x in d:  # the exact two-sided p over the 2^21 sign vectors, listed here
        sums = np.r_[sums + x, sums - x]
    exact = float(np.mean(np.abs(sums) >= abs(d.sum()) - 1e-12))
    test = SignFlips(d)
    assert not test.exact and abs(test.p() - exact) < 0.01


# --------------------------------------------------------------------------- the score interval of pooled rates

Z95 = stats.norm.ppf(0.975)


def wilson_ref(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson limits as the two roots pi of (k/n - pi)^2 = z^2 pi (1 - pi) / n (the quadratic written out)."""
    p = k / n
    a, b, c = 1 + z * z / n, -(2 * p + z * z / n), p * p
    root = math.sqrt(b * b - 4 * a * c)
    return (-b - root) / (2 * a), (-b + root) / (2 * a)


def newcombe_ref(k1: int, n1: int, k2: int, n2: int, z: float = Z95) -> tuple[float, float]:
    """Newcombe's hybrid score interval of k1/n1 - k2/n2 (1998, method 10), from the Wilson limits."""
    (l1, u1), (l2, u2), d = wilson_ref(k1, n1, z), wilson_ref(k2, n2, z), k1 / n1 - k2 / n2
    return (d - math.sqrt((k1 / n1 - l1) ** 2 + (u2 - k2 / n2) ** 2),
            d + math.sqrt((u1 - k1 / n1) ** 2 + (k2 / n2 - l2) ** 2))


# Newcombe (1998), Stat Med 17:873-890, Table II, method 10: (k1, n1, k2, n2) -> the published 95% limits.
PUBLISHED = [((56, 70, 48, 80), (0.0524, 0.3339)), ((5, 56, 0, 29), (-0.0381, 0.1926)),
             ((0, 10, 0, 20), (-0.1611, 0.2775))]


@pytest.mark.parametrize("counts,published", PUBLISHED)
def test_the_score_interval_of_two_rates_is_newcombes(counts, published):
    k1, n1, k2, n2 = counts
    got = RateCombination([(1, k1, n1), (-1, k2, n2)]).interval(0.95)
    assert got == pytest.approx(newcombe_ref(*counts), abs=1e-12)
    assert got == pytest.approx(published, abs=5e-5)  # the table gives 4 decimals


def test_the_score_interval_of_an_interaction_adds_the_four_rates_distances():
    counts = [(1, 3, 8), (-1, 1, 8), (-1, 0, 8), (1, 2, 8)]  # (A - B) - (C - D)
    limits = [wilson_ref(k, n) for _, k, n in counts]
    rates = [k / n for _, k, n in counts]
    d = sum(w * p for (w, _, _), p in zip(counts, rates))
    # a +1 rate moves the lower end down by p - l, a -1 rate by u - p (and the other way for the upper end)
    below = sum((p - lo if w > 0 else hi - p) ** 2 for (w, _, _), p, (lo, hi) in zip(counts, rates, limits))
    above = sum((hi - p if w > 0 else p - lo) ** 2 for (w, _, _), p, (lo, hi) in zip(counts, rates, limits))
    assert RateCombination(counts).interval() == pytest.approx((d - math.sqrt(below), d + math.sqrt(above)), abs=1e-12)


@pytest.mark.parametrize("counts", [(56, 70, 48, 80), (3, 16, 1, 16), (0, 16, 0, 16)])
def test_the_score_p_inverts_the_score_interval(counts):
    k1, n1, k2, n2 = counts
    score = RateCombination([(1, k1, n1), (-1, k2, n2)])
    for delta in (-0.3, -0.1, 0.05, 0.2, 0.4):
        below, above = score.p_below(delta), score.p_above(delta)
        assert below + above == pytest.approx(1.0, abs=1e-12)
        # the interval at the one-sided level the p names ends at delta: its upper end above the estimate, else
        # its lower end
        z = stats.norm.isf(min(below, above))
        end = newcombe_ref(*counts, z=z)[1 if below < 0.5 else 0]
        assert end == pytest.approx(delta, abs=1e-9)


def test_the_score_p_at_zero_of_n_has_its_closed_form():
    # The Wilson upper limit of 0/n at z is z^2 / (n + z^2): it reaches 0.1 at z^2 = 16 * 0.1 / 0.9 for n = 16.
    assert RateCombination([(1, 0, 16), (-1, 0, 16)]).tost(0.1) == pytest.approx(
        stats.norm.sf(math.sqrt(16 * 0.1 / 0.9)), abs=1e-10)


# --------------------------------------------------------------------------- the declared contrast


def collapse_runs(pattern: dict[str, list[int]], seeds: int = 2) -> pd.DataFrame:
    """per_run rows: for each arm, cold start j has pattern[arm][j] of its `seeds` runs collapsed."""
    rows = [{"setting": "", "arm_base": arm, "block": str(j), "collapsed": i < k, "primary": 0.5 + 0.01 * i}
            for arm, ks in pattern.items() for j, k in enumerate(ks) for i in range(seeds)]
    return pd.DataFrame(rows)


PATTERN = {"grpo": [2, 1, 2, 0, 1, 2, 1], "grpo_r3": [0, 0, 1, 0, 1, 0, 0]}


def test_the_row_is_the_test_of_per_cold_start_rate_differences():
    row = declared_contrasts(collapse_runs(PATTERN), [Contrast("grpo", "grpo_r3", "primary", endpoint=COLLAPSE)],
                             COLLAPSE).iloc[0]
    d = (np.array(PATTERN["grpo"]) - np.array(PATTERN["grpo_r3"])) / 2
    assert list(row["per_block"].values()) == pytest.approx(list(d))
    assert row["diff"] == pytest.approx(d.mean()) and row["p"] == pytest.approx(brute_p(d), abs=1e-12)
    assert (row["collapsed"], row["n"], row["collapsed_vs"], row["blocks"]) == (9, 14, 2, 7)
    assert -1 <= row["lo"] <= row["diff"] <= row["hi"] <= 1


def test_no_collapse_in_either_arm_is_no_evidence_of_equivalence():
    # 0/16 against 0/16 runs over 8 cold starts: the sign-flip test alone has the point interval [0, 0] and passes
    # TOST at any margin; each arm's Wilson interval is [0, 0.19], so the row's interval must not be narrower.
    runs = collapse_runs({"grpo": [0] * 8, "grpo_r3": [0] * 8})
    row = declared_contrasts(runs, [Contrast("grpo", "grpo_r3", "primary", 0.1, endpoint=COLLAPSE)], COLLAPSE).iloc[0]
    alone = SignFlips([0.0] * 8)
    assert alone.interval() == (0.0, 0.0) and alone.tost(0.1) < 0.05
    assert row["lo"] <= -0.15 and row["hi"] >= 0.15
    assert (row["lo"], row["hi"]) == pytest.approx(newcombe_ref(0, 16, 0, 16), abs=1e-12)
    assert row["p"] == 1 and row["tost_p"] > 0.05 and row["hypothesis_p"] == row["tost_p"]


@pytest.mark.parametrize("pattern", [PATTERN, {"a": [0] * 8, "b": [0] * 8}, {"a": [2] * 8, "b": [0] * 8},
                                     {"a": [0, 1, 0, 0, 1, 0, 0, 0], "b": [0] * 8}])
def test_the_interval_is_the_union_and_tost_passes_only_inside_it(pattern):
    a, b = pattern
    runs = collapse_runs(pattern)
    d = (np.array(pattern[a]) - np.array(pattern[b])) / 2
    k, n = (sum(pattern[a]), 2 * len(d)), (sum(pattern[b]), 2 * len(d))
    for margin in (0.1, 0.15, 0.2, 0.3, 0.5):
        row = declared_contrasts(runs, [Contrast(a, b, "primary", margin, endpoint=COLLAPSE)], COLLAPSE).iloc[0]
        for level, (lo, hi) in ((0.95, (row["lo"], row["hi"])), (0.90, (row["lo90"], row["hi90"]))):
            z = stats.norm.ppf(0.5 + level / 2)
            flips, score = SignFlips(d).interval(level, (-1, 1)), newcombe_ref(*k, *n, z=z)
            assert (lo, hi) == pytest.approx((max(min(flips[0], score[0]), -1), min(max(flips[1], score[1]), 1)),
                                             abs=1e-12)
        assert row["tost_p"] >= SignFlips(d).tost(margin)
        assert (row["tost_p"] < 0.05) == (-margin < row["lo90"] and row["hi90"] < margin)


def test_an_interaction_with_no_collapse_is_no_evidence_of_equivalence():
    runs = collapse_runs({arm: [0] * 8 for arm in ("grpo", "grpo_r3", "gspo", "grpo_r2")})
    c = Contrast("grpo", "grpo_r3", "primary", 0.2, minus=("gspo", "grpo_r2"), endpoint=COLLAPSE)
    row = declared_contrasts(runs, [c], COLLAPSE).iloc[0]
    # four rates at 0/16: each end is moved by the two rates whose sign points its way, each by the Wilson upper
    # limit, added in quadrature
    half = math.sqrt(2) * wilson_ref(0, 16)[1]
    assert (row["lo"], row["hi"]) == pytest.approx((-half, half), abs=1e-12)
    assert row["tost_p"] > 0.05 and (row["lo90"] <= -0.2 or row["hi90"] >= 0.2)


def test_swapping_arm_and_vs_keeps_p_and_mirrors_the_difference():
    runs = collapse_runs(PATTERN)
    ab = declared_contrasts(runs, [Contrast("grpo", "grpo_r3", "primary", endpoint=COLLAPSE)], COLLAPSE).iloc[0]
    ba = declared_contrasts(runs, [Contrast("grpo_r3", "grpo", "primary", endpoint=COLLAPSE)], COLLAPSE).iloc[0]
    assert ba["p"] == pytest.approx(ab["p"], abs=1e-12) and ba["diff"] == pytest.approx(-ab["diff"], abs=1e-15)
    assert (ba["lo"], ba["hi"]) == (pytest.approx(-ab["hi"], abs=1e-12), pytest.approx(-ab["lo"], abs=1e-12))


def test_identical_arms_differ_by_0_with_0_inside_the_interval():
    runs = collapse_runs({"grpo": PATTERN["grpo"], "copy": PATTERN["grpo"]})
    row = declared_contrasts(runs, [Contrast("grpo", "copy", "primary", endpoint=COLLAPSE)], COLLAPSE).iloc[0]
    assert row["diff"] == 0 and row["lo"] <= 0 <= row["hi"] and row["p"] == 1


def test_primary_collapse_rows_join_holm_with_the_primary_endpoint():
    runs = collapse_runs(PATTERN)
    on_rate = Contrast("grpo", "grpo_r3", "primary", endpoint=COLLAPSE)
    on_acc = Contrast("grpo", "grpo_r3", "primary")
    secondary = Contrast("grpo_r3", "grpo", "secondary", endpoint=COLLAPSE)
    tables = declared_tables(runs, [on_acc, on_rate, secondary], ("primary", COLLAPSE))
    acc, rate = tables["primary"].iloc[0], tables[COLLAPSE]
    assert list(rate["role"]) == ["primary", "secondary"] and np.isnan(rate.iloc[1]["holm_p"])
    expected = holm([acc["hypothesis_p"], rate.iloc[0]["hypothesis_p"]])
    assert [acc["holm_p"], rate.iloc[0]["holm_p"]] == pytest.approx(expected, abs=1e-15)
    # one table asked for alone still carries the Holm p of the whole family
    assert declared_contrasts(runs, [on_acc, on_rate]).iloc[0]["holm_p"] == pytest.approx(expected[0], abs=1e-15)
    assert declared_contrasts(runs, [on_acc]).iloc[0]["holm_p"] == acc["hypothesis_p"]  # a family of one


@pytest.mark.parametrize("extra,needle", [
    ({"endpoint": "rate"}, "contrasts.primary.endpoint='rate': allowed 'collapse'"),
    ({"endpoint": COLLAPSE, "equivalence_margin": 1}, "contrasts.primary.equivalence_margin=1: a contrast of collapse"),
    ({"endpoint": COLLAPSE, "minus": {"arm": "gspo", "vs": "grpo_r2"}, "equivalence_margin": 2.5},
     "contrasts.primary.equivalence_margin=2.5"),
])
def test_bad_collapse_contrasts_get_one_line(extra, needle):
    exp = {"arms": {a: {} for a in ("grpo", "grpo_r3", "gspo", "grpo_r2")},
           "contrasts": {"primary": [{"arm": "grpo", "vs": "grpo_r3", **extra}]}}
    with pytest.raises(ConfigError) as err:
        contrasts_spec(exp)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_margin_a_rate_difference_can_exceed_is_kept():
    exp = {"arms": {a: {} for a in ("grpo", "grpo_r3", "gspo", "grpo_r2")},
           "contrasts": {"primary": [{"arm": "grpo", "vs": "grpo_r3", "endpoint": COLLAPSE, "equivalence_margin": 0.2},
                                     {"arm": "grpo", "vs": "grpo_r3", "minus": {"arm": "gspo", "vs": "grpo_r2"},
                                      "endpoint": COLLAPSE, "equivalence_margin": 1.5}]}}
    assert [(c.endpoint, c.margin) for c in contrasts_spec(exp)] == [(COLLAPSE, 0.2), (COLLAPSE, 1.5)]


# --------------------------------------------------------------------------- on an experiment folder


def write_folder(root: Path, contrasts: dict) -> Path:
    """grpo and grpo_r3 from 7 cold starts (model.seed 1..7), 2 RL seeds each, collapses as in PATTERN."""
    seeds = {j + 1: [10 * j, 10 * j + 1] for j in range(7)}
    for arm, ks in PATTERN.items():
        for block, listed in seeds.items():
            for i, seed in enumerate(listed):
                cfg = {"model": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "seed": block},
                       "rl": {**PAPER_ARMS[arm]["rl"], "steps": 4, "prompts_per_step": 4, "group_size": 4,
                              "minibatches": 1, "eval_every": 2}, "seed": seed}
                run = write_run(root / "runs" / f"{arm}-s{seed}", cfg, arm, steps=4, minibatches=1, layers=1,
                                eval_every=2)
                collapsed = i < ks[block - 1]
                manifest = json.loads((run / "manifest.json").read_text())
                manifest.update(status="collapsed" if collapsed else "done", collapsed_at=3 if collapsed else None,
                                collapse_rule="reward_drop" if collapsed else "")
                (run / "manifest.json").write_text(json.dumps(manifest))
    exp = {"name": root.name, "arms": {a: PAPER_ARMS[a] for a in PATTERN},
           "blocks": {"field": "model.seed", "seeds": seeds}, "contrasts": contrasts}
    (root / "experiment.yaml").write_text(json.dumps(exp))
    return root


def test_compare_prints_the_collapse_row_it_computes(tmp_path, capsys):
    from moe_lab.cli import main

    folder = write_folder(tmp_path / "exp", {"primary": [{"arm": "grpo", "vs": "grpo_r3", "endpoint": COLLAPSE},
                                                         {"arm": "grpo", "vs": "grpo_r3"}]})
    assert main(["compare", str(folder)]) == 0
    out = capsys.readouterr().out
    tables = load_declared_tables(folder)
    rate = tables[COLLAPSE]
    assert len(rate) == 1 and format_declared(rate, COLLAPSE) in out
    row = rate.iloc[0]
    d = (np.array(PATTERN["grpo"]) - np.array(PATTERN["grpo_r3"])) / 2
    assert list(row["per_block"]) == [str(b) for b in range(1, 8)]
    assert list(row["per_block"].values()) == pytest.approx(list(d))
    assert row["p"] == pytest.approx(brute_p(d), abs=1e-12)
    assert f"| grpo − grpo_r3 | primary | 9/14 vs 2/14 | 7 | {row['diff']:+.3f} " in out
    # the collapse row is in the same Holm family as the primary endpoint's row, in the printed tables too
    expected = holm([tables["primary"].iloc[0]["hypothesis_p"], row["p"]])
    assert [tables["primary"].iloc[0]["holm_p"], row["holm_p"]] == pytest.approx(expected, abs=1e-15)


def test_compare_refuses_an_unknown_endpoint_before_reading_runs(tmp_path, capsys):
    from moe_lab.cli import main

    folder = write_folder(tmp_path / "bad", {"primary": [{"arm": "grpo", "vs": "grpo_r3", "endpoint": "rate"}]})
    assert main(["compare", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "contrasts.primary.endpoint='rate'" in err


def test_report_shows_the_collapse_table_and_draws_it(tmp_path):
    from moe_lab.analysis.report import build

    folder = write_folder(tmp_path / "exp", {"primary": [{"arm": "grpo", "vs": "grpo_r3", "endpoint": COLLAPSE}],
                                             "secondary": [{"arm": "grpo", "vs": "grpo_r3"}]})
    report = build(folder)
    rate = load_declared_tables(folder)[COLLAPSE]
    assert "## Declared contrasts, collapse rate\n\n" + format_declared(rate, COLLAPSE) in report.text
    assert rate.iloc[0]["holm_p"] == rate.iloc[0]["p"]  # the only primary row: a family of one
    drawn = report.figures["report_contrasts.png"].axes
    assert [ax.get_xlabel() for ax in drawn] == ["difference of the primary endpoint",
                                                 "difference of the secondary endpoint",
                                                 f"difference of the {COLLAPSE} endpoint"]


def test_the_primary_table_says_when_its_holm_counts_the_collapse_rows():
    runs = collapse_runs(PATTERN)
    alone = format_declared(declared_contrasts(runs, [Contrast("grpo", "grpo_r3", "primary")]))
    both = format_declared(declared_contrasts(runs, [Contrast("grpo", "grpo_r3", "primary"),
                                                     Contrast("grpo", "grpo_r3", "primary", endpoint=COLLAPSE)]))
    assert "Holm over the primary rows (primary endpoint only);" in alone
    assert "(primary endpoint only, counted with the primary contrasts of the collapse rate)" in both
