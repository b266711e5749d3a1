"""The families whose router scores experts with a softmax: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss,
Qwen3.5-MoE, Qwen3-Next and ERNIE-4.5 (transformers 5.24), one ``FamilySpec`` each in ``SOFTMAX_FAMILIES``.

Qwen2/3-MoE, OLMoE and Qwen3-Next: softmax in fp32, top-k on the probabilities, renormalised when the config's
norm_topk_prob says so; Qwen3.5-MoE the same with the renormalisation always on; Mixtral always renormalises and
keeps fp32 weights; gpt-oss takes the top-k of the raw logits, then a softmax over those k; ERNIE-4.5 adds a
choice-only correction bias and casts its weights to its input's dtype (``routers.bind_input_dtype`` keeps that
dtype). Qwen3-Next and Qwen3.5-MoE are hybrids (gated-DeltaNet linear attention in 3 of 4 layers): without the
fla / causal-conv1d kernels transformers runs its reference PyTorch code (slow, but on CPU too). Tiny builds
make every decoder layer MoE; real checkpoints keep their dense layers (``moe_layers`` finds the routers).
"""

from __future__ import annotations

from transformers import (Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, GptOssConfig, GptOssForCausalLM, MixtralConfig,
                          MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, PretrainedConfig, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3NextConfig,
                          Qwen3NextForCausalLM)
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

from moe_lab.config import ModelConfig
from moe_lab.models.families.routers import (bind_input_dtype, ernie_gate_weights, ernie_select, gpt_oss_gate_weights,
                                             gpt_oss_select, mixtral_gate_weights, mixtral_select, qwen_gate_weights,
                                             qwen_select, renorm_gate_weights, renorm_select, statics_bias)
from moe_lab.models.families.spec import FamilySpec, norm_topk, shared_width


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


def _gpt_oss(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # A sliding window as long as the longest sequence: the alternating sliding/full layers stay the family's,
    # but no layer forgets context, so prefill, KV-cache decoding and teacher forcing see the same keys.
    return GptOssConfig(**{**kw, "intermediate_size": cfg.moe_intermediate_size}, num_local_experts=cfg.num_experts,
                        head_dim=cfg.hidden_size // cfg.num_heads, sliding_window=cfg.max_positions,
                        rope_parameters={"rope_type": "default", "rope_theta": 150000.0})


def _hybrid_fields(cfg: ModelConfig) -> dict:
    """Qwen3-Next / Qwen3.5: linear-attention heads as wide as the attention heads; every other layer full
    attention (the real models: 1 in 4; a 2-layer tiny model then still has one of each)."""
    head_dim = cfg.hidden_size // cfg.num_heads
    return dict(head_dim=head_dim, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                linear_num_key_heads=cfg.num_kv_heads, linear_num_value_heads=cfg.num_heads,
                layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(cfg.num_layers)],
                num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                shared_expert_intermediate_size=shared_width(cfg, cfg.intermediate_size))


def _qwen3_next(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    return Qwen3NextConfig(**kw, **_hybrid_fields(cfg), norm_topk_prob=norm_topk(cfg, True), decoder_sparse_step=1,
                           mlp_only_layers=[])


def _qwen3_5_moe(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # the text model of Qwen3.5-MoE (model_type qwen3_5_moe_text): its router always renormalises
    return Qwen3_5MoeTextConfig(**kw, **_hybrid_fields(cfg))


def _ernie4_5_moe(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # every layer MoE (the real models start at layer 1); shared experts counted in routed-expert widths
    return Ernie4_5_MoeConfig(**kw, moe_num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                              moe_num_shared_experts=shared_width(cfg, max(1, cfg.intermediate_size
                                                                          // cfg.moe_intermediate_size)),
                              moe_layer_start_index=0, moe_layer_end_index=-1, moe_layer_interval=1)


SOFTMAX_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeTopKRouter, _qwen3,
               qwen_select, qwen_gate_weights),
    FamilySpec("qwen2_moe", Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen2MoeTopKRouter, _qwen2,
               qwen_select, qwen_gate_weights),
    FamilySpec("olmoe", OlmoeConfig, OlmoeForCausalLM, OlmoeTopKRouter, _olmoe, qwen_select, qwen_gate_weights),
    FamilySpec("mixtral", MixtralConfig, MixtralForCausalLM, MixtralTopKRouter, _mixtral,
               mixtral_select, mixtral_gate_weights),
    FamilySpec("gpt_oss", GptOssConfig, GptOssForCausalLM, GptOssTopKRouter, _gpt_oss,
               gpt_oss_select, gpt_oss_gate_weights, attn_impl="eager"),
    FamilySpec("qwen3_5_moe", Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTopKRouter, _qwen3_5_moe,
               renorm_select, renorm_gate_weights),
    FamilySpec("qwen3_next", Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3NextTopKRouter, _qwen3_next,
               qwen_select, qwen_gate_weights),
    FamilySpec("ernie4_5_moe", Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, Ernie4_5_MoeTopKRouter, _ernie4_5_moe,
               ernie_select, ernie_gate_weights, bind=bind_input_dtype, bias=statics_bias),
)
