"""record() and replay(): forward hooks on the router modules, installed inside a context and removed on exit.

All state lives in the context's session object (no globals). A forward pre-hook on the model you pass gives
each call's (B, S) and KV-cache length; a forward hook on each router reads or rewrites its output
``(router_logits_NE, weights_NK, ids_NK)``, whose rows are the (B, S) positions flattened row-major.

- record: a teacher-forced forward, or generate() with the KV cache (prefill columns, then one column per
  decode step). generate() never forwards its last sampled token, so the trace of a sequence of total
  length S has S-1 columns, aligned with a teacher-forced forward on input_ids[:, :-1].
- replay: one forward call covering exactly the trace's (B, S); the trace's ids are forced and the gate
  weights recomputed from the CURRENT logits with the family's gate_weights(), so the router keeps its
  gradient. ``handle.latent`` is what the router would have chosen. ``gate`` > 0: forced experts the router now
  rates too low give way to its own (routing/gate.py; ``handle.used``, ``handle.replaced_LBSK``); weights=True
  forces the recorded gate weights too (prime-rl PR #3523): constants, no router gradient from the combine.
- Activation checkpointing: a router running again within the same call is the backward recompute; it
  reuses the call's forced ids and noise and appends nothing.
- router_logp=True (record, replay) also keeps the router's log-probabilities (``FamilySpec.router_logp``: a
  log-softmax over all experts, or DeepSeek's normalised sigmoid scores) of the chosen / forced experts, fp32
  and detached, from the CLEAN router logits (router noise only perturbs the choice). Off by default: then
  nothing extra is computed. ``router_logp_probe()`` keeps the dense (L, B, S, E) log-probs of any call, or
  only those at given ids, so a free-routing forward can be read at another trace's ids (RSPO's old experts).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from moe_lab.models import moe_layers
from moe_lab.routing.gate import gated_ids
from moe_lab.routing.handle import ReplayHandle
from moe_lab.routing.router_logp import RouterLogp
from moe_lab.routing.trace import Trace

Tensor = torch.Tensor


def check_trace(model: nn.Module, trace: Trace, batch_shape: tuple[int, int] | None = None) -> None:
    """Raise one ValueError listing every way ``trace`` does not fit ``model`` (and the batch (B, S))."""
    layers = moe_layers(model)
    router = layers[0].router
    pairs = [("num_layers", trace.num_layers, len(layers)), ("top_k", trace.top_k, router.top_k),
             ("num_experts", trace.num_experts, router.num_experts), ("family", trace.family, layers[0].family.name)]
    if batch_shape is not None:
        pairs.append(("batch shape (B, S)", (trace.batch_size, trace.seq_len), tuple(batch_shape)))
    diffs = [f"{name}: trace {t!r} vs {'batch' if name.startswith('batch') else 'model'} {m!r}"
             for name, t, m in pairs if t != m]
    if diffs:
        raise ValueError("trace does not match: " + "; ".join(diffs))
    _check_ids(trace)


def _check_ids(trace: Trace) -> None:
    """Forced ids must name real experts, k distinct ones per token (else gather fails, or a CUDA assert)."""
    ids = trace.indices.long()
    if ids.numel() and int(ids.max()) >= trace.num_experts:
        raise ValueError(f"trace ids: found expert id {int(ids.max())}; allowed 0..{trace.num_experts - 1}")
    if trace.top_k > 1 and bool((ids.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        raise ValueError("trace ids: a token lists the same expert twice in its top-k; allowed: k distinct ids")


def _call_shape(args: tuple, kwargs: dict) -> tuple[int, int]:
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None or tokens.dim() < 2:
        raise ValueError("routing hooks need input_ids (B, S) or inputs_embeds (B, S, H) in each model call")
    return int(tokens.shape[0]), int(tokens.shape[1])


def _cache_len(kwargs: dict) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0


def _checkpointing(model: nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


class _Session:
    """Call bookkeeping shared by record and replay."""

    def __init__(self, model: nn.Module, noise_std: float, generator: torch.Generator | None,
                 router_logp: bool = False):
        if isinstance(noise_std, bool) or not isinstance(noise_std, (int, float)) or not noise_std >= 0:
            raise ValueError(f"noise_std={noise_std!r} is out of range: allowed a float >= 0")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator: expected a torch.Generator or None, got {type(generator).__name__}")
        if not isinstance(router_logp, bool):
            raise ValueError(f"router_logp={router_logp!r}: allowed True or False")
        self.router_logp = router_logp
        self.model, self.layers = model, moe_layers(model)
        self.noise_std, self.generator = float(noise_std), generator
        self.top_k = self.layers[0].router.top_k
        self.shape: tuple[int, int] | None = None  # (B, S) of the current call
        self.cols, self.calls = 0, 0  # trace columns covered so far; model calls seen
        self.runs = [0] * len(self.layers)  # router runs of each layer in the current call
        self.noise_NE: list[Tensor | None] = [None] * len(self.layers)  # reused by the recompute
        self.checkpointed = False  # current call runs under activation checkpointing
        self.handles: list[Any] = []

    def install(self) -> None:
        self.handles.append(self.model.register_forward_pre_hook(self._pre_call, with_kwargs=True))
        for pos, layer in enumerate(self.layers):
            self.handles.append(layer.router.register_forward_hook(functools.partial(self._router_hook, pos)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _pre_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        B, S = _call_shape(args, kwargs)
        self._start_call(B, S, _cache_len(kwargs))
        self.shape, self.calls = (B, S), self.calls + 1
        self.runs, self.noise_NE = [0] * len(self.layers), [None] * len(self.layers)
        self.checkpointed = torch.is_grad_enabled() and self.model.training and _checkpointing(self.model)

    def _router_hook(self, pos: int, router: nn.Module, inputs: tuple, output: tuple) -> tuple | None:
        if self.shape is None:
            raise RuntimeError(f"MoE layer {self.layers[pos].layer_idx}: its router ran outside a call of the model "
                               f"given to record()/replay() ({type(self.model).__name__}); call that model")
        B, S = self.shape
        if output[0].shape[0] != B * S:
            raise RuntimeError(f"MoE layer {self.layers[pos].layer_idx}: router got {output[0].shape[0]} rows, "
                               f"expected B*S={B}*{S} of the model call")
        self.runs[pos] += 1
        recompute = self.runs[pos] > 1
        if recompute and not _checkpointing(self.model):
            raise RuntimeError(f"MoE layer {self.layers[pos].layer_idx}: router ran twice in one model call "
                               "without activation checkpointing")
        return self._route(pos, router, output, recompute)

    def _noised(self, pos: int, logits_NE: Tensor) -> Tensor:
        if self.noise_std == 0.0:
            return logits_NE
        if self.noise_NE[pos] is None:
            # Drawn on the generator's own device (a CPU generator cannot fill a CUDA tensor), then moved.
            where = self.generator.device if self.generator is not None else logits_NE.device
            noise = torch.randn(logits_NE.shape, generator=self.generator, device=where).to(logits_NE.device)
            self.noise_NE[pos] = (noise * self.noise_std).to(logits_NE.dtype)
        return logits_NE + self.noise_NE[pos]

    def _as_BSK(self, x_NK: Tensor) -> Tensor:
        return x_NK.reshape(*self.shape, self.top_k)

    def _logp_NE(self, pos: int, logits_NE: Tensor) -> Tensor:
        """The router's fp32 log-probs over all experts; detached: a diagnostic, never part of the loss graph."""
        with torch.no_grad():
            return self.layers[pos].family.router_logp(logits_NE.detach())

    def _continue_columns(self, B: int, S: int, past: int, who: str) -> None:
        """One teacher-forced call, or one generate() with the KV cache: every call continues the columns."""
        if self.calls == 0 and past:
            raise RuntimeError(f"{who}: the first call already has {past} cached positions; open {who} "
                               "before the prefill so that every column is recorded")
        if self.calls and not past:
            raise RuntimeError(f"{who} covers one forward call or one generate() with the KV cache; a second "
                               "call without KV cache ran: open one context per call and join the traces with "
                               "Trace.cat (generate(use_cache=False) re-forwards the whole sequence: not supported)")
        if self.calls and (past != self.cols or B != self.shape[0]):
            raise RuntimeError(f"{who}: a KV-cache call continues batch {B} after {past} cached positions, but "
                               f"the trace holds batch {self.shape[0]} x {self.cols} columns")
        self.cols += S

    def _check_recomputed(self, what: str) -> None:
        once = [self.layers[p].layer_idx for p, n in enumerate(self.runs) if n == 1]
        if self.checkpointed and once:
            raise RuntimeError(f"{what}: activation checkpointing is on and MoE layers {once} were not recomputed "
                               f"before the context exited; call backward() inside the {what} context, or the "
                               "recompute would route without it")

    def _start_call(self, B: int, S: int, past: int) -> None:
        raise NotImplementedError

    def _route(self, pos: int, router: nn.Module, output: tuple, recompute: bool) -> tuple | None:
        raise NotImplementedError


