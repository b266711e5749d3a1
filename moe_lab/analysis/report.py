"""`moe-lab report RESULTS`: one generated page per experiment (REPORT.md beside its results), from its data alone.

The statistics are the ones `moe-lab compare` prints (endpoints.py, contrasts.py: the declared contrasts at the
cold-start level with the conditional interval labelled, TOST where a margin was declared, Holm), on both
endpoints, and the declared contrasts of collapse rates (the exact sign-flip test over cold starts); an experiment
that declared no contrasts gets the run-level table of every pair, labelled exploratory.
Then collapse counts with Wilson intervals, the descriptive tables of the metrics the file declares
(``describe:``), the runs that raised the harness alarm (moe_lab/store/harness.py), the figures, and under
"Conclusion" the file's ``verdict:``, printed only when every number in it appears in the generated tables (a
conclusion may round nothing and quote nothing the tables do not show).

The design section is the folder's own experiment.yaml (what the runner ran); the command-line overrides are the
fields where every run's config.yaml differs from that file's expansion; the provenance is the manifests (code
commits, start and end times) and, where the folder sits in a git checkout, the commit that added the experiment
file. The figures: learning curves per arm, the declared contrasts per cold start, and the metrics the file
declares (``describe:``).

The descriptive tables run no test: per run, the mean of each declared metric over a declared window of RL steps
(each step's rows averaged first, so a metric logged once per step and one logged per update weigh steps alike);
then per cell the median and range over its runs and the mean with its 95% t-interval, and per cold start the
cell's mean over the runs from it.
"""

from __future__ import annotations

import collections
import datetime as dt
import math
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from matplotlib.figure import Figure

from moe_lab.analysis import run_fidelity
from moe_lab.analysis.arm_traits import traits_of
from moe_lab.analysis.contrasts import declared_tables, format_declared
from moe_lab.analysis.endpoints import endpoints_head, format_arms, format_pairs, load_comparison
from moe_lab.analysis.plots import STEP, arm_order, curves, figure_legend, new_figure, styled
from moe_lab.analysis.stats import detectable_difference, group_ci, wilson_interval
from moe_lab.analysis.tables import flatten, load_runs
from moe_lab.config import ConfigError, dump_yaml
from moe_lab.launch.design import COLLAPSE, Describe
from moe_lab.launch.progress import finished_of
from moe_lab.launch.spec import Experiment, parse_experiment
from moe_lab.store.run_folder import ResultsFolder, first_segments

REPORT_FILE = "REPORT.md"
# a number as a verdict writes it: optional sign, digits, decimals, exponent; not inside a word (R3, k3, 1e-3 ok)
NUMBER = re.compile(r"(?<![\w.])[-+−]?\d+(?:\.\d+)?(?:e[-+−]?\d+)?(?![\w.]*\w)")


@dataclass
class Report:
    text: str
    figures: dict[str, Figure] = field(default_factory=dict)


def numbers(text: str) -> list[str]:
    return [m.replace("−", "-") for m in NUMBER.findall(text)]


def check_verdict(verdict: str, tables: str, where: str) -> None:
    """One ConfigError naming the first number of ``verdict`` the tables do not show (a sign must match where the
    verdict writes one)."""
    shown = set(numbers(tables))
    unsigned = {n.lstrip("+-") for n in shown}
    for n in numbers(verdict):
        if (n not in shown) if n[0] in "+-" else (n not in unsigned):
            raise ConfigError(f"{where}: verdict: the number {n} does not appear in the report's generated tables; "
                              "quote the tables as printed")


