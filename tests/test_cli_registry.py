"""moe_lab.cli is a dispatcher over COMMANDS: every command comes from its module's add_parser and main, the
help names each command's module, and Ctrl-C prints the module's own message (or a plain one) with exit 130."""

from __future__ import annotations

import argparse
import importlib

import pytest

from moe_lab import cli
from moe_lab.commands import plot, run


def test_every_command_is_one_registered_module():
    """Each module of COMMANDS adds one command, no two the same, and the help names each with its module."""
    described = " ".join(cli.build_parser().description.split())
    names = []
    for module_name in cli.COMMANDS:
        module = importlib.import_module(module_name)
        name = module.add_parser(argparse.ArgumentParser(prog="moe-lab").add_subparsers()).prog.split()[-1]
        assert callable(module.main) and f"{name} ({module_name})" in described
        names.append(name)
    assert len(set(names)) == len(cli.COMMANDS)  # one name per module, none registered twice


@pytest.mark.parametrize("module, argv, needle", [
    (plot, ["plot", "somewhere"], "moe-lab: plot interrupted"),
    (run, ["run", "exp.yaml", "--out", "o", "rl.steps=2"], "Resume with:\n  moe-lab run exp.yaml --out o rl.steps=2"),
])
def test_ctrl_c_prints_the_commands_message(monkeypatch, capsys, module, argv, needle):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "main", interrupted)
    assert cli.main(argv) == 130
    assert needle in capsys.readouterr().err
