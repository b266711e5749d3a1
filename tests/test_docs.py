"""The docs stay true to the code and to themselves: the config table in docs/config.md is the one generated
from the dataclasses, every logged metric is documented, every built-in experiment has a README row with its
true run count, every relative link and image in README.md and docs/*.md resolves (file and #anchor), and every
repository path they cite in a code span exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from moe_lab.commands.config_table import config_page
from moe_lab.launch.experiment import expand
from moe_lab.algos.losses import policy_loss
from moe_lab.config.yaml_io import load_yaml
from recipes import recipe_new_files

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "results" / "README.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
# [text](target) or ![alt](target), text may hold one level of brackets; an optional "title" after the target
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The markdown without fenced code blocks (links and headings there are not rendered as such)."""
    return FENCE.sub("", text)


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text lowercased, punctuation dropped (``-`` and ``_``
    kept), each space a hyphen; repeated hyphens are not merged."""
    text = LINK.sub(lambda m: re.sub(r"^!?\[(.*)\]\(.*\)$", r"\1", m.group(0), flags=re.S), heading)
    text = text.replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(_prose(path.read_text(encoding="utf-8"))):
        slug = github_slug(title)
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def relative_links(path: Path) -> list[str]:
    """Targets of the links and images of a markdown file that point inside the repository."""
    prose = CODE_SPAN.sub("", _prose(path.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return broken


def test_github_slugs():
    # GitHub's rule (github-slugger): lowercase, drop punctuation but - and _, spaces to hyphens
    assert github_slug("What the main job shows (measured, `results/reference/`)") == \
        "what-the-main-job-shows-measured-resultsreference"
    assert github_slug("Headline: does Routing Replay rescue GRPO?") == "headline-does-routing-replay-rescue-grpo"
    assert github_slug("Models, local checkpoints and GPUs") == "models-local-checkpoints-and-gpus"
    assert github_slug("The instability experiment without gradient clipping (`results/reference/instability_clip_off`)") \
        == "the-instability-experiment-without-gradient-clipping-resultsreferenceinstability_clip_off"
    assert github_slug("a — b") == "a--b"  # the em dash goes, both spaces stay


def test_link_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Same\n\n## Same\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("# Page\n[ok](other.md#same-1) [bad anchor](other.md#same-2) ![img](missing.png)\n"
                    "[self](#page) [web](https://example.com/x) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n", encoding="utf-8")
    assert relative_links(page) == ["other.md#same-1", "other.md#same-2", "missing.png", "#page"]
    assert [b.split(":")[0] for b in broken_links(page)] == ["other.md#same-2", "missing.png"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(path):
    broken = broken_links(path)
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


# A code span that is a path of the repository: under one of its top-level folders (an optional ":name" or
# "#anchor" after it), or a bare page name (*.md: the root's or docs/'s).
REPO_TOPS = ("moe_lab", "tests", "docs", "scripts", "benchmarks", "experiments", "results", "notebooks")
CITED_PATH = re.compile(rf"`((?:{'|'.join(REPO_TOPS)})/[^`\s:#]*|[\w.-]+\.md)(?:[:#][^`\s]*)?`")
PLACEHOLDER = re.compile(r"[<>{}*…]|\b[A-Z][A-Z_]+\b")  # a path the reader fills in: experiments/NAME.yaml
# Where runs write by default (results/paper/...): gitignored, a user's output; only these results/ are committed.
COMMITTED_RESULTS = ("results/reference", "results/README.md")
RECIPE_FILES = recipe_new_files()  # docs/extending.md's recipes create them (tests/test_extending*.py)


def missing_paths(text: str) -> list[str]:
    """The repository paths a markdown text cites in code spans (outside fenced blocks) that do not exist."""
    missing = []
    for cited in CITED_PATH.findall(_prose(text)):
        if PLACEHOLDER.search(cited) or cited in RECIPE_FILES:
            continue
        if cited.startswith("results/") and not cited.startswith(COMMITTED_RESULTS):
            continue
        if not (ROOT / cited).exists() and not ("/" not in cited and (ROOT / "docs" / cited).exists()):
            missing.append(cited)
    return missing


def test_path_checker_finds_what_is_missing():
    text = ("`moe_lab/cli.py` `moe_lab/store/health.py:check` `moe_lab/no_such.py` `gspo-notes.md` `metrics.md` "
            "`tests/` `experiments/NAME.yaml` `results/paper/summary.csv` `results/reference/no_such/` "
            "`moe_lab/x.py --flag` `docs/gone.md#anchor`\n```\n`moe_lab/fenced.py`\n```\n")
    assert missing_paths(text) == ["moe_lab/no_such.py", "gspo-notes.md", "results/reference/no_such/",
                                   "docs/gone.md"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_repository_path_exists(path):
    missing = missing_paths(path.read_text(encoding="utf-8"))
    assert not missing, f"{path.relative_to(ROOT)} cites paths not in the repository: {missing}"


def test_config_page_is_the_generated_one():
    doc = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert doc == config_page(), "regenerate it: moe-lab config > docs/config.md"


def test_every_builtin_experiment_has_a_row_with_its_run_count():
    readme = (ROOT / "docs" / "experiments.md").read_text(encoding="utf-8")
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        exp = load_yaml(str(path))
        row = re.search(rf"^\| `{re.escape(exp['name'])}` \|.*$", readme, re.M)
        assert row, f"docs/experiments.md: no row for experiments/{path.name} in the table of built-in experiments"
        runs = row.group(0).split("|")[3]
        stated = re.search(r"= (\d+)\s*$", runs)
        assert stated and int(stated.group(1)) == len(expand(exp)), \
            f"docs/experiments.md: {exp['name']} runs {len(expand(exp))} cells, the table says {runs.strip()!r}"


def test_every_policy_metric_is_in_the_metric_table():
    table = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`([a-z_]+/[a-z_{}0-9/]+)`", table))
    B, T = 2, 3
    _, metrics = policy_loss(torch.zeros(B, T), torch.zeros(B, T), torch.ones(B), torch.ones(B, T),
                             algo="grpo", clip_low=0.2, clip_high=0.2)
    missing = sorted(set(metrics) - documented)
    assert not missing, f"undocumented metrics: {missing}"


def test_results_readme_states_how_each_reference_sampled():
    """results/README.md's table of rl.rollout_seeding per reference is what the runs' configs say (a config
    written before the field existed reads as sequential, moe_lab.config.upgrade_run_config)."""
    from moe_lab.config import upgrade_run_config

    text = (ROOT / "results" / "README.md").read_text(encoding="utf-8")
    stated = dict(re.findall(r"^\| `([\w.-]+)/` \| ((?:`\w+`(?:, )?)+) \|$", text, re.M))
    found = {}
    for exp in sorted(p for p in (ROOT / "results" / "reference").iterdir() if p.is_dir()):
        # golden/ holds two experiment folders (default/, avx2/: process-wide kernel pins cannot be arms)
        modes = {upgrade_run_config(load_yaml(str(c)))["rl"]["rollout_seeding"] for c in exp.glob("**/runs/*/config.yaml")}
        if modes:  # a folder whose runner has not yet written a run (an experiment just started) states nothing
            found[exp.name] = ", ".join(f"`{m}`" for m in sorted(modes))
    assert stated == found
