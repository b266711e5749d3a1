"""The house rules of the package layout (docs/architecture.md), checked on the source with ast:
no import circle between modules, no private name imported across modules, and each layer imports only
the layers below it; and every ``moe_lab`` import the project's code, docs and notebooks spell names a module
(or a name in one) that exists."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

import moe_lab
from recipes import recipe_new_files

PKG = Path(moe_lab.__file__).resolve().parent
# layer of each top-level part of moe_lab: a module may import from its own layer or a lower one
LAYERS = {"config": 1, "algos": 2, "models": 2, "routing": 3,
          "tasks": 2, "store": 2, "formats": 4, "rl": 4, "launch": 5, "analysis": 5, "audit": 6, "train": 7, "cli": 7, "commands": 7,
          "integrations": 8}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(module: str, path: Path, modules: dict[str, Path] = MODULES):
    """(imported module, imported names, whether at module level) of every moe_lab import in a module, those
    inside functions included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moe_lab"):
            base = node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    yield sub, [], id(node) in top
                else:
                    yield base, [alias.name], id(node) in top
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("moe_lab.") and alias.name in modules:
                    yield alias.name, [], id(node) in top


def _packages_entered(module: str, dep: str) -> set[str]:
    """The packages whose ``__init__`` importing ``dep`` runs first, from ``module``: each package above it
    that ``module`` is not already inside (below the root, which every module sits under; its own imports are
    checked like any module's)."""
    parts = dep.split(".")
    above = {".".join(parts[:i]) for i in range(2, len(parts))}
    return {p for p in above if not module.startswith(p + ".") and module != p}


def _graph(modules: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    """module -> the moe_lab modules it depends on: what it imports at any level (a deferred import inside a
    function is still a dependency: it runs whenever that function does) and the ``__init__`` of each package
    it enters to get there."""
    graph = {}
    for m, p in modules.items():
        deps = {dep for dep, _, _ in _imports(m, p, modules) if dep != m and dep in modules}
        graph[m] = deps | {pkg for dep in deps for pkg in _packages_entered(m, dep) if pkg in modules}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):  # a package's __init__ and its submodules too: a circle through it is one
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    assert _cycle(_graph()) is None, f"import circle: {' -> '.join(_cycle(_graph()))}"


def test_cycle_finder_finds_a_planted_circle():
    graph = {"moe_lab.a": {"moe_lab.b"}, "moe_lab.b": {"moe_lab.c"}, "moe_lab.c": {"moe_lab.a"}}
    assert _cycle(graph) == ["moe_lab.a", "moe_lab.b", "moe_lab.c", "moe_lab.a"]


def _plant(tmp_path: Path, sources: dict[str, str]) -> dict[str, Path]:
    """Fake modules of a fake package ``pkg`` written under moe_lab (spelled ``pkg`` here, so that the import
    check below does not read this file's fakes as the project's imports)."""
    modules = {}
    for name, text in sources.items():
        name, text = name.replace("pkg", "moe_lab"), text.replace("pkg.", "moe_lab.")
        path = tmp_path / f"{name.replace('.', '_')}.py"
        path.write_text(text, encoding="utf-8")
        modules[name] = path
    return modules


def test_a_circle_closed_by_a_function_level_import_is_found(tmp_path):
    """The package's __init__ exports a module whose function imports (lazily) a sibling that imports back
    from the package: the shape of audit/__init__ -> replay_check -> check_trace -> audit."""
    modules = _plant(tmp_path, {
        "pkg.p": "from pkg.p.api import f\n",
        "pkg.p.api": "def f():\n    from pkg.p.command import g\n    return g()\n",
        "pkg.p.command": "from pkg.p import f\n\ndef g():\n    return f\n"})
    circle = ["pkg.p", "pkg.p.api", "pkg.p.command", "pkg.p"]
    assert _cycle(_graph(modules)) == [n.replace("pkg", "moe_lab") for n in circle]
    modules = _plant(tmp_path, {  # the same without the lazy import back: no circle
        "pkg.p": "from pkg.p.api import f\n",
        "pkg.p.api": "def f():\n    return 1\n",
        "pkg.p.command": "from pkg.p import f\n"})
    assert _cycle(_graph(modules)) is None


