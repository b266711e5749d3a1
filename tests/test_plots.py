"""moe_lab.analysis.plots and moe_lab.analysis.figures on synthetic result folders: axes, labels, scales, series, files."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")  # nothing here needs a display (plots never use pyplot anyway)

import matplotlib.colors as mcolors  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from synthetic import PAPER_ARMS, clip_sweep_arms, volatility_sweep_arms, write_experiment  # noqa: E402

from moe_lab.analysis import figures  # noqa: E402
from moe_lab.analysis import plots
from moe_lab.analysis import results
from moe_lab.analysis import stability
from moe_lab.analysis import stability_plots
from moe_lab.analysis.arm_traits import ArmTraits, traits_of
from moe_lab.launch.compose import arm_presets

ROOT = Path(__file__).resolve().parents[1]

LAYERS, STEPS = 3, 5
PER_STEP_FIGURES = ["clip_fraction", "reward_curves", "routing_volatility", "routing_heatmap", "ratio_variance"]
ENDPOINT_FIGURES = ["learning_curves", "forest"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("results")
    write_experiment(base / "paper", PAPER_ARMS, seeds=(0, 1, 2), steps=STEPS, layers=LAYERS)
    write_experiment(base / "clip_sweep", clip_sweep_arms(), seeds=(0, 1), steps=3, layers=2)
    write_experiment(base / "volatility_sweep", volatility_sweep_arms(), seeds=(0, 1), steps=3, layers=2)
    return base


@pytest.fixture(scope="module")
def paper(root):
    return results.load_runs(root / "paper")


def labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def legend_texts(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def preset_traits(*names: str) -> dict:
    """The traits of arms that run their preset's config (the config, not the name, is what the plots read)."""
    return {n: ArmTraits(*arm_presets()[n].overrides["rl"].values()) for n in names}


PAPER = list(PAPER_ARMS)  # experiments/paper.yaml's arms, in its order
PAPER_TRAITS = preset_traits(*PAPER)
PAPER_LABELS = [plots.arm_label(a, PAPER_TRAITS) for a in PAPER]


def color(arm: str, as_preset: str | None = None) -> str:
    """The colour of an arm that runs the preset ``as_preset`` (default: its own name)."""
    return plots.arm_color(arm, {arm: preset_traits(as_preset or arm)[as_preset or arm]})


# --------------------------------------------------------------------------- style


def test_arm_colours_are_fixed_okabe_ito_and_distinct():
    colours = [plots.arm_color(a, PAPER_TRAITS) for a in PAPER]
    assert len(set(colours)) == len(colours) and set(colours) <= set(plots.OKABE_ITO)
    assert color("grpo__rl.clip_low=0.1", "grpo") == color("grpo")
    assert plots.arm_color("my_new_arm", {}) in plots.OKABE_ITO


def test_an_arms_colour_label_and_order_come_from_its_config_not_its_name():
    """An arm named like one preset but running another's config is drawn as what it runs; a flag of the config
    (the gate weights replayed too) names itself; the name only tells arms of one config apart."""
    frame = pd.DataFrame({"arm": ["grpo_r3", "mine", "free__arm=x", "frozen__arm=x", "zeta"],
                          "rl.algo": ["gspo", "grpo", "grpo", "grpo", "no_such_objective"],
                          "rl.replay": ["none", "old", "rollout", "rollout", "none"],
                          "rl.rollout_correction": ["none"] * 5,
                          "rl.replay_gate_weights": [False, True, False, False, False]})
    traits = traits_of(frame)
    assert plots.arm_color("grpo_r3", traits) == color("gspo")
    assert plots.arm_label("grpo_r3", traits) == "GSPO (grpo_r3)"
    assert plots.arm_label("mine", traits) == "GRPO + R2 replay + gate weights"
    assert plots.arm_color("mine", traits) not in (color("grpo_r2"), color("grpo"))
    assert plots.arm_color("free__arm=x", traits) == plots.arm_color("frozen__arm=x", traits) == color("grpo_r3")
    assert plots.arm_label("free__arm=x", traits) == "GRPO + R3 replay (free, arm=x)"
    assert plots.arm_linestyle("frozen__arm=x", ["free__arm=x", "frozen__arm=x"], traits) == "--"
    assert "zeta" not in traits and plots.arm_label("zeta", traits) == "zeta"
    assert plots.arm_order(list(frame["arm"]), traits) == ["free__arm=x", "frozen__arm=x", "grpo_r3", "mine", "zeta"]