def _empty_trace(layers: list, weights: bool, router_logp: bool = False) -> Trace:
    router = layers[0].router
    return Trace._recording(len(layers), router.top_k, router.num_experts, layers[0].family.name, weights,
                            router_logp)


class Recorder(_Session):
    def __init__(self, model: nn.Module, weights: bool, noise_std: float, generator: torch.Generator | None,
                 router_logp: bool = False):
        super().__init__(model, noise_std, generator, router_logp)
        self.trace = _empty_trace(self.layers, bool(weights), router_logp)

    def _start_call(self, B: int, S: int, past: int) -> None:
        self._continue_columns(B, S, past, "record()")

    def _route(self, pos: int, router: nn.Module, output: tuple, recompute: bool) -> tuple | None:
        logits_NE, weights_NK, ids_NK = output
        if self.noise_std:
            weights_NK, ids_NK = self.layers[pos].family.select(router, self._noised(pos, logits_NE))
        if not recompute:
            logp_NK = self._logp_NE(pos, logits_NE).gather(1, ids_NK.long()) if self.router_logp else None
            self.trace._append(pos, self._as_BSK(ids_NK), self._as_BSK(weights_NK),
                               None if logp_NK is None else self._as_BSK(logp_NK))
        # noise_std == 0: leave the output object untouched (bit-exact with no hooks at all)
        return (logits_NE, weights_NK, ids_NK) if self.noise_std else None

    def finish(self) -> None:
        if self.calls == 0:
            raise RuntimeError("record(): no call of the model ran inside the context; nothing was recorded")
        never = [self.layers[p].layer_idx for p, part in enumerate(self.trace._parts) if not part]
        if never:
            raise RuntimeError(f"record(): the routers of MoE layers {never} never ran (a fused path bypassed them)")
        if self.noise_std:
            self._check_recomputed("record()")
        self.trace._finish()


