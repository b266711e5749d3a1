"""Each objective's own parameters, declared once: a frozen dataclass of ``knob`` fields (default, bounds,
help) per objective that has knobs. ``moe_lab.algos.objectives`` binds each to its objective's registry entry
(which receives it as one object); ``policy_loss`` takes the fields as ``<prefix>_<field>`` keyword arguments
and the run config exposes them as ``rl.<prefix>_<field>`` (tests/test_objectives.py keeps the two equal).
Pure data: no torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any


def knob(default: float, help: str, *, gt: float | None = None, ge: float | None = None, le: float | None = None,
         lt: float | None = None) -> Any:
    """A field of an objective's parameters: its default, its help text and its bounds (a finite float)."""
    return field(default=default, metadata={"help": help, "gt": gt, "ge": ge, "le": le, "lt": lt})


@dataclass(frozen=True)
class NoParams:
    """The parameters of an objective without knobs of its own."""


@dataclass(frozen=True)
class SapoParams:
    # SAPO paper defaults (arXiv:2511.20347): a slightly faster-decaying gate for negative advantages.
    tau_pos: float = knob(1.0, "SAPO gate temperature for positive advantages (the paper's 1.0)", gt=0.0)
    tau_neg: float = knob(1.05, "SAPO gate temperature for advantages <= 0 (the paper's 1.05)", gt=0.0)


@dataclass(frozen=True)
class RspoParams:
    # RSPO (arXiv:2510.23027) floors gamma so a token whose old experts moved is down-weighted, never
    # dropped; the paper states the floor but the sources reachable here do not give its value: 0.5 is
    # our choice (at most a factor 2 on any token's ratio, i.e. |log| <= ln 2, the "extreme" threshold).
    floor: float = knob(0.5, "RSPO lower bound on the router-shift ratio gamma (the paper floors gamma but gives "
                             "no value we could read; 0.5 is ours)", gt=0.0, le=1.0)


@dataclass(frozen=True)
class DppoParams:
    # DPPO truncates the (detached) ratio at this cap (verl's clip_ratio_c). The authors' run script sets 10000
    # ("disable dual-clip PPO and TIS for a fair comparison"); verl's code cites the paper's section 5.4 for
    # a large cap (truncation biases the gradient). The value, like CISPO's, is built on logp_new itself.
    ratio_cap: float = knob(10000.0, "DPPO (dppo_tv, dppo_kl) truncation of the detached ratio (verl's "
                                     "clip_ratio_c; the authors' 10000 = practically off); their clip_low/high "
                                     "are divergence thresholds", ge=1.0)


@dataclass(frozen=True)
class VespoParams:
    # VESPO's kernel shape: TRL's GRPOConfig defaults (vespo_k_pos ...). k = 0 is allowed (no suppression of
    # small W); lambda = 0 would make phi grow without bound.
    k_pos: float = knob(2.0, "VESPO kernel exponent k for A >= 0 (TRL's default)", ge=0.0)
    lambda_pos: float = knob(3.0, "VESPO kernel decay lambda for A >= 0 (TRL's default)", gt=0.0)
    k_neg: float = knob(3.0, "VESPO kernel exponent k for A < 0 (TRL's default)", ge=0.0)
    lambda_neg: float = knob(2.0, "VESPO kernel decay lambda for A < 0 (TRL's default)", gt=0.0)


SAPO_TAU_POS_DEFAULT, SAPO_TAU_NEG_DEFAULT = SapoParams.tau_pos, SapoParams.tau_neg
RSPO_FLOOR_DEFAULT = RspoParams.floor
DPPO_RATIO_CAP_DEFAULT = DppoParams.ratio_cap
VESPO_SHAPE_DEFAULT = (VespoParams.k_pos, VespoParams.lambda_pos, VespoParams.k_neg, VespoParams.lambda_neg)


def check_knob(name: str, value, meta: dict) -> float:
    bounds = [(op, meta[k]) for k, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if meta[k] is not None]
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and all(
        {">": value > b, ">=": value >= b, "<": value < b, "<=": value <= b}[op] for op, b in bounds)
    if not ok:
        allowed = " and ".join(f"{op} {b:g}" for op, b in bounds)
        raise ValueError(f"{name} must be a finite float{' ' + allowed if allowed else ''}, got {value!r}")
    return float(value)  # plain floats: NumPy scalars would promote tensor arithmetic to their own dtype rules
