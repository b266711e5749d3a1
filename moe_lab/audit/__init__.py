"""Auditing results rather than making or reading them: ``verify`` re-runs cells of a results folder and says
whether this machine gives the same bits (``verdicts`` judges one cell), ``check_trace`` tells whether routed
experts recorded elsewhere (an inference engine's or a trainer's R3 routes, moe_lab.formats) line up with a
checkpoint's own routing and whether replaying them takes effect, ``volatility`` how much the routing moved
between two checkpoints (experts changed per MoE layer, router shift, the routing share of the log-ratio's
variance). One layer above launch and analysis (it may import both, and everything below them), below the
command line."""
from moe_lab.audit.replay_check import ReplayVerdict, assert_replay_ok, verify_replay  # noqa: F401 (imports no torch)
