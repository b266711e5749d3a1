"""`moe-lab report RESULTS`: one generated page per experiment (REPORT.md beside its results), from its data alone.

The statistics are the ones `moe-lab compare` prints (endpoints.py, contrasts.py: the declared contrasts at the
cold-start level with the conditional interval labelled, TOST where a margin was declared, Holm), on both
endpoints; an experiment that declared no contrasts gets the run-level table of every pair, labelled exploratory.
Then collapse counts with Wilson intervals, the descriptive tables of the metrics the file declares
(``describe:``), the runs that raised the harness alarm (moe_lab/store/harness.py), the figures, and under
"Conclusion" the file's ``verdict:``, printed only when every number in it appears in the generated tables (a
conclusion may round nothing and quote nothing the tables do not show).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from moe_lab.analysis import report_design, report_plots, report_tables, run_fidelity
from moe_lab.analysis.contrasts import declared_contrasts, format_declared
from moe_lab.analysis.endpoints import endpoints_head, format_arms, format_pairs, load_comparison
from moe_lab.analysis.stats import detectable_difference
from moe_lab.config import ConfigError
from moe_lab.launch.progress import finished_of
from moe_lab.launch.spec import Experiment, parse_experiment
from moe_lab.store.run_folder import ResultsFolder

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


def _contrast_sections(per_run: pd.DataFrame, exp: Experiment, pairs: pd.DataFrame) -> tuple[list[str], dict]:
    contrasts = list(exp.contrasts)
    if not contrasts:
        return ["## Every pair of arms (no contrasts declared)", "",
                "The experiment file declares no contrasts, so this page tests no hypothesis the file fixed: every "
                "pair of arms at the run level (Welch 95% interval, permutation p), without correction for the "
                "number of pairs; read it as exploratory unless an analysis fixed before the runs elsewhere says "
                "otherwise (a LOG.md beside this page, where there is one).", "", *format_pairs(pairs)], {}
    tables = {column: declared_contrasts(per_run, contrasts, column) for column in ("primary", "secondary")}
    lines = []
    for column, table in tables.items():
        if len(table):
            lines += [f"## Declared contrasts, {column} endpoint", "", format_declared(table, column), ""]
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


def _figures(metrics, evals, spec, tables, describe) -> dict[str, Figure]:
    from moe_lab.analysis.endpoint_plots import learning_curves

    figures = {"report_curves.png": learning_curves(metrics, evals, spec)}
    if tables:
        figures["report_contrasts.png"] = report_plots.contrast_dots(tables)
    if describe and any(m in metrics for m in describe.metrics):
        figures["report_describe.png"] = report_plots.describe_curves(metrics, describe)
    return figures


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
    from moe_lab.analysis.tables import load_runs

    folder = results if isinstance(results, ResultsFolder) else ResultsFolder(results)
    where = shown_as or folder.path.as_posix()
    exp = parse_experiment(folder.experiment())
    head = [f"# {exp.name or folder.path.name}", "",
            f"Generated by `moe-lab report {where}` from this folder alone; do not edit (regenerate).", "",
            *report_design.question(exp), ""]
    n_runs = len(folder.run_folders(with_manifest=True))
    if not n_runs:  # an experiment file committed without its runs: its design, nothing measured
        return Report("\n".join([*head, *report_design.design(folder, exp, 0, where), "",
                                 *report_design.provenance(folder, exp), "", "## Results", "",
                                 "No runs in this folder: nothing was measured here."]) + "\n")
    blind = _interim(folder, exp, where)
    if blind:  # a confirmatory design part-way: its design and how far it has got, no outcome
        return Report("\n".join([*head, *report_design.design(folder, exp, n_runs, where), "",
                                 *report_design.provenance(folder, exp), "", "## Results", "", *blind]) + "\n")
    spec, per_run, arms, pairs = load_comparison(folder)
    describe, verdict = exp.describe, exp.verdict
    metrics, evals = load_runs(folder.path)
    contrast_lines, tables = _contrast_sections(per_run, exp, pairs)
    body = [*report_design.design(folder, exp, n_runs, where), "",
            *report_design.provenance(folder, exp), "",
            "## Endpoints per arm", "", endpoints_head(spec), "", *format_arms(arms), "", *contrast_lines, "",
            "## Collapses", "", *report_tables.collapse_table(per_run), ""]
    body[0:0] = _notes(folder, per_run)
    if describe:
        body += ["## Routing and mismatch (descriptive, declared in the experiment file)", "",
                 *report_tables.describe_tables(metrics, per_run, describe)]
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
