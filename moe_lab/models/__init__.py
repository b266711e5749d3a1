"""Build tiny transformers MoE models from a ModelConfig, or load a local checkpoint; find their MoE layers.

The models are plain transformers ``PreTrainedModel`` objects: routing record/replay attaches to them from
the outside (``moe_lab.routing``), nothing here knows about RL.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from transformers import PreTrainedModel

from moe_lab.config import constants as C
from moe_lab.config import ModelConfig
from moe_lab.models.experts import fused_experts_forward  # registers experts_impl 'fused' with transformers
from moe_lab.models.families import (FAMILIES, REFUSED, FamilySpec, family_of_model_type, family_of_router, get_family,
                                     hf_kwargs)

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class MoeLayer(NamedTuple):
    layer_idx: int  # index of the decoder layer in the model
    router: nn.Module
    family: FamilySpec


def _check_build_args(cfg: ModelConfig, vocab_size: int, special_ids: dict[str, int]) -> FamilySpec:
    spec = get_family(cfg.family)
    if cfg.experts_impl not in C.EXPERTS_KERNELS:
        raise ValueError(f"experts_impl={cfg.experts_impl!r} is not supported: allowed {', '.join(C.EXPERTS_KERNELS)}")
    if not isinstance(vocab_size, int) or vocab_size < 3:
        raise ValueError(f"vocab_size={vocab_size!r} is out of range: allowed an int >= 3")
    for name, value in special_ids.items():
        if not 0 <= value < vocab_size:
            raise ValueError(f"{name}={value} is out of range: allowed 0 <= {name} < vocab_size={vocab_size}")
    if not 1 <= cfg.top_k <= cfg.num_experts:
        raise ValueError(f"top_k={cfg.top_k} is out of range: allowed 1 <= top_k <= num_experts={cfg.num_experts}")
    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"num_heads={cfg.num_heads}: hidden_size ({cfg.hidden_size}) must be divisible by "
                         f"num_heads and num_heads by num_kv_heads ({cfg.num_kv_heads})")
    return spec


@contextlib.contextmanager
def _quiet_empty_init():
    # model.shared_expert=False builds a width-0 shared expert: torch warns that initialising it is a no-op
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        yield


def build_model(cfg: ModelConfig, vocab_size: int, *, pad_token_id: int = 0, bos_token_id: int = 1,
                eos_token_id: int = 2) -> PreTrainedModel:
    """A randomly initialised fp32 model of ``cfg.family`` in eval() mode, every layer MoE.

    The init is seeded by ``cfg.seed`` inside a forked RNG, so building a model never moves the caller's
    global random state (and the same config always gives the same weights).
    """
    special = dict(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    spec = _check_build_args(cfg, vocab_size, special)
    hf_cfg = spec.tiny_config(cfg, hf_kwargs(cfg, vocab_size, **special))
    with torch.random.fork_rng(devices=[]), _quiet_empty_init():
        torch.manual_seed(cfg.seed)
        model = spec.model_cls._from_config(hf_cfg, attn_implementation=spec.attn_impl,
                                            experts_implementation=cfg.experts_impl, dtype=torch.float32)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.bos_token_id = bos_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model.eval()


def checkpoint_family(path: str | Path) -> FamilySpec:
    """The family of a local checkpoint directory, read from its config.json alone (no weights loaded);
    ValueError naming what was expected when it is none of the supported ones."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"checkpoint={str(path)!r} does not exist or is not a directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"checkpoint={str(path)!r} holds no config.json: not a transformers checkpoint")
    model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    spec = family_of_model_type(model_type)
    refused = REFUSED.get(str(model_type).removesuffix("_text"))
    if spec is None and refused:
        raise ValueError(f"checkpoint={str(path)!r} holds model_type={model_type!r}, which is refused: {refused}")
    if spec is None:
        raise ValueError(f"checkpoint={str(path)!r} holds model_type={model_type!r}, not a supported MoE family: "
                         f"allowed {', '.join(s.model_type for s in FAMILIES.values())}")
    return spec


