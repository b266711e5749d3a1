"""One declaration per objective (moe_lab/config/objective_specs.py): a row that forgets a trait, a row without a
function and a function without a row all fail when the module is built, not later in a run."""

import dataclasses

import pytest

from moe_lab import config
from moe_lab.config import constants as C
from moe_lab.algos.objectives import OBJECTIVES, ObjectiveRegistry, grpo, knob_names
from moe_lab.config.objective_specs import OBJECTIVE_SPECS, Knob, Knobs, ObjectiveSpec, knob_fields, spec_table

TRAITS = dict(ppo_clip=False, clip_low_unbounded=False, token_clip=False, sequence_level=False)


@pytest.mark.parametrize("trait", sorted(TRAITS))
def test_a_row_that_forgets_a_trait_is_refused(trait):
    traits = {k: v for k, v in TRAITS.items() if k != trait}
    with pytest.raises(TypeError, match=trait):
        ObjectiveSpec("toy", "Toy", (0.2, 0.2), **traits)
    with pytest.raises(TypeError, match="trait"):  # a trait is True or False, not a truthy stand-in
        ObjectiveSpec("toy", "Toy", (0.2, 0.2), **{**TRAITS, trait: 1})


def test_a_paper_clip_out_of_range_is_refused():
    with pytest.raises(ValueError, match="paper_clip"):
        ObjectiveSpec("toy", "Toy", (1.0, 0.2), **TRAITS)  # clip_low 1 needs clip_low_unbounded
    ObjectiveSpec("toy", "Toy", (1.0, 0.2), **{**TRAITS, "clip_low_unbounded": True})


def test_registry_needs_one_function_per_row():
    specs = spec_table((ObjectiveSpec("toy", "Toy", (0.2, 0.2), **TRAITS), ObjectiveSpec("toy2", "Toy 2", (0.2, 0.2), **TRAITS)))
    registry = ObjectiveRegistry(specs)
    with pytest.raises(ValueError, match="no row"):
        registry.register("not_a_row")
    registry.register("toy")(grpo)
    with pytest.raises(ValueError, match="twice"):
        registry.register("toy")
    with pytest.raises(ValueError, match="toy2"):
        registry.complete()
    registry.register("toy2")(grpo)
    assert list(registry.complete()) == ["toy", "toy2"]


def test_spec_table_refuses_a_repeated_name_or_a_knob_field_declared_twice():
    row = ObjectiveSpec("toy", "Toy", (0.2, 0.2), **TRAITS)
    with pytest.raises(ValueError, match="twice"):
        spec_table((row, row))
    knobs = Knobs("toy", (Knob("tau", 1.0, "help", gt=0.0),))
    again = Knobs("toy", (Knob("tau", 2.0, "other help", gt=0.0),))
    with pytest.raises(ValueError, match="toy_tau"):
        spec_table((ObjectiveSpec("a", "Toy A", (0.2, 0.2), **TRAITS, knobs=knobs),
                    ObjectiveSpec("b", "Toy B", (0.2, 0.2), **TRAITS, knobs=again)))


def test_constants_registry_and_config_follow_the_rows():
    """The derived names hold exactly the rows with each trait, and every knob is an RLConfig field carrying
    its declaration (default, help, bounds) in the rows' order, right after rl.dual_clip_c."""
    assert tuple(OBJECTIVES) == C.ALGOS == tuple(OBJECTIVE_SPECS)
    for trait, names in (("ppo_clip", C.PPO_CLIP_ALGOS), ("clip_low_unbounded", C.CLIP_LOW_UNBOUNDED),
                         ("token_clip", C.TOKEN_CLIP_ALGOS)):
        assert set(names) == {n for n, s in OBJECTIVE_SPECS.items() if getattr(s, trait)}
    fields = [f.name for f in dataclasses.fields(config.RLConfig)]
    knobs = knob_fields(OBJECTIVE_SPECS)
    start = fields.index("dual_clip_c") + 1
    assert fields[start:start + len(knobs)] == list(knobs)
    by_name = {f.name: f for f in dataclasses.fields(config.RLConfig)}
    for name, knob in knobs.items():
        meta = by_name[name].metadata
        assert (by_name[name].default, meta["help"]) == (knob.default, knob.help)
        assert {k: meta[k] for k in ("gt", "ge", "le", "lt")} == knob.bounds()
    assert [n for a in OBJECTIVES for n in knob_names(a)] == ["sapo_tau_pos", "sapo_tau_neg", "rspo_floor",
                                                              "dppo_ratio_cap", "dppo_ratio_cap", "vespo_k_pos",
                                                              "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"]
