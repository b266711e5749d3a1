"""A run's harness alarm (pure Python): a setting of the harness that shapes the run more than the published
runs it imitates, read from the run's own update rows, in the style of "Probe the Harness" (arXiv:2610.02911).

Rules (docs/metrics.md, "Harness alarm"):

- ``grad_clip_binds``: ``rl.grad_clip`` binds (``optim/grad_norm`` > ``rl.grad_clip``: torch's
  ``clip_grad_norm_`` scaled the gradient down) on more than GRAD_CLIP_SHARE_MAX of the run's updates. In
  published MoE runs the norm sits far below the clip, which catches spikes only; a clip that binds this often
  is a stabiliser they do not have.
- ``ratio_clip_silent``: an objective with a clipped surrogate (``constants.PPO_CLIP_ALGOS``) whose clip never
  fired: ``clip_frac/active`` is 0 on every update (e.g. one mini-batch per rollout batch, where every update
  is on-policy and the ratio is 1): the clip the run names is not part of it.

The run writes the alarm into its manifest (``harness_alarm``: one line per rule that fired, [] when none) and
prints it; readers of runs written without the field compute it here from their metrics, with the same rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from moe_lab.config import RLConfig
from moe_lab.config.constants import PPO_CLIP_ALGOS

GRAD_CLIP_SHARE_MAX = 0.25
MANIFEST_KEY = "harness_alarm"


def rl_field(rl, key: str):
    """A field of an RLConfig, or of a config dict's ``rl`` section (its default where the dict lacks it)."""
    default = RLConfig.__dataclass_fields__[key].default
    return rl.get(key, default) if isinstance(rl, Mapping) else getattr(rl, key, default)


def clip_binds(grad_norm: float, grad_clip: float) -> bool:
    """Whether ``rl.grad_clip`` scaled this update's gradient (0 = off: never)."""
    return grad_clip > 0 and math.isfinite(grad_norm) and grad_norm > grad_clip


def clip_share(grad_norms: Iterable[float], grad_clip: float) -> tuple[int, int]:
    """(updates on which the clip binds, updates with a finite gradient norm)."""
    norms = [float(g) for g in grad_norms if g is not None and math.isfinite(float(g))]
    return sum(clip_binds(g, grad_clip) for g in norms), len(norms)


def alarm(rows: Iterable[Mapping], rl) -> list[str]:
    """One line per rule that fires on a run's update rows (metrics.parquet's rows; [] = no alarm). ``rl``: the
    run's RLConfig or its config dict's ``rl`` section."""
    rows = list(rows)
    out = []
    grad_clip = float(rl_field(rl, "grad_clip"))
    bound, n = clip_share((r.get("optim/grad_norm") for r in rows), grad_clip)
    if n and bound / n > GRAD_CLIP_SHARE_MAX:
        out.append(f"grad_clip_binds: rl.grad_clip={grad_clip:g} binds on {bound} of {n} updates "
                   f"({bound / n:.0%} > {GRAD_CLIP_SHARE_MAX:.0%})")
    clipped = [float(r["clip_frac/active"]) for r in rows if r.get("clip_frac/active") is not None]
    clipped = [c for c in clipped if math.isfinite(c)]
    algo = rl_field(rl, "algo")
    if algo in PPO_CLIP_ALGOS and clipped and not any(clipped):
        out.append(f"ratio_clip_silent: rl.algo={algo}'s ratio clip never fired in {len(clipped)} updates "
                   "(clip_frac/active 0 on every one)")
    return out


def manifest(rows: Iterable[Mapping], rl) -> dict:
    """The manifest's field."""
    return {MANIFEST_KEY: alarm(rows, rl)}


def recorded(manifest_: Mapping) -> list[str] | None:
    """The alarm a manifest records (None: a manifest without the field)."""
    value = manifest_.get(MANIFEST_KEY)
    return None if value is None else list(value)
