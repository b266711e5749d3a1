"""The MoE families RL is run on since the first six: GLM-4.5/4.6, Qwen3.5-MoE, Qwen3-Next, MiniMax-M2, dots.llm1,
DeepSeek-V3.2 and ERNIE-4.5 (transformers 5.24), one ``FamilySpec`` each, merged into ``families.FAMILIES``.

Each router returns ``(router_logits_NE, weights_NK, ids_NK)`` and its experts consume those ids: the seam of
``moe_lab.routing``. GLM-4-MoE, dots1 and DeepSeek-V3.2 route exactly as DeepSeek-V3 (sigmoid scores, a
choice-only correction bias, group-limited top-k), Qwen3-Next as Qwen3-MoE, Qwen3.5-MoE as Qwen3-MoE with the
renormalisation always on, MiniMax-M2 by sigmoid scores with a correction bias kept on the MoE BLOCK (the router
gets it as an argument; ``rules.bind_block`` links it), ERNIE-4.5 by softmax with a choice-only bias, casting its
weights to its input's dtype (``rules.bind_input_dtype`` keeps that dtype). Qwen3-Next and Qwen3.5-MoE are
hybrids (gated-DeltaNet linear attention in 3 of 4 layers): without the fla / causal-conv1d kernels
transformers runs its reference PyTorch code (slow, but on CPU too). Tiny builds make every decoder layer MoE, like the first six; real
checkpoints keep their dense layers (``moe_layers`` finds the routers where they are).

``REFUSED``: the families whose router a hook cannot serve, and why (``get_family`` says it).
"""

from __future__ import annotations

from transformers import (DeepseekV32Config, DeepseekV32ForCausalLM, Dots1Config, Dots1ForCausalLM,
                          Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM,
                          MiniMaxM2Config, MiniMaxM2ForCausalLM, PretrainedConfig, Qwen3NextConfig,
                          Qwen3NextForCausalLM)
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter
from transformers.models.dots1.modeling_dots1 import Dots1TopkRouter
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTopKRouter
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

from moe_lab.config import ModelConfig
from moe_lab.models.rules import (FamilySpec, bind_block, bind_input_dtype, block_bias, router_bias, statics_bias, deepseek_gate_weights, deepseek_groups,
                                  deepseek_select, ernie_gate_weights, ernie_select, minimax_gate_weights,
                                  minimax_select, norm_topk, qwen_gate_weights, qwen_select, renorm_gate_weights,
                                  renorm_select, shared_width, sigmoid_router_logp)


def _sigmoid_groups(cfg: ModelConfig) -> dict:
    """Fields of DeepSeek-style routers: groups as for deepseek_v3, all layers MoE, a shared expert unless off."""
    n_group, topk_group = deepseek_groups(cfg.num_experts, cfg.top_k)
    return dict(n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                n_shared_experts=shared_width(cfg, max(1, cfg.intermediate_size // cfg.moe_intermediate_size)),
                first_k_dense_replace=0, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk(cfg, True))


def _glm4_moe(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # GLM-4.5/4.6: GQA attention (partial rotary), DeepSeek's router; MTP layers are not built by transformers
    return Glm4MoeConfig(**kw, **_sigmoid_groups(cfg), head_dim=cfg.hidden_size // cfg.num_heads,
                         num_nextn_predict_layers=0)


def _dots1(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # no sliding window: every layer sees the whole context (prefill, decoding and teacher forcing agree)
    return Dots1Config(**kw, **_sigmoid_groups(cfg), sliding_window=None)


def _deepseek_v32(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # MLA as in families._deepseek, plus the DSA indexer; index_topk >= any sequence, so attention stays dense
    head_dim = cfg.hidden_size // cfg.num_heads
    rope_dim = max(2, head_dim // 2 // 2 * 2)
    kw = {**kw, "num_key_value_heads": cfg.num_heads}
    return DeepseekV32Config(**kw, **_sigmoid_groups(cfg), q_lora_rank=max(8, cfg.hidden_size // 2),
                             kv_lora_rank=max(8, cfg.hidden_size // 4), qk_rope_head_dim=rope_dim,
                             qk_nope_head_dim=max(2, head_dim - rope_dim), v_head_dim=head_dim, head_dim=rope_dim,
                             index_n_heads=2, index_head_dim=max(8, head_dim), index_topk=cfg.max_positions)


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


def _minimax_m2(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # MiniMax-M2's experts read config.intermediate_size: that is the routed-expert width here; no shared expert
    return MiniMaxM2Config(**{**kw, "intermediate_size": cfg.moe_intermediate_size},
                           num_local_experts=cfg.num_experts, head_dim=cfg.hidden_size // cfg.num_heads,
                           router_jitter_noise=0.0)


def _ernie4_5_moe(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # every layer MoE (the real models start at layer 1); shared experts counted in routed-expert widths
    return Ernie4_5_MoeConfig(**kw, moe_num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                              moe_num_shared_experts=shared_width(cfg, max(1, cfg.intermediate_size
                                                                          // cfg.moe_intermediate_size)),
                              moe_layer_start_index=0, moe_layer_end_index=-1, moe_layer_interval=1)


NEW_FAMILIES: dict[str, FamilySpec] = {
    "glm4_moe": FamilySpec("glm4_moe", Glm4MoeConfig, Glm4MoeForCausalLM, Glm4MoeTopkRouter, _glm4_moe,
                           deepseek_select, deepseek_gate_weights, router_logp=sigmoid_router_logp,
                           bias=router_bias),
    "qwen3_5_moe": FamilySpec("qwen3_5_moe", Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeTopKRouter,
                              _qwen3_5_moe, renorm_select, renorm_gate_weights),
    "qwen3_next": FamilySpec("qwen3_next", Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3NextTopKRouter, _qwen3_next,
                             qwen_select, qwen_gate_weights),
    "minimax_m2": FamilySpec("minimax_m2", MiniMaxM2Config, MiniMaxM2ForCausalLM, MiniMaxM2TopKRouter, _minimax_m2,
                             minimax_select, minimax_gate_weights, router_logp=sigmoid_router_logp, bind=bind_block,
                             bias=block_bias),
    "dots1": FamilySpec("dots1", Dots1Config, Dots1ForCausalLM, Dots1TopkRouter, _dots1,
                        deepseek_select, deepseek_gate_weights, router_logp=sigmoid_router_logp,
                        bias=router_bias),
    "deepseek_v32": FamilySpec("deepseek_v32", DeepseekV32Config, DeepseekV32ForCausalLM, DeepseekV32TopkRouter,
                               _deepseek_v32, deepseek_select, deepseek_gate_weights, router_logp=sigmoid_router_logp,
                               bias=router_bias),
    "ernie4_5_moe": FamilySpec("ernie4_5_moe", Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, Ernie4_5_MoeTopKRouter,
                               _ernie4_5_moe, ernie_select, ernie_gate_weights, bind=bind_input_dtype,
                               bias=statics_bias),
}

REFUSED: dict[str, str] = {
    "llama4": "Llama 4's router returns dense (router_scores_NE, router_logits_NE) and every expert runs on every "
              "token weighted by those scores; there are no top-k ids for the experts to consume, so the seam "
              "record/replay hooks into (router -> (logits, weights, ids) -> experts) does not exist",
    "hunyuan_v1_moe": "Hunyuan-A13B's config allows per-layer expert counts and top-k (lists), while a trace holds "
                      "one (E, k) for all layers, and its router keeps its weight under .wg (the router-weight "
                      "readers of moe_lab use router.weight); not served yet",
}
