"""moe_lab: measure what RL does to expert routing in Mixture-of-Experts language models.

The package is layered; each folder imports only from the ones listed before it (docs/architecture.md):
``config`` / ``constants`` / ``objective_specs`` (the bottom), ``algos`` (pure tensor math), ``models`` and
``routing``, ``tasks``, ``formats`` (routed-expert layouts of other stacks), ``rl`` (the run loop), ``launch``
(experiment grids, runner, trackers), ``analysis`` (read results), ``audit`` (verify, check-trace), ``cli`` and
``commands`` (one module per command). ``python -m moe_lab.train`` runs one config.
"""

__version__ = "0.1.0"
