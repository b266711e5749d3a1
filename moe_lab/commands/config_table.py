"""`moe-lab config`: the table of every config field (markdown), the one docs/config.md holds. Exit code 0."""

from __future__ import annotations

import argparse

from moe_lab.config import field_table


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser("config", help="print the table of every config field (markdown)")


def config_table() -> str:
    lines = ["| field | default | allowed | meaning |", "|---|---|---|---|"]
    lines += [f"| `{n}` | `{d}` | {a} | {h} |" for n, d, a, h in field_table()]
    return "\n".join(lines)


def main(args) -> int:
    print(config_table())
    return 0
