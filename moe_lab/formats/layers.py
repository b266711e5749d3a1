"""Which decoder layers of a model are MoE layers, and how a layout's layer axis maps onto them.

Engines and trainers number the layer axis of their routed experts in one of a few ways: only the MoE layers
(vLLM in the versions NeMo-RL reads, SGLang, NeMo-RL, prime-rl), every decoder layer with zeros in the dense
ones (vLLM where verl #5037 met it), and sometimes the MTP (next-token-prediction) layers appended after the
backbone. The model's HF config says which decoder layers are MoE; the axis length says which numbering a
layout used. That decision is made here from the config, never guessed from the data.

``IS_MOE_LAYER`` is one entry per ``model_type``: (config -> is decoder layer i an MoE layer). A new family
adds one line. A model_type without an entry is refused (one line naming the allowed ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping


def _field(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    value = getattr(config, name, default)
    return default if value is None else value


def _qwen_moe(config: Any, i: int) -> bool:
    # transformers' Qwen2/3-MoE decoder layer: not in mlp_only_layers, experts exist, every sparse_step-th layer
    step = int(_field(config, "decoder_sparse_step", 1) or 1)
    # transformers 5 writes num_experts to config.json as num_local_experts (an attribute_map alias)
    experts = int(_field(config, "num_experts", 0) or _field(config, "num_local_experts", 0) or 0)
    return i not in set(_field(config, "mlp_only_layers", []) or []) and experts > 0 and (i + 1) % step == 0


def _deepseek_moe(config: Any, i: int) -> bool:
    # DeepSeek-V2/V3 and GLM-4-MoE: the first first_k_dense_replace layers are dense; moe_layer_freq (when the
    # config carries one) thins the rest as in DeepSeek's own modelling code
    first = int(_field(config, "first_k_dense_replace", 0) or 0)
    freq = int(_field(config, "moe_layer_freq", 1) or 1)
    return i >= first and i % freq == 0


def _every_layer(config: Any, i: int) -> bool:
    return True


def _ernie_moe(config: Any, i: int) -> bool:
    # ERNIE-4.5: every interval-th layer from moe_layer_start_index to moe_layer_end_index (-1: the last)
    start, interval = int(_field(config, "moe_layer_start_index", 0)), int(_field(config, "moe_layer_interval", 1))
    end = int(_field(config, "moe_layer_end_index", -1))
    end = num_decoder_layers(config) - 1 if end == -1 else end
    return (i + 1) % interval == 0 and start <= i <= end


def _mlp_layer_types(config: Any, i: int) -> bool:
    # DeepSeek-V3.2: an explicit "dense"/"sparse" list when the config has one, else DeepSeek's rule
    types = _field(config, "mlp_layer_types")
    return types[i] == "sparse" if types else _deepseek_moe(config, i)


IS_MOE_LAYER: dict[str, Callable[[Any, int], bool]] = {
    "qwen3_moe": _qwen_moe,
    "qwen2_moe": _qwen_moe,
    "deepseek_v3": _deepseek_moe,
    "deepseek_v2": _deepseek_moe,
    "glm4_moe": _deepseek_moe,
    "olmoe": _every_layer,
    "mixtral": _every_layer,
    "gpt_oss": _every_layer,
    # Qwen3-Next's config carries Qwen3-MoE's fields (mlp_only_layers, decoder_sparse_step); Qwen3.5-MoE's text
    # model and MiniMax-M2 have no dense decoder layer
    "qwen3_next": _qwen_moe,
    "qwen3_5_moe_text": _every_layer,
    "minimax_m2": _every_layer,
    "dots1": _deepseek_moe,
    "deepseek_v32": _mlp_layer_types,
    "ernie4_5_moe": _ernie_moe,
}

# Config fields that count MTP layers appended after the backbone (their routes are not the backbone's).
_MTP_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


def model_type(config: Any) -> str:
    value = _field(config, "model_type")
    if value not in IS_MOE_LAYER:
        raise ValueError(f"config: model_type={value!r} has no IS_MOE_LAYER entry; allowed "
                         f"{', '.join(sorted(IS_MOE_LAYER))}")
    return value


def num_decoder_layers(config: Any) -> int:
    value = _field(config, "num_hidden_layers")
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"config: num_hidden_layers={value!r}; allowed an int >= 1")
    return value


def num_mtp_layers(config: Any) -> int:
    # the first field present, not their sum: on a transformers config object one can alias another
    # (Glm4MoeConfig.num_mtp_layers reads num_nextn_predict_layers), which a sum would count twice
    return next((int(v) for v in (_field(config, name, 0) for name in _MTP_FIELDS) if v), 0)


def moe_layer_indices(config: Any) -> list[int]:
    """Decoder-layer indices (0-based, backbone only: MTP layers excluded) whose MLP is an MoE block."""
    is_moe = IS_MOE_LAYER[model_type(config)]
    return [i for i in range(num_decoder_layers(config)) if is_moe(config, i)]


def top_k(config: Any) -> int:
    for name in ("num_experts_per_tok", "moe_topk", "top_k", "moe_k"):  # moe_k: ERNIE-4.5's config.json
        value = _field(config, name)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("config: no num_experts_per_tok (top_k) field")


def num_experts(config: Any) -> int:
    for name in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"):  # the last: ERNIE
        value = _field(config, name)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("config: no num_experts / n_routed_experts / num_local_experts / moe_num_experts field")


# The layer numberings each producer's capture writes (docs/traces.md cites the code): the engines' capture
# buffers are [tokens, num_hidden_layers, top_k] (or the MoE layers only, in the vLLM versions NeMo-RL reads),
# never with MTP rows appended. verl writes no file: a JSONL of its tensor is the user's own dump, not pinned.
BACKBONE = ("moe", "decoder")
LAYOUT_AXES: dict[str, tuple[str, ...] | None] = {
    "vllm": BACKBONE, "sglang": BACKBONE, "nemo_rl": BACKBONE, "prime_rl": BACKBONE, "slime": BACKBONE,
    "verl": None,
}


@dataclass(frozen=True)
class LayerMap:
    """How a layout's layer axis of length ``axis_len`` maps onto the model's MoE layers.

    ``kind``: "moe" (MoE layers only), "decoder" (every decoder layer, dense ones zero), with "+mtp" when MTP
    layers follow. ``rows[l]`` is the axis row holding MoE layer l; ``moe_layers[l]`` its decoder index.
    """

    kind: str
    axis_len: int
    rows: tuple[int, ...]
    moe_layers: tuple[int, ...]

    @property
    def dropped(self) -> tuple[int, ...]:
        """Axis rows that are not backbone MoE layers (dense or MTP): dropped on reading."""
        keep = set(self.rows)
        return tuple(r for r in range(self.axis_len) if r not in keep)


def layer_maps(config: Any) -> dict[str, LayerMap]:
    """Every numbering this model's config allows, by kind (kinds of equal length give the same rows)."""
    moe = moe_layer_indices(config)
    n_dec, n_mtp = num_decoder_layers(config), num_mtp_layers(config)
    maps = {"moe": LayerMap("moe", len(moe), tuple(range(len(moe))), tuple(moe)),
            "decoder": LayerMap("decoder", n_dec, tuple(moe), tuple(moe))}
    if n_mtp:
        maps["moe+mtp"] = LayerMap("moe+mtp", len(moe) + n_mtp, tuple(range(len(moe))), tuple(moe))
        maps["decoder+mtp"] = LayerMap("decoder+mtp", n_dec + n_mtp, tuple(moe), tuple(moe))
    return maps


