"""One module per `moe-lab` command that has no other home: each has ``add_parser(subparsers)`` (returns its
parser) and ``main(args)`` (returns the exit code), imports its heavy dependencies inside ``main``, and may
define ``on_interrupt(args) -> str`` (what Ctrl-C prints) and ``TAKES_OVERRIDES = True`` (stray FIELD=VALUE
arguments are config overrides). ``moe_lab.cli.COMMANDS`` lists them with the commands living in their own
layer's modules (audit/check_trace.py, audit/volatility.py, launch/progress.py)."""
