"""docs/extending.md's recipes as code: a recipe's code block found by its marker, written where the page says,
in a copy of the package run by a fresh interpreter (tests/test_extending*.py use these)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import moe_lab

PKG = Path(moe_lab.__file__).resolve().parent
DOC = PKG.parent / "docs" / "extending.md"


NEW_FILE = re.compile(r"<!-- recipe: [\w-]+, new file (\S+) -->")


def block(name: str) -> str:
    """The code block under the marker ``<!-- recipe: name -->`` (or ``<!-- recipe: name, new file PATH -->``)
    of docs/extending.md."""
    found = re.search(rf"<!-- recipe: {name}(?:, new file \S+)? -->\n```\w*\n(.*?)```",
                      DOC.read_text(encoding="utf-8"), re.S)
    assert found, f"docs/extending.md: no code block marked recipe: {name}"
    return found.group(1)


def recipe_new_files() -> set[str]:
    """The repository paths the recipes create (a marker's ``new file PATH``): cited before they exist."""
    return set(NEW_FILE.findall(DOC.read_text(encoding="utf-8")))


def write_new_file(root: Path, name: str) -> None:
    """Write the block marked ``recipe: name, new file PATH`` at PATH under ``root`` (a copy's parent)."""
    found = re.search(rf"<!-- recipe: {name}, new file (\S+) -->", DOC.read_text(encoding="utf-8"))
    assert found, f"docs/extending.md: recipe {name} names no new file"
    (root / found.group(1)).write_text(block(name), encoding="utf-8")


def insert(path: Path, anchor: str, text: str, before: bool) -> None:
    """Put ``text`` before or after the one occurrence of ``anchor`` in ``path`` (the place the recipe names)."""
    source = path.read_text(encoding="utf-8")
    assert source.count(anchor) == 1, f"{path.name}: the recipe's place {anchor!r} is not there exactly once"
    at = source.index(anchor) + (0 if before else len(anchor))
    path.write_text(source[:at] + text + source[at:], encoding="utf-8")


def copy_package(tmp_path: Path) -> Path:
    shutil.copytree(PKG, tmp_path / "moe_lab", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "moe_lab"


def run_python(tmp_path: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
