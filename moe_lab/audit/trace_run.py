"""The model side of `moe-lab check-trace`: teacher-forced forwards of one sequence, free and replayed.

``free_pass``: the model routes on its own (moe_lab's record(), with each router's margin kept by hooks of
this module). ``replay_pass``: the imported routes forced with moe_lab's replay() (R3), while a pre-hook on each
MoE layer's experts module reads the ids the experts were actually handed - what ran, not what the router
hook returned: a fused path that ignores the router's output shows up here as a difference.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from moe_lab.formats.routes import RoutedSequence
from moe_lab.models import moe_layers
from moe_lab.routing import Trace, index_dtype, record, replay

Tensor = torch.Tensor


@dataclass
class FreePass:
    ids_LSK: Tensor  # the model's own top-k, int64
    margin_LS: Tensor  # router log-prob of its k-th choice minus its (k+1)-th: how near the set was to changing
    token_logp_S: Tensor  # log p(token s | tokens < s) for s >= 1 (entry 0 is 0), float64
    tie_LS: Tensor | None = None  # the margin one bf16 rounding of the router logits erases (tie_scale_S)


@dataclass
class ReplayPass:
    forced_LSK: Tensor  # the ids replay forced (the trace's where usable, else the model's own)
    ran_LSK: Tensor | None  # the ids the experts modules received; None: no experts module to observe
    token_logp_S: Tensor


def _token_logp(logits_1SV: Tensor, tokens_S: Tensor) -> Tensor:
    logp = F.log_softmax(logits_1SV[0, :-1].double(), dim=-1)
    out = torch.zeros(tokens_S.numel(), dtype=torch.float64)
    out[1:] = logp.gather(1, tokens_S[1:, None].to(logp.device)).squeeze(1).cpu()
    return out


def _margin_LS(logp_LSE: Tensor, k: int) -> Tensor:
    if logp_LSE.shape[-1] <= k:
        return torch.full(logp_LSE.shape[:2], float("inf"))
    top = logp_LSE.float().topk(k + 1, dim=-1).values
    return (top[..., k - 1] - top[..., k]).cpu()


def tie_scale_S(router_logp, logits_NE: Tensor, k: int) -> Tensor:
    """How much of a row's margin one bf16 rounding erases: engines run routers in bf16 (or on bf16 hidden
    states), so the k-th and (k+1)-th logits each move by up to one bf16 spacing at the row's largest |logit|;
    the margin moved toward the tie by that, in the margin's own units (the family's router log-probs)."""
    z = logits_NE.detach().float()
    if z.shape[-1] <= k:
        return torch.ones(z.shape[0])
    top = z.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(top)))
    pair = router_logp(z).topk(k + 1, dim=-1).indices[:, k - 1:]  # the k-th and (k+1)-th choices
    moved = z.scatter_add(1, pair, torch.cat([-ulp, ulp], dim=1))
    before, after = router_logp(z).gather(1, pair), router_logp(moved).gather(1, pair)
    return ((before[:, 0] - before[:, 1]) - (after[:, 0] - after[:, 1])).abs().cpu()


@contextmanager
def margin_probe(model: nn.Module) -> Iterator[list[list[Tensor]]]:
    """Forward hooks on the routers keeping, per call, each row's margin (``_margin_LS``) from the family's
    router log-probs and its rounding scale (``tie_scale_S``): (2, S) per layer, never the dense (S, E) log-probs
    (a long sequence of a large model)."""
    seen: list[list[Tensor]] = []
    handles = []
    for layer in moe_layers(model):
        seen.append([])

        def hook(router, args, output, store=seen[-1], family=layer.family):
            logp_NE = family.router_logp(output[0].detach())
            store.append(torch.stack([_margin_LS(logp_NE[None], router.top_k)[0],
                                      tie_scale_S(family.router_logp, output[0], router.top_k)]))
        handles.append(layer.router.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def free_pass(model: nn.Module, tokens_S: Tensor, device: torch.device) -> FreePass:
    input_ids = tokens_S[None].to(device)
    with record(model, weights=False) as trace, margin_probe(model) as margins:
        logits = model(input_ids=input_ids).logits
    ids_LSK = trace.indices[:, 0].long().cpu()
    probe_L2S = torch.stack([torch.cat(m, dim=1) for m in margins])
    return FreePass(ids_LSK, probe_L2S[:, 0], _token_logp(logits, tokens_S), probe_L2S[:, 1])


def usable_LS(ids_LSK: Tensor, mask_LS: Tensor, num_experts: int) -> Tensor:
    """Slots whose route can be forced: present, every id in range, no id repeated within the top-k."""
    in_range = ((ids_LSK >= 0) & (ids_LSK < num_experts)).all(-1)
    srt = ids_LSK.sort(-1).values
    unique = (srt[..., 1:] != srt[..., :-1]).all(-1) if ids_LSK.shape[-1] > 1 else torch.ones_like(mask_LS)
    return mask_LS & in_range & unique


def forced_trace(seq: RoutedSequence, free_ids_LSK: Tensor, num_experts: int, family: str) -> Trace:
    """The Trace replay forces: the imported route on usable slots, the model's own choice elsewhere (a
    missing route is never forced as expert 0)."""
    r = seq.routes
    use = usable_LS(r.ids_LSK, r.mask_LS, num_experts)
    ids = torch.where(use[..., None], r.ids_LSK, free_ids_LSK)
    return Trace(ids[:, None].to(index_dtype(num_experts)), num_experts=num_experts, family=family)


@contextmanager
def experts_probe(model: nn.Module) -> Iterator[list[list[Tensor]]]:
    """Pre-hooks on each MoE layer's experts module (the router's sibling ``experts``) keeping the top-k ids
    it is handed; yields per-layer lists (empty lists: that layer has no experts module to observe)."""
    names = {id(m): n for n, m in model.named_modules()}
    seen: list[list[Tensor]] = []
    handles = []
    for layer in moe_layers(model):
        parent = model.get_submodule(names[id(layer.router)].rpartition(".")[0])
        experts = getattr(parent, "experts", None)
        seen.append([])
        if isinstance(experts, nn.Module):
            handles.append(experts.register_forward_pre_hook(_keeper(seen[-1]), with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _keeper(store: list[Tensor]):
    def hook(module, args, kwargs):
        ids = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
        if isinstance(ids, Tensor):
            store.append(ids.detach().long().cpu())
    return hook


@torch.no_grad()
def replay_pass(model: nn.Module, tokens_S: Tensor, trace: Trace, device: torch.device) -> ReplayPass:
    input_ids = tokens_S[None].to(device)
    L, _, S, K = trace.shape
    with experts_probe(model) as seen, replay(model, trace.to(device)):
        logits = model(input_ids=input_ids).logits
    ran = None
    if all(len(s) == 1 and s[0].numel() == S * K for s in seen):
        ran = torch.stack([s[0].reshape(S, K) for s in seen])
    return ReplayPass(trace.indices[:, 0].long().cpu(), ran, _token_logp(logits, tokens_S))
