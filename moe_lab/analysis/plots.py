"""Figures of the paper's comparisons, from the frames of moe_lab.analysis.results (never reads files, never trains).

Every function returns a matplotlib Figure built without pyplot (no global figure registry, no display
backend needed: savefig picks Agg/PDF/SVG by format). Curves are the mean over seeds with a shaded 95%
t-interval (results.per_step); sweep points carry the same interval as error bars. An arm's colour and label
come from its traits (its objective and modes, read from its runs' config: arm_traits), so an arm looks the same
in every figure.
"""

from __future__ import annotations

import functools
import re
import zlib
from collections.abc import Sequence

import matplotlib as mpl
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from moe_lab.analysis import results
from moe_lab.analysis.arm_traits import ArmTraits, traits_of
from moe_lab.config.constants import PPO_CLIP_ALGOS

OKABE_ITO = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#000000")
STYLE = {"axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
         "font.size": 9, "axes.titlesize": 9, "legend.fontsize": 7, "legend.frameon": False, "lines.linewidth": 1.5}
BAND_ALPHA = 0.2
HEATMAP_COLS = 4
LINESTYLES = ("-", "--", ":", "-.")
LAYER_RE = re.compile(r"routing/layer_(\d+)/expert_change")
STEP, TOKENS = "RL step", "fraction of response tokens"
CHANGE = "share of top-k experts changed"
Traits = dict[str, ArmTraits]  # arm -> its traits, from its runs' config (arm_traits.traits_of of the frame)


def styled(fn):
    """Build the figure under STYLE, so every figure shares fonts, grid and spines."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with mpl.rc_context(STYLE):
            return fn(*args, **kwargs)
    return wrapper


def arm_family(arm: str, traits: Traits) -> tuple[ArmTraits | str, str]:
    """(what gives the arm its colour, its variant tag): its traits where its config names them, else its base
    name. The tag tells arms of one set of traits apart: the rest of a name that extends the traits' preset or
    objective ('grpo_r2_mb4' -> 'mb4'), or a name that extends neither ('free'); none where the name is one of
    them or a flag's words already name what the arm adds."""
    base = results.base_arm(arm)
    t = traits.get(str(arm), traits.get(base))
    if t is None:
        return base, ""
    if t.flags:
        return t, ""
    for prefix in (t.preset, t.algo):
        if base == prefix or base.startswith(prefix + "_"):
            return t, base[len(prefix) + 1:]
    return t, base


def arm_color(arm: str, traits: Traits) -> str:
    """A fixed colour per set of traits (its objective and modes, arm_traits), the same in every figure: a sweep
    arm ('grpo__rl.clip_low=0.1') or a variant ('grpo_r2_mb4') takes its preset's colour (launch/compose.py), and
    line styles tell them apart; an arm without traits takes an Okabe-Ito colour by its name."""
    family, _ = arm_family(arm, traits)
    if isinstance(family, ArmTraits) and family.color:
        return family.color
    name = family.preset if isinstance(family, ArmTraits) else family
    return OKABE_ITO[zlib.crc32(name.encode()) % len(OKABE_ITO)]


def arm_label(arm: str, traits: Traits, wrap: bool = False) -> str:
    """'GRPO', 'GRPO + R2 replay (mb4)' for a variant, or 'GRPO (clip_low=0.1, clip_high=0.13)' for a sweep arm
    (second line with wrap=True); an arm without traits: its name."""
    family, tag = arm_family(arm, traits)
    label = family.label if isinstance(family, ArmTraits) else family
    sweep = str(arm).partition("__")[2]
    points = ", ".join([tag] * bool(tag) + [f"{key.rsplit('.', 1)[-1]}={value}" for key, _, value in
                                            (p.partition("=") for p in sweep.split("__")) if sweep])
    return f"{label}{chr(10) if wrap else ' '}({points})" if points else label


def arm_linestyle(arm: str, arms: Sequence[str], traits: Traits) -> str:
    """Solid for a plain arm; the sweep points and variants of one family share its colour and differ by line
    style."""
    siblings = [a for a in arms if arm_family(a, traits)[0] == arm_family(arm, traits)[0]]
    return LINESTYLES[siblings.index(arm) % len(LINESTYLES)] if arm in siblings else "-"


