"""The parts of an experiment file that say how its runs are grouped and compared, fixed before the runs.

``blocks``: independent cold starts (or any other field whose value is shared by a group of runs). Each block
value gets its own RL seeds, so runs are nested in blocks and no seed is shared across blocks::

    blocks:
      field: model.seed            # a dotted RunConfig field; each value warms up its own cold start
      seeds: {1: [400, 401], 2: [410, 411]}

``contrasts``: the pairs of arms the analysis is about, each taken within every setting, primary ones
Holm-adjusted together; a contrast with ``equivalence_margin`` is also tested for equivalence (TOST)::

    contrasts:
      primary:   [{arm: gspo, vs: grpo_r2}, {arm: grpo_r2, vs: grpo, equivalence_margin: 0.05}]
      secondary: [{arm: grpo_r2w, vs: grpo_r2}]

A contrast with ``endpoint: collapse`` compares the arms' collapse rates instead (the tertiary endpoint: per cold
start, the share of an arm's RL seeds whose run a collapse rule stopped), by the exact sign-flip test over cold
starts (analysis/stats.py, ``SignFlips``); primary ones join the same Holm family. Its margin, if any, is a
difference of rates, below the largest the contrast can take (1; 2 for an interaction)::

      primary:   [{arm: grpo, vs: grpo_r3, endpoint: collapse}]

An **interaction** subtracts a second difference: ``{arm: A, vs: B, minus: {arm: C, vs: D}}`` is
(A - B) - (C - D), taken per cold start like any contrast (for example R3 - R2 off-policy minus R3 - R2 on-policy)::

      primary:   [{arm: grpo_r3_mb4, vs: grpo_r2_mb4, minus: {arm: grpo_r3_mb1, vs: grpo_r2_mb1}}]

Arm names are arm bases (the name before ``__``). Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moe_lab.config import ConfigError

ROLES = ("primary", "secondary")
COLLAPSE = "collapse"
"""``endpoint:`` of a contrast of collapse rates (the name endpoints.tertiary gives the endpoint)"""


@dataclass(frozen=True)
class Blocks:
    field: str
    """dotted config field that defines a block (model.seed: the cold start)"""
    seeds: dict[Any, list[int]]
    """block value -> the RL seeds run from it (disjoint across blocks)"""

    def cells(self, only: list[int] | None = None) -> list[tuple[Any, int]]:
        """(block value, seed) in running order: the i-th seed of every block, then the (i+1)-th, so an
        experiment stopped part-way holds the same number of seeds in every cold start."""
        depth = max(len(s) for s in self.seeds.values())
        order = [(v, s[i]) for i in range(depth) for v, s in self.seeds.items() if i < len(s)]
        return [(v, s) for v, s in order if only is None or s in only]


@dataclass(frozen=True)
class Contrast:
    arm: str
    """arm base whose endpoint is the minuend (arm - vs)"""
    vs: str
    """arm base subtracted"""
    role: str
    """primary (Holm-adjusted together) or secondary (reported, unadjusted)"""
    margin: float | None = None
    """equivalence margin: TOST of |arm - vs| < margin; None = difference test only"""
    minus: tuple[str, str] | None = None
    """(arm, vs) of a second difference subtracted: the interaction (arm - vs) - (minus.arm - minus.vs)"""
    endpoint: str | None = None
    """COLLAPSE: the collapse rate; None: the primary and secondary endpoints"""

    def weights(self) -> dict[str, float]:
        """arm base -> its weight in the contrast: +1, -1 (and -1, +1 for the subtracted difference)."""
        out = {self.arm: 1.0, self.vs: -1.0}
        if self.minus:
            out.update({self.minus[0]: -1.0, self.minus[1]: 1.0})
        return out

    def sides(self) -> tuple[str, str]:
        """How the two sides read in a table: the arm names, or "(A − B)" and "(C − D)" for an interaction."""
        if not self.minus:
            return self.arm, self.vs
        return f"({self.arm} − {self.vs})", f"({self.minus[0]} − {self.minus[1]})"


def _seed_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value)


def blocks_spec(exp: dict | None) -> Blocks | None:
    """The ``blocks:`` block checked (one ConfigError naming the key), or None when the file has none."""
    block = (exp or {}).get("blocks")
    if block is None:
        return None
    if not isinstance(block, dict) or set(block) != {"field", "seeds"}:
        raise ConfigError(f"blocks: expected a mapping with keys field, seeds, got {block!r}")
    if exp.get("seeds") is not None:
        raise ConfigError("experiment: 'blocks' and 'seeds' exclude each other (blocks.seeds names every seed)")
    field, seeds = block["field"], block["seeds"]
    if not isinstance(field, str) or "." not in field:
        raise ConfigError(f"blocks.field: expected a dotted config field such as model.seed, got {field!r}")
    if not isinstance(seeds, dict) or not seeds or not all(map(_seed_list, seeds.values())):
        raise ConfigError(f"blocks.seeds: expected a mapping block value -> non-empty list of integers >= 0, "
                          f"got {seeds!r}")
    flat = [s for listed in seeds.values() for s in listed]
    if len(set(flat)) != len(flat):
        raise ConfigError("blocks.seeds: a seed appears twice; every block runs seeds of its own")
    return Blocks(field, {k: list(v) for k, v in seeds.items()})


def _arm_name(where: str, value: Any, arms: set[str]) -> str:
    if arms and value not in arms:
        raise ConfigError(f"{where}={value!r}: no such arm; allowed: {', '.join(sorted(arms))}")
    return str(value)


def _minus(where: str, item: Any, arms: set[str]) -> tuple[str, str] | None:
    if item is None:
        return None
    if not isinstance(item, dict) or set(item) != {"arm", "vs"}:
        raise ConfigError(f"{where}.minus: expected {{arm: C, vs: D}} (the difference subtracted), got {item!r}")
    return _arm_name(f"{where}.minus.arm", item["arm"], arms), _arm_name(f"{where}.minus.vs", item["vs"], arms)


def _contrast(role: str, item: Any, arms: set[str]) -> Contrast:
    where = f"contrasts.{role}"
    if not isinstance(item, dict) or not {"arm", "vs"} <= set(item) \
            or set(item) - {"arm", "vs", "minus", "equivalence_margin", "endpoint"}:
        raise ConfigError(f"{where}: expected entries {{arm: A, vs: B[, minus: {{arm: C, vs: D}}]"
                          f"[, equivalence_margin: m][, endpoint: {COLLAPSE}]}}, got {item!r}")
    arm, vs = (_arm_name(f"{where}.{key}", item[key], arms) for key in ("arm", "vs"))
    if arm == vs:
        raise ConfigError(f"{where}: arm and vs are both {arm!r}")
    minus = _minus(where, item.get("minus"), arms)
    if minus and len({arm, vs, *minus}) != 4:
        raise ConfigError(f"{where}: an interaction names four different arms (arm, vs, minus.arm, minus.vs), "
                          f"got {arm!r}, {vs!r}, {minus[0]!r}, {minus[1]!r}")
    margin = item.get("equivalence_margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not 0 < margin < math.inf):
        raise ConfigError(f"{where}.equivalence_margin: allowed a number > 0, got {margin!r}")
    endpoint = item.get("endpoint")
    if endpoint is not None and endpoint != COLLAPSE:
        raise ConfigError(f"{where}.endpoint={endpoint!r}: allowed {COLLAPSE!r} (the collapse rate); without it the "
                          "contrast is on the primary and secondary endpoints")
    widest = 2 if minus else 1  # the largest |difference| of collapse rates the contrast can take
    if endpoint == COLLAPSE and margin is not None and margin >= widest:
        raise ConfigError(f"{where}.equivalence_margin={margin!r}: a contrast of collapse rates lies within "
                          f"[-{widest}, {widest}], so this margin holds whatever the runs show; allowed a number in "
                          f"(0, {widest})")
    return Contrast(arm, vs, role, None if margin is None else float(margin), minus, endpoint)


def contrasts_spec(exp: dict | None) -> list[Contrast]:
    """The declared contrasts (primary first), checked against the file's arms; [] when none are declared."""
    block = (exp or {}).get("contrasts")
    if block is None:
        return []
    if not isinstance(block, dict) or not block or set(block) - set(ROLES):
        raise ConfigError(f"contrasts: expected a mapping with keys {', '.join(ROLES)}, got {block!r}")
    arms = {str(a).split("__", 1)[0] for a in ((exp or {}).get("arms") or {})}
    out = []
    for role in ROLES:
        items = block.get(role) or []
        if not isinstance(items, list):
            raise ConfigError(f"contrasts.{role}: expected a list of {{arm: A, vs: B}}, got {items!r}")
        out += [_contrast(role, item, arms) for item in items]
    return out


