"""The README's config table is the one generated from the dataclasses, and every logged metric is documented."""

from __future__ import annotations

import re
from pathlib import Path

from moe_lab.cli import _config_table
from moe_lab.losses import policy_loss
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_readme_config_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert _config_table() in readme, "regenerate it: moe-lab config, and paste it into README.md"


def test_every_policy_metric_is_in_the_metric_table():
    table = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`([a-z_]+/[a-z_{}0-9/]+)`", table))
    B, T = 2, 3
    _, metrics = policy_loss(torch.zeros(B, T), torch.zeros(B, T), torch.ones(B), torch.ones(B, T),
                             algo="grpo", clip_low=0.2, clip_high=0.2)
    missing = sorted(set(metrics) - documented)
    assert not missing, f"undocumented metrics: {missing}"
