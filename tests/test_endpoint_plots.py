"""moe_lab.analysis.endpoint_plots on synthetic folders: the drawn curves and intervals are the endpoints' numbers.

Every expected value is recomputed here from the raw eval/metric rows (a pivot over seeds, held forward), not
from the module's own helpers, and read back from the figure's artists.
"""

from __future__ import annotations

import os
import shutil

os.environ.setdefault("MPLBACKEND", "Agg")

import matplotlib.colors as mcolors  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from synthetic import PAPER_ARMS, write_experiment  # noqa: E402

from moe_lab.analysis import endpoint_plots, endpoints, figures, results  # noqa: E402
from moe_lab.analysis.arm_traits import traits_of  # noqa: E402
from moe_lab.analysis.plots import arm_label  # noqa: E402
from moe_lab.analysis.stats import mean_ci  # noqa: E402
from moe_lab.launch.experiment import EndpointSpec  # noqa: E402

STEPS, EVERY = 8, 2
SCHEDULE = [0, 2, 4, 6, 8]
ARMS = ("grpo", "grpo_r2", "gspo")
ACC, REWARD = "eval/acc_greedy", "reward/mean"
STOP = 4  # grpo seed 1 is stopped by a collapse rule after its step-4 evaluation


def stop_run(metrics: pd.DataFrame, evals: pd.DataFrame, run_id: str, after: int, status: str):
    """The frames as if run_id had ended after step `after` with `status` (the rows it never wrote dropped)."""
    def cut(df):
        df = df[~((df["run_id"] == run_id) & (df["step"] > after))].copy()
        df.loc[df["run_id"] == run_id, "status"] = status
        return df
    return cut(metrics), cut(evals)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_experiment(tmp_path_factory.mktemp("ep") / "exp", {a: PAPER_ARMS[a] for a in ARMS},
                            seeds=(0, 1, 2), steps=STEPS, eval_every=EVERY, layers=1)


@pytest.fixture(scope="module")
def frames(folder):
    return stop_run(*results.load_runs(folder), "grpo-s1", STOP, "collapsed")


def held_per_seed(evals: pd.DataFrame, arm: str, grid, metric=ACC) -> pd.DataFrame:
    """step x seed: each seed's value at the step, else its last before it (an independent pivot + ffill)."""
    wide = evals[evals["arm"] == arm].pivot_table(index="step", columns="seed", values=metric, aggfunc="mean")
    return wide.reindex(sorted(set(wide.index) | set(grid))).ffill().loc[list(grid)]


def line(ax, label):
    found = [ln for ln in ax.get_lines() if ln.get_label() == label]
    assert len(found) == 1, [ln.get_label() for ln in ax.get_lines()]
    return found[0]


def test_the_band_mean_is_the_seed_mean_of_carried_accuracies(frames):
    metrics, evals = frames
    fig = endpoint_plots.learning_curves(metrics, evals)
    acc_ax = fig.axes[0]
    for arm in ARMS:
        held = held_per_seed(evals, arm, SCHEDULE)
        ln = line(acc_ax, arm_label(arm, traits_of(evals)))
        assert list(ln.get_xdata()) == SCHEDULE
        assert list(ln.get_ydata()) == pytest.approx(list(held.mean(axis=1)))
    # the band's upper edge at the last step is the 95% t-interval over all three seeds, the stopped one included
    grpo_rgb = mcolors.to_rgb(line(acc_ax, "GRPO").get_color())
    band = next(c for c in acc_ax.collections if tuple(c.get_facecolor()[0][:3]) == pytest.approx(grpo_rgb))
    verts = band.get_paths()[0].vertices
    last = held_per_seed(evals, "grpo", SCHEDULE).loc[STEPS]
    assert verts[verts[:, 0] == STEPS, 1].max() == pytest.approx(mean_ci(last)[2])


def test_a_run_stopped_early_gives_its_last_value_to_every_later_point(frames):
    metrics, evals = frames
    ydata = line(endpoint_plots.learning_curves(metrics, evals).axes[0], "GRPO").get_ydata()
    stopped = evals[(evals["run_id"] == "grpo-s1")].set_index("step")[ACC]
    assert stopped.index.max() == STOP
    survivors = evals[(evals["arm"] == "grpo") & (evals["run_id"] != "grpo-s1")].groupby("step")[ACC].mean()
    for i, step in enumerate(SCHEDULE):
        if step > STOP:  # mean of three: the two survivors' values and the stopped run's step-4 accuracy
            assert ydata[i] == pytest.approx((2 * survivors[step] + stopped[STOP]) / 3)
            assert ydata[i] != pytest.approx(survivors[step])
    # and the endpoints agree: the stopped run's primary is its step-4 value held over the last evaluations
    per_run = endpoints.run_endpoints(metrics, evals, EndpointSpec(last_evals=2))
    assert per_run.set_index("run_id").loc["grpo-s1", "primary"] == pytest.approx(stopped[STOP])


