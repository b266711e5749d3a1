"""One registry of the MoE families moe_lab can build, load, record and replay.

Every transformers MoE family routes through a router module that returns
``(router_logits_NE, topk_weights_NK, topk_ids_NK)`` and its experts consume whatever ids/weights the router
returns: that output is the seam routing record/replay hooks into. A family entry says how to build a tiny
config from :class:`~moe_lab.config.ModelConfig`, which module class is its router, and two pure functions:

- ``select(router, logits_NE) -> (weights_NK, ids_NK)``: exactly the family's choice rule, bit-exact with the
  router's own output given the logits it returned;
- ``gate_weights(router, logits_NE, ids_NK) -> weights_NK``: the family's normalisation applied to GIVEN ids,
  gathered from the dense logits/probabilities (never from top-k-zeroed ones, which would silently kill the
  router gradient of a replayed expert the router no longer picks).

Adding a family = one ``FamilySpec`` entry in ``FAMILIES`` (+ its name in ``constants.FAMILIES``).

megablocks is not yet supported: its PyPI release is a CUDA-only build pinned to torch 2.7.0 and its fused
MoE MLP bypasses the router module (the seam above), so it needs a GPU machine and its own entry (a router
class and select/gate_weights matching its kernel); replay() refuses any model whose routers never ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, GptOssConfig, GptOssForCausalLM, MixtralConfig,
                          MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, PretrainedConfig, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from moe_lab.config import ModelConfig

Tensor = torch.Tensor


def softmax_router_logp(logits_NE: Tensor) -> Tensor:
    # log-softmax over all E experts in fp32: the distribution a softmax router samples its top-k from,
    # also for gpt-oss (whose gate renormalises over the k chosen logits only).
    return F.log_softmax(logits_NE.float(), dim=-1)


@dataclass(frozen=True)
class FamilySpec:
    name: str
    config_cls: type
    model_cls: type
    router_cls: type
    tiny_config: Callable[[ModelConfig, dict], PretrainedConfig]  # (cfg, shared HF kwargs) -> HF config
    select: Callable[[nn.Module, Tensor], tuple[Tensor, Tensor]]
    gate_weights: Callable[[nn.Module, Tensor, Tensor], Tensor]
    attn_impl: str = "sdpa"  # gpt_oss has attention sinks and no sdpa path
    # logits_NE -> fp32 log-probabilities over ALL experts (RSPO's router shift; never feeds the forward)
    router_logp: Callable[[Tensor], Tensor] = softmax_router_logp

    @property
    def model_type(self) -> str:
        return self.config_cls.model_type


# --------------------------------------------------------------------------- choice rules


def _softmax_select(logits_NE: Tensor, k: int, norm: bool, cast_back: bool) -> tuple[Tensor, Tensor]:
    # Same op order as Qwen2/3-MoE, OLMoE and Mixtral routers: softmax in fp32, top-k on probabilities.
    probs_NE = F.softmax(logits_NE, dim=-1, dtype=torch.float)
    weights_NK, ids_NK = torch.topk(probs_NE, k, dim=-1)
    if norm:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return (weights_NK.to(logits_NE.dtype) if cast_back else weights_NK), ids_NK


def _softmax_gate(logits_NE: Tensor, ids_NK: Tensor, norm: bool, cast_back: bool) -> Tensor:
    weights_NK = F.softmax(logits_NE, dim=-1, dtype=torch.float).gather(1, ids_NK)
    if norm:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return weights_NK.to(logits_NE.dtype) if cast_back else weights_NK


def qwen_select(router: nn.Module, logits_NE: Tensor) -> tuple[Tensor, Tensor]:
    return _softmax_select(logits_NE, router.top_k, router.norm_topk_prob, cast_back=True)


def qwen_gate_weights(router: nn.Module, logits_NE: Tensor, ids_NK: Tensor) -> Tensor:
    return _softmax_gate(logits_NE, ids_NK.long(), router.norm_topk_prob, cast_back=True)


def mixtral_select(router: nn.Module, logits_NE: Tensor) -> tuple[Tensor, Tensor]:
    # Mixtral always renormalises and keeps the fp32 probabilities (no cast back).
    return _softmax_select(logits_NE.float(), router.top_k, norm=True, cast_back=False)


def mixtral_gate_weights(router: nn.Module, logits_NE: Tensor, ids_NK: Tensor) -> Tensor:
    return _softmax_gate(logits_NE.float(), ids_NK.long(), norm=True, cast_back=False)


def gpt_oss_select(router: nn.Module, logits_NE: Tensor) -> tuple[Tensor, Tensor]:
    # gpt-oss: top-k on the raw logits, then a softmax over the k selected logits only.
    top_NK, ids_NK = torch.topk(logits_NE, router.top_k, dim=-1)
    return F.softmax(top_NK, dim=1, dtype=top_NK.dtype), ids_NK


def gpt_oss_gate_weights(router: nn.Module, logits_NE: Tensor, ids_NK: Tensor) -> Tensor:
    top_NK = logits_NE.gather(1, ids_NK.long())
    return F.softmax(top_NK, dim=1, dtype=top_NK.dtype)


def _deepseek_scale(router: nn.Module, weights_NK: Tensor) -> Tensor:
    if router.norm_topk_prob:
        weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_NK * router.routed_scaling_factor


def deepseek_select(router: nn.Module, logits_NE: Tensor) -> tuple[Tensor, Tensor]:
    # Sigmoid scores; e_score_correction_bias shifts the CHOICE only (group-limited top-k), never the weights.
    scores_NE = logits_NE.sigmoid()
    choice_NE = scores_NE + router.e_score_correction_bias
    G, E = router.num_group, router.num_experts
    group_NG = choice_NE.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_NG, k=router.topk_group, dim=-1, sorted=False)[1]
    keep_NG = torch.zeros_like(group_NG).scatter_(1, group_ids, 1)
    keep_NE = keep_NG.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    choice_NE = choice_NE.masked_fill(~keep_NE.bool(), float("-inf"))
    ids_NK = torch.topk(choice_NE, k=router.top_k, dim=-1, sorted=False)[1]
    return _deepseek_scale(router, scores_NE.gather(1, ids_NK)), ids_NK


def deepseek_gate_weights(router: nn.Module, logits_NE: Tensor, ids_NK: Tensor) -> Tensor:
    return _deepseek_scale(router, logits_NE.sigmoid().gather(1, ids_NK.long()))


def sigmoid_router_logp(logits_NE: Tensor) -> Tensor:
    # DeepSeek-V3 scores experts with independent sigmoids (no softmax): their log, normalised over all E
    # experts, log(s_e / sum_j s_j), is the distribution we compare. The choice-only correction bias is left
    # out, like in the gate weights. logsigmoid keeps it finite for very negative logits.
    logs_NE = F.logsigmoid(logits_NE.float())
    return logs_NE - torch.logsumexp(logs_NE, dim=-1, keepdim=True)


# --------------------------------------------------------------------------- tiny configs


def _deepseek_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group): groups of >= 2 experts (the router sums each group's top-2), at most 4 groups,
    and enough kept groups to hold top_k experts; half the groups kept so the group limit really bites."""
    n_group = max(g for g in range(1, 5) if num_experts % g == 0 and num_experts // g >= 2)
    per_group = num_experts // n_group
    topk_group = min(n_group, max(-(-top_k // per_group), n_group // 2, 1))
    return n_group, topk_group


def _shared_width(cfg: ModelConfig, width: int) -> int:
    # model.shared_expert=False: a width-0 shared expert. transformers builds the module unconditionally; with
    # no hidden units its output is exactly 0 (an empty sum), in the forward, in save/load and on any device,
    # so the block's output is the routed experts' alone. (qwen2_moe's sigmoid gate then multiplies 0.)
    return width if cfg.shared_expert else 0


def _norm_topk(cfg: ModelConfig, family_default: bool) -> bool:
    return family_default if cfg.norm_topk_prob is None else cfg.norm_topk_prob


def _qwen3(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    return Qwen3MoeConfig(**kw, num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                          norm_topk_prob=_norm_topk(cfg, True), decoder_sparse_step=1, mlp_only_layers=[])


def _qwen2(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    return Qwen2MoeConfig(**kw, num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                          shared_expert_intermediate_size=_shared_width(cfg, cfg.intermediate_size),
                          norm_topk_prob=_norm_topk(cfg, False),
                          decoder_sparse_step=1, mlp_only_layers=[])


def _olmoe(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # OLMoE's experts read config.intermediate_size: that is the routed-expert width here.
    return OlmoeConfig(**{**kw, "intermediate_size": cfg.moe_intermediate_size}, num_experts=cfg.num_experts,
                       norm_topk_prob=_norm_topk(cfg, False))


def _mixtral(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    return MixtralConfig(**{**kw, "intermediate_size": cfg.moe_intermediate_size}, num_local_experts=cfg.num_experts,
                         router_jitter_noise=0.0, sliding_window=None)


def _deepseek(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    n_group, topk_group = _deepseek_groups(cfg.num_experts, cfg.top_k)
    head_dim = cfg.hidden_size // cfg.num_heads
    rope_dim = max(2, head_dim // 2 // 2 * 2)  # rotary halves must be even
    # MLA has no grouped KV heads (keys/values are expanded per head): num_kv_heads does not apply.
    kw = {**kw, "num_key_value_heads": cfg.num_heads}
    return DeepseekV3Config(**kw, n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                            n_shared_experts=_shared_width(cfg, max(1, cfg.intermediate_size
                                                                    // cfg.moe_intermediate_size)),
                            first_k_dense_replace=0, n_group=n_group, topk_group=topk_group,
                            q_lora_rank=max(8, cfg.hidden_size // 2), kv_lora_rank=max(8, cfg.hidden_size // 4),
                            qk_rope_head_dim=rope_dim, qk_nope_head_dim=max(2, head_dim - rope_dim),
                            v_head_dim=head_dim, norm_topk_prob=_norm_topk(cfg, True))


def _gpt_oss(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # A sliding window as long as the longest sequence: the alternating sliding/full layers stay the family's,
    # but no layer forgets context, so prefill, KV-cache decoding and teacher forcing see the same keys.
    return GptOssConfig(**{**kw, "intermediate_size": cfg.moe_intermediate_size}, num_local_experts=cfg.num_experts,
                        head_dim=cfg.hidden_size // cfg.num_heads, sliding_window=cfg.max_positions,
                        rope_parameters={"rope_type": "default", "rope_theta": 150000.0})


def hf_kwargs(cfg: ModelConfig, vocab_size: int, pad_token_id: int, bos_token_id: int, eos_token_id: int) -> dict:
    """Fields every family's HF config shares."""
    return dict(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, num_experts_per_tok=cfg.top_k,
                max_position_embeddings=cfg.max_positions, tie_word_embeddings=False, use_cache=True,
                pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


FAMILIES: dict[str, FamilySpec] = {
    "qwen3_moe": FamilySpec("qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeTopKRouter, _qwen3,
                            qwen_select, qwen_gate_weights),
    "qwen2_moe": FamilySpec("qwen2_moe", Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen2MoeTopKRouter, _qwen2,
                            qwen_select, qwen_gate_weights),
    "olmoe": FamilySpec("olmoe", OlmoeConfig, OlmoeForCausalLM, OlmoeTopKRouter, _olmoe,
                        qwen_select, qwen_gate_weights),
    "mixtral": FamilySpec("mixtral", MixtralConfig, MixtralForCausalLM, MixtralTopKRouter, _mixtral,
                          mixtral_select, mixtral_gate_weights),
    "deepseek_v3": FamilySpec("deepseek_v3", DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3TopkRouter,
                              _deepseek, deepseek_select, deepseek_gate_weights, router_logp=sigmoid_router_logp),
    "gpt_oss": FamilySpec("gpt_oss", GptOssConfig, GptOssForCausalLM, GptOssTopKRouter, _gpt_oss,
                          gpt_oss_select, gpt_oss_gate_weights, attn_impl="eager"),
}


def get_family(name: str) -> FamilySpec:
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
    for spec in FAMILIES.values():
        if spec.model_type == model_type:
            return spec
    return None
