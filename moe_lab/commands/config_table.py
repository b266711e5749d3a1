"""`moe-lab config`: the table of every config field (markdown), the one docs/config.md holds, one table per
section (``rl`` by the sections of moe_lab/config/sections.py). Exit code 0."""

from __future__ import annotations

import argparse

from moe_lab.config import RLConfig, field_table
from moe_lab.config.sections import RL_SECTIONS

HEADER = ["| field | default | allowed | meaning |", "|---|---|---|---|"]


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser("config", help="print the table of every config field (markdown), section by section")


def _section(name: str) -> str:
    """The heading of the table a field's row goes in."""
    head, _, rest = name.partition(".")
    if not rest:
        return "run"
    if head == "rl":
        section = RLConfig.SECTION_OF[rest]
        return f"rl ({section}): {RL_SECTIONS[section][0]}"
    return head


def config_table() -> str:
    groups: dict[str, list[str]] = {}
    for n, d, a, h in field_table():
        groups.setdefault(_section(n), []).append(f"| `{n}` | `{d}` | {a} | {h} |")
    rl_order = [t for t in (_section(f"rl.{names[0]}") for _, names in RL_SECTIONS.values()) if t in groups]
    order = [t for t in groups if not t.startswith("rl (")] + rl_order
    return "\n\n".join("\n".join([f"**{title}**", "", *HEADER, *groups[title]]) for title in order)


def main(args) -> int:
    print(config_table())
    return 0