def test_the_reward_panel_carries_the_stopped_run_per_step(frames):
    metrics, evals = frames
    fig = endpoint_plots.learning_curves(metrics, evals)
    held = held_per_seed(metrics, "grpo", range(STEPS), metric=REWARD)
    ln = line(fig.axes[1], "GRPO")
    assert list(ln.get_xdata()) == list(range(STEPS))
    assert list(ln.get_ydata()) == pytest.approx(list(held.mean(axis=1)))
    assert held.loc[STEPS - 1, 1] == held.loc[STOP, 1]  # seed 1's last logged reward, held


def test_a_running_run_is_drawn_up_to_its_last_step_and_left_out_of_the_forest(frames):
    metrics, evals = stop_run(*frames, "gspo-s2", 2, "running")
    ydata = line(endpoint_plots.learning_curves(metrics, evals).axes[0], "GSPO").get_ydata()
    finished = evals[(evals["arm"] == "gspo") & (evals["run_id"] != "gspo-s2")].groupby("step")[ACC].mean()
    assert ydata[-1] == pytest.approx(finished[STEPS])  # not pulled towards the running run's step-2 value
    per_run = endpoint_plots.finished_endpoints(metrics, evals)
    assert "gspo-s2" not in set(per_run["run_id"]) and len(per_run) == 3 * len(ARMS) - 1
    texts = [t.get_text() for t in endpoint_plots.forest_of_frames(metrics, evals).axes[0].texts]
    assert sum("n=2 vs 3" in t for t in texts) == 1  # GSPO - GRPO: 2 finished GSPO runs