def test_a_circle_through_a_package_init_entered_from_outside_is_found(tmp_path):
    """Importing moe_lab.p.b from outside p runs p's __init__ first: what that __init__ reaches (here lazily)
    is a dependency of the importer."""
    modules = _plant(tmp_path, {
        "pkg.p": "from pkg.p.a import f\n",
        "pkg.p.a": "def f():\n    from pkg.q import h\n    return h\n",
        "pkg.p.b": "X = 1\n",
        "pkg.q": "from pkg.p.b import X\n\ndef h():\n    return X\n"})
    circle = ["pkg.p", "pkg.p.a", "pkg.q", "pkg.p"]
    assert _cycle(_graph(modules)) == [n.replace("pkg", "moe_lab") for n in circle]


def test_no_private_name_imported_across_modules():
    bad = [f"{m} imports {dep}.{name}" for m, p in MODULES.items() for dep, names, _ in _imports(m, p)
           for name in names if name.startswith("_") and not name.startswith("__") and dep != m]
    assert not bad, "\n".join(bad)


def _layer(module: str) -> int:
    return LAYERS[module.split(".")[1]] if module != "moe_lab" else 99


def test_layers_import_downwards_only():
    bad = [f"{m} (layer {_layer(m)}) imports {dep} (layer {_layer(dep)})" for m, p in MODULES.items()
           if m != "moe_lab" for dep, _, _ in _imports(m, p)
           if dep in MODULES and dep != "moe_lab" and _layer(dep) > _layer(m)]
    assert not bad, "\n".join(bad)


def test_nothing_in_moe_lab_imports_the_integrations():
    """moe_lab.integrations sits on top (it may need third-party trainers such as TRL): no other module, the
    package's __init__ included, imports it, not even deferred or by name (importlib)."""
    bad = [f"{m} imports {dep}" for m, p in MODULES.items() if not m.startswith("moe_lab.integrations")
           for dep, _, _ in _imports(m, p) if dep.startswith("moe_lab.integrations")]
    bad += [f"{m} names moe_lab.integrations" for m, p in MODULES.items()
            if not m.startswith("moe_lab.integrations") and "moe_lab.integrations" in p.read_text(encoding="utf-8")]
    assert not bad, "\n".join(bad)
    assert "moe_lab.integrations.trl" in MODULES  # the check above looked at a tree that holds them


def test_the_run_store_sits_below_the_trainer_and_the_analysis_reads_runs_through_it():
    """moe_lab.store imports only the config layer and itself; nothing in moe_lab.analysis imports the trainer
    (moe_lab.rl), even deferred: the analysis reads runs through the store."""
    config_layer = {m for m in LAYERS if LAYERS[m] <= LAYERS["config"]}
    bad = [f"{m} imports {dep}" for m, p in MODULES.items() if m.startswith("moe_lab.store")
           for dep, _, _ in _imports(m, p) if dep.split(".")[1] not in config_layer | {"store"}]
    bad += [f"{m} imports {dep}" for m, p in MODULES.items() if m.startswith("moe_lab.analysis")
            for dep, _, _ in _imports(m, p) if dep.startswith("moe_lab.rl")]
    assert not bad, "\n".join(bad)
    assert "moe_lab.store.run_folder" in MODULES and "moe_lab.analysis.tables" in MODULES