def arm_order(arms: Sequence[str], traits: Traits | None = None) -> list[str]:
    """The arms in the tables' order of their traits (objective, replay, correction: the paper's GRPO, + R2,
    + R3, GSPO, GSPO-token), then by name; arms without traits (or no ``traits``) after them by name."""
    def key(arm):
        family, _ = arm_family(arm, traits or {})
        return (0, family.order, str(arm)) if isinstance(family, ArmTraits) else (1, (), str(arm))
    return sorted(dict.fromkeys(arms), key=key)


def paper_arms(arms: Sequence[str], traits: Traits) -> list[str]:
    """The paper's comparison among ``arms``: the PPO-clip objectives, with or without replay, no correction."""
    return [a for a in arms if isinstance(f := arm_family(a, traits)[0], ArmTraits)
            and f.algo in PPO_CLIP_ALGOS and not f.corrected and not f.flags]


def arms_to_draw(df: pd.DataFrame, arms: Sequence[str] | None) -> list[str]:
    present = arm_order(df["arm"].dropna().astype(str).unique(), traits_of(df)) if "arm" in df else []
    if arms is None:
        return present
    missing = [a for a in arms if a not in present]
    if missing:
        raise ValueError(f"arms: {missing} not in the data; available: {present}")
    return list(arms)


def _require(df: pd.DataFrame, cols: Sequence[str], name: str) -> None:
    missing = [c for c in cols if c not in df.columns or df[c].isna().all()]
    if missing:
        raise ValueError(f"{name}: the frame has no values for {missing}")


def new_figure(ncols: int, nrows: int = 1, width: float = 4.0, height: float = 3.0):
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def positive_floor(lo: np.ndarray, mean: np.ndarray) -> np.ndarray:
    # On a log axis a band reaching <= 0 (two seeds give wide t-intervals) would vanish entirely;
    # floor it at a tenth of the mean so the band stays visible and honest about its upper side.
    return np.where(lo > 0, lo, mean / 10)


def band(ax, table: pd.DataFrame, label: str, color: str, *, log: bool = False, linestyle: str = "-") -> None:
    """Mean line (labelled, one Line2D) and its 95% band (a PolyCollection) from a per_step table."""
    x, mean, lo, hi = (table[c].to_numpy(float) for c in ("step", "mean", "lo", "hi"))
    ax.plot(x, mean, color=color, linestyle=linestyle, label=label)
    # Every quantity plotted here (shares, variances, rewards, accuracies) is >= 0: a t-band below 0
    # from three seeds says nothing the axis should show.
    lo = positive_floor(lo, mean) if log else np.maximum(lo, 0.0)
    ax.fill_between(x, np.where(np.isnan(lo), mean, lo), np.where(np.isnan(hi), mean, hi), color=color,
                    alpha=BAND_ALPHA, linewidth=0)


def curves(ax, df: pd.DataFrame, metric: str, arms: Sequence[str], *, ylabel: str, title: str,
           log: bool = False, traits: Traits | None = None) -> None:
    """One seed-band curve per arm of `metric` against the RL step (``traits``: the arms', where ``df`` is a
    frame derived without the config columns)."""
    table = results.per_step(df[df["arm"].isin(arms)], metric, by=("arm",))
    traits = traits_of(df) if traits is None else traits
    for arm in arms:
        rows = table[table["arm"] == arm]
        if rows["mean"].notna().any():
            band(ax, rows, arm_label(arm, traits), arm_color(arm, traits), log=log,
                 linestyle=arm_linestyle(arm, arms, traits))
    ax.set(xlabel=STEP, ylabel=ylabel, title=title)
    if log:
        ax.set_yscale("log")