def utc(t: float | None) -> str:
    return "unknown" if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def inline(value) -> str:
    """One line of YAML flow style (a mapping as ``{a: 1, b: 2}``)."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip()


def question(exp: Experiment) -> list[str]:
    text = " ".join(str(exp.description or "").split())
    return ["## Question", "", text or "The experiment file states no question (no `description:`)."]


def _overrides(folder: ResultsFolder, exp: Experiment) -> dict:
    """Dotted fields where every finished run's config differs from the experiment's expansion, with the value
    they all share (a command-line override, or a default changed since the runs); {} when none or unknown."""
    try:
        cells = {c.run_id: flatten(yaml.safe_load(dump_yaml(c.config))) for c in exp.cells()}
    except ConfigError:
        return {}
    common = None
    for run in folder.run_folders(with_manifest=True):
        if run.run_id not in cells:
            continue
        ran = flatten(run.config())
        diff = {k: v for k, v in ran.items() if k in cells[run.run_id] and cells[run.run_id][k] != v}
        common = diff if common is None else {k: v for k, v in common.items() if diff.get(k) == v}
    return dict(sorted((common or {}).items()))


def design(folder: ResultsFolder, exp: Experiment, n_runs: int, where: str) -> list[str]:
    """Organism, schedule, arms, cold starts or seeds, the command (``where``: the folder as the page names it)."""
    if not exp.explicit:
        return ["## Design", "", f"No experiment.yaml in this folder: {n_runs} runs, their design unknown here."]
    base = exp.base
    lines = ["## Design", "",
             f"- organism: `model: {inline(base.get('model') or {})}`, `task: {inline(base.get('task') or {})}`"
             + (f", `coldstart: {inline(base['coldstart'])}`" if base.get("coldstart") else ""),
             f"- RL: `rl: {inline(base.get('rl') or {})}` (other fields at their defaults)"]
    for key in ("sweep", "factors"):
        if exp.setting(key):
            lines.append(f"- {key}: `{inline(exp.setting(key))}`")
    blocks = exp.blocks
    if blocks:
        lines.append(f"- cold starts: {len(blocks.seeds)} values of `{blocks.field}` "
                     f"({', '.join(map(str, blocks.seeds))}), RL seeds of their own: `{inline(blocks.seeds)}`")
    else:
        lines.append(f"- seeds: `{inline(exp.setting('seeds') or [0])}` (one cold start per model config)")
    lines += ["", "| arm | overrides of base |", "|---|---|"]
    lines += [f"| {arm} | `{inline(spec or {})}` |" for arm, spec in exp.arms.items()]
    over = _overrides(folder, exp)
    command = f"moe-lab run {exp.name or folder.path.name} --out {where}"
    command += "".join(f" {k}={v}" for k, v in over.items())
    lines += ["", f"Command: `{command}`" + (" (the fields after the folder are where every run's config differs "
                                             "from the experiment file's expansion by the current code)"
                                             if over else "")
              + f"; {n_runs} run folders."]
    return lines


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def file_committed(folder: ResultsFolder, exp: Experiment) -> str:
    """When the experiment file (experiments/<name>.yaml, else the folder's experiment.yaml) was first committed:
    its adding commit and date from git log; "unknown" without git or without such a file in the history."""
    root = _git(folder.path, "rev-parse", "--show-toplevel")
    if root is None:
        return "unknown (no git checkout)"
    name = exp.name
    candidates = [Path(root) / "experiments" / f"{name}.yaml"] if name else []
    for path in [*candidates, folder.experiment_path.resolve()]:
        log = _git(Path(root), "log", "--diff-filter=A", "--format=%H %ct", "--", str(path))
        if log:  # the full hash cut to 7, as git_commit above: %h's length depends on the clone's object count
            commit, when = log.splitlines()[-1].split()
            return f"{utc(float(when))} ({commit[:7]}, `{Path(path).relative_to(root).as_posix()}`)"
    return "unknown (not in the git history)"


def provenance(folder: ResultsFolder, exp: Experiment) -> list[str]:
    """Code commits, when the first run started and the last ended, when the experiment file was committed."""
    commits, starts, inferred, ends = collections.Counter(), [], [], []
    for run in folder.run_folders(with_manifest=True):
        m = run.manifest
        commits[(m.get("git_commit") or "unknown")[:7]] += 1
        starts += [s["started"] for s in first_segments(m)[:1] if s.get("started") is not None]
        if m.get("updated") is not None:
            ends.append(float(m["updated"]))
            inferred.append(float(m["updated"]) - float(m.get("wall_s") or 0.0))
    first = (utc(min(starts)) if starts else
             f"not recorded (manifests before start times); at the latest {utc(min(inferred))} (updated − wall_s)"
             if inferred else "unknown")
    code = ", ".join(f"{c} ({n} runs)" for c, n in commits.most_common()) or "none"
    return ["## Provenance", "", f"- code (manifests' git_commit): {code}",
            f"- experiment file first committed: {file_committed(folder, exp)}",
            f"- first run started: {first}", f"- last manifest written: {utc(max(ends) if ends else None)}"]


def _contrast_sections(per_run: pd.DataFrame, exp: Experiment, pairs: pd.DataFrame) -> tuple[list[str], dict]:
    contrasts = list(exp.contrasts)
    if not contrasts:
        return ["## Every pair of arms (no contrasts declared)", "",
                "The experiment file declares no contrasts, so this page tests no hypothesis the file fixed: every "
                "pair of arms at the run level (Welch 95% interval, permutation p), without correction for the "
                "number of pairs; read it as exploratory unless an analysis fixed before the runs elsewhere says "
                "otherwise (a LOG.md beside this page, where there is one).", "", *format_pairs(pairs)], {}
    tables = declared_tables(per_run, contrasts)  # both endpoints and the collapse rate, one Holm family
    lines = []
    for column, table in tables.items():
        if len(table):
            heading = "collapse rate" if column == COLLAPSE else f"{column} endpoint"
            lines += [f"## Declared contrasts, {heading}", "", format_declared(table, column), ""]
    lines += _resolution(tables["primary"])
    margins = any(c.margin is not None for c in contrasts)
    lines.append("Equivalence: " + ("TOST at the declared margins (the table's equivalence column)." if margins else
                                    "no equivalence margin was declared before the runs, so no equivalence test ran: "
                                    "an interval that includes 0 bounds the effect, it does not show equivalence."))
    return lines, {k: t for k, t in tables.items() if len(t)}


def _notes(folder: ResultsFolder, per_run: pd.DataFrame) -> list[str]:
    """What `moe-lab compare` says on stderr, said on the page: runs left out, a block mixing two models."""
    from moe_lab.launch.coldstart_origin import mixed_notes

    unfinished = per_run.attrs.get("unfinished", [])
    notes = [f"Interim: {len(unfinished)} run(s) not finished, left out: {', '.join(unfinished)}."] if unfinished else []
    notes += [line.removeprefix("moe-lab: note: ") for line in mixed_notes(folder.runs_dir)]
    return [*(f"> {n}" for n in notes), ""] if notes else []


def _resolution(table: pd.DataFrame) -> list[str]:
    """What the design could resolve: per primary contrast, the difference it would detect with 80% power."""
    rows = table[table["role"] == "primary"] if len(table) else table
    if not len(rows):
        return []
    lines = ["Resolution of the design (primary contrasts, primary endpoint): the true difference a two-sided 5% test "
             "over these cold starts would detect with 80% power, (t_0.975 + t_0.80) × the standard error the runs "
             "gave, df as above.", "", "| setting | contrast | standard error over cold starts | detectable with "
             "80% power |", "|---|---|---|---|"]
    lines += [f"| {r.setting} | {r.arm} − {r.vs} | {r.se:.3f} | ±{detectable_difference(r.se, r.df):.3f} |"
              for r in rows.itertuples()]
    return [*lines, ""]


def fmt(x: float) -> str:
    """Three significant digits (what the report's tables print and a verdict may quote)."""
    if not math.isfinite(x):
        return "n/a"
    return f"{x:.3g}" if x == 0 or 1e-3 <= abs(x) < 1e4 else f"{x:.2e}".replace("e-0", "e-").replace("e+0", "e+")


def collapse_table(per_run: pd.DataFrame) -> list[str]:
    """Per cell: runs that a collapse rule stopped, k of n, with the 95% Wilson interval of the rate."""
    lines = ["| setting | arm | collapsed | rate, 95% Wilson |", "|---|---|---|---|"]
    for (setting, arm), g in per_run.groupby(["setting", "arm_base"], sort=False):
        k, n = int(g["collapsed"].sum()), len(g)
        lo, hi = wilson_interval(k, n)
        lines.append(f"| {setting} | {arm} | {k}/{n} | {k / n:.2f} [{lo:.2f}, {hi:.2f}] |")
    k, n = int(per_run["collapsed"].sum()), len(per_run)
    lo, hi = wilson_interval(k, n)
    return [*lines, f"| all | all | {k}/{n} | {k / n:.2f} [{lo:.2f}, {hi:.2f}] |"]


def window_means(metrics: pd.DataFrame, per_run: pd.DataFrame, spec: Describe, label: str) -> pd.DataFrame:
    """One row per finished run (its setting, arm_base, block) with each declared metric's mean over the window."""
    first, last = spec.windows[label]
    present = [m for m in spec.metrics if m in metrics]
    inside = metrics[(metrics["step"] >= first) & (metrics["step"] <= last)]
    by_step = inside.groupby(["run_id", "step"], sort=True)[present].mean()
    means = by_step.groupby(level="run_id").mean()
    keep = per_run.set_index("run_id")[["setting", "arm_base", "block"]]
    return keep.join(means, how="left").reset_index()


def describe_tables(metrics: pd.DataFrame, per_run: pd.DataFrame, spec: Describe) -> list[str]:
    """Per window and declared metric: per cell (median [range], mean [95% t]) and per cold start (cell means)."""
    lines: list[str] = []
    missing = [m for m in spec.metrics if m not in metrics]
    if missing:
        lines += [f"Not logged by these runs (left out): {', '.join(f'`{m}`' for m in missing)}.", ""]
    for label, (first, last) in spec.windows.items():
        runs = window_means(metrics, per_run, spec, label)
        blocks = list(dict.fromkeys(runs["block"]))
        for metric in (m for m in spec.metrics if m in runs):
            lines += [f"**`{metric}`, {label}** (per-run mean over steps {first}-{last})", "",
                      "| setting | arm | n | median [range] over runs | mean, 95% t | "
                      + " | ".join(f"cold start {b}" for b in blocks) + " |",
                      "|---|---|---|---|---|" + "---|" * len(blocks)]
            ci = group_ci(runs, [metric], ["setting", "arm_base"])
            for (setting, arm), g in runs.groupby(["setting", "arm_base"], sort=False):
                v = g[metric].dropna()
                mean, lo, hi = ci.loc[(setting, arm)]
                per_block = g.groupby("block")[metric].mean()
                cells = " | ".join(fmt(per_block.get(b, math.nan)) for b in blocks)
                lines.append(f"| {setting} | {arm} | {len(v)} | {fmt(float(np.median(v)) if len(v) else math.nan)} "
                             f"[{fmt(v.min() if len(v) else math.nan)}, {fmt(v.max() if len(v) else math.nan)}] | "
                             f"{fmt(mean)} [{fmt(lo)}, {fmt(hi)}] | {cells} |")
            lines.append("")
    return lines


def _figures(metrics, evals, spec, tables, describe) -> dict[str, Figure]:
    from moe_lab.analysis.endpoint_plots import learning_curves

    figures = {"report_curves.png": learning_curves(metrics, evals, spec)}
    if tables:
        figures["report_contrasts.png"] = contrast_dots(tables)
    if describe and any(m in metrics for m in describe.metrics):
        figures["report_describe.png"] = describe_curves(metrics, describe)
    return figures


@styled
def contrast_dots(tables: dict[str, pd.DataFrame]) -> Figure:
    """Per endpoint (one column each) and declared contrast (one row each): the difference on every cold start
    (dots) and its mean with the 95% interval over cold starts (bar), against 0."""
    fig, axes = new_figure(len(tables), 1, width=5.0, height=0.6 + 0.5 * max(len(t) for t in tables.values()))
    for ax, (column, table) in zip(axes[0], tables.items()):
        labels = [f"{r.setting + ': ' if r.setting else ''}{r.arm} − {r.vs}" for r in table.itertuples()]
        for i, r in enumerate(table.itertuples()):
            ax.plot(list(r.per_block.values()), [i] * len(r.per_block), "o", color="0.45", markersize=4)
            ax.errorbar(r.diff, i, xerr=[[r.diff - r.lo], [r.hi - r.diff]], fmt="D", color="black", capsize=3)
        ax.axvline(0.0, color="0.6", linewidth=1)
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set(xlabel=f"difference of the {column} endpoint", title=f"{column}: per cold start (dots), 95% over "
                                                                      "cold starts (bar)")
    return fig


@styled
def describe_curves(metrics: pd.DataFrame, spec: Describe) -> Figure:
    """Each declared metric per arm against the RL step (mean over runs, 95% t band)."""
    present = [m for m in spec.metrics if m in metrics]
    arms = arm_order(metrics["arm"].unique(), traits_of(metrics))
    fig, axes = new_figure(min(3, len(present)), -(-len(present) // 3), width=4.4, height=3.2)
    for ax, metric in zip(axes.flat, present):
        curves(ax, metrics, metric, arms, ylabel=metric, title=metric)
    for ax in list(axes.flat)[len(present):]:
        ax.set_visible(False)
    figure_legend(fig, axes.flat[0])
    fig.suptitle(f"each run's step mean, then the mean over runs with its 95% t band, against the {STEP}")
    return fig


def _interim(folder: ResultsFolder, exp: Experiment, where: str) -> list[str]:
    """The page's results in place of the outcomes while an experiment with declared contrasts has runs not yet
    finished: an analysis fixed before the runs is the one after the last run, so no endpoint, contrast, collapse
    count or descriptive table is shown before it ([] when finished, or when nothing was declared: an
    exploration shows what it has)."""
    counted = finished_of(folder) if exp.contrasts else None
    if counted is None or counted[1] == counted[2]:
        return []
    _, finished, total = counted
    return [f"Interim: {finished} of {total} runs finished (`moe-lab progress {where}`). The endpoints, the declared "
            "contrasts, the collapse counts and the descriptive tables are generated once the last run has "
            "finished: the analysis fixed before the runs is the one after the last run."]


def build(results: str | Path | ResultsFolder, figures: bool = True, shown_as: str | None = None) -> Report:
    """The report of a results folder; ``shown_as``: the folder's name in the page (default: its path)."""
    folder = results if isinstance(results, ResultsFolder) else ResultsFolder(results)
    where = shown_as or folder.path.as_posix()
    exp = parse_experiment(folder.experiment())
    head = [f"# {exp.name or folder.path.name}", "",
            f"Generated by `moe-lab report {where}` from this folder alone; do not edit (regenerate).", "",
            *question(exp), ""]
    n_runs = len(folder.run_folders(with_manifest=True))
    if not n_runs:  # an experiment file committed without its runs: its design, nothing measured
        return Report("\n".join([*head, *design(folder, exp, 0, where), "",
                                 *provenance(folder, exp), "", "## Results", "",
                                 "No runs in this folder: nothing was measured here."]) + "\n")
    blind = _interim(folder, exp, where)
    if blind:  # a confirmatory design part-way: its design and how far it has got, no outcome
        return Report("\n".join([*head, *design(folder, exp, n_runs, where), "",
                                 *provenance(folder, exp), "", "## Results", "", *blind]) + "\n")
    spec, per_run, arms, pairs = load_comparison(folder)
    describe, verdict = exp.describe, exp.verdict
    metrics, evals = load_runs(folder.path)
    contrast_lines, tables = _contrast_sections(per_run, exp, pairs)
    body = [*design(folder, exp, n_runs, where), "",
            *provenance(folder, exp), "",
            "## Endpoints per arm", "", endpoints_head(spec), "", *format_arms(arms), "", *contrast_lines, "",
            "## Collapses", "", *collapse_table(per_run), ""]
    body[0:0] = _notes(folder, per_run)
    if describe:
        body += ["## Routing and mismatch (descriptive, declared in the experiment file)", "",
                 *describe_tables(metrics, per_run, describe)]
    body += run_fidelity.format_alarms(run_fidelity.alarms(metrics))
    if verdict:
        check_verdict(verdict, "\n".join(body), f"{where}/experiment.yaml")
    drawn = _figures(metrics, evals, spec, tables, describe) if figures else {}
    names = list(drawn) if figures else ["report_curves.png", *(["report_contrasts.png"] if tables else []),
                                         *(["report_describe.png"] if describe else [])]
    tail = ["## Figures", "", *[f"![{n}]({n})" for n in names], "", "## Conclusion", "",
            " ".join(verdict.split()) if verdict else "No verdict in the experiment file."]
    return Report("\n".join([*head, *body, *tail]).rstrip() + "\n", drawn)


def write(report: Report, out: Path) -> list[Path]:
    """REPORT.md at ``out`` and its figures beside it; the paths written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.text, encoding="utf-8")
    written = [out]
    for name, fig in report.figures.items():
        fig.savefig(out.parent / name, dpi=100, bbox_inches="tight")
        written.append(out.parent / name)
    return written
