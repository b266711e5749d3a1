"""Every Routing Replay mode and every rollout-correction mode, once: one row per ``rl.replay`` value in
``REPLAY_SPECS``, one per ``rl.rollout_correction`` value in ``ROLLOUT_CORRECTION_SPECS`` (torch-free).

A row carries the mode's traits; the code reads the traits, never the mode's name: ``moe_lab.config.constants``
derives ``REPLAY_MODES``, ``ROLLOUT_CORRECTION_MODES`` and ``ROLLOUT_CORRECTION_BOUNDS`` from the rows, config
validation (config, config.checks), ``rl.collect`` (which trace is forced), ``rl.step`` / ``rl.loop``
(the predictor), ``rl.dp_split`` (data-parallel), ``algos.rollout_correction`` (the weights) and the TRL
integration's ``MoEGRPOConfig`` (its allowed ``routing_replay`` values) read them. Every trait is a required
keyword and an inconsistent row fails at import. Adding a mode = one row here (+ the code its new trait
value needs, if any).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_lab.config.objective_specs import check_color

# where a replayed update's routing comes from (ReplaySpec.forces); None: the routers choose freely
OLD_FORWARD = "old_forward"  # R2: the old-policy forward's routing, recorded before the updates
ROLLOUT = "rollout"  # R3: the routing the sampler recorded while generating
FORCE_SOURCES = (None, OLD_FORWARD, ROLLOUT)


@dataclass(frozen=True)
class ReplaySpec:
    """One value of rl.replay. Traits (all required):

    label: the paper's name of the mode ("" for no replay), for tables and plots.
    forces: the routing the old-policy pass (R3) and the updates follow (FORCE_SOURCES; None: free routing).
    predictor: the sampler routes by learned prediction heads (installed before the run, refitted after each
      step's updates): only the current step's heads exist, so rl.rollout_lag must stay 0.
    single_process: why the mode runs in one process only ("" = allowed data-parallel, under torchrun).
    trl: offered by the TRL integration (MoEGRPOConfig.routing_replay).
    color: the mode's hue in figures ("#RRGGBB"; "" for no replay): an arm preset with this mode takes it
      (launch/compose.py).
    """

    name: str
    label: str
    forces: str | None
    predictor: bool
    single_process: str
    trl: bool
    color: str = ""

    def __post_init__(self):
        check_color(self.color or None, f"replay spec {self.name!r}")
        if (self.color == "") != (self.forces is None):
            raise ValueError(f"replay spec {self.name!r}: a replay has a colour; free routing has none")
        if self.forces not in FORCE_SOURCES:
            raise ValueError(f"replay spec {self.name!r}: forces={self.forces!r}, allowed {FORCE_SOURCES}")
        if not all(isinstance(t, bool) for t in (self.predictor, self.trl)):
            raise TypeError(f"replay spec {self.name!r}: predictor and trl must be True or False")
        if self.predictor and self.forces != ROLLOUT:
            raise ValueError(f"replay spec {self.name!r}: a predicted routing is the rollout's: forces={ROLLOUT!r}")
        if (self.forces is None) != (self.label == ""):
            raise ValueError(f"replay spec {self.name!r}: a label names a replay; free routing has none")

    @property
    def replays(self) -> bool:
        return self.forces is not None

    @property
    def data_parallel(self) -> bool:
        return not self.single_process


# a rollout-correction weight's level (CorrectionSpec.level) and what it does beyond its bounds (.action)
TOKEN, SEQUENCE = "token", "sequence"  # r_t per token; R_i = exp(sum_t log r_t), broadcast over the sequence
TRUNCATE, MASK = "truncate", "mask"  # min(r, upper); 0 outside [lower, upper] (the weight itself inside)


@dataclass(frozen=True)
class CorrectionSpec:
    """One value of rl.rollout_correction: its level and action (both None: no weights, all 1) and its default
    bounds (used when rl.rollout_correction_lower/upper are None). Only a MASK mode takes a lower bound."""

    name: str
    label: str  # "" for none; names the mode in tables and arm presets (its lower-cased form: the arm suffix)
    level: str | None
    action: str | None
    lower: float | None
    upper: float | None
    color: str = ""  # its hue in figures ("#RRGGBB"), "" for none: an arm preset with this mode takes it

    def __post_init__(self):
        check_color(self.color or None, f"correction spec {self.name!r}")
        if (self.color == "") != (self.level is None):
            raise ValueError(f"correction spec {self.name!r}: a correction has a colour; none has none")
        if self.level not in (None, TOKEN, SEQUENCE) or self.action not in (None, TRUNCATE, MASK):
            raise ValueError(f"correction spec {self.name!r}: level={self.level!r}, action={self.action!r}")
        if (self.level is None) != (self.label == ""):
            raise ValueError(f"correction spec {self.name!r}: a label names a correction; none has none")
        if (self.level is None) != (self.action is None) or (self.level is None) != (self.upper is None):
            raise ValueError(f"correction spec {self.name!r}: level, action and upper are all set or all None")
        if self.lower is not None and not (self.action == MASK and 0.0 < self.lower < self.upper < math.inf):
            raise ValueError(f"correction spec {self.name!r}: a default lower bound needs action={MASK!r} and "
                             "0 < lower < upper")

    @property
    def active(self) -> bool:
        return self.level is not None

    @property
    def takes_lower(self) -> bool:
        return self.action == MASK

    @property
    def bounds(self) -> tuple[float | None, float | None]:
        return self.lower, self.upper


_PR2_SINGLE = "the predictor heads are refitted by the single-process step only"

_REPLAY_ROWS = (
    ReplaySpec("none", "", forces=None, predictor=False, single_process="", trl=True),
    ReplaySpec("old", "R2", forces=OLD_FORWARD, predictor=False, single_process="", trl=True, color="#E69F00"),
    ReplaySpec("rollout", "R3", forces=ROLLOUT, predictor=False, single_process="", trl=True, color="#CC79A7"),
    # a simplified PR2 (moe_lab/routing/predictor.py): R3 of a rollout routed by a prediction of the next router
    ReplaySpec("predictive", "PR2", forces=ROLLOUT, predictor=True, single_process=_PR2_SINGLE, trl=False,
               color="#7F3F63"),
)

# TIS/MIS: verl's rollout_is_threshold 2.0; IcePop: the Ring-1T report's alpha = 0.5, beta = 5. MIS follows the
# blog's rho 1[rho <= C] (upper only; a lower bound may be given).
_CORRECTION_ROWS = (
    CorrectionSpec("none", "", level=None, action=None, lower=None, upper=None),
    CorrectionSpec("tis_token", "TIS", level=TOKEN, action=TRUNCATE, lower=None, upper=2.0, color="#B8A000"),
    CorrectionSpec("tis_seq", "TIS-seq", level=SEQUENCE, action=TRUNCATE, lower=None, upper=2.0, color="#7A6A00"),
    CorrectionSpec("mis_token", "MIS", level=TOKEN, action=MASK, lower=None, upper=2.0, color="#5C5C5C"),
    CorrectionSpec("mis_seq", "MIS-seq", level=SEQUENCE, action=MASK, lower=None, upper=2.0, color="#3D3D3D"),
    CorrectionSpec("icepop", "IcePop", level=TOKEN, action=MASK, lower=0.5, upper=5.0, color="#8C8C8C"),
)


def mode_table(rows: tuple) -> dict:
    """name -> row, in the rows' order; a repeated name is an error."""
    table = {}
    for row in rows:
        if row.name in table:
            raise ValueError(f"mode {row.name!r} declared twice")
        table[row.name] = row
    return table


def names_where(table: dict, trait) -> str:
    """The names of the rows for which ``trait(row)`` holds, as an error message lists allowed values."""
    return ", ".join(name for name, row in table.items() if trait(row))


REPLAY_SPECS: dict[str, ReplaySpec] = mode_table(_REPLAY_ROWS)
ROLLOUT_CORRECTION_SPECS: dict[str, CorrectionSpec] = mode_table(_CORRECTION_ROWS)