def _file_name_literals(names: set[str], modules: dict[str, Path]) -> list[str]:
    """Where a module outside moe_lab.store spells one of ``names`` as a string (docstrings aside)."""
    found = []
    for m, path in modules.items():
        if m.startswith("moe_lab.store"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        found += [f"{m}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in names and id(n) not in docs]
    return found


def test_a_run_s_file_names_are_spelled_only_in_the_store(tmp_path):
    """Every file name of a run, its checkpoint and its results folder is moe_lab/store/layout.py's: code elsewhere
    takes the constant (or RunFolder's paths), never the literal."""
    from moe_lab.store.layout import RUN_FILE_NAMES

    found = _file_name_literals(set(RUN_FILE_NAMES), MODULES)
    assert not found, "\n".join(found)
    planted = tmp_path / "planted.py"  # the check can fail
    planted.write_text('"""Reads metrics.parquet."""\nopen(p / "metrics.parquet")\n', encoding="utf-8")
    assert _file_name_literals(set(RUN_FILE_NAMES), {"moe_lab.x": planted}) == ["moe_lab.x:2: 'metrics.parquet'"]


def test_every_subpackage_says_what_it_is():
    for init in PKG.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and len(doc.split()) >= 20, f"{init.relative_to(PKG.parent)}: a one-paragraph docstring"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_and_function_sizes(module):
    path = MODULES[module]
    text = path.read_text(encoding="utf-8")
    # one topic, one file, read whole by one reader: a file this long has usually begun a second topic; the limit
    # is a prompt to look, set high enough that it never forces a split of one topic (issue 63: it had split several)
    assert len(text.splitlines()) <= 650, f"{module}: {len(text.splitlines())} lines (one topic per file; look for a second)"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 65]
    assert not long, f"{module}: functions over ~60 lines: {long}"


def test_every_package_ships_in_the_wheel():
    """pyproject's explicit package list names every folder of moe_lab (a missing one imports from a checkout and
    an editable install, and is absent from the wheel)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    listed = set(tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(PKG.parent).parts) for p in PKG.rglob("__init__.py")}
    found.add("moe_lab.experiments")  # the YAML files' package, mapped from experiments/
    assert found == listed


REPO = PKG.parent
# an import in code, in a docs snippet or prose, in a notebook cell or a string run as code
FROM_IMPORT = re.compile(r"\bfrom[ \t]+(moe_lab(?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[\w \t,]+)")
IMPORT = re.compile(r"\bimport[ \t]+(moe_lab(?:\.\w+)*)")
RUN_MODULE = re.compile(r"-m[\s\"',]+(moe_lab(?:\.\w+)*)")  # `python -m <module>`, or "-m", "<module>" in a list


def _project_files(root: Path):
    """The repository's .py, .md and .ipynb files (hidden folders such as .venv, and build outputs, left out)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("build", "dist", "__pycache__")
                         and not d.endswith(".egg-info"))
        yield from (Path(folder) / f for f in sorted(files) if f.endswith((".py", ".md", ".ipynb")))