class _Replayer(_Session):
    def __init__(self, model: nn.Module, trace: Trace, noise_std: float, generator: torch.Generator | None,
                 router_logp: bool = False, gate: float = 0.0, weights: bool = False):
        if not isinstance(trace, Trace):
            raise ValueError(f"trace: expected a moe_lab.routing.Trace, got {type(trace).__name__}")
        if isinstance(gate, bool) or not isinstance(gate, (int, float)) or not 0.0 <= gate <= 1.0:
            raise ValueError(f"gate={gate!r} is out of range: allowed a float in [0, 1]")
        if weights and (gate > 0 or trace.weights is None):
            raise ValueError("weights=True needs a trace with recorded weights and gate=0 (a replaced expert has "
                             "no recorded weight)")
        self.gate, self.replay_weights = float(gate), bool(weights)
        super().__init__(model, noise_std, generator, router_logp)
        check_trace(model, trace)
        dense = RouterLogp(len(self.layers)) if router_logp else None
        self.handle = ReplayHandle(trace, _empty_trace(self.layers, weights=True, router_logp=router_logp), dense)
        self.forced_NK: list[Tensor | None] = [None] * len(self.layers)
        self.replaced_NK: list[Tensor | None] = [None] * len(self.layers)

    def _start_call(self, B: int, S: int, past: int) -> None:
        if self.calls:
            raise RuntimeError("replay() covers one forward call; open one replay() per call")
        if past:
            raise RuntimeError(f"replay() forces a forward without KV cache; this call has {past} cached positions")
        check_trace(self.model, self.handle.trace, batch_shape=(B, S))

    def _forced(self, pos: int, router: nn.Module, noisy_NE: Tensor) -> Tensor:
        """The ids this layer runs, fixed at its first run of the call (a checkpointing recompute reuses them)."""
        if self.forced_NK[pos] is None:
            ids_BSK = self.handle.trace.indices[pos]
            ids_NK = ids_BSK.reshape(-1, self.top_k).to(device=noisy_NE.device, dtype=torch.long)
            if self.gate > 0:
                ids_NK, self.replaced_NK[pos] = gated_ids(self.layers[pos].family, router, noisy_NE, ids_NK, self.gate)
            self.forced_NK[pos] = ids_NK
        return self.forced_NK[pos]

    def _weights(self, pos: int, router: nn.Module, noisy_NE: Tensor, ids_NK: Tensor, dtype: torch.dtype) -> Tensor:
        if not self.replay_weights:
            return self.layers[pos].family.gate_weights(router, noisy_NE, ids_NK)
        # The recorded fp32 weights, in the dtype the family's own weights have (fp32 in fp32 training: exactly
        # the recorded values; bf16 under train_dtype=bfloat16 only for the softmax families that cast back).
        w_NK = self.handle.trace.weights[pos].reshape(-1, self.top_k)
        return w_NK.to(device=noisy_NE.device, dtype=dtype)

    def _route(self, pos: int, router: nn.Module, output: tuple, recompute: bool) -> tuple:
        logits_NE, weights_NK, ids_NK = output
        family = self.layers[pos].family
        noisy_NE = self._noised(pos, logits_NE)
        if not recompute:
            if self.noise_std:  # no_grad: the recompute skips this, so it must save no tensors for backward
                with torch.no_grad():
                    weights_NK, ids_NK = family.select(router, noisy_NE)
            logp_BSK = None
            if self.router_logp:
                logp_NE = self._logp_NE(pos, logits_NE)
                self.handle.router_logp._append(pos, logp_NE.reshape(*self.shape, -1))
                logp_BSK = self._as_BSK(logp_NE.gather(1, ids_NK.long()))
            self.handle.latent._append(pos, self._as_BSK(ids_NK), self._as_BSK(weights_NK), logp_BSK)
        forced_NK = self._forced(pos, router, noisy_NE)
        return logits_NE, self._weights(pos, router, noisy_NE, forced_NK, weights_NK.dtype), forced_NK

    def finish(self) -> None:
        if self.calls == 0:
            raise RuntimeError("replay(): no call of the model ran inside the context; nothing was replayed")
        never = [(layer.layer_idx, type(layer.router).__name__) for p, layer in enumerate(self.layers)
                 if self.runs[p] == 0]
        if never:
            raise RuntimeError(f"replay() did not take effect: the routers of MoE layers {never} never ran, so a "
                               "fused path (e.g. a hub kernel such as MegaBlocksMoeMLP) bypassed them")
        self._check_recomputed("replay()")
        self.handle.latent._finish()
        if self.gate > 0:
            B, S = self.shape
            trace = self.handle.trace
            ids_LBSK = torch.stack([ids.reshape(B, S, self.top_k) for ids in self.forced_NK])
            self.handle.used = Trace(ids_LBSK.to(trace.indices.device, trace.indices.dtype),
                                     num_experts=trace.num_experts, family=trace.family)
            self.handle.replaced_LBSK = torch.stack([r.reshape(B, S, self.top_k) for r in self.replaced_NK])