def figure_legend(fig: Figure, ax) -> None:
    """One legend for the whole figure, below the panels (every panel shows the same arms)."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 3) or 1)


def run_mean_bars(ax, metrics_df: pd.DataFrame, arms: Sequence[str], metrics: Sequence[str]) -> None:
    """Horizontal bars (log x): each metric's mean over the whole run per arm, 95% interval over seeds;
    the first metric solid, the next ones pale."""
    per_run = results.last_frac_means(metrics_df[metrics_df["arm"].isin(arms)], metrics, ["arm"], 1.0)
    height = 0.8 / len(metrics)
    traits = traits_of(metrics_df)
    for j, metric in enumerate(metrics):
        stats = np.array([results.mean_ci(per_run.loc[per_run["arm"] == a, metric]) for a in arms]).reshape(-1, 3)
        lo = positive_floor(stats[:, 1], stats[:, 0])
        err = np.abs(np.nan_to_num(np.stack([lo, stats[:, 2]]) - stats[None, :, 0]))
        ax.barh(np.arange(len(arms)) + (j - (len(metrics) - 1) / 2) * height, stats[:, 0], height, xerr=err,
                capsize=2, color=[arm_color(a, traits) for a in arms], alpha=1.0 if j == 0 else 0.5, label=metric)
    ax.set_yticks(np.arange(len(arms)), [arm_label(a, traits, wrap=True) for a in arms])
    ax.invert_yaxis()  # first arm on top, as in the legend
    ax.set(xscale="log", xlabel=f"{TOKENS} (log)", title="mean over the run (solid: outside, pale: zeroed)")


@styled
def clip_fraction(metrics_df: pd.DataFrame, arms: Sequence[str] | None = None) -> Figure:
    """The paper's Figure 2 analogue: clipped-token fraction per algorithm, both senses, log scale."""
    senses = {"clip_frac/out_of_range": "ratio outside the clip range",
              "clip_frac/active": "gradient zeroed by the clip"}
    _require(metrics_df, list(senses), "clip_fraction")
    arms = arms_to_draw(metrics_df, arms)
    fig, axes = new_figure(3, height=max(3.0, 1.2 + 0.3 * len(arms)))
    for ax, (metric, title) in zip(axes[0], senses.items()):
        curves(ax, metrics_df, metric, arms, ylabel=f"{TOKENS} (log)", title=title, log=True)
    figure_legend(fig, axes[0, 0])
    run_mean_bars(axes[0, 2], metrics_df, arms, list(senses))
    fig.suptitle("Clipped-token fraction per algorithm (95% interval over seeds)")
    return fig


@styled
def reward_curves(metrics_df: pd.DataFrame, eval_df: pd.DataFrame | None = None,
                  arms: Sequence[str] | None = None) -> Figure:
    """The paper's Figures 1 and 3: training reward and held-out accuracy per arm against the RL step
    (default arms: the paper's five where present, else every arm)."""
    _require(metrics_df, ["reward/mean"], "reward_curves")
    if arms is None:
        arms = paper_arms(arms_to_draw(metrics_df, None), traits_of(metrics_df)) or None
    arms = arms_to_draw(metrics_df, arms)
    evals = {m: t for m, t in (("eval/acc_greedy", "held-out accuracy, greedy"),
                                ("eval/acc_sampled", "held-out accuracy, sampled (T=1)"))
             if eval_df is not None and m in eval_df.columns and eval_df[m].notna().any()}
    fig, axes = new_figure(1 + len(evals))
    curves(axes[0, 0], metrics_df, "reward/mean", arms, ylabel="mean reward per response", title="training reward")
    for ax, (metric, title) in zip(axes[0, 1:], evals.items()):
        curves(ax, eval_df, metric, [a for a in arms if a in set(eval_df["arm"])],
               ylabel="fraction of eval prompts solved", title=title)
    figure_legend(fig, axes[0, 0])
    fig.suptitle("GRPO with and without Routing Replay vs GSPO and GSPO-token (mean, 95% band over seeds)")
    return fig


@styled
def routing_volatility(metrics_df: pd.DataFrame, arms: Sequence[str] | None = None) -> Figure:
    """Expert change per update per arm; next to it, under replay, the latent change vs the forced one."""
    _require(metrics_df, ["routing/expert_change"], "routing_volatility")
    arms = arms_to_draw(metrics_df, arms)
    traits = traits_of(metrics_df)
    replay_arms = []
    if "routing/expert_change_latent" in metrics_df:
        replay_arms = [a for a in arms if a in traits and traits[a].replays]
    fig, axes = new_figure(2 if replay_arms else 1)
    curves(axes[0, 0], metrics_df, "routing/expert_change", arms, ylabel=CHANGE,
           title="per update: old-policy routing vs routing used")
    figure_legend(fig, axes[0, 0])
    if replay_arms:
        ax, sub = axes[0, 1], metrics_df[metrics_df["arm"].isin(replay_arms)]
        latent = results.per_step(sub, "routing/expert_change_latent")
        forced = results.per_step(sub, "routing/expert_change")
        for arm in replay_arms:
            label, color = arm_label(arm, traits), arm_color(arm, traits)
            band(ax, latent[latent["arm"] == arm], f"{label}: latent", color)
            band(ax, forced[forced["arm"] == arm], f"{label}: forced", color, linestyle="--")
        ax.set(xlabel=STEP, ylabel=CHANGE,
               title="under replay: router's choice (latent) vs used (forced)")
        ax.legend()
    fig.suptitle("Routing volatility (mean, 95% band over seeds)")
    return fig