class AmbiguousLayerAxis(ValueError):
    """More than one layer numbering of the model fits the axis and neither the layout nor ``--layers`` pins one:
    the same bytes read two ways (e.g. ``decoder`` and ``moe+mtp`` with one dense and one MTP layer)."""

    def __init__(self, what: str, axis_len: int, kinds: list[str]):
        self.axis_len, self.kinds = axis_len, kinds
        super().__init__(f"{what}: {axis_len} layer rows fit the layer numberings {' and '.join(kinds)} of this "
                         f"model and the layout does not pin one; pick one with --layers {'|'.join(kinds)}")


def layer_map(config: Any, axis_len: int, kind: str = "auto", *, what: str = "routed_experts",
              allowed: tuple[str, ...] | None = None, empty_rows: tuple[int, ...] = ()) -> LayerMap:
    """The numbering a layer axis of ``axis_len`` rows follows; ``kind`` names one (``--layers``), "auto" picks
    by length among ``allowed`` (the numberings the producer writes, ``LAYOUT_AXES``; None: any).

    Two numberings of one length with different rows (one dense and one MTP layer: ``decoder`` and
    ``moe+mtp``) read the same bytes two ways. ``empty_rows``: axis rows that carry no route at any position
    (all-zero top-k rows, a placeholder no top-k router writes, or missing markers). A numbering that would
    read such a row as an MoE layer is excluded when another one drops it; when that leaves exactly one, it is
    the reading. Otherwise, without a pin, that is ``AmbiguousLayerAxis``.
    """
    maps = layer_maps(config)
    if kind != "auto":
        if kind not in maps:
            raise ValueError(f"{what}: --layers={kind} is not a layer numbering this model has; allowed "
                             f"{', '.join(maps)}")
        if maps[kind].axis_len != axis_len:
            raise ValueError(f"{what}: {axis_len} layer rows, but --layers={kind} of this model has "
                             f"{maps[kind].axis_len}")
        return maps[kind]
    sizes = ", ".join(f"{m.axis_len} ({k})" for k, m in maps.items())
    model = _field(config, "model_type")
    fits = {m.rows: m for k, m in maps.items() if m.axis_len == axis_len and (allowed is None or k in allowed)}
    if len(fits) == 1:  # "moe" before "decoder": without a dense layer they are the same rows
        return next(iter(fits.values()))
    keeps_no_empty = [m for m in fits.values() if not set(m.rows) & set(empty_rows)]
    if len(fits) > 1 and len(keeps_no_empty) == 1:  # the evidence of an empty row decides the axis
        return keeps_no_empty[0]
    if fits:
        raise AmbiguousLayerAxis(what, axis_len, [m.kind for m in fits.values()])
    other = [k for k, m in maps.items() if m.axis_len == axis_len]
    if other:
        raise ValueError(f"{what}: {axis_len} layer rows fit only {', '.join(other)}, which this layout does not "
                         f"write ({model}: it writes {', '.join(allowed or ())}); --layers={other[0]} reads it so")
    raise ValueError(f"{what}: {axis_len} layer rows fit no layer numbering of this model ({model}); allowed {sizes}")
