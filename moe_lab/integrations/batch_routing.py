"""Routing data of a trainer's batches: traces carried batch-first, the columns its forwards cover, position ids.

Not TRL-specific (any trainer integration can use it): trainers such as TRL's shuffle and split every tensor of
the batch dict along dim 0, so the routing rides in that dict as ``ids_BLSK`` (rows first) and stays aligned
with its rows; a ``Trace`` (``ids_LBSK``) is rebuilt for each forward. Pure tensor code: imports no trainer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from moe_lab.models import position_ids_from_mask
from moe_lab.routing import Trace, record, replay

Tensor = torch.Tensor


def to_batch(ids_LBSK: Tensor) -> Tensor:
    """Trace layout (L, B, S, K) -> batch-first (B, L, S, K), so TRL's shuffle and split keep rows aligned."""
    return ids_LBSK.transpose(0, 1).contiguous()


def to_trace(ids_BLSK: Tensor, like: Trace | dict, router_logp_BLSK: Tensor | None = None,
             weights_BLSK: Tensor | None = None) -> Trace:
    """A Trace of batch-first ids (and router log-probs, combine weights); ``like`` gives num_experts and family."""
    num_experts, family = (like.num_experts, like.family) if isinstance(like, Trace) else (like["E"], like["family"])
    logp = None if router_logp_BLSK is None else router_logp_BLSK.transpose(0, 1).contiguous()
    weights = None if weights_BLSK is None else weights_BLSK.transpose(0, 1).contiguous()
    return Trace(ids_BLSK.transpose(0, 1).contiguous(), weights, num_experts=num_experts, family=family,
                 router_logp=logp)


def fit_columns(ids_XLSK: Tensor, seq_len: int) -> Tensor:
    """Cut or extend the column axis (2) to ``seq_len``.

    generate() never forwards its last token, so its trace has S-1 columns (and more when rows were padded
    after their EOS); TRL's forward covers S = P + C. An added column is the last position's, whose routing
    reaches no scored token (causal attention): it gets the valid filler ids 0..k-1 and is masked everywhere.
    """
    have = ids_XLSK.shape[2]
    if have >= seq_len:
        return ids_XLSK[:, :, :seq_len].contiguous()
    k = ids_XLSK.shape[-1]
    if ids_XLSK.is_floating_point():  # combine weights: the filler column carries 1/k each (masked anyway)
        filler = torch.full((k,), 1.0 / k, dtype=ids_XLSK.dtype, device=ids_XLSK.device)
    else:
        filler = torch.arange(k, dtype=ids_XLSK.dtype, device=ids_XLSK.device)
    pad = filler.expand(ids_XLSK.shape[0], ids_XLSK.shape[1], seq_len - have, k)
    return torch.cat([ids_XLSK, pad], dim=2)


def place_rows(rows: list[Tensor], prompt_lens: list[int], prompt_width: int, seq_len: int,
               dtype: torch.dtype) -> Tensor:
    """(B, L, seq_len, K) from per-sequence routes (L, n_i, K) of UNPADDED sequences (an engine such as vLLM
    returns one array per request): row i's position t lands in column prompt_width - prompt_lens[i] + t, as the
    batch left-pads prompts to prompt_width and right-pads completions. Pad columns get the filler ids 0..k-1
    (ids) or 1/k (weights): never scored, masked everywhere."""
    L, _, K = rows[0].shape
    if dtype.is_floating_point:
        out = torch.full((len(rows), L, seq_len, K), 1.0 / K, dtype=dtype)
    else:
        out = torch.arange(K, dtype=dtype).expand(len(rows), L, seq_len, K).clone()
    for i, (row, p) in enumerate(zip(rows, prompt_lens)):
        start = prompt_width - p
        n = min(row.shape[1], seq_len - start)
        out[i, :, start:start + n] = row[:, :n].to(dtype)
    return out


def fit_width(x_BC: Tensor, width: int) -> Tensor:
    """Cut or zero-pad the last axis to ``width`` (per-token values of the completions; the padding is masked)."""
    if x_BC.shape[1] >= width:
        return x_BC[:, :width]
    return torch.cat([x_BC, x_BC.new_zeros(x_BC.shape[0], width - x_BC.shape[1])], dim=1)


