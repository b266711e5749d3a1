"""Every policy objective's facts, once: one row of ``OBJECTIVE_SPECS`` per ``rl.algo`` (torch-free).

A row gives the objective's name, its paper's default clip range, its traits and its own knobs (default, help,
bounds). ``moe_lab.config.constants`` derives ``ALGOS``, ``PAPER_CLIP``, ``PPO_CLIP_ALGOS``, ``CLIP_LOW_UNBOUNDED`` and
``TOKEN_CLIP_ALGOS`` from the rows, ``moe_lab.config.RLConfig`` exposes each knob as the field
``rl.<prefix>_<name>``, and ``moe_lab.algos.objectives`` registers one function per row (a row without a
function, or a function without a row, fails at import). Every trait is a required keyword: a row that
forgets one fails at import too. Adding an objective = its function in algos/objectives.py + one row here
(docs/extending.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    """One parameter of an objective: its field name, default, help text and bounds (a finite float)."""

    name: str
    default: float
    help: str
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    lt: float | None = None

    def bounds(self) -> dict[str, float | None]:
        return {"gt": self.gt, "ge": self.ge, "le": self.le, "lt": self.lt}


@dataclass(frozen=True)
class Knobs:
    """An objective's knobs: the config fields ``rl.<prefix>_<knob.name>``; objectives sharing the same
    ``Knobs`` object (dppo_tv, dppo_kl) share the fields."""

    prefix: str
    knobs: tuple[Knob, ...]

    def fields(self) -> dict[str, Knob]:
        """config field name (``sapo_tau_pos``) -> its knob."""
        return {f"{self.prefix}_{k.name}": k for k in self.knobs}


def check_color(color: str | None, owner: str) -> None:
    """A declared figure colour is "#RRGGBB" (or None where the row declares none)."""
    if color is not None and re.fullmatch(r"#[0-9A-Fa-f]{6}", str(color)) is None:
        raise ValueError(f"{owner}: color={color!r}, expected '#RRGGBB'")


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective. Traits (all required):

    label: the objective's name in tables and figures; arm presets (moe_lab/launch/compose.py) build theirs on it.
    ppo_clip: a clipped surrogate on a token or sequence ratio; dual clip allowed; the algorithms the
      clipped-surrogate properties and the golden file hold for.
    clip_low_unbounded: clip_low may reach 1 and beyond (no ratio lower bound, a log-space clip, or a
      divergence threshold): validation takes rl.clip_low's bounds from ``field_bounds``, not the field's.
    token_clip: the clip acts on the token ratio w_t, so ratio/route_clip_exit_frac uses the run's clip range
      (the others: GRPO's paper range).
    sequence_level: one ratio per sequence built as a geometric mean of token ratios (rollout-correction
      weights are folded the same way).
    color: its plain arm's colour in figures ("#RRGGBB"; arm presets with a replay or correction mode derive
      theirs from it and the modes': launch/compose.py); None: figures pick one by name.
    """

    name: str
    label: str  # how tables, legends and arm presets name it (the paper's spelling)
    paper_clip: tuple[float, float]  # the default (clip_low, clip_high) when the config leaves them None
    ppo_clip: bool
    clip_low_unbounded: bool
    token_clip: bool
    sequence_level: bool
    knobs: Knobs | None = None
    color: str | None = None

    def field_bounds(self) -> dict[str, dict[str, float | None]]:
        """The bounds this objective declares for shared rl fields, in place of the field's own: where clip_low
        is unbounded it may reach 1 and beyond (CISPO's own setting is 1.0)."""
        return {"clip_low": {"ge": 0.0, "lt": None}} if self.clip_low_unbounded else {}

    def __post_init__(self):
        check_color(self.color, f"objective spec {self.name!r}")
        traits = (self.ppo_clip, self.clip_low_unbounded, self.token_clip, self.sequence_level)
        if not all(isinstance(t, bool) for t in traits):
            raise TypeError(f"objective spec {self.name!r}: every trait must be True or False, got {traits}")
        low, high = self.paper_clip
        if not (0.0 <= low < (math.inf if self.clip_low_unbounded else 1.0) and 0.0 <= high < math.inf):
            raise ValueError(f"objective spec {self.name!r}: paper_clip {self.paper_clip} out of range")


_PPO = dict(ppo_clip=True, clip_low_unbounded=False, sequence_level=False)
_GSPO_CLIP = (3e-4, 4e-4)
# GRPO's range, where an objective has no ratio clip of its own (SAPO, VESPO): clip_frac/* are measured on it.
_GRPO_CLIP = (0.2, 0.27)
# The knob sets of the objectives that have them, by name: algos.objective_params builds one frozen class from
# each (SapoParams ...), which the objective functions annotate.
SAPO_KNOBS = Knobs("sapo", (
    Knob("tau_pos", 1.0, "SAPO gate temperature, advantages > 0", gt=0.0),
    Knob("tau_neg", 1.05, "SAPO gate temperature, advantages <= 0", gt=0.0)))
RSPO_KNOBS = Knobs("rspo", (
    Knob("floor", 0.5, "RSPO floor on the router-shift ratio (0.5: ours)", gt=0.0, le=1.0),))
VESPO_KNOBS = Knobs("vespo", (
    Knob("k_pos", 2.0, "VESPO kernel exponent, A >= 0", ge=0.0),
    Knob("lambda_pos", 3.0, "VESPO kernel decay, A >= 0", gt=0.0),
    Knob("k_neg", 3.0, "VESPO kernel exponent, A < 0", ge=0.0),
    Knob("lambda_neg", 2.0, "VESPO kernel decay, A < 0", gt=0.0)))
