"""Write every figure an experiment folder's data supports (`moe-lab plot`, the end of `moe-lab reproduce`).

File names are fixed (FIGURE_NAMES + format suffix) so that READMEs and notebooks can point at them. A figure
whose columns are absent, or a sweep figure whose knob does not vary within an arm, is skipped, not drawn empty;
the survival figure is drawn once some run collapsed, the atlas for a one-factor-at-a-time experiment (arms
labelled '<arm>__<factor>=<level>' that include the atlas's reference arm, GRPO + R2 by its config), the
endpoints' learning curves once some arm has several seeds and their forest once some setting also has two arms.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from moe_lab.analysis import arm_traits
from moe_lab.analysis import endpoint_plots
from moe_lab.analysis import plots
from moe_lab.analysis import replay_map
from moe_lab.analysis import replay_plots
from moe_lab.analysis import results
from moe_lab.analysis import stability
from moe_lab.analysis import stability_plots
from moe_lab.config.constants import PPO_CLIP_ALGOS
from moe_lab.config.errors import ConfigError
from moe_lab.launch.experiment import BASE_LABEL
from moe_lab.launch.spec import Experiment, parse_experiment

FORMATS = ("png", "pdf", "svg")
FIGURE_NAMES = ("clip_fraction", "reward_curves", "routing_volatility", "routing_heatmap", "ratio_variance",
                "clip_sweep", "volatility_sweep", "survival", "atlas", "head_to_head", "replay_map", "rescue",
                "learning_curves", "forest")
DPI = 100


def _has(df: pd.DataFrame, *cols: str) -> bool:
    return all(c in df.columns and df[c].notna().any() for c in cols)


def varies(df: pd.DataFrame, col: str, within: str = "arm_base") -> bool:
    """Whether col takes several values inside one base arm: a sweep over it, not just two algorithms'
    different defaults (GRPO's clip 0.2 vs GSPO's 3e-4 is not a clip sweep)."""
    if not _has(df, col) or within not in df.columns:
        return False
    return bool((df.groupby(within)[col].nunique() > 1).any())


def _parsed(design: dict | Experiment | None) -> Experiment | None:
    """The typed experiment, or None when there is none or it does not parse (`moe-lab compare` reports a bad
    block; the figures that need no design still draw)."""
    try:
        return None if design is None else parse_experiment(design)
    except ConfigError:
        return None


def planned_figures(metrics: pd.DataFrame, evals: pd.DataFrame,
                    design: dict | Experiment | None = None) -> dict[str, Callable[[], Figure]]:
    """Name -> builder of every figure these frames support, in FIGURE_NAMES order. ``design``: the
    experiment as run (its experiment.yaml, or parsed); a ``factors`` block there makes the folder an atlas."""
    plan: dict[str, Callable[[], Figure]] = {}
    exp = _parsed(design)
    design = exp.explicit if exp is not None else None
    if exp is not None and exp.setting("factors"):  # an atlas: per-arm curves of ~80 cells would be unreadable
        if _has(metrics, "ratio/token_var", "routing/expert_change"):
            plan["atlas"] = lambda: stability_plots.atlas(metrics, evals, design=design)
        if is_replay_comparison(metrics):
            plan["replay_map"] = lambda: replay_plots.replay_map_figure(metrics, evals)
        return plan
    if _has(metrics, "clip_frac/out_of_range", "clip_frac/active"):
        plan["clip_fraction"] = lambda: plots.clip_fraction(metrics)
    if _has(metrics, "reward/mean"):
        plan["reward_curves"] = lambda: plots.reward_curves(metrics, evals)
    if _has(metrics, "routing/expert_change"):
        plan["routing_volatility"] = lambda: plots.routing_volatility(metrics)
    if plots.layer_columns(metrics):
        plan["routing_heatmap"] = lambda: plots.routing_heatmap(metrics)
    if _has(metrics, "ratio/token_var", "ratio/extreme_frac"):
        plan["ratio_variance"] = lambda: plots.ratio_variance(metrics)
    clip_x = next((c for c in ("rl.clip_low_resolved", "rl.clip_high_resolved") if varies(metrics, c)), None)
    if clip_x and _has(metrics, "clip_frac/active"):
        plan["clip_sweep"] = lambda: plots.clip_sweep(metrics, evals, x=clip_x)
    if varies(metrics, "rl.router_lr_mult") and _has(metrics, "reward/mean", "routing/expert_change"):
        plan["volatility_sweep"] = lambda: plots.volatility_sweep(metrics, evals)
    # Survival only once some run collapsed: with none, every curve is the line at 1 and the summary's
    # "0/n" collapse rate says the same.
    if _has(metrics, "collapsed_at"):
        plan["survival"] = lambda: stability_plots.survival(metrics)
    # a factors design returned above; without one (no experiment.yaml), the arm labels tell
    if is_atlas(metrics) and _has(metrics, "ratio/token_var", "routing/expert_change"):
        plan["atlas"] = lambda: stability_plots.atlas(metrics, evals, design=design)
    if is_head_to_head(metrics) and _has(metrics, "ratio/token_var", "routing/expert_change"):
        plan["head_to_head"] = lambda: stability_plots.head_to_head(metrics, evals)
    if is_replay_comparison(metrics):  # a factors design gets the map; one setting, the rescue head line
        if is_atlas(metrics):
            plan["replay_map"] = lambda: replay_plots.replay_map_figure(metrics, evals)
        else:
            plan["rescue"] = lambda: replay_plots.rescue(metrics, evals)
    if not is_atlas(metrics):  # ~80 one-seed cells: an atlas has neither seed bands nor pairs to compare
        plan.update(_endpoint_figures(metrics, evals, exp if exp is not None else parse_experiment(None)))
    return plan


def _endpoint_figures(metrics: pd.DataFrame, evals: pd.DataFrame, exp: Experiment) -> dict[str, Callable[[], Figure]]:
    """Learning curves with seed bands once some arm has several seeds, and the forest of differences once
    some setting also has two arms; the endpoints (and their windows) are the experiment file's."""
    spec = exp.endpoints
    # frames not read by load_runs (no arm_base, no schedule columns) cannot place the endpoints' windows
    if "arm" not in evals or "arm_base" not in evals or not _has(evals, spec.primary_metric, "seed", "rl.steps",
                                                                 "rl.eval_every") \
            or evals.groupby("arm")["seed"].nunique().max() < 2:
        return {}
    plan = {"learning_curves": lambda: endpoint_plots.learning_curves(metrics, evals, spec)}
    if evals.groupby(evals["arm"].map(endpoint_plots.setting_of))["arm_base"].nunique().max() >= 2:
        plan["forest"] = lambda: endpoint_plots.forest_of_frames(metrics, evals, spec)
    return plan