def response_mask_BS(completion_mask_BC: Tensor, prompt_len: int) -> Tensor:
    """(B, P + C) bool: routing column j is the one that scores token j + 1, so the C completion tokens are
    scored by columns P - 1 .. P + C - 2 (the last column scores nothing)."""
    B, C = completion_mask_BC.shape
    mask_BS = torch.zeros(B, prompt_len + C, dtype=torch.bool, device=completion_mask_BC.device)
    mask_BS[:, prompt_len - 1:prompt_len + C - 1] = completion_mask_BC.bool()
    return mask_BS


def _add_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    mask_BS = kwargs.get("attention_mask")
    if kwargs.get("position_ids") is not None or mask_BS is None or mask_BS.dim() != 2:
        return None
    return args, {**kwargs, "position_ids": position_ids_from_mask(mask_BS)}


@contextmanager
def position_ids(model: nn.Module, on: bool = True) -> Iterator[None]:
    """Each call of ``model`` inside gets position_ids from its 2-D attention mask when it passes none (TRL's
    forwards), numbered as generate() numbers left-padded rows; off: nothing installed."""
    handle = model.register_forward_pre_hook(_add_position_ids, with_kwargs=True) if on else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


class RoutingRun:
    """The routing of one forward call: ``used`` (what ran; with the router's log-probs of those ids when kept)
    and ``free`` (the router's own choice: the same trace without replay, ``handle.latent`` under replay).
    Read them after the ``routing_run`` context has exited."""

    def __init__(self, recorded: Trace | None = None, handle=None, router_logp: bool = False):
        self.recorded, self.handle, self.router_logp = recorded, handle, router_logp

    @property
    def used(self) -> Trace:
        if self.handle is None:
            return self.recorded
        used = self.handle.used
        return used.with_router_logp(self.handle.router_logp_LBTK) if self.router_logp else used

    @property
    def free(self) -> Trace:
        return self.recorded if self.handle is None else self.handle.latent


@contextmanager
def routing_run(model: nn.Module, forced: Trace | None, router_logp: bool = False,
                weights: bool = False) -> Iterator[RoutingRun]:
    """moe_lab's record() (forced None) or replay(forced) around ONE model call (and its backward, whose
    checkpointing recompute reuses the call's routing). ``weights``: record the combine weights too, and under
    replay force the trace's recorded weights as well (moe_lab's ``rl.replay_gate_weights``)."""
    if forced is None:
        with record(model, weights=weights, router_logp=router_logp) as trace:
            yield RoutingRun(recorded=trace, router_logp=router_logp)
    else:
        with replay(model, forced, router_logp=router_logp, weights=weights) as handle:
            yield RoutingRun(handle=handle, router_logp=router_logp)


class RolloutLogp:
    """Log-probs of the sampled tokens under generate()'s own forwards: ``log_softmax(logits / T)`` of each
    step, read at the token the next step feeds back (the last one from the returned completions). The same
    tempered distribution TRL's training forward scores (TRL passes ``temperature`` to its fused LM head)."""

    def __init__(self, temperature: float):
        self.temperature = float(temperature)
        self.steps: list[Tensor] = []
        self.pending_BV: Tensor | None = None

    def hook(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        with torch.no_grad():
            ids = kwargs.get("input_ids", args[0] if args else None)
            if self.pending_BV is not None:
                self.steps.append(self.pending_BV.gather(1, ids[:, -1:].long()))
            logits_BV = output.logits[:, -1].float()
            self.pending_BV = torch.log_softmax(logits_BV / self.temperature, dim=-1)

    def finish(self, completion_ids: list[list[int]]) -> Tensor:
        """(B, C) log-probs of the completions' tokens (0 past a row's end), C = the longest completion."""
        if self.pending_BV is None:
            raise RuntimeError("RolloutLogp: generate() made no forward call")
        B, C = len(completion_ids), max((len(c) for c in completion_ids), default=0)
        steps = self.steps
        if len(steps) < C:  # the last sampled token is never fed back: read it from the completions
            last = torch.tensor([c[len(steps)] if len(c) > len(steps) else 0 for c in completion_ids])
            steps = steps + [self.pending_BV.gather(1, last.view(B, 1).to(self.pending_BV.device))]
        logp_BC = torch.cat(steps, dim=1)[:, :C] if steps else torch.zeros(B, 0)
        self.steps, self.pending_BV = [], None
        return logp_BC
