"""The sections of rl (moe_lab/config/sections.py): a class whose fields are not each in exactly one section is
refused at import, and a section's view carries the config's own values."""

from __future__ import annotations

import dataclasses

import pytest

from moe_lab.config import RLConfig, apply_overrides, from_dict, validate
from moe_lab.config.sections import RL_SECTIONS, sectioned


def _toy(sections, extra=None):
    @sectioned(sections, extra or {})
    @dataclasses.dataclass
    class Toy:
        a: int = 0
        b: int = 0
        c: int = 0
    return Toy


def test_a_field_in_no_section_or_in_two_is_refused():
    assert _toy({"x": ("", ("a", "b")), "y": ("", ("c",))}).SECTION_OF == {"a": "x", "b": "x", "c": "y"}
    with pytest.raises(TypeError, match=r"without one: \['c'\]"):
        _toy({"x": ("", ("a", "b"))})
    with pytest.raises(TypeError, match=r"twice: \['b'\]"):
        _toy({"x": ("", ("a", "b")), "y": ("", ("b", "c"))})
    with pytest.raises(TypeError, match=r"unknown: \['d'\]"):
        _toy({"x": ("", ("a", "b", "c"))}, {"x": ("d",)})


def test_every_rl_field_has_one_section_and_its_view_carries_the_values():
    rl = validate(from_dict(apply_overrides({}, ["model.family=deepseek_v3", "rl.bias_update_rate=0.25",
                                                "rl.collapse_window=7",
                                                "rl.algo=gspo"]))).rl
    seen = []
    for name in RL_SECTIONS:
        view = rl.section(name)
        values = dataclasses.asdict(view)
        assert all(values[f] == getattr(rl, f) for f in values)
        seen += list(values)
    assert sorted(seen) == sorted(f.name for f in dataclasses.fields(RLConfig))
    assert rl.section("bias").bias_update_rate == 0.25 and rl.section("collapse").collapse_window == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        rl.section("bias").bias_update_rate = 1.0
    with pytest.raises(KeyError, match="allowed: objective"):
        rl.section("optimizer")