def _design(results_dir: Path) -> dict | None:
    """The experiment.yaml the runner wrote beside runs/, if readable (the atlas's factors, the endpoints); parsed
    once, by planned_figures."""
    from moe_lab.store.run_folder import ResultsFolder

    try:
        return ResultsFolder(results_dir).experiment()
    except (OSError, ConfigError):
        return None


def is_head_to_head(df: pd.DataFrame) -> bool:
    """A comparison of stabilizers: some arm runs an objective beyond the PPO-clip family or a rollout
    correction (experiments/stabilizers.yaml), and no arm is a factor level (an atlas)."""
    if _has(df, "factor") and df["factor"].notna().any():
        return False
    return any(t.algo not in PPO_CLIP_ALGOS or t.corrected for t in arm_traits.traits_of(df).values())


def is_replay_comparison(df: pd.DataFrame) -> bool:
    """GRPO with and without Routing Replay, with the ratio decomposition logged (replay_map / rescue figures);
    a folder whose runs did not log the decomposition draws neither (it has no share to place on the map)."""
    if "arm_base" not in df or not _has(df, replay_map.SHARE, "ratio/token_var", "optim/grad_norm"):
        return False
    traits, arms = arm_traits.traits_of(df), df["arm_base"].dropna().unique()
    return bool(arm_traits.arms_where(arms, traits, arm_traits.is_baseline)
                and arm_traits.arms_where(arms, traits, arm_traits.is_replay_of_baseline))


