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

Adding a family = one ``FamilySpec`` entry in ``FAMILIES`` (+ its name in ``constants.FAMILIES``). The six
first families live here, those added since in ``families_2026`` (with ``REFUSED``: the families a router hook
cannot serve, and why); ``FamilySpec`` and the choice rules in ``rules``.

megablocks is not yet supported: its PyPI release is a CUDA-only build pinned to torch 2.7.0 and its fused
MoE MLP bypasses the router module (the seam above), so it needs a GPU machine and its own entry (a router
class and select/gate_weights matching its kernel); replay() refuses any model whose routers never ran.
"""

from __future__ import annotations

from typing import Any

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
from moe_lab.models.families_2026 import NEW_FAMILIES, REFUSED
from moe_lab.models.rules import (FamilySpec, deepseek_gate_weights, deepseek_groups, deepseek_select,  # noqa: F401
                                  gpt_oss_gate_weights, gpt_oss_select, mixtral_gate_weights, mixtral_select,
                                  norm_topk, qwen_gate_weights, qwen_select, shared_width, sigmoid_router_logp,
                                  router_bias, softmax_router_logp)

_deepseek_groups = deepseek_groups  # the name tests/test_models.py imports


def _qwen3(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    return Qwen3MoeConfig(**kw, num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                          norm_topk_prob=norm_topk(cfg, True), decoder_sparse_step=1, mlp_only_layers=[])


def _qwen2(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    return Qwen2MoeConfig(**kw, num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                          shared_expert_intermediate_size=shared_width(cfg, cfg.intermediate_size),
                          norm_topk_prob=norm_topk(cfg, False),
                          decoder_sparse_step=1, mlp_only_layers=[])


def _olmoe(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # OLMoE's experts read config.intermediate_size: that is the routed-expert width here.
    return OlmoeConfig(**{**kw, "intermediate_size": cfg.moe_intermediate_size}, num_experts=cfg.num_experts,
                       norm_topk_prob=norm_topk(cfg, False))


def _mixtral(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    return MixtralConfig(**{**kw, "intermediate_size": cfg.moe_intermediate_size}, num_local_experts=cfg.num_experts,
                         router_jitter_noise=0.0, sliding_window=None)


def _deepseek(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    n_group, topk_group = deepseek_groups(cfg.num_experts, cfg.top_k)
    head_dim = cfg.hidden_size // cfg.num_heads
    rope_dim = max(2, head_dim // 2 // 2 * 2)  # rotary halves must be even
    # MLA has no grouped KV heads (keys/values are expanded per head): num_kv_heads does not apply.
    kw = {**kw, "num_key_value_heads": cfg.num_heads}
    return DeepseekV3Config(**kw, n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                            n_shared_experts=shared_width(cfg, max(1, cfg.intermediate_size
                                                                    // cfg.moe_intermediate_size)),
                            first_k_dense_replace=0, n_group=n_group, topk_group=topk_group,
                            q_lora_rank=max(8, cfg.hidden_size // 2), kv_lora_rank=max(8, cfg.hidden_size // 4),
                            qk_rope_head_dim=rope_dim, qk_nope_head_dim=max(2, head_dim - rope_dim),
                            v_head_dim=head_dim, norm_topk_prob=norm_topk(cfg, True))


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
                              _deepseek, deepseek_select, deepseek_gate_weights, router_logp=sigmoid_router_logp,
                              bias=router_bias),
    "gpt_oss": FamilySpec("gpt_oss", GptOssConfig, GptOssForCausalLM, GptOssTopKRouter, _gpt_oss,
                          gpt_oss_select, gpt_oss_gate_weights, attn_impl="eager"),
    **NEW_FAMILIES,  # the families RL runs on since (moe_lab/models/families_2026.py)
}


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
    for spec in FAMILIES.values():
        if spec.model_type == model_type:
            return spec
    return None
