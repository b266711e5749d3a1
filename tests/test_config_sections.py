"""The sections of rl (moe_lab/config/rl.py, built by moe_lab/config/sections.py): each field declared in one
section class, a name declared in two refused at import, each section's fields together in RLConfig, and a
section's view the section's own frozen class carrying the config's values."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from moe_lab.config import RL_SECTIONS, RLConfig, apply_overrides, from_dict, validate
from moe_lab.config.fields import param
from moe_lab.config.sections import flat, section


def _section(label: str, *fields: str) -> type:
    cls = type(label.upper(), (), {"__annotations__": {f: "int" for f in fields}, **{f: param(0, f) for f in fields}})
    return section(label)(cls)


def test_a_name_declared_in_two_sections_is_refused():
    x, y = _section("x", "a", "b"), _section("y", "c")
    toy = flat("Toy", (x, y), "toy", __name__)
    assert [f.name for f in dataclasses.fields(toy)] == ["a", "b", "c"]
    assert toy.SECTION_OF == {"a": "x", "b": "x", "c": "y"} and toy(c=3).section("y") == y(c=3)
    with pytest.raises(TypeError, match=r"Toy\.b: declared in section 'x' and 'y'"):
        flat("Toy", (x, _section("y", "b")), "toy", __name__)


def test_each_section_s_fields_sit_together_and_every_field_has_one():
    names = [f.name for f in dataclasses.fields(RLConfig)]
    runs = [s for s, _ in itertools.groupby(RLConfig.SECTION_OF[n] for n in names)]
    assert runs == [s.SECTION for s in RL_SECTIONS]  # one run of fields per section, in the declared order
    assert names == [f.name for s in RL_SECTIONS for f in dataclasses.fields(s)]


def test_a_section_s_view_is_its_frozen_class_with_the_config_s_values():
    rl = validate(from_dict(apply_overrides({}, ["model.family=deepseek_v3", "rl.bias_update_rate=0.25",
                                                "rl.collapse_window=7", "rl.algo=gspo"]))).rl
    seen = []
    for cls in RL_SECTIONS:
        view = rl.section(cls.SECTION)
        assert type(view) is cls
        values = dataclasses.asdict(view)
        assert all(values[f] == getattr(rl, f) for f in values)
        seen += list(values)
    assert sorted(seen) == sorted(f.name for f in dataclasses.fields(RLConfig))
    assert rl.section("bias").bias_update_rate == 0.25 and rl.section("collapse").collapse_window == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        rl.section("bias").bias_update_rate = 1.0
    with pytest.raises(KeyError, match="allowed: objective"):
        rl.section("optimizer")
