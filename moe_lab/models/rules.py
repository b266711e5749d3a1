"""The pieces every family entry is made of: ``FamilySpec`` and the routers' choice rules.

``select``/``gate_weights`` reproduce one router class's output bit-exactly (see ``families``); the tiny-config
helpers at the end are shared by the families of ``families`` and ``families_2026``. The functions of the six
first families moved here verbatim from ``families`` (which re-exports them): their record/replay is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

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
    # (moe block, its router) -> None: links a router to state its block keeps (MiniMax-M2's correction bias);
    # moe_layers() runs it, so every record/replay session finds the link made
    bind: Callable[[nn.Module, nn.Module], None] | None = None
    # router -> its choice-only correction bias (the tensor itself, updated in place by moe_lab/rl/expert_bias.py);
    # None: the family's router has none (constants.BIAS_FAMILIES names the others)
    bias: Callable[[nn.Module], Tensor] | None = None

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


def renorm_select(router: nn.Module, logits_NE: Tensor) -> tuple[Tensor, Tensor]:
    # Qwen3.5-MoE: Qwen's rule with the renormalisation always on (its router has no norm_topk_prob switch)
    return _softmax_select(logits_NE, router.top_k, norm=True, cast_back=True)


def renorm_gate_weights(router: nn.Module, logits_NE: Tensor, ids_NK: Tensor) -> Tensor:
    return _softmax_gate(logits_NE, ids_NK.long(), norm=True, cast_back=True)


BLOCK_LINK = "moe_lab_block"  # router attribute holding (its MoE block,): a tuple, so not a submodule


def bind_block(block: nn.Module, router: nn.Module) -> None:
    # A plain attribute, not a buffer: the state dict keeps transformers' layout, .to() moves the block's own
    # buffer (read at call time), and deepcopy maps the tuple onto the copied block.
    first = BLOCK_LINK not in router.__dict__
    router.__dict__[BLOCK_LINK] = (block,)
    if first:  # router(x) alone (PR2's refit, a manual call) then routes as inside its block
        router.register_forward_pre_hook(_default_block_bias)


def _default_block_bias(router: nn.Module, args: tuple) -> tuple | None:
    # the block passes its bias itself: then nothing changes (None keeps the call as it was)
    return (args[0], _block_bias(router)) if len(args) == 1 else None


def _block_bias(router: nn.Module) -> Tensor:
    link = router.__dict__.get(BLOCK_LINK)
    if link is None:
        raise RuntimeError(f"{type(router).__name__}: its correction bias lives on the MoE block; call "
                           "moe_lab.models.moe_layers(model) (record/replay do) before select()")
    return link[0].e_score_correction_bias


def router_bias(router: nn.Module) -> Tensor:
    return router.e_score_correction_bias


def block_bias(router: nn.Module) -> Tensor:
    return _block_bias(router)


def statics_bias(router: nn.Module) -> Tensor:
    # ERNIE-4.5 keeps it as a (1, E) Parameter without gradient on router.moe_statics
    return router.moe_statics.e_score_correction_bias


def minimax_select(router: nn.Module, logits_NE: Tensor) -> tuple[Tensor, Tensor]:
    # MiniMax-M2: sigmoid scores in fp32, the block's correction bias shifts the choice only (no groups), the
    # k chosen scores always renormalised
    scores_NE = F.sigmoid(logits_NE.float())
    ids_NK = torch.topk(scores_NE + _block_bias(router), router.top_k, dim=-1, sorted=False)[1]
    weights_NK = scores_NE.gather(1, ids_NK)
    return weights_NK / weights_NK.sum(dim=-1, keepdim=True), ids_NK


def minimax_gate_weights(router: nn.Module, logits_NE: Tensor, ids_NK: Tensor) -> Tensor:
    weights_NK = F.sigmoid(logits_NE.float()).gather(1, ids_NK.long())
    return weights_NK / weights_NK.sum(dim=-1, keepdim=True)


INPUT_DTYPE = "moe_lab_input_dtype"  # router attribute: the dtype of the hidden states of its latest call


def bind_input_dtype(block: nn.Module, router: nn.Module) -> None:
    # ERNIE-4.5 casts its gate weights to the dtype of the hidden states it is called with, which its (always
    # fp32) logits do not carry: a pre-hook keeps that dtype on the router for select()/gate_weights()
    if INPUT_DTYPE not in router.__dict__:
        router.__dict__[INPUT_DTYPE] = None
        router.register_forward_pre_hook(_keep_input_dtype)


def _keep_input_dtype(router: nn.Module, args: tuple) -> None:
    router.__dict__[INPUT_DTYPE] = args[0].dtype


def _ernie_weights(router: nn.Module, probs_NE: Tensor, ids_NK: Tensor) -> Tensor:
    dtype = router.__dict__.get(INPUT_DTYPE)
    if dtype is None:
        raise RuntimeError(f"{type(router).__name__}: its gate weights take the dtype of its input; call "
                           "moe_lab.models.moe_layers(model) (record/replay do) and run the model first")
    weights_NK = probs_NE.gather(1, ids_NK)
    return (weights_NK / torch.clamp(weights_NK.sum(dim=-1, keepdim=True), min=router.norm_min)).to(dtype)


def ernie_select(router: nn.Module, logits_NE: Tensor) -> tuple[Tensor, Tensor]:
    # ERNIE-4.5: softmax in fp32, the correction bias (router.moe_statics) shifts the choice only, the k chosen
    # probabilities renormalised with the sum clamped at norm_min
    probs_NE = F.softmax(logits_NE, dim=1, dtype=torch.float)
    ids_NK = torch.topk(router.moe_statics(probs_NE), router.top_k, dim=-1)[1]
    return _ernie_weights(router, probs_NE, ids_NK), ids_NK


def ernie_gate_weights(router: nn.Module, logits_NE: Tensor, ids_NK: Tensor) -> Tensor:
    return _ernie_weights(router, F.softmax(logits_NE, dim=1, dtype=torch.float), ids_NK.long())


def sigmoid_router_logp(logits_NE: Tensor) -> Tensor:
    # DeepSeek-V3 scores experts with independent sigmoids (no softmax): their log, normalised over all E
    # experts, log(s_e / sum_j s_j), is the distribution we compare. The choice-only correction bias is left
    # out, like in the gate weights. logsigmoid keeps it finite for very negative logits.
    logs_NE = F.logsigmoid(logits_NE.float())
    return logs_NE - torch.logsumexp(logs_NE, dim=-1, keepdim=True)


# --------------------------------------------------------------------------- tiny configs


def deepseek_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group): groups of >= 2 experts (the router sums each group's top-2), at most 4 groups,
    and enough kept groups to hold top_k experts; half the groups kept so the group limit really bites."""
    n_group = max(g for g in range(1, 5) if num_experts % g == 0 and num_experts // g >= 2)
    per_group = num_experts // n_group
    topk_group = min(n_group, max(-(-top_k // per_group), n_group // 2, 1))
    return n_group, topk_group


def shared_width(cfg: ModelConfig, width: int) -> int:
    # model.shared_expert=False: a width-0 shared expert. transformers builds the module unconditionally; with
    # no hidden units its output is exactly 0 (an empty sum), in the forward, in save/load and on any device,
    # so the block's output is the routed experts' alone. (qwen2_moe's sigmoid gate then multiplies 0.)
    return width if cfg.shared_expert else 0


def norm_topk(cfg: ModelConfig, family_default: bool) -> bool:
    return family_default if cfg.norm_topk_prob is None else cfg.norm_topk_prob
