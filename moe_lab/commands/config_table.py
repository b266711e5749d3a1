"""`moe-lab config`: the table of every config field (markdown), docs/config.md whole, one table per
section (``rl`` by its sections, moe_lab/config/rl.py, each headed by its docstring). Exit code 0."""

from __future__ import annotations

import argparse
import dataclasses

from moe_lab.config import RL_SECTIONS, RLConfig, field_table

HEADER = ["| field | default | allowed | meaning |", "|---|---|---|---|"]
# docs/config.md is this command's output, whole: `moe-lab config > docs/config.md` (tests/test_docs.py checks it)
INTRO = """# Every config field

Back to the [README](../README.md). The metrics every run logs are in [metrics.md](metrics.md); how to run
experiments and override fields, in [guide.md](guide.md).

This page is the output of `moe-lab config` (`moe-lab config > docs/config.md` rewrites it).
Each field is declared once, with its help and allowed values, in `moe_lab/config/`: `__init__.py` for model,
task, coldstart and run, `rl.py` for `rl`, one class per section. Set a field in an experiment file or as
`section.field=value` on the command line. The `rl` keys stay flat: `rl.collapse_window`, not
`rl.collapse.window`. Code that needs one section gets it as a typed view, `cfg.rl.section(name)`.
"""


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser("config", help="print the table of every config field (markdown), section by section")


def _section(name: str) -> str:
    """The heading of the table a field's row goes in."""
    head, _, rest = name.partition(".")
    if not rest:
        return "run"
    if head == "rl":
        section = RLConfig.SECTION_OF[rest]
        return f"rl ({section}): {RLConfig.SECTIONS[section].__doc__.strip().rstrip('.')}"
    return head


def config_table() -> str:
    groups: dict[str, list[str]] = {}
    for n, d, a, h in field_table():
        groups.setdefault(_section(n), []).append(f"| `{n}` | `{d}` | {a} | {h} |")
    rl_order = [t for t in (_section(f"rl.{dataclasses.fields(s)[0].name}") for s in RL_SECTIONS) if t in groups]
    order = [t for t in groups if not t.startswith("rl (")] + rl_order
    return "\n\n".join("\n".join([f"**{title}**", "", *HEADER, *groups[title]]) for title in order)


def config_page() -> str:
    """docs/config.md, whole."""
    return f"{INTRO}\n{config_table()}\n"


def main(args) -> int:
    print(config_page(), end="")
    return 0
