"""The declared interface of a batch split (moe_lab/rl/split.py): the plain run's SingleProcess / PlainRun and
torchrun's DataParallel supply every member of StepSplit / RunSplit, each method with the Protocol's parameters,
so the one loop and the one step never depend on which split they were given."""

from __future__ import annotations

import inspect

import pytest

from moe_lab.rl.loop import PlainRun
from moe_lab.rl.split import RunSplit, StepSplit
from moe_lab.rl.step import SingleProcess


def _members(protocol) -> dict[str, inspect.Signature | None]:
    """name -> the method's signature (None for a declared attribute) over the Protocol and its Protocol bases."""
    out: dict[str, inspect.Signature | None] = {}
    for cls in reversed(protocol.__mro__):
        if not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        out.update({name: None for name in vars(cls).get("__annotations__", {})})
        out.update({name: inspect.signature(value) for name, value in vars(cls).items()
                    if inspect.isfunction(value) and not name.startswith("_")})
    return out


def _differences(split: type, protocol) -> list[str]:
    """What ``split`` lacks of ``protocol``, or where its parameters differ (names and order)."""
    bad = []
    for name, signature in _members(protocol).items():
        if not hasattr(split, name):
            bad.append(f"{split.__name__} lacks {name}")
        elif signature is not None:
            got = list(inspect.signature(getattr(split, name)).parameters)
            if got != list(signature.parameters):
                bad.append(f"{split.__name__}.{name}{tuple(got)} != {protocol.__name__}.{name}"
                           f"{tuple(signature.parameters)}")
    return bad


def test_the_protocols_declare_the_thirteen_members():
    step = set(_members(StepSplit))
    assert step == {"trained", "collect", "schedule", "checked", "all_finite", "reduce"}
    assert set(_members(RunSplit)) - step == {"writer", "check", "setup", "resume_state", "broadcast", "barrier",
                                              "manifest_extra"}


@pytest.mark.parametrize("split, protocol", [(SingleProcess, StepSplit), (PlainRun, RunSplit)])
def test_the_plain_run_supplies_every_member(split, protocol):
    assert _differences(split, protocol) == []


def test_data_parallel_supplies_every_member():
    pytest.importorskip("torch.distributed")
    from moe_lab.rl.distributed import DataParallel

    assert _differences(DataParallel, RunSplit) == []


def test_a_split_missing_a_member_or_renaming_a_parameter_is_found():
    class Partial(SingleProcess):
        writer = True

        def check(self, config):  # renamed parameter
            """Not the Protocol's."""

    bad = _differences(Partial, RunSplit)
    assert "Partial.check('self', 'config') != RunSplit.check('self', 'cfg')" in bad
    assert {f"Partial lacks {name}" for name in ("setup", "resume_state", "broadcast", "barrier",
                                                  "manifest_extra")} <= set(bad)
