"""`moe-lab list`: every built-in experiment (moe_lab/launch/catalog.py). Exit code 0."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser("list", help="every built-in experiment: first sentence of its description, cells, "
                                       "runtime on 2 cores")


def main(args) -> int:
    from moe_lab.launch.catalog import catalog, format_catalog

    print(format_catalog(catalog()))
    return 0