def test_preset_colours_come_from_the_objective_and_mode_tables():
    """A GRPO preset shows its mode's hue, another objective's preset mixes the mode's hue with its own (so that
    GSPO + R3 is neither GSPO nor GRPO + R3), and no two presets of the paper's modes share a colour."""
    from moe_lab.config.mode_specs import REPLAY_SPECS, ROLLOUT_CORRECTION_SPECS
    from moe_lab.config.objective_specs import OBJECTIVE_SPECS

    assert color("gspo") == OBJECTIVE_SPECS["gspo"].color
    assert color("grpo_r3") == REPLAY_SPECS["rollout"].color
    assert color("grpo_tis") == ROLLOUT_CORRECTION_SPECS["tis_token"].color
    gspo_r3 = color("gspo_r3")
    assert gspo_r3 not in (color("gspo"), color("grpo_r3"))
    rgb = [[int(c[i:i + 2], 16) for i in (1, 3, 5)] for c in (color("gspo"), color("grpo_r3"))]
    assert [int(gspo_r3[i:i + 2], 16) for i in (1, 3, 5)] == [round((a + b) / 2) for a, b in zip(*rgb)]
    arms = [f"{algo}{suffix}" for algo in ("grpo", "gspo") for suffix in ("", "_r2", "_r3", "_tis", "_icepop")]
    assert len({color(a) for a in arms}) == len(arms)


def test_a_variant_of_a_preset_takes_its_colour_and_a_line_style_of_its_own():
    arms = ["grpo_r2_mb1", "grpo_r2_mb2", "grpo_r2_mb4", "grpo_r3_mb4"]
    traits = {**{a: preset_traits("grpo_r2")["grpo_r2"] for a in arms[:3]}, **preset_traits("grpo_r2", "grpo_r3"),
              arms[3]: preset_traits("grpo_r3")["grpo_r3"]}
    assert plots.arm_family("grpo_r2_mb4", traits) == (traits["grpo_r2"], "mb4")
    assert {plots.arm_color(a, traits) for a in arms[:3]} == {color("grpo_r2")} != {plots.arm_color(arms[3], traits)}
    assert [plots.arm_linestyle(a, arms, traits) for a in arms] == ["-", "--", ":", "-"]
    assert plots.arm_label("grpo_r2_mb4", traits) == "GRPO + R2 replay (mb4)"
    assert plots.arm_label("grpo_r2_mb4__rl.lr=0.001", traits) == "GRPO + R2 replay (mb4, lr=0.001)"


@pytest.mark.parametrize("bad", ["red", "#12345", "#GG0000"])
def test_a_spec_colour_must_be_rgb_hex(bad):
    from moe_lab.config.mode_specs import ReplaySpec
    from moe_lab.config.objective_specs import check_color

    with pytest.raises(ValueError, match="#RRGGBB"):
        check_color(bad, "x")
    with pytest.raises(ValueError, match="#RRGGBB"):
        ReplaySpec("x", "R9", forces="rollout", predictor=False, single_process="", trl=True, color=bad)


