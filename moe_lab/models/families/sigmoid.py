"""The families whose router scores experts with independent sigmoids and chooses with a per-expert correction
bias that shifts the choice only (DeepSeek-V3's aux-loss-free balancing): DeepSeek-V3, GLM-4.5/4.6, dots.llm1,
DeepSeek-V3.2 and MiniMax-M2 (transformers 5.24), one ``FamilySpec`` each in ``SIGMOID_FAMILIES``.

DeepSeek-V3, GLM-4-MoE, dots1 and DeepSeek-V3.2 route alike: group-limited top-k on the biased scores, weights
from the unbiased ones. MiniMax-M2 has no groups and keeps its correction bias on the MoE BLOCK, which passes it
to the router as an argument (``routers.bind_block`` links the two). Tiny builds make every decoder layer MoE;
real checkpoints keep their dense first layers (``moe_layers`` finds the routers where they are).
"""

from __future__ import annotations

from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM,
                          Dots1Config, Dots1ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM, MiniMaxM2Config,
                          MiniMaxM2ForCausalLM, PretrainedConfig)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter
from transformers.models.dots1.modeling_dots1 import Dots1TopkRouter
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

from moe_lab.config import ModelConfig
from moe_lab.models.families.routers import (bind_block, block_bias, deepseek_gate_weights, deepseek_select,
                                             minimax_gate_weights, minimax_select, router_bias, sigmoid_router_logp)
from moe_lab.models.families.spec import FamilySpec, norm_topk, shared_width


def deepseek_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group): groups of >= 2 experts (the router sums each group's top-2), at most 4 groups,
    and enough kept groups to hold top_k experts; half the groups kept so the group limit really bites."""
    n_group = max(g for g in range(1, 5) if num_experts % g == 0 and num_experts // g >= 2)
    per_group = num_experts // n_group
    topk_group = min(n_group, max(-(-top_k // per_group), n_group // 2, 1))
    return n_group, topk_group


def _sigmoid_groups(cfg: ModelConfig) -> dict:
    """Fields of DeepSeek-style routers: groups from deepseek_groups, all layers MoE, a shared expert unless off."""
    n_group, topk_group = deepseek_groups(cfg.num_experts, cfg.top_k)
    return dict(n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_intermediate_size,
                n_shared_experts=shared_width(cfg, max(1, cfg.intermediate_size // cfg.moe_intermediate_size)),
                first_k_dense_replace=0, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk(cfg, True))


def _mla_fields(cfg: ModelConfig, kw: dict) -> dict:
    """DeepSeek's multi-head latent attention: no grouped KV heads (keys/values are expanded per head), so
    num_kv_heads does not apply; rotary halves must be even."""
    head_dim = cfg.hidden_size // cfg.num_heads
    rope_dim = max(2, head_dim // 2 // 2 * 2)
    return dict(kw, num_key_value_heads=cfg.num_heads, q_lora_rank=max(8, cfg.hidden_size // 2),
                kv_lora_rank=max(8, cfg.hidden_size // 4), qk_rope_head_dim=rope_dim,
                qk_nope_head_dim=max(2, head_dim - rope_dim), v_head_dim=head_dim)


def _deepseek(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    return DeepseekV3Config(**_mla_fields(cfg, kw), **_sigmoid_groups(cfg))


def _deepseek_v32(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # MLA plus the DSA indexer; index_topk >= any sequence, so attention stays dense
    fields = _mla_fields(cfg, kw)
    return DeepseekV32Config(**fields, **_sigmoid_groups(cfg), head_dim=fields["qk_rope_head_dim"], index_n_heads=2,
                             index_head_dim=max(8, fields["v_head_dim"]), index_topk=cfg.max_positions)


def _glm4_moe(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # GLM-4.5/4.6: GQA attention (partial rotary), DeepSeek's router; MTP layers are not built by transformers
    return Glm4MoeConfig(**kw, **_sigmoid_groups(cfg), head_dim=cfg.hidden_size // cfg.num_heads,
                         num_nextn_predict_layers=0)


def _dots1(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # no sliding window: every layer sees the whole context (prefill, decoding and teacher forcing agree)
    return Dots1Config(**kw, **_sigmoid_groups(cfg), sliding_window=None)


def _minimax_m2(cfg: ModelConfig, kw: dict) -> PretrainedConfig:
    # MiniMax-M2's experts read config.intermediate_size: that is the routed-expert width here; no shared expert
    return MiniMaxM2Config(**{**kw, "intermediate_size": cfg.moe_intermediate_size},
                           num_local_experts=cfg.num_experts, head_dim=cfg.hidden_size // cfg.num_heads,
                           router_jitter_noise=0.0)


SIGMOID_FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec("deepseek_v3", DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3TopkRouter, _deepseek,
               deepseek_select, deepseek_gate_weights, router_logp=sigmoid_router_logp, bias=router_bias),
    FamilySpec("glm4_moe", Glm4MoeConfig, Glm4MoeForCausalLM, Glm4MoeTopkRouter, _glm4_moe,
               deepseek_select, deepseek_gate_weights, router_logp=sigmoid_router_logp, bias=router_bias),
    FamilySpec("dots1", Dots1Config, Dots1ForCausalLM, Dots1TopkRouter, _dots1,
               deepseek_select, deepseek_gate_weights, router_logp=sigmoid_router_logp, bias=router_bias),
    FamilySpec("deepseek_v32", DeepseekV32Config, DeepseekV32ForCausalLM, DeepseekV32TopkRouter, _deepseek_v32,
               deepseek_select, deepseek_gate_weights, router_logp=sigmoid_router_logp, bias=router_bias),
    FamilySpec("minimax_m2", MiniMaxM2Config, MiniMaxM2ForCausalLM, MiniMaxM2TopKRouter, _minimax_m2,
               minimax_select, minimax_gate_weights, router_logp=sigmoid_router_logp, bind=bind_block,
               bias=block_bias),
)
