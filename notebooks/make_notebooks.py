"""Generate the analysis notebooks (outputs cleared) from the cell sources below.

    python notebooks/make_notebooks.py          # rewrites notebooks/*.ipynb

The notebooks only read results (moe_lab.analysis.results) and draw (moe_lab.analysis.plots): no training. They read
$MOE_LAB_RESULTS if set, else the results/reference folder of this repository (see results/README.md).
Edit this file, not the .ipynb files: tests/test_notebooks.py checks that they match.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = '''\
%matplotlib inline
import os, re, sys
from pathlib import Path

# Make `import moe_lab` work from a checkout that is not pip-installed.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "moe_lab" / "__init__.py").exists()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moe_lab.analysis import figures, plots, results, stability, stability_plots

REFERENCE = results.reference_dir()  # $MOE_LAB_RESULTS, else results/reference above the working directory
print("reading results from", REFERENCE)'''

LOAD_PAPER = '''\
metrics, evals = results.load_runs(REFERENCE / "paper")
print(f"{metrics['run_id'].nunique()} runs, {len(metrics)} update rows, {len(evals)} eval rows")
print("arms:", plots.arm_order(metrics["arm"].unique()))'''

PAPER = {
    "title": "# Reproducing the GSPO paper's figures on a small MoE\n\n"
             "GRPO (token-level ratio), GRPO with Routing Replay (R2: old-policy routing; R3: rollout routing), "
             "GSPO and GSPO-token, 3 seeds each, from the same cold-started model "
             "(`moe-lab reproduce`, see `results/README.md`). Bands and intervals are 95% t-intervals over seeds.",
    "cells": [
        ("code", SETUP),
        ("code", LOAD_PAPER),
        ("md", "## Summary per arm\nFinal held-out accuracy; the other columns are means over the last 25% of "
               "steps (`results.summarize`)."),
        ("code", "table = results.summarize(metrics, evals)\nprint(results.format_summary(table))"),
        ("md", "## Clipped-token fraction (paper, Figure 2)\nThe paper finds GSPO clips about two orders of "
               "magnitude more tokens than GRPO, yet trains more efficiently."),
        ("code", "plots.clip_fraction(metrics)"),
        ("code", 'frac = table.set_index("arm")["clip_frac/out_of_range"]\n'
                 'if {"grpo", "gspo"} <= set(frac.index):\n'
                 '    print(f"GSPO / GRPO clipped fraction: {frac[\'gspo\'] / frac[\'grpo\']:.3g}x")'),
        ("md", "## Training reward and held-out accuracy (paper, Figures 1 and 3)"),
        ("code", "plots.reward_curves(metrics, evals)"),
        ("md", "## Importance-ratio noise\nVariance of the token ratio w and the share of tokens with "
               "|log w| > ln 2."),
        ("code", "plots.ratio_variance(metrics)"),
    ],
}

VOLATILITY = {
    "title": "# Routing volatility\n\nHow much of the top-k routing changes per update, per arm, per MoE layer "
             "and per step; under Routing Replay, the change the router would make (latent) against the one "
             "forced on it (0 by construction).",
    "cells": [
        ("code", SETUP),
        ("code", LOAD_PAPER),
        ("code", "plots.routing_volatility(metrics)"),
        ("md", "## Per layer and per step"),
        ("code", "plots.routing_heatmap(metrics)"),
        ("code", 'layer_cols = plots.layer_columns(metrics)\n'
                 'late = results.last_frac_means(metrics, layer_cols, ["arm"], last_frac=0.25)\n'
                 'late.groupby("arm")[layer_cols].mean().rename(columns=lambda c: c.split("/")[1])'),
        ("md", "## Latent vs forced change under replay\nWithout replay the two are the same quantity."),
        ("code", 'cols = ["routing/expert_change", "routing/expert_change_latent"]\n'
                 'results.last_frac_means(metrics, cols, ["arm", "replay"], last_frac=0.25)'
                 '.groupby(["arm", "replay"])[cols].mean()'),
        ("md", "## Per position\nShown only where the runs logged per-position columns "
               "(`routing/pos_{j}/expert_change`); otherwise the per-layer and per-step views above are the finest."),
        ("code", 'pos_re = re.compile(r"routing/pos_(\\d+)/expert_change")\n'
                 'pos_cols = sorted((c for c in metrics.columns if pos_re.fullmatch(c)),\n'
                 '                  key=lambda c: int(pos_re.fullmatch(c).group(1)))\n'
                 'if pos_cols:\n'
                 '    display(metrics.groupby("arm")[pos_cols].mean())\n'
                 'else:\n'
                 '    print("no per-position expert-change columns in these runs")'),
        ("md", "## Volatility sweep: router learning-rate multiplier"),
        ("code", 'vol_metrics, vol_evals = results.load_runs(REFERENCE / "volatility_sweep")\n'
                 'plots.volatility_sweep(vol_metrics, vol_evals)'),
        ("code", 'sweep = plots.sweep_table(vol_metrics, vol_evals, "rl.router_lr_mult")\n'
                 'sweep[["arm_base", "rl.router_lr_mult", "seeds", "routing/expert_change_latent", '
                 '"reward/mean", "eval/acc_greedy"]]'),
    ],
}

CLIP = {
    "title": "# Clip-range sweep\n\nClipped fraction, late training reward and final held-out accuracy against "
             "the clip range, per algorithm (GRPO near 0.2/0.27, GSPO near 3e-4/4e-4: a log axis shows both).",
    "cells": [
        ("code", SETUP),
        ("code", 'metrics, evals = results.load_runs(REFERENCE / "clip_sweep")\n'
                 'clip_cols = ("rl.clip_low_resolved", "rl.clip_high_resolved")\n'
                 'x = next(c for c in clip_cols if figures.varies(metrics, c))  # the swept end of the clip range\n'
                 'print("swept:", x, "| arms:", plots.arm_order(metrics["arm"].unique()))'),
        ("code", "plots.clip_sweep(metrics, evals, x=x)"),
        ("code", 'sweep = results.summarize(metrics, evals, by=("arm_base", *clip_cols))\n'
                 'sweep[["arm_base", *clip_cols, "seeds", "clip_frac/active", '
                 '"clip_frac/out_of_range", "reward/mean", "eval/acc_greedy"]]'),
        ("md", "## Clipped fraction per step at each clip range"),
        ("code", "plots.clip_fraction(metrics)"),
    ],
}

SHOW_EXPERIMENT = '''\
def show_experiment(name):
    """Summary table, reward/accuracy curves and survival of one experiment folder, if it is there."""
    folder = REFERENCE / name
    if not (folder / "runs").is_dir():
        print(f"no {name}/ under {REFERENCE}")
        return None, None
    m, e = results.load_runs(folder)
    print(results.format_summary(results.summarize(m, e)))
    display(plots.reward_curves(m, e))
    display(stability_plots.survival(m))
    return m, e'''

STABILITY = {
    "title": "# The stability atlas, the instability experiment and the stabilizers\n\n"
             "Where do the arms separate? The atlas (`experiments/atlas.yaml`) varies one factor at a time "
             "around the main job's config (one seed per cell); the instability experiment "
             "(`experiments/instability.yaml`) repeats a chosen setting over 5 seeds; "
             "`experiments/stabilizers.yaml` puts every published fix in that setting. This notebook only "
             "reads results (see `results/README.md` for the commands that produce them).",
    "cells": [
        ("code", SETUP),
        ("code", 'from moe_lab.config import load_yaml\n'
                 'atlas_metrics, atlas_evals = results.load_runs(REFERENCE / "atlas")\n'
                 'design = load_yaml(str(REFERENCE / "atlas" / "experiment.yaml"))\n'
                 'print(atlas_metrics["run_id"].nunique(), "atlas runs; factors:", list(design["factors"]))'),
        ("md", "## The atlas\nPer factor level: the router's own expert change per update (last 25% of updates), "
               "the p99 of the minibatch token-ratio variance, and each arm's final greedy accuracy minus "
               "GRPO + R2's at the same level. The base point sits on every factor's axis."),
        ("code", "stability_plots.atlas(atlas_metrics, atlas_evals, design=design)"),
        ("code", 'table = stability.atlas_table(atlas_metrics, atlas_evals, design=design)\n'
                 'table.pivot_table(index=["factor", "level"], columns="arm_base", values="acc_gap", sort=False)'),
        ("md", "## Where GRPO without replay falls furthest behind GRPO + R2\nOne seed per cell: a ranking "
               "of single runs. Read it as where to look, then check with seeds (next section)."),
        ("code", 'grpo = table[table["arm_base"] == "grpo"].sort_values("acc_gap")\n'
                 'grpo[["factor", "level", "expert_change", "ratio_var_p99", "acc_greedy", "acc_gap"]].head(8)'),
        ("code", 'runs = atlas_metrics.drop_duplicates("run_id")\n'
                 'runs.loc[runs["collapsed_at"].notna(), ["run_id", "collapsed_at", "collapse_rule"]]'),
        ("md", "## The instability experiment (5 seeds)"),
        ("code", SHOW_EXPERIMENT),
        ("code", 'inst_metrics, inst_evals = show_experiment("instability")'),
        ("md", "## Every stabilizer in that setting"),
        ("code", 'stab_metrics, stab_evals = show_experiment("stabilizers")'),
    ],
}

REPLAY = {
    "title": "# Does Routing Replay rescue GRPO? The rescue experiment and the replay map\n\n"
             "`experiments/replay_rescue.yaml` runs GRPO with and without Routing Replay (R2, R3) against GSPO and "
             "GSPO-token in a setting fixed before its multi-seed run (64 small experts, top-1 routing, gradient-norm "
             "clipping off). `experiments/replay_map.yaml` varies one factor at a time around it. The ratio "
             "decomposition (`docs/metrics.md`) splits each token's log-ratio into a routing part d_route and a "
             "weight part d_weight; the routing share Var(d_route) / (Var(d_route) + Var(d_weight)) under GRPO is the "
             "map's x. This notebook only reads results (`results/README.md` has the commands).",
    "cells": [
        ("code", SETUP.replace("stability, stability_plots", "replay_map, replay_plots, stability, stability_plots")),
        ("code", 'rescue_metrics, rescue_evals = results.load_runs(REFERENCE / "replay_rescue")\n'
                 'print(rescue_metrics["run_id"].nunique(), "rescue runs; arms:",\n'
                 '      plots.arm_order(rescue_metrics["arm"].unique()))'),
        ("md", "## The rescue, head to head\nFinal greedy accuracy and collapse rate per arm with 95% intervals "
               "(t over seeds; Wilson for the collapse rate); reward, expert change and clip share over the last "
               "25% of steps."),
        ("code", 'stability.arm_table(rescue_metrics, rescue_evals)[["arm", "runs", "acc_greedy", "acc_greedy_lo",\n'
                 '    "acc_greedy_hi", "collapses", "collapse_rate_lo", "collapse_rate_hi", "reward"]]'),
        ("code", "replay_plots.rescue(rescue_metrics, rescue_evals)"),
        ("md", "## How much of the ratio noise is routing?\nPer arm, the run means of the decomposition: the "
               "variances of d_route and d_weight, the routing share, and the share of tokens whose routing "
               "alone moves the ratio out of the clip range."),
        ("code", 'decomp = ["ratio/d_route_var", "ratio/d_weight_var", "ratio/routing_share",\n'
                 '          "ratio/route_extreme_frac", "ratio/route_clip_exit_frac"]\n'
                 'per_run = results.last_frac_means(rescue_metrics, decomp, ["arm"], 1.0)\n'
                 'per_run.groupby("arm")[decomp].mean()'),
        ("md", "## The replay map\nOne point per setting: GRPO's routing share (x) against the final-accuracy "
               "gap of R2 (and GSPO) to GRPO (y), 95% intervals on both."),
        ("code", 'map_folder = REFERENCE / "replay_map"\n'
                 'map_metrics, map_evals = results.load_runs(map_folder)\n'
                 'replay_plots.replay_map_figure(map_metrics, map_evals)'),
        ("code", "replay_map.replay_map_table(map_metrics, map_evals)"),
    ],
}

LOAD_CONFIRMATION = '''\
# Each folder only where it exists: the confirmation and the controls may still be running (their running runs
# are drawn up to their last step and left out of the tables and the forest until they finish).
NAMES = ("replay_rescue", "replay_rescue_confirm", "router_controls", "router_controls_aux", "learning_rescue",
         "router_learns")
FOLDERS = [REFERENCE / n for n in NAMES if (REFERENCE / n / "runs").is_dir()]
loaded = {f.name: endpoint_plots.load_folder(f) for f in FOLDERS}
for name in NAMES:
    print(name, "->", f"{loaded[name][2]['run_id'].nunique()} runs" if name in loaded else "not there (yet)")'''

COMPARE = '''\
for name, (spec, m, e) in loaded.items():
    per_run = endpoint_plots.finished_endpoints(m, e, spec)
    unfinished = e["run_id"].nunique() - len(per_run)
    print(f"\\n### {name}" + (f" ({unfinished} runs not finished, left out)" if unfinished else ""))
    if not len(per_run):
        continue
    pairs = endpoint_plots.endpoint_pairs(per_run, traits=arm_traits.traits_of(e))  # each arm against GRPO
    print(endpoints.format_comparison(spec, endpoints.arm_means(per_run), pairs))'''

DECLARED = '''\
# Folders whose experiment file declares its contrasts (router_learns): stratified by cold start, TOST, Holm
for name, (spec, m, e) in loaded.items():
    exp = load_yaml(str(REFERENCE / name / "experiment.yaml"))
    declared, blocks = design.contrasts_spec(exp), design.blocks_spec(exp)
    per_run = endpoints.run_endpoints(m, e, spec, blocks.field if blocks else None)
    _, cells = progress.collect(REFERENCE / name)
    finished = sum(c.state == "finished" for c in cells)
    if declared and finished < len(cells):  # fixed before the runs: the analysis is the one after the last
        print(f"\\n### {name}: {finished} of {len(cells)} runs finished; declared contrasts after the last")
    elif declared and len(per_run):
        print(f"\\n### {name}")
        for line in coldstart_origin.mixed_notes(REFERENCE / name / "runs"):  # one key naming two models (two processors)
            print(line)
        print(contrasts.format_declared(contrasts.declared_contrasts(per_run, declared)))'''

CONFIRMATION = {
    "title": "# Does the rescue survive scrutiny? Endpoints fixed in advance, fresh seeds, router controls\n\n"
             "`replay_rescue` (seeds 0-4) found GRPO without replay collapsing where GRPO + R2 and GSPO did not. "
             "`replay_rescue_confirm` runs the same experiment unchanged on 10 seeds never used before (100-109); "
             "`router_controls` repeats GRPO, GRPO + R2 and GSPO under four router/optimizer settings (one column "
             "each below), `router_controls_aux` follows up its balancing-loss control, and `router_learns` "
             "tests the two learning-router settings from three independent cold starts each, with GRPO + R2 "
             "replaying the gate weights too. This notebook only reads results; folders still running are shown "
             "as far as they got.",
    "cells": [
        ("code", SETUP.replace("from moe_lab.analysis import figures, plots, results, stability, stability_plots",
                               "from moe_lab.analysis import (arm_traits, contrasts, endpoint_plots, endpoints, figures,\n"
                               "                              plots, results, stability, stability_plots)\n"
                               "from moe_lab.config import load_yaml\n"
                               "from moe_lab.launch import coldstart_origin, design, progress")),
        ("code", LOAD_CONFIRMATION),
        ("md", "## The endpoints, fixed before the runs\n"
               "- **primary**: per seed, the mean greedy accuracy (`eval/acc_greedy`) over the last 5 scheduled "
               "evaluations (steps 110-150 of the rescue's 150);\n"
               "- **secondary**: per seed, the mean sampled reward (`reward/mean`) over the last 25% of the steps;\n"
               "- **tertiary**, descriptive only: whether a collapse rule fired.\n\n"
               "**Carry-forward.** A run a collapse rule stopped has no rows after its stop; its last value is "
               "carried forward over the scheduled steps it did not reach (the policy it stopped with is its final "
               "policy). Dropping it would average the survivors only and flatter the arm; the same rule draws the "
               "curves below.\n\n"
               "**The test is the difference.** Each pair of arms is compared by the difference of the per-seed "
               "means with its Welch 95% interval and an exact permutation p-value. Whether the two arms' own "
               "intervals lie apart is not the test: they can overlap while the difference's interval excludes 0, "
               "so \"intervals apart\" is a stricter criterion than the one fixed in advance. Read the pair rows "
               "and the forest."),
        ("code", COMPARE),
        ("md", "## The contrasts an experiment file declared\n"
               "`router_learns` fixed its contrasts before its runs: GSPO − R2 and R2 − GRPO (equivalence within "
               "±0.05, TOST) primary, Holm-adjusted together; (R2 + weights) − R2 and (R2 + weights) − GSPO "
               "secondary. Each is taken within a setting, with the cold start as the unit (the t over the per-cold-start "
               "differences, what a new cold start would show); the interval conditional on these cold starts is "
               "printed beside it, labelled so, then the per-cold-start differences and, for comparison, the "
               "run-level Welch interval that ignores the cold start."),
        ("code", DECLARED),
        ("md", "## Learning curves\nGreedy accuracy at each scheduled evaluation (top) and sampled reward per step "
               "(bottom): mean over seeds with a 95% t band, a stopped run holding its last value; shaded, the "
               "endpoint's window; dashed, the cold start (the step-0 accuracy)."),
        ("code", 'for name, (spec, m, e) in loaded.items():\n'
                 '    print(name)\n'
                 '    display(endpoint_plots.learning_curves(m, e, spec))'),
        ("md", "## Every difference on the primary endpoint, across experiments and settings\n"
               "GRPO + R2 and GSPO against GRPO in the same experiment and setting (`arms=None`: every arm): the point is the difference of the "
               "per-seed means, the whiskers its Welch 95% interval, the line at 0 no difference; beside each row "
               "the permutation p and the seeds on each side. To keep it as a file: "
               "`endpoint_plots.forest_across(FOLDERS).savefig(\"forest.png\", dpi=100, bbox_inches=\"tight\")`."),
        ("code", "endpoint_plots.forest_across(FOLDERS, baseline=\"grpo\", arms=(\"grpo_r2\", \"gspo\"))"),
    ],
}


EXPLORE_SETUP = '''\
from IPython.display import Markdown, display

from moe_lab.analysis import endpoint_plots, report
from moe_lab.analysis.contrasts import declared_contrasts, format_declared
from moe_lab.analysis.endpoints import load_comparison
from moe_lab.launch.design import contrasts_spec, describe_spec
from moe_lab.store.run_folder import ResultsFolder

# The two newest experiments; any other results folder opens the same way (set FOLDERS by hand).
NEWEST = ("rollout_mismatch", "expert_bias")
FOLDERS = [REFERENCE / n for n in NEWEST if (REFERENCE / n / "runs").is_dir()] or [REFERENCE / "paper"]
FOLDER = FOLDERS[0]


def open_folder(folder):
    """(experiment, endpoint spec, per-run endpoints, metrics, evals) of a results folder."""
    spec, per_run, _, _ = load_comparison(folder)
    metrics, evals = results.load_runs(folder)
    return ResultsFolder(folder).experiment() or {}, spec, per_run, metrics, evals


exp, spec, per_run, metrics, evals = open_folder(FOLDER)
print(FOLDER.name, "-", per_run["run_id"].nunique(), "finished runs;", "arms:", ", ".join(per_run["arm_base"].unique()))'''

EXPLORE_CONTRASTS = '''\
def contrasts_of(exp, per_run):
    """The declared contrasts on both endpoints ({} when the file declares none)."""
    declared = contrasts_spec(exp)
    return {c: declared_contrasts(per_run, declared, c) for c in ("primary", "secondary")} if declared else {}


tables = contrasts_of(exp, per_run)
for column, table in tables.items():
    display(Markdown(format_declared(table, column)))
if tables:
    display(report.contrast_dots(tables))
else:
    print(FOLDER.name, "declares no contrasts: `moe-lab compare` prints every pair at the run level")'''

EXPLORE_DESCRIBE = '''\
described = describe_spec(exp)
if described:
    display(Markdown("\\n".join(report.describe_tables(metrics, per_run, described))))
    display(report.describe_curves(metrics, described))
else:
    print(FOLDER.name, "declares no `describe:` metrics")'''

EXPLORE_OTHERS = '''\
for folder in FOLDERS[1:]:
    exp, spec, per_run, metrics, evals = open_folder(folder)
    display(Markdown(f"### {folder.name}"))
    display(endpoint_plots.learning_curves(metrics, evals, spec))
    tables = contrasts_of(exp, per_run)
    if tables:
        display(report.contrast_dots(tables))
    if describe_spec(exp):
        display(report.describe_curves(metrics, describe_spec(exp)))'''

EXPLORER = {
    "title": "# Experiment explorer\n\n"
             "Opens a results folder (by default the two newest experiments, `rollout_mismatch` and `expert_bias`): "
             "learning curves per arm, the contrasts its experiment file declared, per cold start, on both "
             "endpoints, and the routing and mismatch metrics it declares (`describe:`). The same tables and "
             "figures as `moe-lab report` (each folder's REPORT.md), for looking further.",
    "cells": [
        ("code", SETUP),
        ("code", EXPLORE_SETUP),
        ("md", "## Learning curves\nGreedy accuracy at each scheduled evaluation (top) and sampled reward per step "
               "(bottom): mean over runs with a 95% t band; shaded, the endpoints' windows."),
        ("code", "endpoint_plots.learning_curves(metrics, evals, spec)"),
        ("md", "## Declared contrasts, per cold start\nEach contrast with the cold start as the unit (95% over "
               "cold starts), the interval conditional on these cold starts labelled so, on the primary and the "
               "secondary endpoint; the figure shows each cold start's difference (dots) and the interval (bar)."),
        ("code", EXPLORE_CONTRASTS),
        ("md", "## Routing and mismatch metrics the experiment file declares\nDescriptive only: per-run means over "
               "each declared window, per cell and per cold start."),
        ("code", EXPLORE_DESCRIBE),
        ("md", "## The other folders"),
        ("code", EXPLORE_OTHERS),
    ],
}

NOTEBOOKS = {"01_reproduce_paper_figures.ipynb": PAPER, "02_routing_volatility.ipynb": VOLATILITY,
             "03_clip_range_sweep.ipynb": CLIP, "04_stability_atlas.ipynb": STABILITY,
             "05_replay_map.ipynb": REPLAY, "06_confirmation.ipynb": CONFIRMATION,
             "07_experiment_explorer.ipynb": EXPLORER}


def build(spec: dict) -> nbformat.NotebookNode:
    cells = [new_markdown_cell(spec["title"])]
    cells += [new_code_cell(src) if kind == "code" else new_markdown_cell(src) for kind, src in spec["cells"]]
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids: regenerating gives byte-identical files
        cell["id"] = f"cell-{i:02d}"
    return nb


def build_all() -> dict[str, nbformat.NotebookNode]:
    return {name: build(spec) for name, spec in NOTEBOOKS.items()}


def main(out_dir: Path = HERE) -> list[Path]:
    paths = []
    for name, nb in build_all().items():
        nbformat.validate(nb)
        path = Path(out_dir) / name
        nbformat.write(nb, path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(f"wrote {p}")
