"""The model side of `moe-lab check-trace`: teacher-forced forwards of one sequence, free and replayed.

``free_pass``: the model routes on its own (moe_lab's record(), with each router's margin kept by hooks of
this module). ``replay_pass``: the imported routes forced with moe_lab's replay() (R3), while a pre-hook on each
MoE layer's experts module reads the ids the experts were actually handed - what ran, not what the router
hook returned: a fused path that ignores the router's output shows up here as a difference.

Both run the decoder alone (``get_decoder()``): routing needs no logits. The output head runs only for a
sequence that carries engine log-probs (``logp_from``), over the positions they cover, a chunk of positions at
a time, so a full-vocabulary row is never held for the whole sequence (V = 152k at S = 8k is 2.4 GB of bf16
logits; a float64 log-softmax over all of them would be 10 GB).
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
    # log p(token s | tokens < s) for s >= logp_from (entries before are 0), float64; None: not asked for
    token_logp_S: Tensor | None
    tie_LS: Tensor | None = None  # the margin one bf16 rounding of the router logits erases (tie_scale_S)


@dataclass
class ReplayPass:
    forced_LSK: Tensor  # the ids replay forced (the trace's where usable, else the model's own)
    ran_LSK: Tensor | None  # the ids the experts modules received; None: no experts module to observe
    token_logp_S: Tensor | None


# logits held at once by the log-prob pass: positions per chunk = this // vocabulary size (64 MB of fp32)
LOGP_CHUNK_ELEMENTS = 1 << 24


def input_device(model: nn.Module) -> torch.device:
    """Where the token ids go: the input embedding's device (under a device_map, the first layer's)."""
    weight = model.get_input_embeddings().weight
    return torch.device("cpu") if weight.device.type == "meta" else weight.device


def _token_logp(model: nn.Module, hidden_1SH: Tensor, tokens_S: Tensor, logp_from: int) -> Tensor:
    """log p(token s | tokens < s) for s in [max(1, logp_from), S): the model's own head, in its dtype, on a
    chunk of positions at a time; the log-softmax of each chunk in float32 (as engines compute log-probs from
    bf16 logits), returned as float64."""
    head, S = model.get_output_embeddings(), tokens_S.numel()
    out = torch.zeros(S, dtype=torch.float64)
    first = max(1, logp_from)
    chunk = max(1, LOGP_CHUNK_ELEMENTS // head.weight.shape[0])
    for a in range(first, S, chunk):
        b = min(S, a + chunk)
        logits_CV = head(hidden_1SH[0, a - 1:b - 1])  # position s is predicted from hidden state s - 1
        logp_CV = F.log_softmax(logits_CV.float(), dim=-1)
        out[a:b] = logp_CV.gather(1, tokens_S[a:b, None].to(logp_CV.device)).squeeze(1).double().cpu()
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
def free_pass(model: nn.Module, tokens_S: Tensor, device: torch.device, logp_from: int | None = None) -> FreePass:
    """``logp_from``: the first position whose token log-prob is wanted (None: none, the head never runs)."""
    decoder = model.get_decoder()
    with record(decoder, weights=False) as trace, margin_probe(decoder) as margins:
        hidden = decoder(input_ids=tokens_S[None].to(device)).last_hidden_state
    ids_LSK = trace.indices[:, 0].long().cpu()
    probe_L2S = torch.stack([torch.cat(m, dim=1) for m in margins])
    logp = None if logp_from is None else _token_logp(model, hidden, tokens_S, logp_from)
    return FreePass(ids_LSK, probe_L2S[:, 0], logp, probe_L2S[:, 1])


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
def replay_pass(model: nn.Module, tokens_S: Tensor, trace: Trace, device: torch.device,
                logp_from: int | None = None) -> ReplayPass:
    decoder = model.get_decoder()
    L, _, S, K = trace.shape
    with experts_probe(decoder) as seen, replay(decoder, trace.to(device)):
        hidden = decoder(input_ids=tokens_S[None].to(device)).last_hidden_state
    ran = None
    if all(len(s) == 1 and s[0].numel() == S * K for s in seen):
        ran = torch.stack([s[0].reshape(S, K) for s in seen])
    logp = None if logp_from is None else _token_logp(model, hidden, tokens_S, logp_from)
    return ReplayPass(trace.indices[:, 0].long().cpu(), ran, logp)