def test_a_new_arms_colour_is_the_same_in_every_process():
    """Not Python's hash(): str hashes are salted per process, so a figure redrawn later would recolour."""
    import subprocess
    import sys

    code = ("from moe_lab.analysis import plots; "
            "print(plots.arm_color('my_new_arm', {}), plots.arm_color('another', {}))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outs == {f"{plots.arm_color('my_new_arm', {})} {plots.arm_color('another', {})}\n"}


def test_arm_label_and_order():
    sweep = "gspo__rl.clip_low=0.0001__rl.clip_high=0.0002"
    assert plots.arm_label(sweep, {sweep: PAPER_TRAITS["gspo"]}) == "GSPO (clip_low=0.0001, clip_high=0.0002)"
    assert plots.arm_order(["zeta", "gspo", "grpo_r2", "grpo"], PAPER_TRAITS) == ["grpo", "grpo_r2", "gspo", "zeta"]


# --------------------------------------------------------------------------- per-step figures


def test_clip_fraction_log_scale_both_senses_one_line_per_arm(paper):
    metrics, _ = paper
    fig = plots.clip_fraction(metrics)
    out, active, bars = fig.axes[:3]
    for ax, title in ((out, "outside"), (active, "zeroed")):
        assert ax.get_yscale() == "log" and ax.get_xlabel() == "RL step"
        assert "fraction of response tokens" in ax.get_ylabel() and title in ax.get_title()
        assert labels(ax) == PAPER_LABELS
        assert [mcolors.to_hex(line.get_color()) for line in ax.get_lines()] == \
            [plots.arm_color(a, PAPER_TRAITS).lower() for a in PAPER]
        assert len(ax.collections) == len(PAPER_LABELS)  # one seed band per arm
    assert legend_texts(fig) == PAPER_LABELS
    assert bars.get_xscale() == "log" and len(bars.patches) == 2 * len(PAPER_LABELS)
    assert [t.get_text() for t in bars.get_yticklabels()] == PAPER_LABELS


def test_clip_fraction_curve_is_the_seed_mean_per_step(paper):
    metrics, _ = paper
    ax = plots.clip_fraction(metrics, arms=["gspo"]).axes[1]
    expected = results.per_step(metrics[metrics["arm"] == "gspo"], "clip_frac/active")
    np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), expected["mean"])
    np.testing.assert_array_equal(ax.get_lines()[0].get_xdata(), np.arange(STEPS))


def test_reward_curves_training_and_eval_panels(paper):
    metrics, evals = paper
    fig = plots.reward_curves(metrics, evals)
    assert len(fig.axes) == 3
    assert fig.axes[0].get_ylabel() == "mean reward per response"
    assert all(ax.get_ylabel() == "fraction of eval prompts solved" for ax in fig.axes[1:])
    assert all(labels(ax) == PAPER_LABELS and ax.get_xlabel() == "RL step" for ax in fig.axes)
    assert len(plots.reward_curves(metrics).axes) == 1  # no eval frame: the training panel only


def test_routing_volatility_latent_vs_forced_under_replay(paper):
    metrics, _ = paper
    fig = plots.routing_volatility(metrics)
    left, right = fig.axes
    assert labels(left) == PAPER_LABELS and "experts" in left.get_ylabel()
    replay = ["GRPO + R2 replay", "GRPO + R3 replay"]
    assert labels(right) == [f"{a}: {kind}" for a in replay for kind in ("latent", "forced")]
    # Each line is its own column's seed mean (the fixture's forced change is 0 and its latent one is not,
    # so swapped columns would fail here).
    for arm, label in zip(("grpo_r2", "grpo_r3"), replay):
        runs = metrics[metrics["arm"] == arm].groupby(["seed", "step"])
        for kind, col, style in (("latent", "routing/expert_change_latent", "-"), ("forced", "routing/expert_change", "--")):
            line = next(ln for ln in right.get_lines() if ln.get_label() == f"{label}: {kind}")
            want = runs[col].mean().groupby("step").mean().to_numpy()
            assert line.get_linestyle() == style
            np.testing.assert_allclose(line.get_ydata(), want, rtol=1e-12)
        assert metrics.loc[metrics["arm"] == arm, "routing/expert_change_latent"].gt(0).all()
    no_replay = plots.routing_volatility(metrics[metrics["replay"] == "none"])
    assert len(no_replay.axes) == 1


def test_routing_heatmap_layer_by_step_grid(paper):
    metrics, _ = paper
    fig = plots.routing_heatmap(metrics, arms=["grpo", "gspo"])
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert len(images) == 2
    grid = images[0].get_array()
    assert grid.shape == (LAYERS, STEPS)
    layer2 = results.per_step(metrics[metrics["arm"] == "grpo"], "routing/layer_2/expert_change")
    np.testing.assert_allclose(grid[2], layer2["mean"])
    ax = images[0].axes
    assert ax.get_xlabel() == "RL step" and ax.get_ylabel() == "MoE layer" and ax.get_title() == "GRPO"
    assert "experts changed" in fig.axes[-1].get_ylabel()  # the colour bar


def test_routing_heatmap_wraps_many_arms(root):
    metrics, _ = results.load_runs(root / "clip_sweep")
    fig = plots.routing_heatmap(metrics)
    assert sum(bool(ax.images) for ax in fig.axes) == metrics["arm"].nunique() == 6
    assert len({ax.get_position().y0 for ax in fig.axes if ax.images}) == 2  # two rows of at most 4


