"""The MoE families moe_lab can build, load, record and replay: one registry, ``FAMILIES``, of one ``FamilySpec``
per transformers family, declared in the module of its router kind.

Every transformers MoE family routes through a router module that returns
``(router_logits_NE, topk_weights_NK, topk_ids_NK)`` and its experts consume whatever ids/weights the router
returns: that output is the seam routing record/replay hooks into. A family entry says how to build a tiny
config from :class:`~moe_lab.config.ModelConfig`, which module class is its router, and its router's
``select``/``gate_weights`` (``routers``: the choice function, bit-exact with the router's own output, and the
normalisation applied to given ids).

- ``spec``: ``FamilySpec`` and the tiny-config helpers all kinds share;
- ``routers``: the routers' choice functions, grouped by kind;
- ``softmax``: softmax routers (Qwen2/3-MoE, OLMoE, Mixtral, gpt-oss, Qwen3.5-MoE, Qwen3-Next, ERNIE-4.5);
- ``sigmoid``: sigmoid routers with a choice-only correction bias (DeepSeek-V3 and V3.2, GLM-4.5, dots1,
  MiniMax-M2);
- here: the registry, ``REFUSED`` (the families a router hook cannot serve, and why) and the look-ups.

A new family whose router works as an existing one's is code in 2 files: its tiny config and ``FamilySpec`` row
in its kind's module, and its name in ``constants.FAMILIES`` (the config's choices; also ``NORM_TOPK_FAMILIES`` /
``BIAS_FAMILIES`` where its router has the switch / the bias); a 3rd, ``formats/layers.py`` (its MoE-layer rule),
for ``check-trace`` / ``verify-replay`` on its real checkpoints; and docs/config.md's table regenerated
(docs/extending.md, "A new model family", gives the lines). A new router kind adds its ``select`` /
``gate_weights`` to ``routers`` and, for a new kind module, its tuple to the ``_registry`` call below.
``FAMILIES`` is built in ``constants.FAMILIES``' order and refuses at import a name declared on one side only,
or a ``NORM_TOPK_FAMILIES`` / ``BIAS_FAMILIES`` list that disagrees with the rows.

megablocks is not yet supported: its PyPI release is a CUDA-only build pinned to torch 2.7.0 and its fused
MoE MLP bypasses the router module (the seam above), so it needs a GPU machine and its own entry (a router
class and select/gate_weights matching its kernel); replay() refuses any model whose routers never ran.
"""

from __future__ import annotations

from typing import Any

from moe_lab.config import constants as C
from moe_lab.models.families.sigmoid import SIGMOID_FAMILIES
from moe_lab.models.families.softmax import SOFTMAX_FAMILIES
from moe_lab.models.families.spec import FamilySpec, hf_kwargs


def _registry(*kinds: tuple[FamilySpec, ...]) -> dict[str, FamilySpec]:
    """name -> spec in ``constants.FAMILIES``' order; a family declared in one place only fails here, at import."""
    specs = {spec.name: spec for kind in kinds for spec in kind}
    missing, undeclared = set(C.FAMILIES) - set(specs), set(specs) - set(C.FAMILIES)
    if missing or undeclared or len(specs) != sum(map(len, kinds)):
        raise ValueError(f"constants.FAMILIES without a FamilySpec row: {sorted(missing)}; FamilySpec rows not in "
                         f"constants.FAMILIES: {sorted(undeclared)} (each name once)")
    # the two name lists the config checks with (constants sits below models) must say what the rows say
    traits = {"NORM_TOPK_FAMILIES (its HF config has norm_topk_prob)":
              (C.NORM_TOPK_FAMILIES, lambda spec: hasattr(spec.config_cls, "norm_topk_prob")),
              "BIAS_FAMILIES (its FamilySpec has a bias)": (C.BIAS_FAMILIES, lambda spec: spec.bias is not None)}
    for what, (names, has) in traits.items():
        wrong = sorted(name for name, spec in specs.items() if has(spec) != (name in names))
        if wrong:
            raise ValueError(f"constants.{what} disagrees with the FamilySpec rows for: {wrong}")
    return {name: specs[name] for name in C.FAMILIES}


FAMILIES: dict[str, FamilySpec] = _registry(SOFTMAX_FAMILIES, SIGMOID_FAMILIES)

# Multimodal checkpoints served through their text model: config.json's model_type -> its text_config's. The
# text model's class loads such a checkpoint's language weights itself (model.language_model.* -> model.*).
TEXT_MODELS: dict[str, str] = {"qwen3_5_moe": "qwen3_5_moe_text"}

REFUSED: dict[str, str] = {
    "llama4": "Llama 4's router returns dense (router_scores_NE, router_logits_NE) and every expert runs on every "
              "token weighted by those scores; there are no top-k ids for the experts to consume, so the seam "
              "record/replay hooks into (router -> (logits, weights, ids) -> experts) does not exist",
    "hunyuan_v1_moe": "Hunyuan-A13B's config allows per-layer expert counts and top-k (lists), while a trace holds "
                      "one (E, k) for all layers, and its router keeps its weight under .wg (the router-weight "
                      "readers of moe_lab use router.weight); not served yet",
}


def served_config(config: dict) -> dict:
    """A checkpoint's config.json as the model moe_lab runs sees it: a multimodal one's ``text_config``."""
    text = config.get("text_config")
    if config.get("model_type") in TEXT_MODELS and isinstance(text, dict):
        return {"model_type": TEXT_MODELS[config["model_type"]], **text}
    return config


def get_family(name: str) -> FamilySpec:
    if name in REFUSED:
        raise ValueError(f"family={name!r} is not supported: {REFUSED[name]}")
    if name not in FAMILIES:
        raise ValueError(f"family={name!r} is not supported: allowed {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of_router(module: Any) -> FamilySpec | None:
    """The family whose router class this module is exactly (None for any other module)."""
    for spec in FAMILIES.values():
        if type(module) is spec.router_cls:
            return spec
    return None


def family_of_model_type(model_type: str) -> FamilySpec | None:
    model_type = TEXT_MODELS.get(model_type, model_type)  # a multimodal checkpoint: its text model's family
    for spec in FAMILIES.values():
        if spec.model_type == model_type:
            return spec
    return None


__all__ = ["FAMILIES", "REFUSED", "TEXT_MODELS", "FamilySpec", "family_of_model_type", "family_of_router",
           "get_family", "hf_kwargs", "served_config"]
