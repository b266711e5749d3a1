"""The routers' choice functions: for each router class, ``select`` and ``gate_weights`` that reproduce its output
bit-exactly, its ``router_logp``, and where it keeps a choice-only correction bias.

- ``select(router, logits_NE) -> (weights_NK, ids_NK)``: the router's own choice, bit-exact with what it returns
  given the logits it returned (same op order, same dtypes);
- ``gate_weights(router, logits_NE, ids_NK) -> weights_NK``: its normalisation applied to GIVEN ids, gathered
  from the dense logits/probabilities (never from top-k-zeroed ones, which would silently kill the router
  gradient of a replayed expert the router no longer picks).

Grouped by router kind, as the family modules ``softmax`` and ``sigmoid`` are: each family's functions sit beside
those of the routers it differs from by one step (the renormalisation, a dtype, where the bias is kept).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor


# --------------------------------------------------------------------------- softmax routers


def softmax_router_logp(logits_NE: Tensor) -> Tensor:
    # log-softmax over all E experts in fp32: the distribution a softmax router samples its top-k from,
    # also for gpt-oss (whose gate renormalises over the k chosen logits only).
    return F.log_softmax(logits_NE.float(), dim=-1)


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


def renorm_select(router: nn.Module, logits_NE: Tensor) -> tuple[Tensor, Tensor]:
    # Qwen3.5-MoE: Qwen's choice with the renormalisation always on (its router has no norm_topk_prob switch)
    return _softmax_select(logits_NE, router.top_k, norm=True, cast_back=True)


def renorm_gate_weights(router: nn.Module, logits_NE: Tensor, ids_NK: Tensor) -> Tensor:
    return _softmax_gate(logits_NE, ids_NK.long(), norm=True, cast_back=True)


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


INPUT_DTYPE = "moe_lab_input_dtype"  # router attribute: the dtype of the hidden states of its latest call


def bind_input_dtype(block: nn.Module, router: nn.Module) -> None:
    # ERNIE-4.5 casts its gate weights to the dtype of the hidden states it is called with, which its (always
    # fp32) logits do not carry: a pre-hook keeps that dtype on the router for select()/gate_weights()
    if INPUT_DTYPE not in router.__dict__:
        router.__dict__[INPUT_DTYPE] = None
        router.register_forward_pre_hook(_keep_input_dtype)


def _keep_input_dtype(router: nn.Module, args: tuple) -> None:
    router.__dict__[INPUT_DTYPE] = args[0].dtype


def statics_bias(router: nn.Module) -> Tensor:
    # ERNIE-4.5 keeps it as a (1, E) Parameter without gradient on router.moe_statics
    return router.moe_statics.e_score_correction_bias


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


# ------------------------------------------------------- sigmoid routers with a choice-only correction bias


def sigmoid_router_logp(logits_NE: Tensor) -> Tensor:
    # DeepSeek-V3 scores experts with independent sigmoids (no softmax): their log, normalised over all E
    # experts, log(s_e / sum_j s_j), is the distribution we compare. The choice-only correction bias is left
    # out, like in the gate weights. logsigmoid keeps it finite for very negative logits.
    logs_NE = F.logsigmoid(logits_NE.float())
    return logs_NE - torch.logsumexp(logs_NE, dim=-1, keepdim=True)


def router_bias(router: nn.Module) -> Tensor:
    return router.e_score_correction_bias


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


def block_bias(router: nn.Module) -> Tensor:
    return _block_bias(router)


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