def test_ratio_variance_panels(paper):
    metrics, _ = paper
    var, extreme = plots.ratio_variance(metrics).axes
    assert var.get_yscale() == "log" and extreme.get_yscale() == "linear"
    assert "ln 2" in extreme.get_title() and extreme.get_ylabel() == "fraction of response tokens"
    assert labels(var) == labels(extreme) == PAPER_LABELS


def test_sweep_arms_share_colour_and_differ_by_linestyle(root):
    metrics, _ = results.load_runs(root / "clip_sweep")
    ax = plots.ratio_variance(metrics).axes[0]
    grpo = [line for line in ax.get_lines() if line.get_label().startswith("GRPO")]
    assert len(grpo) == 3 and len({line.get_color() for line in grpo}) == 1
    assert len({line.get_linestyle() for line in grpo}) == 3


def test_plot_input_errors_name_the_problem(paper):
    metrics, evals = paper
    with pytest.raises(ValueError, match="nope"):
        plots.clip_fraction(metrics, arms=["nope"])
    with pytest.raises(ValueError, match="clip_frac/active"):
        plots.clip_fraction(metrics.drop(columns=["clip_frac/active"]))
    with pytest.raises(ValueError, match="layer"):
        plots.routing_heatmap(metrics.drop(columns=plots.layer_columns(metrics)))


# --------------------------------------------------------------------------- sweeps


def test_clip_sweep_log_x_one_line_per_algorithm(root):
    metrics, evals = results.load_runs(root / "clip_sweep")
    fig = plots.clip_sweep(metrics, evals, x="rl.clip_low_resolved")
    assert len(fig.axes) == 3 and all(ax.get_xscale() == "log" for ax in fig.axes)
    assert fig.axes[0].get_yscale() == "log"
    assert all("eps_low" in ax.get_xlabel() for ax in fig.axes)
    assert legend_texts(fig) == ["GRPO", "GSPO"]
    containers = fig.axes[0].containers  # one errorbar per algorithm: (data line, caps, bars)
    assert [c.get_label() for c in containers] == ["GRPO", "GSPO"]
    lines = [c.lines[0] for c in containers]
    xs = np.concatenate([line.get_xdata() for line in lines])
    assert list(xs) == sorted(metrics.loc[metrics["algo"] == "grpo", "rl.clip_low_resolved"].unique()) + \
        sorted(metrics.loc[metrics["algo"] == "gspo", "rl.clip_low_resolved"].unique())
    table = plots.sweep_table(metrics, evals, "rl.clip_low_resolved")
    np.testing.assert_allclose(np.concatenate([line.get_ydata() for line in lines]), table["clip_frac/active"])


def test_volatility_sweep_panels(root):
    metrics, evals = results.load_runs(root / "volatility_sweep")
    fig = plots.volatility_sweep(metrics, evals)
    change, reward, scatter = fig.axes
    assert change.get_xscale() == reward.get_xscale() == "log" and "multiplier" in change.get_xlabel()
    assert "latent" in change.get_ylabel() and scatter.get_xlabel() == change.get_ylabel()
    assert legend_texts(fig) == ["GRPO", "GSPO"]
    assert [t.get_text() for t in scatter.texts] == ["x1", "x10", "x100"] * 2


# --------------------------------------------------------------------------- write_figures


def test_write_figures_paper_writes_per_step_figures_only(root, tmp_path):
    paths = figures.write_figures(root / "paper", tmp_path / "figs", formats=("png", "svg"))
    # GRPO with and without replay, ratio decomposition logged: the rescue figure too; 3 seeds per arm: the
    # endpoints' learning curves and forest
    assert [p.name for p in paths] == [f"{n}.{f}" for n in [*PER_STEP_FIGURES, "rescue", *ENDPOINT_FIGURES]
                                       for f in ("png", "svg")]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths if p.suffix == ".png")
    assert all(b"<svg" in p.read_bytes()[:2000] for p in paths if p.suffix == ".svg")