def test_windows_and_cold_start_reference(frames):
    metrics, evals = frames
    spec = EndpointSpec(last_evals=2, last_frac=0.5)
    acc_ax, reward_ax = endpoint_plots.learning_curves(metrics, evals, spec).axes[:2]
    span = acc_ax.patches[0].get_bbox()
    assert (span.x0, span.x1) == (SCHEDULE[-2], SCHEDULE[-1])  # the last 2 scheduled evaluations
    reward_span = reward_ax.patches[0].get_bbox()
    assert (reward_span.x0, reward_span.x1) == (STEPS - STEPS // 2 + 1, STEPS)  # as run_endpoints counts them
    cold = line(acc_ax, "cold start (step 0)")
    assert list(cold.get_ydata()) == pytest.approx([evals.loc[evals["step"] == 0, ACC].mean()] * 2)


def forest_rows(ax):
    """(point x, point y, whisker lo, whisker hi) per errorbar, top to bottom."""
    out = []
    for c in ax.containers:
        (x,), (y,) = c.lines[0].get_xdata(), c.lines[0].get_ydata()
        (seg,) = c.lines[2][0].get_segments()
        out.append((x, y, seg[0][0], seg[1][0]))
    return out


def test_forest_points_and_whiskers_are_compare_arms(frames):
    metrics, evals = frames
    pairs = endpoints.compare_arms(endpoints.run_endpoints(metrics, evals), "grpo")
    traits = traits_of(evals)
    ax = endpoint_plots.forest([("exp", pairs)], traits=traits).axes[0]
    rows = forest_rows(ax)
    assert len(rows) == len(pairs) == len(ARMS) - 1
    for (x, y, lo, hi), r, i in zip(rows, pairs.itertuples(), range(len(rows))):
        assert (x, lo, hi) == pytest.approx((r.primary_diff, r.primary_lo, r.primary_hi)) and y == -i
        assert any(f"p={r.primary_p:.4f}" in t.get_text() and t.get_position()[1] == y for t in ax.texts)
    expected = [f"exp: {arm_label(r.arm, traits)} − GRPO" for r in pairs.itertuples()]
    assert [t.get_text() for t in ax.get_yticklabels()] == expected
    assert any(list(ln.get_xdata()) == [0, 0] for ln in ax.get_lines())  # the line at no difference


@pytest.fixture(scope="module")
def settings_folder(tmp_path_factory):
    arms = {f"{a}__control={c}": PAPER_ARMS[a] for c in ("aux", "clip") for a in ("grpo", "gspo")}
    return write_experiment(tmp_path_factory.mktemp("ep") / "controls", arms, seeds=(0, 1), steps=4, eval_every=2,
                            layers=1)


def test_settings_get_one_column_each_and_their_own_rows(settings_folder):
    metrics, evals = results.load_runs(settings_folder)
    fig = endpoint_plots.learning_curves(metrics, evals)
    axes = np.array(fig.axes).reshape(2, 2)
    assert [ax.get_title() for ax in axes[0]] == ["control=aux", "control=clip"]
    for ax, setting in zip(axes[0], ("aux", "clip")):
        held = held_per_seed(evals, f"gspo__control={setting}", [0, 2, 4])
        assert list(line(ax, "GSPO").get_ydata()) == pytest.approx(list(held.mean(axis=1)))
    traits = traits_of(evals)
    pairs = endpoint_plots.endpoint_pairs(endpoint_plots.finished_endpoints(metrics, evals), traits=traits)
    assert list(pairs["setting"]) == ["control=aux", "control=clip"]
    labels = [t.get_text() for t in endpoint_plots.forest([("controls", pairs)], traits=traits).axes[0]
              .get_yticklabels()]
    assert labels == ["controls · control=aux: GSPO − GRPO", "controls · control=clip: GSPO − GRPO"]


def test_forest_across_folders_skips_absent_ones(folder, settings_folder, tmp_path):
    fig = endpoint_plots.forest_across([folder, tmp_path / "not_run_yet", settings_folder])
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert [lb.split(":")[0] for lb in labels] == ["exp", "exp", "controls · control=aux", "controls · control=clip"]
    _, _, _, expected = endpoints.load_comparison(settings_folder, "grpo")
    assert [r[0] for r in forest_rows(ax)[2:]] == pytest.approx(list(expected["primary_diff"]))
    only_gspo = endpoint_plots.forest_across([folder, settings_folder], arms=["gspo"]).axes[0]
    assert [t.get_text().split(": ")[1] for t in only_gspo.get_yticklabels()] == ["GSPO − GRPO"] * 3
    with pytest.raises(ValueError, match="no pair"):
        endpoint_plots.forest_across([tmp_path / "not_run_yet"])


def test_planned_only_with_seeds_to_band_and_arms_to_pair(folder, tmp_path):
    assert list(figures.planned_figures(*results.load_runs(folder)))[-2:] == ["learning_curves", "forest"]
    one_seed = write_experiment(tmp_path / "one", {a: PAPER_ARMS[a] for a in ARMS[:2]}, seeds=(0,), steps=2,
                                eval_every=2, layers=1)
    assert not {"learning_curves", "forest"} & set(figures.planned_figures(*results.load_runs(one_seed)))
    one_arm = tmp_path / "one_arm"
    shutil.copytree(folder, one_arm)
    for run in (one_arm / "runs").iterdir():
        if not run.name.startswith("grpo-"):
            shutil.rmtree(run)
    planned = figures.planned_figures(*results.load_runs(one_arm))
    assert "learning_curves" in planned and "forest" not in planned


def test_forest_command_draws_the_folders_rows_and_refuses_bad_input_in_one_line(folder, settings_folder, tmp_path,
                                                                                 capsys, monkeypatch):
    from moe_lab.cli import main

    drawn = {}
    real = endpoint_plots.forest_across
    monkeypatch.setattr(endpoint_plots, "forest_across",
                        lambda *a, **k: drawn.setdefault("fig", real(*a, **k)))
    out = tmp_path / "figs" / "forest.png"
    assert main(["forest", str(folder), str(settings_folder), "--arms", "gspo", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = [t.get_text() for t in drawn["fig"].axes[0].get_yticklabels()]
    assert labels == ["exp: GSPO − GRPO", "controls · control=aux: GSPO − GRPO", "controls · control=clip: GSPO − GRPO"]
    capsys.readouterr()
    for argv, needle in ([str(tmp_path / "absent"), "--out", str(out)], f"RESULTS_DIR={tmp_path / 'absent'}"), \
                        ([str(folder), "--out", str(tmp_path / "f.txt")], "--out="), \
                        ([str(folder), "--arms", "ppo", "--out", str(out)], "--arms=ppo"):
        assert main(["forest", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1


def test_forest_across_leaves_out_a_folder_whose_runs_are_all_still_running(folder, tmp_path):
    running = tmp_path / "running"
    shutil.copytree(folder, running)
    for manifest in running.glob("runs/*/manifest.json"):
        manifest.write_text(manifest.read_text().replace('"status": "done"', '"status": "running"'))
    assert {m.read_text().count('"status": "running"') for m in running.glob("runs/*/manifest.json")} == {1}
    labels = [t.get_text() for t in endpoint_plots.forest_across([folder, running]).axes[0].get_yticklabels()]
    assert [lb.split(":")[0] for lb in labels] == ["exp", "exp"]