# DPPO truncates the (detached) ratio at this cap (verl's clip_ratio_c). The authors' run script sets 10000
# ("disable dual-clip PPO and TIS for a fair comparison"); verl's code cites the paper's section 5.4 for
# a large cap (truncation biases the gradient). The value, like CISPO's, is built on logp_new itself.
DPPO_KNOBS = Knobs("dppo", (
    Knob("ratio_cap", 10000.0, "DPPO's cap on the detached ratio (verl's clip_ratio_c)", ge=1.0),))
# DPPO (arXiv:2602.04879): clip_low/high are thresholds on the divergence estimate, not the ratio; TV 0.15 / 0.15
# and binary KL 0.05 / 0.05, the values of the authors' run script (verl examples/dppo_trainer/
# run_qwen30b_dppo.sh, Stable-RL); a TV threshold >= 1 or any KL one is simply never reached.
_DPPO = dict(ppo_clip=False, clip_low_unbounded=True, token_clip=False, sequence_level=False, knobs=DPPO_KNOBS)

_ROWS = (
    ObjectiveSpec("grpo", "GRPO", _GRPO_CLIP, **_PPO, token_clip=True, color="#D55E00"),
    ObjectiveSpec("gspo", "GSPO", _GSPO_CLIP, **_PPO, token_clip=False, color="#0072B2"),
    ObjectiveSpec("gspo_token", "GSPO-token", _GSPO_CLIP, **_PPO, token_clip=False, color="#56B4E9"),
    ObjectiveSpec("gspo_unnormalized", "GSPO (no 1/|y|)", _GSPO_CLIP, **_PPO, token_clip=False, color="#000000"),
    # SAPO paper defaults (arXiv:2511.20347): a slightly faster-decaying gate for negative advantages.
    ObjectiveSpec("sapo", "SAPO", _GRPO_CLIP, ppo_clip=False, clip_low_unbounded=False, token_clip=True,
                  sequence_level=False, knobs=SAPO_KNOBS, color="#00704F"),
    # CISPO: no lower bound on its IS weight (clip_low 1.0: ratio >= 0) and DAPO's 0.28 above, the paper
    # publishing none.
    ObjectiveSpec("cispo", "CISPO", (1.0, 0.28), ppo_clip=False, clip_low_unbounded=True, token_clip=True,
                  sequence_level=False, color="#7F5200"),
    # GMPO/RSPO: +-0.4 on the LOG ratio, clipped inside a geometric mean.
    ObjectiveSpec("gmpo", "GMPO", (0.4, 0.4), ppo_clip=False, clip_low_unbounded=True, token_clip=False,
                  sequence_level=True, color="#004C7F"),
    # RSPO (arXiv:2510.23027) floors gamma so a token whose old experts moved is down-weighted, never
    # dropped; the paper states the floor but the sources reachable here do not give its value: 0.5 is
    # our choice (at most a factor 2 on any token's ratio, i.e. |log| <= ln 2, the "extreme" threshold).
    ObjectiveSpec("rspo", "RSPO", (0.4, 0.4), ppo_clip=False, clip_low_unbounded=True, token_clip=False,
                  sequence_level=True, knobs=RSPO_KNOBS, color="#5A2D7F"),
    ObjectiveSpec("dppo_tv", "DPPO-TV", (0.15, 0.15), **_DPPO, color="#F0E442"),
    ObjectiveSpec("dppo_kl", "DPPO-KL", (0.05, 0.05), **_DPPO, color="#A8A030"),
    # LUSPO (arXiv:2602.05261) is GSPO with a length factor: GSPO's range.
    ObjectiveSpec("luspo", "LUSPO", _GSPO_CLIP, ppo_clip=False, clip_low_unbounded=False, token_clip=False,
                  sequence_level=False, color="#2F6F8F"),
    # VESPO's kernel shape: TRL's GRPOConfig defaults (vespo_k_pos ...). k = 0 is allowed (no suppression of
    # small W); lambda = 0 would make phi grow without bound. No clip: GRPO's range for the metrics.
    ObjectiveSpec("vespo", "VESPO", _GRPO_CLIP, ppo_clip=False, clip_low_unbounded=False, token_clip=False,
                  sequence_level=False, knobs=VESPO_KNOBS,
                  color="#9E3D00"),
)


def spec_table(rows: tuple[ObjectiveSpec, ...]) -> dict[str, ObjectiveSpec]:
    """name -> row, in the rows' order; a repeated name, or two knob sets claiming one config field, is an error."""
    table: dict[str, ObjectiveSpec] = {}
    for row in rows:
        if row.name in table:
            raise ValueError(f"objective spec {row.name!r} declared twice")
        table[row.name] = row
    knob_fields(table)
    return table


def knob_fields(specs: dict[str, ObjectiveSpec]) -> dict[str, Knob]:
    """config field name -> knob, for every objective's knobs (a shared ``Knobs`` once), in the rows' order."""
    fields: dict[str, Knob] = {}
    owners: dict[str, Knobs] = {}
    for spec in specs.values():
        if spec.knobs is None:
            continue
        for name, knob in spec.knobs.fields().items():
            if name in owners and owners[name] is not spec.knobs:
                raise ValueError(f"objective spec {spec.name!r}: knob field {name!r} already declared by another "
                                 "objective (share its Knobs object instead)")
            owners[name], fields[name] = spec.knobs, knob
    return fields


OBJECTIVE_SPECS: dict[str, ObjectiveSpec] = spec_table(_ROWS)