# Two seeds: the learning curves. The clip sweep's points are one algorithm each (no pair to put in a forest);
# the router-lr sweep runs GRPO and GSPO at each point.
@pytest.mark.parametrize("name, figure, endpoint_figures", [("clip_sweep", "clip_sweep", ["learning_curves"]),
                                                            ("volatility_sweep", "volatility_sweep", ENDPOINT_FIGURES)])
def test_sweeps_plan_their_figure(root, name, figure, endpoint_figures):
    # rendering each figure is covered above; planning is what decides the files (and is cheap)
    assert list(figures.planned_figures(*results.load_runs(root / name))) == [*PER_STEP_FIGURES, figure,
                                                                              *endpoint_figures]


def test_write_figures_skips_figures_without_columns(tmp_path):
    exp = write_experiment(tmp_path / "exp", {"grpo": PAPER_ARMS["grpo"]}, seeds=(0,), steps=3, layers=2)
    f = exp / "runs" / "grpo-s0" / "metrics.parquet"
    df = pd.read_parquet(f)
    df.drop(columns=[c for c in df.columns if c.startswith(("routing/", "ratio/"))]).to_parquet(f)
    paths = figures.write_figures(exp, formats="pdf")
    assert paths == [exp / "figures" / "clip_fraction.pdf", exp / "figures" / "reward_curves.pdf"]  # default out_dir
    assert paths[0].read_bytes()[:5] == b"%PDF-"


def test_write_figures_rejects_bad_format_before_any_work(root, tmp_path):
    with pytest.raises(ValueError, match="formats"):
        figures.write_figures(root / "paper", tmp_path / "never", formats=("png", "jpg"))
    assert not (tmp_path / "never").exists()


def test_write_figures_on_empty_folder_returns_nothing(tmp_path):
    (tmp_path / "runs").mkdir()
    with pytest.warns(UserWarning, match="no readable runs"):
        assert figures.write_figures(tmp_path) == []


def test_varies_needs_several_values_within_one_arm(paper, root):
    metrics, _ = paper
    assert not figures.varies(metrics, "rl.clip_low_resolved")  # GRPO 0.2 vs GSPO 3e-4 is not a sweep
    sweep, _ = results.load_runs(root / "clip_sweep")
    assert figures.varies(sweep, "rl.clip_low_resolved") and not figures.varies(sweep, "rl.router_lr_mult")


# --------------------------------------------------------------------------- collapse survival and atlas


@pytest.fixture(scope="module")
def collapsed(tmp_path_factory):
    """Two arms of three seeds; grpo-s0's reward is 0 from step 2 (zero-reward rule fires at step 6)."""
    exp = write_experiment(tmp_path_factory.mktemp("collapse") / "exp",
                           {"grpo": PAPER_ARMS["grpo"], "gspo": PAPER_ARMS["gspo"]}, seeds=(0, 1, 2), steps=9,
                           layers=2)
    f = exp / "runs" / "grpo-s0" / "metrics.parquet"
    df = pd.read_parquet(f)
    df.loc[df["step"] >= 2, "reward/mean"] = 0.0
    df.to_parquet(f)
    return exp


def test_survival_draws_the_kaplan_meier_steps_per_arm(collapsed):
    metrics, _ = results.load_runs(collapsed)
    fig = stability_plots.survival(metrics)
    ax = fig.axes[0]
    assert labels(ax) == ["GRPO", "GSPO"] and ax.get_xlabel() == "RL step" and "not yet collapsed" in ax.get_ylabel()
    grpo, gspo = ax.get_lines()
    assert list(grpo.get_xdata()) == list(range(9)) and grpo.get_drawstyle() == "steps-post"
    assert list(grpo.get_ydata()) == pytest.approx([1] * 6 + [2 / 3] * 3)
    assert list(gspo.get_ydata()) == [1] * 9
    assert mcolors.to_hex(grpo.get_color()) == color("grpo").lower()


def test_survival_is_planned_only_once_a_run_collapsed(collapsed, paper):
    assert "survival" in figures.planned_figures(*results.load_runs(collapsed))
    assert "survival" not in figures.planned_figures(*paper)