def check_tost_named(text: str, exp: dict | None, where: str) -> None:
    """An experiment file whose text names TOST must declare the margin it is tested at (``equivalence_margin``
    on a contrast), fixed before the runs: a margin chosen after seeing the data would tune the test. One
    ConfigError naming the file and the field."""
    if "TOST" in text and not any(c.margin is not None for c in contrasts_spec(exp)):
        raise ConfigError(f"{where}: names TOST but no contrast declares contrasts.<role>[].equivalence_margin; "
                          "declare the margin before the runs, or remove the TOST naming")


@dataclass(frozen=True)
class Describe:
    metrics: tuple[str, ...]
    """metrics-table columns summarised descriptively (no test): per-run means over each window"""
    windows: dict[str, tuple[int, int]]
    """label -> (first, last) RL step, both included (0-based metrics steps)"""


def describe_spec(exp: dict | None) -> Describe | None:
    """The ``describe:`` block (descriptive routing and mismatch tables of `moe-lab report`), checked::

        describe:
          metrics: [mismatch/k3, routing/load_max_violation]
          windows: {step 0: [0, 0], last 25%: [75, 99]}

    None when the file has none. It changes no cell: the runs are the same with or without it."""
    block = (exp or {}).get("describe")
    if block is None:
        return None
    if not isinstance(block, dict) or set(block) != {"metrics", "windows"}:
        raise ConfigError(f"describe: expected a mapping with keys metrics, windows, got {block!r}")
    metrics, windows = block["metrics"], block["windows"]
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) and m for m in metrics):
        raise ConfigError(f"describe.metrics: expected a non-empty list of metric names, got {metrics!r}")
    ok = isinstance(windows, dict) and windows and all(
        isinstance(w, list) and len(w) == 2 and all(isinstance(s, int) and not isinstance(s, bool) for s in w)
        and 0 <= w[0] <= w[1] for w in windows.values())
    if not ok:
        raise ConfigError(f"describe.windows: expected a mapping label -> [first step, last step] (0 <= first <= "
                          f"last), got {windows!r}")
    return Describe(tuple(metrics), {str(k): (int(v[0]), int(v[1])) for k, v in windows.items()})


def verdict_of(exp: dict | None) -> str | None:
    """The experiment's ``verdict:`` (a short conclusion, written after its runs, printed by `moe-lab report` under
    "Conclusion" once every number in it is found in the report's tables); None when it has none."""
    verdict = (exp or {}).get("verdict")
    if verdict is not None and (not isinstance(verdict, str) or not verdict.strip()):
        raise ConfigError(f"verdict: expected a non-empty text, got {verdict!r}")
    return verdict.strip() if verdict else None
