"""The suite leaves HOME as it found it.

Libraries the tests import keep caches and configs under HOME by default (matplotlib's font cache, wandb's
settings and logs, IPython's profile and Jupyter's kernel connection files); those go to one scratch folder of this session instead, removed at the end (a variable already
set by the caller is left alone). Every test that runs the pipeline passes its own ``coldstart.cache_dir``,
and the Ray tests keep Ray's token and session files in their own tmp folders (tests/test_ray_backend.py).

The guard: HOME's entries two levels deep (and everything under the folders our dependencies write to) are
listed at the start and at the end of the session; a path that appeared fails the session, naming it.
On a HOME shared with other running programs their writes show up too: MOE_LAB_HOME_GUARD=0 turns the check
off (the redirections stay).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

SCRATCH = Path(tempfile.mkdtemp(prefix="moe_lab_tests_"))
REDIRECTED = {"MPLCONFIGDIR": "matplotlib", "WANDB_DIR": "wandb", "WANDB_CONFIG_DIR": "wandb_config",
              "WANDB_CACHE_DIR": "wandb_cache", "WANDB_DATA_DIR": "wandb_data",  # wandb-core's logs too
              "IPYTHONDIR": "ipython", "JUPYTER_RUNTIME_DIR": "jupyter_runtime"}  # the notebook tests' kernels
for _var, _sub in REDIRECTED.items():
    os.environ.setdefault(_var, str(SCRATCH / _sub))
# where our dependencies (and moe_lab's default cold-start cache) write under HOME: listed in full
WATCHED = (".cache/moe_lab", ".ray", ".cache/matplotlib", ".config/matplotlib", ".config/wandb", ".cache/wandb",
           ".cache/huggingface", ".ipython", ".local/share/jupyter")
HOME_DEPTH = 2


def home_entries(home: Path) -> set[str]:
    """HOME's paths up to HOME_DEPTH levels, plus every path under WATCHED (relative, as strings)."""
    found: set[str] = set()

    def walk(folder: Path, depth: int | None) -> None:
        try:
            children = list(folder.iterdir())
        except OSError:
            return
        for child in children:
            found.add(str(child.relative_to(home)))
            if child.is_dir() and not child.is_symlink() and (depth is None or depth > 1):
                walk(child, None if depth is None else depth - 1)

    walk(home, HOME_DEPTH)
    for sub in WATCHED:
        if (home / sub).is_dir():
            walk(home / sub, None)
    return found


HOME = Path(os.path.expanduser("~"))
BEFORE = home_entries(HOME) if os.environ.get("MOE_LAB_HOME_GUARD", "1") != "0" else set()
_new: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("MOE_LAB_HOME_GUARD", "1") != "0":
        _new.extend(sorted(home_entries(HOME) - BEFORE))
    if _new:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(SCRATCH, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    if _new:
        terminalreporter.write_line(f"FAILED: the tests wrote into HOME ({HOME}): {', '.join(_new[:10])}"
                                    f"{' ...' if len(_new) > 10 else ''}; every write must go to a tmp folder "
                                    "(if another program wrote it meanwhile, rerun)", red=True)
