"""The objective registry's entries (``Objective``: a function bound to its row of moe_lab/config/objective_specs.py,
``ObjectiveRegistry``: one function per row) and each objective's parameter object: a frozen dataclass built
from the one declaration of its knobs (the ``knobs`` of its row: default, bounds, help).
``moe_lab.algos.objectives`` hands it to the objective's function as one object; ``policy_loss`` takes its
fields as ``<prefix>_<name>`` keyword arguments and the run config exposes them as ``rl.<prefix>_<name>``
(both from the same declaration). No torch.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Callable

from moe_lab.config.objective_specs import (DPPO_KNOBS, OBJECTIVE_SPECS, RSPO_KNOBS, SAPO_KNOBS, VESPO_KNOBS, Knobs,
                                           ObjectiveSpec)
from moe_lab.config.rl import bounds_under


@dataclass(frozen=True)
class NoParams:
    """The parameters of an objective without knobs of its own."""


@functools.cache
def params_class(knobs: Knobs | None) -> type:
    """The frozen dataclass of one ``Knobs`` declaration (one class per declaration: dppo_tv and dppo_kl share it);
    each field's metadata holds its help and bounds (``check_knob``)."""
    if knobs is None:
        return NoParams
    fields = [(k.name, float, field(default=k.default, metadata={"help": k.help, **k.bounds()})) for k in knobs.knobs]
    cls = make_dataclass(f"{knobs.prefix.capitalize()}Params", fields, frozen=True)
    cls.__module__ = __name__
    return cls


# The classes of the objectives' knob sets, by name (type annotations, pickling by reference).
SapoParams, RspoParams, DppoParams, VespoParams = map(params_class, (SAPO_KNOBS, RSPO_KNOBS, DPPO_KNOBS, VESPO_KNOBS))
SAPO_TAU_POS_DEFAULT, SAPO_TAU_NEG_DEFAULT = SapoParams.tau_pos, SapoParams.tau_neg
RSPO_FLOOR_DEFAULT = RspoParams.floor
DPPO_RATIO_CAP_DEFAULT = DppoParams.ratio_cap
VESPO_SHAPE_DEFAULT = (VespoParams.k_pos, VespoParams.lambda_pos, VespoParams.k_neg, VespoParams.lambda_neg)


@dataclass(frozen=True)
class Objective:
    """A registered objective: its function, its spec row (traits and knobs) and its own metrics' reductions."""

    fn: Callable[..., Any]  # (inputs, params) -> terms
    spec: ObjectiveSpec
    reductions: dict[str, str] = field(default_factory=dict)  # its own metrics across ranks (algos/reductions.py)
    sequence_advantage: bool = False  # one ratio per sequence that takes one advantage per sequence (B,) only

    @property
    def params(self) -> type:
        """The frozen dataclass of its knobs (NoParams without any), received as one object."""
        return params_class(self.spec.knobs)

    @property
    def knob_prefix(self) -> str | None:
        return None if self.spec.knobs is None else self.spec.knobs.prefix

    @property
    def sequence_level(self) -> bool:
        return self.spec.sequence_level

    @property
    def clip_low_max(self) -> float:
        """Exclusive upper bound on clip_low: the one rl.clip_low has under this objective (inf: none)."""
        lt = bounds_under(self.spec.name, "clip_low")["lt"]
        return math.inf if lt is None else lt

    @property
    def dual_clip(self) -> bool:
        """Accepts dual_clip_c (the PPO-clip family only)."""
        return self.spec.ppo_clip


class ObjectiveRegistry:
    """Objective functions registered against spec rows: exactly one per row (``complete`` checks)."""

    def __init__(self, specs: dict[str, ObjectiveSpec]):
        self.specs = specs
        self.entries: dict[str, Objective] = {}

    def register(self, name: str, *, reductions: dict[str, str] | None = None, sequence_advantage: bool = False):
        """Decorator: the function of the spec row ``name``; reductions: how its own metrics combine across ranks;
        sequence_advantage: advantages that vary within a response are refused (one ratio per sequence)."""
        if name not in self.specs:
            raise ValueError(f"objective {name!r}: no row in the spec table (moe_lab/config/objective_specs.py)")
        if name in self.entries:
            raise ValueError(f"objective {name!r}: registered twice")

        def add(fn: Callable[..., Any]):
            self.entries[name] = Objective(fn, self.specs[name], dict(reductions or {}), sequence_advantage)
            return fn
        return add

    def complete(self) -> dict[str, Objective]:
        """name -> Objective in the spec table's order; a row without a function is an error."""
        missing = [name for name in self.specs if name not in self.entries]
        if missing:
            raise ValueError(f"objective spec rows without a registered function: {', '.join(missing)}")
        return {name: self.entries[name] for name in self.specs}


def check_knob(name: str, value, meta: dict) -> float:
    bounds = [(op, meta[k]) for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if meta[k] is not None]
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and all(
        {">": value > b, ">=": value >= b, "<": value < b, "<=": value <= b}[op] for op, b in bounds)
    if not ok:
        allowed = " and ".join(f"{op} {b:g}" for op, b in bounds)
        raise ValueError(f"{name} must be a finite float{' ' + allowed if allowed else ''}, got {value!r}")
    return float(value)  # plain floats: NumPy scalars would promote tensor arithmetic to their own dtype rules