def is_atlas(df: pd.DataFrame, reference: str | None = None) -> bool:
    """A one-factor-at-a-time experiment: factor-labelled arms that include the reference arm (the atlas's
    accuracy gap is taken to it; default: stability.atlas_reference). A plain sweep (clip range, router lr of
    GRPO and GSPO) is not one."""
    if not _has(df, "factor") or "arm_base" not in df:
        return False
    labelled = df[df["factor"].notna()]
    # A grid sweep labels every cell with the one (compound) factor it varies and has no shared base point;
    # an atlas varies several factors, or runs its base point as '<arm>__base'.
    one_at_a_time = labelled["factor"].nunique() > 1 or bool((labelled["factor"] == BASE_LABEL).any())
    reference = stability.atlas_reference(df) if reference is None else reference
    return one_at_a_time and reference is not None and bool((labelled["arm_base"] == reference).any())


def parse_formats(formats: str | Sequence[str]) -> tuple[str, ...]:
    items = formats.split(",") if isinstance(formats, str) else list(formats)
    items = [str(f).strip().lower().lstrip(".") for f in items if str(f).strip()]
    bad = [f for f in items if f not in FORMATS]
    if bad or not items:
        raise ValueError(f"formats={formats!r}: allowed a non-empty list of {', '.join(FORMATS)}")
    return tuple(dict.fromkeys(items))


def write_figures(results_dir: str | Path, out_dir: str | Path | None = None,
                  formats: str | Sequence[str] = ("png",)) -> list[Path]:
    """Load results_dir with results.load_runs and write each supported figure in each format.

    Returns the written paths (empty when there is nothing to plot). A figure that fails on unexpected data
    is skipped with a warning: the end of a long `reproduce` must not be lost to one plot.
    """
    formats = parse_formats(formats)
    results_dir = Path(results_dir)
    metrics, evals = results.load_runs(results_dir)
    out_dir = Path(out_dir) if out_dir is not None else results_dir / "figures"
    plan = planned_figures(metrics, evals, _design(results_dir)) if len(metrics) else {}
    paths = []
    for name, build in plan.items():
        try:
            fig = build()
        except ValueError as exc:
            warnings.warn(f"figure {name} skipped: {exc}", stacklevel=2)
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        for fmt in formats:
            path = out_dir / f"{name}.{fmt}"
            fig.savefig(path, format=fmt, dpi=DPI, bbox_inches="tight")
            paths.append(path)
    return paths


# --------------------------------------------------------------------------- `moe-lab plot FOLDER`

SKIPPED_RUN = "skipping run "  # the prefix of results.load_runs' warning for an unreadable run


def experiment_folders(path: str | Path) -> list[Path]:
    """[path] when it holds runs (an experiment, runs/ or run folder); else each subfolder that does (a folder
    of experiments such as results/reference); [] when there are none."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a folder; expected an experiment folder or a folder of experiments")
    if results.find_run_dirs(path):
        return [path]
    return [p for p in sorted(path.iterdir()) if p.is_dir() and results.find_run_dirs(p)]


def plot_folder(path: str | Path, out_dir: str | Path | None = None, formats: str | Sequence[str] = ("png",),
                progress: Callable[[int, int, Path, list[Path]], None] | None = None,
                ) -> tuple[list[Path], list[tuple[str, str]]]:
    """Figures of each experiment under path; returns (written paths, [(unreadable run, why)]).

    With several experiments and an out_dir, each gets out_dir/<experiment>. Unreadable runs are reported, not
    raised: the figures of every readable run are still written. ``progress(i, n, folder, written)`` after each.
    """
    formats = parse_formats(formats)
    folders = experiment_folders(path)
    paths, unreadable = [], []
    for i, folder in enumerate(folders, 1):
        dest = None if out_dir is None else (Path(out_dir) / folder.name if len(folders) > 1 else Path(out_dir))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            written = write_figures(folder, dest, formats)
        paths += written
        if progress is not None:
            progress(i, len(folders), folder, written)
        for w in caught:
            text = str(w.message)
            if text.startswith(SKIPPED_RUN):
                run, _, why = text[len(SKIPPED_RUN):].partition(": ")
                unreadable.append((run, why))
            elif not text.startswith("no readable runs"):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return paths, unreadable
