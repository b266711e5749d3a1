"""What one family entry is: ``FamilySpec``, and the tiny-config helpers every router kind's families share
(the fields all HF configs take from a ``ModelConfig``, the shared-expert width, the norm_topk_prob switch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from moe_lab.config import ModelConfig
from moe_lab.models.families.routers import softmax_router_logp

Tensor = torch.Tensor


@dataclass(frozen=True)
class FamilySpec:
    name: str
    config_cls: type
    model_cls: type
    router_cls: type
    tiny_config: Callable[[ModelConfig, dict], PretrainedConfig]  # (cfg, hf_kwargs(...)) -> HF config
    select: Callable[[nn.Module, Tensor], tuple[Tensor, Tensor]]
    gate_weights: Callable[[nn.Module, Tensor, Tensor], Tensor]
    attn_impl: str = "sdpa"  # gpt_oss has attention sinks and no sdpa path
    # logits_NE -> fp32 log-probabilities over ALL experts (RSPO's router shift; never feeds the forward)
    router_logp: Callable[[Tensor], Tensor] = softmax_router_logp
    # (moe block, its router) -> None: links a router to state its block keeps (MiniMax-M2's correction bias);
    # moe_layers() runs it, so every record/replay session finds the link made
    bind: Callable[[nn.Module, nn.Module], None] | None = None
    # router -> its choice-only correction bias (the tensor itself, updated in place by moe_lab/rl/expert_bias.py);
    # None: the family's router has none (constants.BIAS_FAMILIES names the others)
    bias: Callable[[nn.Module], Tensor] | None = None

    @property
    def model_type(self) -> str:
        return self.config_cls.model_type


def hf_kwargs(cfg: ModelConfig, vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int) -> dict:
    """Fields every family's HF config shares."""
    return dict(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, num_experts_per_tok=cfg.top_k,
                max_position_embeddings=cfg.max_positions, tie_word_embeddings=False, use_cache=True,
                pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def shared_width(cfg: ModelConfig, width: int) -> int:
    # model.shared_expert=False: a width-0 shared expert. transformers builds the module unconditionally; with
    # no hidden units its output is exactly 0 (an empty sum), in the forward, in save/load and on any device,
    # so the block's output is the routed experts' alone. (qwen2_moe's sigmoid gate then multiplies 0.)
    return width if cfg.shared_expert else 0


def norm_topk(cfg: ModelConfig, family_default: bool) -> bool:
    return family_default if cfg.norm_topk_prob is None else cfg.norm_topk_prob
