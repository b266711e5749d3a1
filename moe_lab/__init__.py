"""moe_lab: measure what RL does to expert routing in Mixture-of-Experts language models.

The package is layered; each folder imports only from the ones listed before it (docs/architecture.md):
``config`` / ``constants`` / ``objective_specs`` (the bottom), ``algos`` (pure tensor math), ``models`` and
``routing``, ``tasks``, ``formats`` (routed-expert layouts of other stacks), ``rl`` (the run loop), ``launch``
(experiment grids, runner, trackers), ``analysis`` (read results), ``audit`` (verify, check-trace), ``cli`` and
``commands`` (one module per command).

The modules lived in one flat folder before; their old names (``moe_lab.losses``, ``moe_lab.results``,
``from moe_lab import plots``...) still import, as aliases of the very same module objects (so that a
monkeypatch through the old name patches the module that runs). ``python -m moe_lab.train`` is a real module.
"""

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# old flat module name -> where it lives now
MOVED = {
    "losses": "algos.losses", "objectives": "algos.objectives", "advantages": "algos.advantages",
    "rollout_correction": "algos.rollout_correction", "ratio_metrics": "algos.ratio_metrics",
    "families": "models.families",
    "rollout": "rl.rollout", "step": "rl.step", "coldstart": "rl.coldstart", "optim": "rl.optim",
    "checkpoint": "rl.checkpoint", "distributed": "rl.distributed", "dp_split": "rl.dp_split",
    "health": "rl.health", "runlog": "rl.runlog",
    "experiment": "launch.experiment", "runner": "launch.runner", "ray_backend": "launch.ray_backend",
    "tracking": "launch.tracking", "catalog": "launch.catalog",
    "results": "analysis.results", "stability": "analysis.stability", "plots": "analysis.plots",
    "stability_plots": "analysis.stability_plots", "figures": "analysis.figures",
    "replay_map": "analysis.replay_map", "replay_plots": "analysis.replay_plots",
    # moved a level deeper: `moe_lab.launch.verify` is now `moe_lab.audit.verify`
    "launch.verify": "audit.verify", "launch.verdicts": "audit.verdicts",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module that now holds its code (one object under two names)."""

    def __init__(self, target: str):
        self.target = target
        self.spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import system set the alias's spec: the module keeps its own


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.partition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(f"{__name__}.{MOVED[name]}"))


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.append(_AliasFinder())
