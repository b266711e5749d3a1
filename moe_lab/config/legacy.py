"""Reading a run folder's config.yaml that lacks some of today's fields: the values it ran with for them.

Committed run folders (results/reference/*, the findings' experiments) must keep loading and comparing equal to
the config that would re-run them, or `moe-lab verify` and resuming them break. Kept apart from moe_lab.config
(the dataclasses and their validation): only the runner's config check, the results tables and the trackers read
run folders.
"""

from __future__ import annotations

import yaml

# A run folder's config.yaml lists every field of the code that wrote it, so a field it lacks did not exist there.
# A field's default normally does what that code did; these do not (their default changes results), so a
# config.yaml without the field ran with the value given here.
LEGACY_VALUES = {"rl.rollout_seeding": "sequential"}  # the committed references' plain runs (moe_lab/rl/groups.py)


def upgrade_run_config(data: dict) -> dict:
    """A run folder's config.yaml as the current code reads it: fields it lacks take the value
    it ran with (LEGACY_VALUES), else their default (from_dict). Not for user configs: a field a user leaves out
    means its default."""
    out = yaml.safe_load(yaml.safe_dump(data or {}))
    for key, value in LEGACY_VALUES.items():
        section, name = key.split(".")
        if isinstance(out.get(section), dict) and name not in out[section]:
            out[section][name] = value
    return out