def _text(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".ipynb":  # the cells' sources, not the JSON that escapes their quotes
        return "\n".join("".join(cell["source"]) for cell in json.loads(text)["cells"])
    return text


# modules docs/extending.md's recipes create: its snippets import them before they exist
RECIPE_MODULES = {path.removesuffix(".py").replace("/", ".") for path in recipe_new_files()}


def _module_file(name: str) -> Path | None:
    """The source file of a moe_lab module, found on disk: importing it would need its optional dependencies
    (moe_lab.integrations.trl refuses to load without trl, and this check runs without it too)."""
    path = REPO.joinpath(*name.split("."))
    return next((f for f in (path.with_suffix(".py"), path / "__init__.py") if f.is_file()), None)


def _is_module(name: str) -> bool:
    return name in RECIPE_MODULES or _module_file(name) is not None


def _defines(module: str, name: str) -> bool:
    """Whether a module's top level binds ``name`` (a def, class, assignment or import), read from its source."""
    found = set()
    for node in ast.parse(_module_file(module).read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return name in found


def _unknown_imports(text: str):
    """(import, why) for each moe_lab import in a text that names no module, or no module or name in one."""
    for m in FROM_IMPORT.finditer(text):
        base = m.group(1)
        if not _is_module(base):
            yield m.group(0).strip(), f"no module {base}"
            continue
        if base in RECIPE_MODULES:  # its names are the recipe's
            continue
        # the imported names, without comments, nor the quotes and \n of an import spelled inside a string
        names = re.sub(r"#[^\n]*|\\n|[\"'()]", " ", m.group(2))
        for name in (item.split()[0] for item in names.split(",") if item.split()):
            if name != "*" and not _is_module(f"{base}.{name}") and not _defines(base, name):
                yield m.group(0).strip(), f"{base} has no module or name {name}"
    for m in (*IMPORT.finditer(text), *RUN_MODULE.finditer(text)):
        if not _is_module(m.group(1)):
            yield m.group(0).strip(), f"no module {m.group(1)}"


def test_every_moe_lab_import_in_the_project_exists():
    """Code, docs and notebooks import modules by the names they have: a module renamed or moved leaves no caller
    (nor a snippet a reader copies) on its old name."""
    files = list(_project_files(REPO))
    assert {"README.md", "train.py", "01_reproduce_paper_figures.ipynb"} <= {p.name for p in files}
    bad = [f"{p.relative_to(REPO)}: {found}: {why}" for p in files for found, why in _unknown_imports(_text(p))]
    assert not bad, "\n".join(bad)


def test_the_import_check_finds_an_old_name(tmp_path):
    """The check above can fail: a name that is not a module, in each spelling it reads."""
    pkg = "moe_lab"  # the imports below are spelled through it so that this file itself holds none of them
    flat = f"{pkg}.losses"
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": [{"source": [f"from {flat} import policy_loss"]}]}))
    (tmp_path / "guide.md").write_text(f"```\nimport {flat}\n```\nor `python -m {flat}`\n")
    (tmp_path / "old.py").write_text(f"from {pkg} import (results,  # a comment\n    plots)\n"
                                     f"from {pkg}.algos import nothing\n")
    found = sorted(why for p in _project_files(tmp_path) for _, why in _unknown_imports(_text(p)))
    assert found == [f"{pkg} has no module or name plots", f"{pkg} has no module or name results",
                     f"{pkg}.algos has no module or name nothing", f"no module {flat}", f"no module {flat}",
                     f"no module {flat}"]
    good = f"from {pkg}.analysis import (plots,  # a comment\n    results)\nimport {pkg}.train\nfrom {pkg} import __version__\n"
    assert list(_unknown_imports(good)) == []


# --------------------------------------------------------------------------- names only in the tables

# The tables, and the objective registry beside them (one ``@register("<name>")`` line per row). Everywhere else
# code reads an arm's objective and modes from its config and asks the rows for their traits.
NAME_TABLES = ("config/objective_specs.py", "config/mode_specs.py", "algos/objectives.py")
MODE_CONTEXT = re.compile(r"replay|correction")


def _table_names() -> tuple[set[str], set[str]]:
    """(names spelled nowhere else: every objective, arm preset and mode with an underscore; plain-word mode
    names ('none', 'old', 'rollout'), which other fields, phases and sections also use)."""
    from moe_lab.config.mode_specs import REPLAY_SPECS, ROLLOUT_CORRECTION_SPECS
    from moe_lab.config.objective_specs import OBJECTIVE_SPECS
    from moe_lab.launch.compose import arm_presets

    modes = set(REPLAY_SPECS) | set(ROLLOUT_CORRECTION_SPECS)
    words = {m for m in modes if "_" not in m}
    return set(OBJECTIVE_SPECS) | set(arm_presets()) | (modes - words), words


def _name_literals(text: str, names: set[str], words: set[str]) -> list[tuple[int, str]]:
    """(line, literal) of each string constant outside docstrings that spells a name (``_table_names``); a
    plain-word mode name only inside a comparison that mentions a replay or a correction. A config field's
    declared default (``param(<default>, ...)``) is the field table's own."""
    tree = ast.parse(text)
    parent = {id(c): n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    skip = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    skip |= {id(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
             and getattr(n.func, "id", getattr(n.func, "attr", None)) == "param"}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        if node.value in names:
            found.append((node.lineno, node.value))
        elif node.value in words:
            up = parent.get(id(node))
            while up is not None and not isinstance(up, ast.Compare):
                up = parent.get(id(up))
            if up is not None and MODE_CONTEXT.search(ast.get_source_segment(text, up) or ""):
                found.append((node.lineno, node.value))
    return sorted(found)


def test_objective_arm_and_mode_names_are_spelled_only_in_the_tables():
    """No arm, objective or mode name drives behaviour outside the tables (and the experiment files, YAML): the
    analysis finds an arm's objective, replay and correction in its runs' config, the trainer a row's trait."""
    names, words = _table_names()
    bad = [f"{path.relative_to(PKG.parent)}:{line}: {value!r}" for path in sorted(PKG.rglob("*.py"))
           if path.relative_to(PKG).as_posix() not in NAME_TABLES
           for line, value in _name_literals(path.read_text(encoding="utf-8"), names, words)]
    assert not bad, "names spelled outside the tables (read the run's config, or the row's trait):\n" + "\n".join(bad)


def test_the_name_check_finds_names_in_code_but_not_in_docs_or_other_fields():
    names, words = _table_names()
    code = ('"""Compares grpo_r2 with gspo."""\n'
            'ARMS = ("grpo_r2", "gspo")\n'
            'def f(cfg, df):\n'
            '    """Only grpo here."""\n'
            '    bounds = BOUNDS["tis_token"]\n'
            '    if cfg.rl.old_logp == "rollout" or cfg.phase == "old":\n'
            '        return df["rl.rollout_correction"].fillna("none") != "none"\n'
            '    return cfg.rl.replay in ("old", "rollout")\n'
            'algo: str = param("grpo", "the default")\n')
    assert _name_literals(code, names, words) == [(2, "grpo_r2"), (2, "gspo"), (5, "tis_token"), (7, "none"),
                                                  (7, "none"), (8, "old"), (8, "rollout")]