def atlas_experiment(root):
    arms = {}
    for base in ("grpo", "grpo_r2", "gspo"):
        for mult in (1, 10, 100):
            arms[f"{base}__router_lr={mult}"] = {**PAPER_ARMS[base], "rl": {**PAPER_ARMS[base]["rl"],
                                                                         "router_lr_mult": float(mult)}}
        for noise in (0, 0.1):
            arms[f"{base}__noise={noise}"] = {"rl": {**PAPER_ARMS[base]["rl"], "router_noise": float(noise)}}
    return write_experiment(root, arms, seeds=(0,), steps=4, layers=2)


def test_atlas_small_multiples_one_column_per_factor(tmp_path):
    metrics, evals = results.load_runs(atlas_experiment(tmp_path / "atlas"))
    fig = stability_plots.atlas(metrics, evals)
    table = stability.atlas_table(metrics, evals)
    axes = np.array(fig.axes).reshape(3, 2)
    assert [ax.get_title() for ax in axes[0]] == ["noise", "router_lr"]
    for j, (factor, levels) in enumerate((("noise", ["0", "0.1"]), ("router_lr", ["1", "10", "100"]))):
        for i, col in enumerate(("expert_change", "ratio_var_p99", "acc_gap")):
            ax = axes[i, j]
            assert [t.get_text() for t in ax.get_xticklabels()] == levels
            assert labels(ax) == ["GRPO", "GRPO + R2 replay", "GSPO"]
            for line, arm in zip(ax.get_lines(), ("grpo", "grpo_r2", "gspo")):
                rows = table[(table["factor"] == factor) & (table["arm_base"] == arm)]
                assert list(line.get_xdata()) == list(range(len(levels)))
                assert list(line.get_ydata()) == pytest.approx(list(rows[col]))
    assert axes[1, 0].get_yscale() == "log" and axes[0, 0].get_yscale() == "linear"
    assert "R2" in axes[2, 0].get_ylabel() and legend_texts(fig) == ["GRPO", "GRPO + R2 replay", "GSPO"]
    # the synthetic runs log the ratio decomposition, so GRPO vs R2 also gets the replay map after the atlas
    assert list(figures.planned_figures(metrics, evals))[-2:] == ["atlas", "replay_map"]


def test_atlas_needs_factor_labels_and_sweeps_are_not_atlases(paper, root):
    with pytest.raises(ValueError, match="label"):
        stability_plots.atlas(*paper)
    assert not figures.is_atlas(results.load_runs(root / "volatility_sweep")[0])
    # the committed sweep runs grpo_r2 (the atlas's reference arm) over a two-field grid: still not an atlas
    real = results.load_runs(ROOT / "results" / "reference" / "volatility_sweep")[0]
    assert "grpo_r2" in set(real["arm_base"]) and real["factor"].notna().all()
    assert not figures.is_atlas(real)
    assert figures.is_atlas(results.load_runs(ROOT / "results" / "reference" / "atlas")[0])


def test_atlas_of_a_factors_design_puts_the_shared_base_on_every_axis(tmp_path):
    """An experiment with a `factors` block runs its base point once per arm ('<arm>__base'); the atlas
    places that run at each factor's base level, in the file's level order."""
    arms = {}
    for base in ("grpo", "grpo_r2"):
        arms[f"{base}__base"] = {"rl": {**PAPER_ARMS[base]["rl"]}}
        arms[f"{base}__noise=0.1"] = {"rl": {**PAPER_ARMS[base]["rl"], "router_noise": 0.1}}
        arms[f"{base}__lag=2"] = {"rl": {**PAPER_ARMS[base]["rl"], "router_lr_mult": 10.0}}
    metrics, evals = results.load_runs(write_experiment(tmp_path / "f", arms, seeds=(0,), steps=4, layers=2))
    design = {"factors": {"noise": {"0.1": {"rl.router_noise": 0.1}, "0": {}}, "lag": {"0": {}, "2": {"x": 1}}}}
    table = stability.atlas_table(metrics, evals, design=design)
    assert list(dict.fromkeys(table["factor"])) == ["noise", "lag"]
    noise = table[table["factor"] == "noise"]
    assert list(dict.fromkeys(noise["level"])) == ["0.1", "0"]  # the file's order, not numeric
    alone = stability.atlas_table(metrics[metrics["arm"].str.endswith("__base")],
                                evals[evals["arm"].str.endswith("__base")])
    for factor, level in (("noise", "0"), ("lag", "0")):  # the base run, wherever it sits
        at = table[(table["factor"] == factor) & (table["level"] == level)].set_index("arm_base")
        ref = alone.set_index("arm_base")
        for col in ("expert_change", "ratio_var_p99", "acc_greedy"):
            assert at[col].to_dict() == pytest.approx(ref[col].to_dict())
    assert (table.loc[table["arm_base"] == "grpo_r2", "acc_gap"] == 0).all()
    fig = stability_plots.atlas(metrics, evals, design=design)
    assert [ax.get_title() for ax in np.array(fig.axes).reshape(3, 2)[0]] == ["noise", "lag"]


