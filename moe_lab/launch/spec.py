"""The typed experiment: an experiment file (or a results folder's copy) parsed once, handed to the runner,
progress, compare, report, catalog and verify, which read its fields instead of the file's keys.

``parse_experiment(exp)`` composes the organism and arm presets (launch/compose.py), checks the whole file
(launch/experiment.py's ``check_shape``: one ConfigError naming the key) and parses each block once: endpoints,
blocks, contrasts, describe, verdict. ``explicit`` is the composed mapping: what ``expand`` reads and what the
runner writes into the results folder. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_lab.launch.compose import compose
from moe_lab.launch.design import (Blocks, Contrast, Describe, blocks_spec, contrasts_spec, describe_spec,
                                   verdict_of)
from moe_lab.launch.experiment import Cell, EndpointSpec, check_shape, endpoint_spec, expand


@dataclass(frozen=True)
class Experiment:
    explicit: dict
    """the composed file (organism merged into base, presets written out): what expand reads, what results keep"""
    name: str | None
    description: str | None
    endpoints: EndpointSpec
    blocks: Blocks | None
    """independent cold starts (or another field) with RL seeds of their own; None: plain seeds"""
    contrasts: tuple[Contrast, ...]
    """declared contrasts, primary first; () when none are declared"""
    describe: Describe | None
    verdict: str | None
    minutes_2cores: float | None
    """runtime measured by hand on 2 cores, where no committed reference records it"""

    @property
    def base(self) -> dict:
        return self.explicit.get("base") or {}

    @property
    def arms(self) -> dict[str, dict | None]:
        """arm name -> overrides of base, as the results folder records them"""
        return self.explicit.get("arms") or {}

    def setting(self, key: str) -> Any:
        """A design block as written (``sweep``, ``factors``, ``seeds``), None when the file has none."""
        return self.explicit.get(key)

    def cells(self, *, overrides: list[str] = (), arms: list[str] | None = None,
              seeds: list[int] | None = None) -> list[Cell]:
        return expand(self.explicit, overrides=overrides, arms=arms, seeds=seeds)


def parse_experiment(exp: dict | Experiment | None) -> Experiment:
    """The typed experiment of a mapping (an experiment file, or a results folder's copy; None: a folder without
    one, every block at its default). Idempotent on an Experiment."""
    if isinstance(exp, Experiment):
        return exp
    explicit = compose(exp if exp is not None else {})
    check_shape(explicit)
    minutes = explicit.get("minutes_2cores")
    return Experiment(explicit, explicit.get("name"), explicit.get("description"), endpoint_spec(explicit),
                      blocks_spec(explicit), tuple(contrasts_spec(explicit)), describe_spec(explicit),
                      verdict_of(explicit), None if minutes is None else float(minutes))