class _Probe(_Session):
    """Reads the routers' logits only (returns None: the forward and any other session's routing unchanged)."""

    def __init__(self, model: nn.Module, ids_LBSK: Tensor | None):
        super().__init__(model, 0.0, None, router_logp=True)
        if ids_LBSK is not None and (ids_LBSK.dim() != 4 or ids_LBSK.shape[0] != len(self.layers)
                                     or ids_LBSK.is_floating_point()):
            raise ValueError(f"ids_LBSK: expected integer ids (L={len(self.layers)}, B, S, k), got "
                             f"{ids_LBSK.dtype} {tuple(ids_LBSK.shape)}")
        self.ids_LBSK = ids_LBSK
        self.logp = RouterLogp(len(self.layers), ids_LBSK)

    def _start_call(self, B: int, S: int, past: int) -> None:
        self._continue_columns(B, S, past, "router_logp_probe()")
        if self.ids_LBSK is not None and (B != self.ids_LBSK.shape[1] or self.cols > self.ids_LBSK.shape[2]):
            raise ValueError(f"ids_LBSK: (B, S)={tuple(self.ids_LBSK.shape[1:3])} do not cover the call's batch "
                             f"{B} x {self.cols} columns")

    def _route(self, pos: int, router: nn.Module, output: tuple, recompute: bool) -> None:
        if not recompute:
            B, S = self.shape
            self.logp._append(pos, self._logp_NE(pos, output[0]).reshape(B, S, -1), col0=self.cols - S)
        return None

    def finish(self) -> None:
        if self.calls == 0:
            raise RuntimeError("router_logp_probe(): no call of the model ran inside the context")
        if self.ids_LBSK is not None and self.cols != self.ids_LBSK.shape[2]:
            raise ValueError(f"ids_LBSK: {self.ids_LBSK.shape[2]} columns, but the calls covered {self.cols}")
        self.logp._join()  # raises unless every layer's router ran in every call (a fused path bypassed them)


