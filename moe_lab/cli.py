"""`moe-lab COMMAND ...`: the command line, a dispatcher over ``COMMANDS`` (`moe-lab --help` lists every command
with the module that holds it).

Each command is a module with ``add_parser(subparsers)`` (returns its parser) and ``main(args)`` (returns the exit
code), which says its own exit codes in its docstring; moe_lab/commands/__init__.py says what else a command
module may declare. Common to every command: 2 bad input (one line on stderr, before any work, nothing written);
130 interrupted by Ctrl-C. Adding a command = its module + its line in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from moe_lab.commands.run import builtin_experiment, read_experiment  # noqa: F401 - re-exported for callers

# Every command, in the order `moe-lab --help` lists them. A module imports its heavy dependencies inside main
# (the parser of every command is built for each invocation).
COMMANDS = (
    "moe_lab.commands.run",
    "moe_lab.commands.reproduce",
    "moe_lab.commands.plot",
    "moe_lab.commands.verify",
    "moe_lab.commands.compare",
    "moe_lab.commands.report",
    "moe_lab.commands.forest",
    "moe_lab.audit.check_trace",
    "moe_lab.audit.volatility",
    "moe_lab.audit.fidelity",
    "moe_lab.launch.progress",
    "moe_lab.commands.config_table",
    "moe_lab.commands.list_experiments",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-lab")
    sub = parser.add_subparsers(dest="cmd", required=True)
    where = []
    for name in COMMANDS:
        module = importlib.import_module(name)
        before = set(sub.choices)
        module.add_parser(sub).set_defaults(command_module=module)
        where += [f"{cmd} ({name})" for cmd in sub.choices if cmd not in before]
    parser.description = f"{__doc__.strip()}\n\nCommands: {'; '.join(where)}."
    return parser


def _interrupted(args, argv: list[str]) -> int:
    module = getattr(args, "command_module", None)
    if module is not None and hasattr(module, "on_interrupt"):
        args.argv = argv
        print(module.on_interrupt(args), file=sys.stderr)
    else:
        print(f"\nmoe-lab: {getattr(args, 'cmd', None) or 'command'} interrupted", file=sys.stderr)
    return 130


def _quiet_broken_pipe() -> int:
    # The reader (e.g. `| head`) went away: no traceback, and no second error when Python flushes at exit.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        return _interrupted(_parsed(argv), argv)
    except BrokenPipeError:
        return _quiet_broken_pipe()


def _parsed(argv: list[str]):
    try:
        return build_parser().parse_known_args(argv)[0]
    except SystemExit:
        return None


def _main(argv: list[str]) -> int:
    parser = build_parser()
    # FIELD=VALUE overrides may come before or after the options: collect the stray ones here.
    args, extra = parser.parse_known_args(argv)
    takes_overrides = getattr(args.command_module, "TAKES_OVERRIDES", False)
    stray = [x for x in extra if x.startswith("-") or "=" not in x or not takes_overrides]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    args.argv = argv  # the command line as given: a command that re-executes itself pinned repeats it
    try:
        return args.command_module.main(args)
    except ValueError as exc:  # ConfigError included: bad input gets one line, not a traceback
        print(f"moe-lab: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