def layer_columns(df: pd.DataFrame) -> list[str]:
    """routing/layer_{i}/expert_change columns present, in layer order."""
    found = [(int(m.group(1)), c) for c in df.columns if (m := LAYER_RE.fullmatch(str(c)))]
    return [c for _, c in sorted(found)]


@styled
def routing_heatmap(metrics_df: pd.DataFrame, arms: Sequence[str] | None = None) -> Figure:
    """Expert change per MoE layer (rows) and RL step (columns), mean over minibatches and seeds, per arm."""
    cols = layer_columns(metrics_df)
    if not cols:
        raise ValueError("routing_heatmap: the frame has no routing/layer_{i}/expert_change columns")
    arms = arms_to_draw(metrics_df, arms)
    traits = traits_of(metrics_df)
    grids = {}
    for arm in arms:
        sub = metrics_df[metrics_df["arm"] == arm]
        tables = [results.per_step(sub, c) for c in cols]
        grids[arm] = (tables[0]["step"].to_numpy(float), np.stack([t["mean"].to_numpy(float) for t in tables]))
    vmax = max(float(np.nanmax(g)) if np.isfinite(g).any() else 0.0 for _, g in grids.values()) or 1.0
    ncols = min(len(arms), HEATMAP_COLS)
    fig, axes = new_figure(ncols, -(-len(arms) // ncols), width=3.0, height=2.6)
    for ax in axes.flat[len(arms):]:
        ax.set_visible(False)
    for ax, arm in zip(axes.flat, arms):
        steps, grid_LS = grids[arm]
        image = ax.imshow(grid_LS, aspect="auto", origin="lower", cmap="viridis", vmin=0.0, vmax=vmax,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(cols) - 0.5), interpolation="nearest")
        ax.set(xlabel=STEP, ylabel="MoE layer", title=arm_label(arm, traits, wrap=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(False)
    fig.colorbar(image, ax=list(axes.flat[:len(arms)]), label=f"{CHANGE} per update")
    fig.suptitle("Expert change per layer and step (mean over seeds)")
    return fig


@styled
def ratio_variance(metrics_df: pd.DataFrame, arms: Sequence[str] | None = None) -> Figure:
    """Token-ratio variance (log) and the share of extreme tokens (|log w| > ln 2) per arm."""
    _require(metrics_df, ["ratio/token_var", "ratio/extreme_frac"], "ratio_variance")
    arms = arms_to_draw(metrics_df, arms)
    fig, axes = new_figure(2)
    curves(axes[0, 0], metrics_df, "ratio/token_var", arms, ylabel="variance of token ratio w (log)",
           title="token-ratio variance", log=True)
    curves(axes[0, 1], metrics_df, "ratio/extreme_frac", arms, ylabel=TOKENS,
           title="extreme tokens: |log w| > ln 2")
    figure_legend(fig, axes[0, 0])
    fig.suptitle("Importance-ratio noise over training (mean, 95% band over seeds)")
    return fig


# --------------------------------------------------------------------------- sweeps

SWEEP_X_LABELS = {"rl.clip_low_resolved": "clip range eps_low (log)",
                  "rl.clip_high_resolved": "clip range eps_high (log)",
                  "rl.router_lr_mult": "router learning-rate multiplier (log)"}


def sweep_table(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, x: str, series: str = "arm_base") -> pd.DataFrame:
    """results.summarize per (series, x): one row per sweep point, 95% interval over its seeds."""
    if series == "arm_base" and "arm_base" not in metrics_df and "arm" in metrics_df:
        metrics_df = metrics_df.assign(arm_base=metrics_df["arm"].map(results.base_arm))
        if len(eval_df):
            eval_df = eval_df.assign(arm_base=eval_df["arm"].map(results.base_arm))
    _require(metrics_df, [x, series], "sweep")
    return results.summarize(metrics_df, eval_df, by=(series, x)).sort_values([series, x])


def _sweep_lines(ax, table: pd.DataFrame, x: str, metric: str, series: str, traits: Traits, *, ylabel: str,
                 log_y: bool = False):
    for name in arm_order(table[series].astype(str).unique(), traits):
        rows = table[table[series] == name]
        mean = rows[metric].to_numpy(float)
        lo, hi = rows[f"{metric}_lo"].to_numpy(float), rows[f"{metric}_hi"].to_numpy(float)
        # Every sweep quantity drawn (clip shares, rewards, accuracies, expert change) lies in [0, 1]:
        # two-seed t-intervals reach far outside it and would only stretch the axis.
        lo, hi = (positive_floor(lo, mean) if log_y else np.maximum(lo, 0.0)), np.minimum(hi, 1.0)
        err = np.abs(np.nan_to_num(np.stack([lo, hi]) - mean[None, :]))
        ax.errorbar(rows[x].to_numpy(float), mean, yerr=err, marker="o", capsize=2, color=arm_color(name, traits),
                    label=arm_label(name, traits))
    ax.set(xscale="log", xlabel=SWEEP_X_LABELS.get(x, f"{x} (log)"), ylabel=ylabel)
    if log_y:
        ax.set_yscale("log")


@styled
def clip_sweep(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, x: str = "rl.clip_high_resolved",
               series: str = "arm_base") -> Figure:
    """Clipped fraction, late reward and final accuracy against the clip range, one line per algorithm."""
    table = sweep_table(metrics_df, eval_df, x, series)
    panels = [("clip_frac/active", f"{TOKENS} (log)", "gradient zeroed by the clip", True),
              ("reward/mean", "mean reward per response", "training reward, last 25% of steps", False),
              ("eval/acc_greedy", "fraction of eval prompts solved", "final held-out accuracy, greedy", False)]
    panels = [p for p in panels if table[p[0]].notna().any()]
    fig, axes = new_figure(len(panels))
    for ax, (metric, ylabel, title, log_y) in zip(axes[0], panels):
        _sweep_lines(ax, table, x, metric, series, traits_of(metrics_df), ylabel=ylabel, log_y=log_y)
        ax.set_title(title)
    figure_legend(fig, axes[0, 0])
    fig.suptitle("Clip-range sweep (mean, 95% interval over seeds)")
    return fig


def volatility_metric(metrics_df: pd.DataFrame) -> str:
    """The router's own change (latent) where logged: under replay the forced change is 0 by construction."""
    latent = "routing/expert_change_latent"
    return latent if latent in metrics_df and metrics_df[latent].notna().any() else "routing/expert_change"


@styled
def volatility_sweep(metrics_df: pd.DataFrame, eval_df: pd.DataFrame, x: str = "rl.router_lr_mult",
                     series: str = "arm_base") -> Figure:
    """Expert change and reward against the router lr multiplier, and reward against expert change."""
    change = volatility_metric(metrics_df)
    _require(metrics_df, [change, "reward/mean"], "volatility_sweep")
    table = sweep_table(metrics_df, eval_df, x, series)
    fig, axes = new_figure(3)
    ylabel = CHANGE + (" (latent)" if change.endswith("latent") else "")
    traits = traits_of(metrics_df)
    _sweep_lines(axes[0, 0], table, x, change, series, traits, ylabel=ylabel)
    _sweep_lines(axes[0, 1], table, x, "reward/mean", series, traits, ylabel="mean reward per response")
    axes[0, 0].set_title("routing volatility, last 25% of steps")
    axes[0, 1].set_title("training reward, last 25% of steps")
    ax = axes[0, 2]
    for name in arm_order(table[series].astype(str).unique(), traits):
        rows = table[table[series] == name]
        ax.plot(rows[change], rows["reward/mean"], marker="o", color=arm_color(name, traits),
                label=arm_label(name, traits))
        for cx, cy, mult in zip(rows[change], rows["reward/mean"], rows[x]):
            ax.annotate(f"x{mult:g}", (cx, cy), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set(xlabel=ylabel, ylabel="mean reward per response", title="reward vs volatility (labels: lr multiplier)")
    figure_legend(fig, axes[0, 0])
    fig.suptitle("Volatility sweep: router learning-rate multiplier (mean, 95% interval over seeds)")
    return fig
