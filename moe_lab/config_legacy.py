"""Reading a run folder's config.yaml written by older code: the values it ran with for fields added since.

Kept apart from moe_lab.config (the dataclasses and their validation): only the runner's config check, the results
tables and the trackers read old run folders.
"""

from __future__ import annotations

import yaml

# A run folder's config.yaml lists every field of the code that wrote it, so a field it lacks was added later.
# A new field's default normally does what the older code did; these did not (the new default changes results),
# and a config.yaml written before the field existed ran with the value given here.
LEGACY_VALUES = {"rl.rollout_seeding": "sequential"}  # plain runs before 2026-11-30 (moe_lab/rl/groups.py)


def upgrade_run_config(data: dict) -> dict:
    """A run folder's config.yaml as the current code reads it: fields added since it was written take the value
    it ran with (LEGACY_VALUES), else their default (from_dict). Not for user configs: a field a user leaves out
    means its default."""
    out = yaml.safe_load(yaml.safe_dump(data or {}))
    for key, value in LEGACY_VALUES.items():
        section, name = key.split(".")
        if isinstance(out.get(section), dict) and name not in out[section]:
            out[section][name] = value
    return out
