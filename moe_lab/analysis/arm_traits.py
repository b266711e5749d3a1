"""An arm's traits, read from its runs' config (rl.algo, rl.replay, rl.rollout_correction and the flags below),
never from its name: its label, colour and order in figures, built from the objective and mode tables as an arm
preset's are (launch/compose.py), and the roles the analysis gives arms (the baseline every gap is taken to, the
treatments of the replay map, the atlas's reference). Reads frames only (moe_lab.analysis.results)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from moe_lab.analysis.tables import base_arm
from moe_lab.config.constants import BASELINE_ALGO, NO_CORRECTION, NO_REPLAY
from moe_lab.config.mode_specs import OLD_FORWARD, REPLAY_SPECS, ROLLOUT_CORRECTION_SPECS
from moe_lab.config.objective_specs import OBJECTIVE_SPECS
from moe_lab.launch.compose import preset_color, preset_label, preset_name

# A boolean config field that makes an arm more than its objective and modes: its words in the label and the
# colour it takes instead (R2 that also replays the gate weights: experiments/router_learns.yaml).
FLAGS = {"rl.replay_gate_weights": ("gate weights", "#8F5F00")}
# each trait's column, and the column of the run manifest's copy where an older frame has no config column
COLUMNS = {"algo": ("rl.algo", "algo"), "replay": ("rl.replay", "replay"),
           "correction": ("rl.rollout_correction", None)}


@dataclass(frozen=True)
class ArmTraits:
    algo: str
    replay: str
    correction: str
    flags: tuple[str, ...] = ()  # the FLAGS columns set in its config

    @property
    def preset(self) -> str:
        """The arm preset of its objective and modes ('grpo_r2'): what an arm's name extends by a variant tag."""
        return preset_name(self.algo, self.replay, self.correction)

    @property
    def label(self) -> str:
        return " + ".join([preset_label(self.algo, self.replay, self.correction), *(FLAGS[f][0] for f in self.flags)])

    @property
    def color(self) -> str | None:
        flagged = [FLAGS[f][1] for f in self.flags]
        return flagged[0] if flagged else preset_color(self.algo, self.replay, self.correction)

    @property
    def order(self) -> tuple:
        """Arms without a correction or flag first (the paper's GRPO, + R2, + R3, GSPO, GSPO-token), each group in
        the tables' order: objective, then replay, then correction rows."""
        return (self.corrected, self.flags, list(OBJECTIVE_SPECS).index(self.algo),
                list(REPLAY_SPECS).index(self.replay), list(ROLLOUT_CORRECTION_SPECS).index(self.correction))

    @property
    def replays(self) -> bool:
        return REPLAY_SPECS[self.replay].replays

    @property
    def corrected(self) -> bool:
        return ROLLOUT_CORRECTION_SPECS[self.correction].active

    @property
    def plain(self) -> bool:
        """No replay, no correction, no flag: the objective alone."""
        return not (self.replays or self.corrected or self.flags)


def _column(df: pd.DataFrame, names: tuple[str, str | None]) -> pd.Series | None:
    found = [df[n] for n in names if n is not None and n in df.columns]
    if not found:
        return None
    return found[0].fillna(found[1]) if len(found) > 1 else found[0]


def traits_of(df: pd.DataFrame) -> dict[str, ArmTraits]:
    """arm -> its traits from its runs' config, for each arm (the ``arm`` column) and each base arm
    ('grpo_r2' of 'grpo_r2__depth=4', tables.base_arm) whose arms share one set; an arm whose config names no
    row of the tables (or a frame without the config columns) has none."""
    if "arm" not in df.columns:
        return {}
    cols = {k: _column(df, names) for k, names in COLUMNS.items()}
    if cols["algo"] is None:
        return {}
    arms = df["arm"]
    first = np.flatnonzero((~arms.duplicated() & arms.notna()).to_numpy())  # an arm's runs share its config
    out: dict[str, ArmTraits] = {}
    for i in first:
        algo = cols["algo"].iloc[i]
        rep = NO_REPLAY if cols["replay"] is None or pd.isna(cols["replay"].iloc[i]) else cols["replay"].iloc[i]
        corr = NO_CORRECTION if cols["correction"] is None or pd.isna(cols["correction"].iloc[i]) \
            else cols["correction"].iloc[i]
        if algo in OBJECTIVE_SPECS and rep in REPLAY_SPECS and corr in ROLLOUT_CORRECTION_SPECS:
            flags = tuple(f for f in FLAGS if f in df.columns and isinstance(df[f].iloc[i], (bool, np.bool_))
                          and bool(df[f].iloc[i]))
            out[str(arms.iloc[i])] = ArmTraits(algo, rep, corr, flags)
    bases: dict[str, set] = {}
    for arm, traits in out.items():
        bases.setdefault(base_arm(arm), set()).add(traits)
    out.update({base: next(iter(ts)) for base, ts in bases.items() if len(ts) == 1 and base not in out})
    return out


def is_baseline(t: ArmTraits) -> bool:
    """The arm every gap is measured against: the baseline objective (GRPO) alone."""
    return t.algo == BASELINE_ALGO and t.plain


def is_replay_of_baseline(t: ArmTraits) -> bool:
    """The baseline objective with Routing Replay alone (GRPO + R2, R3, ...)."""
    return t.algo == BASELINE_ALGO and t.replays and not (t.corrected or t.flags)


def is_sequence_ratio_clip(t: ArmTraits) -> bool:
    """A PPO-clip objective clipping a sequence ratio (GSPO's family), alone: the other rescue the paper names."""
    spec = OBJECTIVE_SPECS[t.algo]
    return spec.ppo_clip and not spec.token_clip and t.plain


def is_atlas_reference(t: ArmTraits) -> bool:
    """The atlas's reference: the baseline objective replaying the old policy's routing (GRPO + R2)."""
    return t.algo == BASELINE_ALGO and REPLAY_SPECS[t.replay].forces == OLD_FORWARD and not t.corrected \
        and not t.flags


def arms_where(arms, traits: dict[str, ArmTraits], role) -> list[str]:
    """The arms (names) whose traits hold ``role``, in the tables' order (then by name)."""
    found = [a for a in dict.fromkeys(map(str, arms)) if a in traits and role(traits[a])]
    return sorted(found, key=lambda a: (traits[a].order, a))


def base_arm_where(df: pd.DataFrame, role) -> str | None:
    """The first base arm of the frame (tables' order) whose traits hold ``role``; None when none does."""
    if "arm" not in df.columns:
        return None
    found = arms_where(df["arm"].dropna().map(base_arm).unique(), traits_of(df), role)
    return found[0] if found else None
