"""docs/extending.md's recipe "A new model family", done: the page's code blocks applied, as written, at the places
it names in a copy of the package; in a fresh interpreter the new family (FlexOlmo, OLMoE's router) is a
validated model.family whose select()/gate_weights() reproduce transformers' router bit for bit and whose
routes record and replay bit-exactly; half a family fails at import."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from recipes import block, copy_package, insert, run_python


def _before_close(path: Path, opener: str, closer: str, text: str, skip: int = 0) -> None:
    """Put ``text`` at the first ``closer`` after ``opener`` (``skip`` characters into it): the end of the
    tuple or dict the recipe names."""
    source = path.read_text(encoding="utf-8")
    assert source.count(opener) == 1, f"{path.name}: the recipe's place {opener!r} is not there exactly once"
    at = source.index(closer, source.index(opener)) + skip
    path.write_text(source[:at] + text + source[at:], encoding="utf-8")


def _add_row(pkg: Path) -> None:
    """Steps 1-3: the classes, the tiny config and the row, in the softmax routers' module."""
    kind = pkg / "models" / "families" / "softmax.py"
    lines = kind.read_text(encoding="utf-8").splitlines()
    last_import = [line for line in lines if line.startswith("from transformers")][-1]
    insert(kind, last_import + "\n", block("family-imports"), before=False)
    insert(kind, "SOFTMAX_FAMILIES: tuple[FamilySpec, ...] = (", block("family-config") + "\n\n", before=True)
    _before_close(kind, "SOFTMAX_FAMILIES: tuple[FamilySpec, ...] = (", "\n)\n", block("family-row"), skip=1)


def _add_name(pkg: Path, lists: tuple[str, ...] = ("FAMILIES", "NORM_TOPK_FAMILIES")) -> None:
    """Step 4: the last name of constants.FAMILIES and NORM_TOPK_FAMILIES."""
    for tuple_name in lists:
        _before_close(pkg / "config" / "constants.py", f"\n{tuple_name} = (", ")", ", " + block("family-name").strip())


FAMILY_CHECK = textwrap.dedent("""
    import dataclasses, sys
    import torch
    import moe_lab
    assert moe_lab.__file__.startswith(sys.argv[1]), moe_lab.__file__  # the copy, not the checkout
    from transformers import FlexOlmoForCausalLM
    from transformers.models.flex_olmo.modeling_flex_olmo import FlexOlmoTopKRouter
    from moe_lab.config import constants as C
    from moe_lab.config import from_dict, validate
    from moe_lab.formats.layers import moe_layer_indices
    from moe_lab.models import build_model, moe_layers
    from moe_lab.models.families import FAMILIES, family_of_model_type
    from moe_lab.routing import record, replay

    assert list(FAMILIES)[-1] == C.FAMILIES[-1] == "flex_olmo" == C.NORM_TOPK_FAMILIES[-1]
    assert family_of_model_type("flex_olmo") is FAMILIES["flex_olmo"]
    tiny = dict(family="flex_olmo", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, num_experts=8,
                top_k=2, moe_intermediate_size=16, intermediate_size=32, max_positions=64)
    cfg = validate(from_dict({"model": {**tiny, "norm_topk_prob": True}})).model
    model, spec = build_model(cfg, 16), FAMILIES["flex_olmo"]
    layers = moe_layers(model)
    assert type(model) is FlexOlmoForCausalLM and [layer.layer_idx for layer in layers] == [0, 1]
    assert all(type(layer.router) is FlexOlmoTopKRouter and layer.router.norm_topk_prob for layer in layers)
    assert moe_layer_indices(model.config) == [0, 1]  # check-trace numbers its layers as moe_layers() does

    def tokens(seed):
        return torch.randint(3, 16, (3, 7), generator=torch.Generator().manual_seed(seed))

    seen = []
    hooks = [layer.router.register_forward_hook(lambda mod, inp, out: seen.append((mod, out))) for layer in layers]
    with torch.no_grad():
        plain = model(tokens(0)).logits
    for hook in hooks:
        hook.remove()
    for router, (logits_NE, weights_NK, ids_NK) in seen:
        sel_w, sel_ids = spec.select(router, logits_NE)
        assert torch.equal(sel_ids, ids_NK) and torch.equal(sel_w, weights_NK)
        assert torch.equal(spec.gate_weights(router, logits_NE, ids_NK), weights_NK)

    with torch.no_grad(), record(model) as trace:
        recorded = model(tokens(0)).logits
    assert torch.equal(recorded, plain) and trace.family == "flex_olmo" and trace.shape == (2, 3, 7, 2)
    with torch.no_grad(), replay(model, trace) as handle:
        assert torch.equal(model(tokens(0)).logits, plain)
    assert torch.equal(handle.latent.indices, trace.indices) and torch.equal(handle.latent.weights, trace.weights)
    with torch.no_grad(), record(model) as other:
        model(tokens(5))
    with torch.no_grad(), replay(model, other) as handle:
        forced = model(tokens(0)).logits
    assert not torch.equal(forced, plain)  # the replayed routes are in force
    assert torch.equal(handle.latent.indices[0], trace.indices[0])  # layer 0's router still wants its own choice

    # model.norm_topk_prob reaches the router: same weights, same choice, unnormalised gate weights
    unnormed = build_model(dataclasses.replace(cfg, norm_topk_prob=False), 16)
    with torch.no_grad(), record(unnormed) as raw:
        unnormed(tokens(0))
    assert torch.equal(raw.indices[0], trace.indices[0]) and not torch.equal(raw.weights[0], trace.weights[0])
    print("flex_olmo ok")
""")


def test_the_new_family_recipe(tmp_path):
    pkg = copy_package(tmp_path)
    _add_row(pkg)
    _add_name(pkg)
    _before_close(pkg / "formats" / "layers.py", "IS_MOE_LAYER: dict", "\n}\n", block("family-layers"), skip=1)
    done = run_python(tmp_path, ["-c", FAMILY_CHECK, str(pkg)])
    assert done.returncode == 0 and "flex_olmo ok" in done.stdout, done.stderr


@pytest.mark.parametrize("missing", ["row", "name", "norm_topk"])
def test_half_a_new_family_fails_at_import(tmp_path, missing):
    pkg = copy_package(tmp_path)
    if missing != "row":
        _add_row(pkg)
    if missing != "name":  # norm_topk: named in FAMILIES only, though its HF config has the switch
        _add_name(pkg, ("FAMILIES",) if missing == "norm_topk" else ("FAMILIES", "NORM_TOPK_FAMILIES"))
    done = run_python(tmp_path, ["-c", "import moe_lab.models.families"])
    assert done.returncode != 0 and "flex_olmo" in done.stderr.strip().splitlines()[-1], done.stderr