def test_arm_table_equals_hand_computed_per_run_reductions(tmp_path):
    arms = {**PAPER_ARMS, "sapo": {"rl": {"algo": "sapo"}}, "grpo_icepop": {
        "rl": {"algo": "grpo", "rollout_correction": "icepop", "rollout_dtype": "bfloat16"}}}
    metrics, evals = results.load_runs(write_experiment(tmp_path / "h2h", arms, seeds=(0, 1, 2), steps=8))
    metrics["routing/router_shift"] = np.linspace(0.0, 1.0, len(metrics))  # synthetic runs do not log it
    table = stability.arm_table(metrics, evals).set_index("arm")
    for arm in ("grpo", "sapo"):
        runs = metrics[metrics["arm"] == arm]
        p99 = [g["ratio/token_var"].quantile(0.99) for _, g in runs.groupby("run_id")]
        late = runs[runs["step"] >= 6]  # the last 25% of 8 steps
        change = late.groupby("run_id")["routing/expert_change_latent"].mean()
        shift = late.groupby("run_id")["routing/router_shift"].mean()
        final = evals[(evals["arm"] == arm) & (evals["step"] == evals["step"].max())]["eval/acc_greedy"]
        for col, values in (("ratio_var_p99", p99), ("expert_change", change), ("router_shift", shift),
                            ("acc_greedy", final)):
            mean, lo, hi = results.mean_ci(values)
            assert table.loc[arm, [col, f"{col}_lo", f"{col}_hi"]].tolist() == pytest.approx([mean, lo, hi])
        assert table.loc[arm, "runs"] == 3 and table.loc[arm, "collapse_rate"] == 0


def test_head_to_head_bars_show_the_arm_table(tmp_path):
    arms = {**PAPER_ARMS, "cispo": {"rl": {"algo": "cispo"}}}
    metrics, evals = results.load_runs(write_experiment(tmp_path / "h2h", arms, seeds=(0, 1), steps=4))
    metrics["routing/router_shift"] = 0.01

    fig = stability_plots.head_to_head(metrics, evals)
    table = stability.arm_table(metrics, evals).set_index("arm")
    traits = traits_of(metrics)
    order = plots.arm_order(metrics["arm"].unique(), traits)
    assert order == [*PAPER, "cispo"]
    for ax, (col, _, _) in zip(fig.axes[1:], stability_plots.H2H_PANELS):
        widths = [patch.get_width() for patch in ax.patches]
        assert widths == pytest.approx(list(np.nan_to_num(table.loc[order, col].to_numpy(float))))
        assert [t.get_text() for t in ax.get_yticklabels()] == [plots.arm_label(a, traits) for a in order]
    assert "head_to_head" in figures.planned_figures(metrics, evals)
    paper = metrics[metrics["arm"].isin(PAPER_ARMS)]
    assert "head_to_head" not in figures.planned_figures(paper, evals)  # the main job is no stabilizer match


def test_a_factors_design_gets_only_the_atlas(tmp_path):
    arms = {f"{a}__base": PAPER_ARMS[a] for a in ("grpo", "grpo_r2")}
    arms.update({f"{a}__noise=0.1": {"rl": {**PAPER_ARMS[a]["rl"], "router_noise": 0.1}} for a in ("grpo", "grpo_r2")})
    metrics, evals = results.load_runs(write_experiment(tmp_path / "f", arms, seeds=(0,), steps=4, layers=2))
    design = {"factors": {"noise": {"0": {}, "0.1": {"rl.router_noise": 0.1}}}}
    assert list(figures.planned_figures(metrics, evals, design)) == ["atlas", "replay_map"]
    assert "reward_curves" in figures.planned_figures(metrics, evals)  # without the design: per-arm figures too