def checkpoint_dtype(path: str | Path) -> torch.dtype:
    """The dtype a checkpoint's config.json declares (``dtype``, or ``torch_dtype`` as older transformers wrote
    it); float32 when it declares none. ValueError when it names something torch has no dtype for."""
    config = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"checkpoint={str(path)!r}: config.json declares dtype={name!r}, not a torch floating dtype; "
                         "name one (e.g. bfloat16)")
    return dtype


def load_model(path: str | Path, *, experts_impl: str = "grouped_mm", dtype: torch.dtype | str = torch.float32,
               device_map: str | dict | None = None) -> PreTrainedModel:
    """Load a local checkpoint directory (offline: nothing is downloaded) in eval() mode.

    ``dtype="auto"``: the checkpoint's own (``checkpoint_dtype``). ``device_map``: transformers' (e.g.
    ``{"": "cuda:0"}``, or ``"auto"`` with accelerate): the weights are read onto their devices in ``dtype``,
    never built whole in CPU memory first."""
    if experts_impl not in C.EXPERTS_KERNELS:
        raise ValueError(f"experts_impl={experts_impl!r} is not supported: allowed {', '.join(C.EXPERTS_KERNELS)}")
    path = Path(path).expanduser()
    spec = checkpoint_family(path)
    dtype = checkpoint_dtype(path) if dtype == "auto" else dtype
    with _quiet_empty_init():
        model = spec.model_cls.from_pretrained(path, local_files_only=True, dtype=dtype, device_map=device_map,
                                               attn_implementation=spec.attn_impl, experts_implementation=experts_impl)
    moe_layers(model)  # a checkpoint whose layers hold no recognised router is refused here
    return model.eval()


def moe_layers(model: nn.Module) -> list[MoeLayer]:
    """Every MoE layer of ``model`` in layer order: (layer_idx, router module, family spec).

    The trace axis L follows this list. Raises ValueError when no module is a supported router class.
    """
    found = []
    for name, module in model.named_modules():
        spec = family_of_router(module)
        if spec is None:
            continue
        match = _LAYER_RE.search(name)
        if match is None:
            raise ValueError(f"router {name!r} is not inside a 'layers.<i>' module: cannot number its layer")
        if spec.bind is not None:  # e.g. MiniMax-M2: the router's correction bias is its block's
            spec.bind(model.get_submodule(name.rpartition(".")[0]), module)
        found.append(MoeLayer(int(match.group(1)), module, spec))
    if not found:
        routers = ", ".join(spec.router_cls.__name__ for spec in FAMILIES.values())
        raise ValueError(f"{type(model).__name__} has no MoE router of a supported family: allowed "
                         f"{', '.join(FAMILIES)} (routers {routers})")
    return sorted(found, key=lambda layer: layer.layer_idx)


def correction_biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every MoE layer's expert correction bias by its state-dict name ({} for a family without one): model state
    outside the gradient, which the rollout copy and the lag snapshots carry with the weights."""
    mine = {id(layer.family.bias(layer.router)) for layer in moe_layers(model) if layer.family.bias is not None}
    named = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    return {name: t for name, t in named.items() if id(t) in mine}


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when one is visible, else cpu; 'cuda' without one is refused before any work."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device='cuda' but torch sees no CUDA device; allowed here: cpu, auto")
    return torch.device(name)


def position_ids_from_mask(attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows exactly as ``generate()`` makes them (pads get 0).

    A teacher-forced forward must pass these: without them transformers numbers columns 0..S-1 whatever the
    padding, so its routing (and log-probs) would differ from the rollout's on left-padded rows.
    """
    position_ids_BS = attention_mask_BS.long().cumsum(-1) - 1
    return position_ids_BS.masked_fill(attention_mask_BS == 0, 0)


__all__ = ["MoeLayer", "build_model", "fused_experts_forward", "checkpoint_dtype", "checkpoint_family", "correction_biases",
           "load_model", "moe_layers", "position_ids_from_mask", "resolve_device"]