@contextmanager
def installed(session: _Session, value: Any) -> Iterator[Any]:
    """A session's hooks installed for the body of a with-statement (record, replay, the probe, predictor's
    recorder); finished, and checked, only when the body raised nothing."""
    session.install()
    try:
        yield value
    finally:
        session.remove()
    session.finish()  # only reached when the body raised nothing


def record(model: nn.Module, *, weights: bool = True, noise_std: float = 0.0,
           generator: torch.Generator | None = None, router_logp: bool = False):
    """Context manager yielding a Trace of every MoE layer's top-k ids (and gate weights) for the model call
    (or generate()) inside. noise_std > 0 adds N(0, noise_std^2) noise from ``generator`` to the router
    logits before the family's select(): ids and weights then both come from the noised logits.
    router_logp=True: the trace also keeps ``router_logp_LBTK``, the router's log-probs of its chosen ids."""
    session = Recorder(model, weights, noise_std, generator, router_logp)
    return installed(session, session.trace)


def replay(model: nn.Module, trace: Trace, *, noise_std: float = 0.0, generator: torch.Generator | None = None,
           router_logp: bool = False, gate: float = 0.0, weights: bool = False):
    """Context manager forcing ``trace``'s ids in every MoE layer for the one forward call inside; gate weights
    come from the current (optionally noised) router logits. Yields a ReplayHandle (``.latent``; with
    router_logp=True also the current router's log-probs: ``router_logp_at(ids)``, ``router_logp_LBTK``).
    gate in [0, 1]: gated replay (routing/gate.py); weights=True: force the trace's gate weights as well."""
    session = _Replayer(model, trace, noise_std, generator, router_logp, gate, weights)
    return installed(session, session.handle)


def router_logp_probe(model: nn.Module, ids_LBSK: Tensor | None = None):
    """Context manager yielding a RouterLogp: the log-probs of every MoE layer's router for the call (or
    generate()) inside, read at any ids with ``.at(ids_LBSK)``; given ``ids_LBSK`` (e.g. the old routing's), it
    keeps only those (L, B, S, k) instead of the dense (L, B, S, E). Changes no routing; nests with
    record/replay."""
    session = _Probe(model, ids_LBSK)
    return installed(session, session.logp)
