"""Predictive routing replay (``rl.replay=predictive``): a toy-scale, simplified PR² (arXiv:2606.00395).

PR² augments each router with a lightweight "evolution predictor" that anticipates how the router will change
over the next updates; the rollout routes with the PREDICTED top-k and training replays that route (as R3
does), so gradients reach experts that are about to become active while the importance ratios stay
consistent. What we could read of the paper (abstract and summaries; the method section and the reference
PR radixark/miles #1362 were not available to us) fixes that much; the predictor below is ours:

- predictor: per MoE layer a linear head ``D_l`` (E x H, fp32, zero at the start) on the router's input x:
  predicted logits = router logits(x) + x D_l^T. Stored as a buffer ``pr2_head`` on each router, so it is
  saved and resumed with the model (safetensors) and never touched by the optimizer.
- training (``fit``): online, once per RL step. Before the step's updates we keep the router inputs X (response
  positions of the replayed forward) and logits L0; after the updates the routers' new logits L1 = router(X)
  on the SAME inputs. D_l is the ridge solution of min ||X D^T - (L1 - L0)||^2 + lam ||D||^2, with
  lam = 1e-3 * tr(X^T X) / H (scale-free), on the latest step only: the head predicts that the router's next
  step of drift equals its last one, i.e. a linear extrapolation (momentum) of the router's own updates. For a
  linear router the drift IS linear in x, so the head can express it exactly; the paper's predictor may be a
  deeper network trained by SGD over many steps: a simplification for a 2-core toy, said so here.
- Simplifications besides the predictor: one step of horizon; inputs held fixed (only the router weights'
  drift is predicted, not that of the hidden states feeding them). A bf16 rollout copy routes by the current
  heads (copied with the weights before each rollout, moe_lab.rl.loop); a lagged rollout (rl.rollout_lag) is
  refused: its copy would need the heads of that older step, which are not kept.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from moe_lab.algos import reductions as R
from moe_lab.models import moe_layers
from moe_lab.routing.hooks import Recorder, installed

# across ranks: refitted from the whole batch after the updates (rl.replay=predictive is refused under torchrun)
REDUCTIONS = {"pr2/*": R.SAME}

Tensor = torch.Tensor
HEAD = "pr2_head"  # buffer name on each router
RIDGE = 1e-3  # lam = RIDGE * tr(X^T X) / H: the ridge term relative to the inputs' mean energy


def install(model: nn.Module) -> None:
    """A zero head (E x H, fp32) on every router (a no-op where one exists: a resumed run keeps its own)."""
    for layer in moe_layers(model):
        router = layer.router
        if not hasattr(router, HEAD):
            hidden = router.weight.shape[1]
            router.register_buffer(HEAD, torch.zeros(router.num_experts, hidden, device=router.weight.device))


def heads(model: nn.Module) -> dict[str, Tensor]:
    """Every predictor head of ``model`` by buffer name ({} when none is installed)."""
    return {name: buf for name, buf in model.named_buffers() if name.rsplit(".", 1)[-1] == HEAD}


def predicted_logits(router: nn.Module, hidden_NH: Tensor, logits_NE: Tensor) -> Tensor:
    head_EH = getattr(router, HEAD, None)
    if head_EH is None:
        raise RuntimeError("predictive routing needs the predictor heads: call moe_lab.routing.predictor.install")
    return logits_NE + F.linear(hidden_NH.to(head_EH.dtype), head_EH).to(logits_NE.dtype)


class _PredictiveRecorder(Recorder):
    """record() that routes by the predicted logits (ids and gate weights from the family's select on them);
    the recorded router log-probs stay those of the router's own logits (router_shift's reference)."""

    def _router_hook(self, pos: int, router: nn.Module, inputs: tuple, output: tuple) -> tuple | None:
        self._hidden_NH = inputs[0]
        return super()._router_hook(pos, router, inputs, output)

    def _route(self, pos: int, router: nn.Module, output: tuple, recompute: bool) -> tuple:
        logits_NE = output[0]
        family = self.layers[pos].family
        pred_NE = predicted_logits(router, self._hidden_NH.reshape(logits_NE.shape[0], -1), logits_NE)
        weights_NK, ids_NK = family.select(router, self._noised(pos, pred_NE))
        if not recompute:
            logp_NK = self._logp_NE(pos, logits_NE).gather(1, ids_NK.long()) if self.router_logp else None
            self.trace._append(pos, self._as_BSK(ids_NK), self._as_BSK(weights_NK),
                               None if logp_NK is None else self._as_BSK(logp_NK))
        return logits_NE, weights_NK, ids_NK


def record_predicted(model: nn.Module, *, router_logp: bool = False, noise_std: float = 0.0,
                     generator: torch.Generator | None = None):
    """record() whose routing follows the predicted router (PR²'s rollout); yields the Trace of that routing.
    noise_std/generator: the sampler-side router noise (rl.rollout_router_noise), as record() takes them."""
    session = _PredictiveRecorder(model, True, noise_std, generator, router_logp)
    return installed(session, session.trace)


class Observation:
    """Router inputs and logits of one forward (per MoE layer, masked rows), kept to fit the heads."""

    def __init__(self, num_layers: int):
        self.inputs_NH: list[Tensor | None] = [None] * num_layers
        self.logits_NE: list[Tensor | None] = [None] * num_layers


@contextmanager
def observe(model: nn.Module, mask_BT: Tensor) -> Iterator[Observation]:
    """Keep every router's fp32 inputs and logits at the masked positions of the one call inside."""
    layers, obs = moe_layers(model), Observation(len(moe_layers(model)))
    rows_N = mask_BT.reshape(-1)

    def hook(pos: int, router: nn.Module, inputs: tuple, output: tuple) -> None:
        if obs.inputs_NH[pos] is None:
            obs.inputs_NH[pos] = inputs[0].reshape(rows_N.shape[0], -1)[rows_N].detach().float()
            obs.logits_NE[pos] = output[0][rows_N].detach().float()

    handles = [layer.router.register_forward_hook(functools.partial(hook, p)) for p, layer in enumerate(layers)]
    try:
        yield obs
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def fit(model: nn.Module, obs: Observation) -> dict[str, float]:
    """Refit every head on (inputs, logits now - logits observed); returns pr2/* metrics of the OLD heads."""
    err, drift, n = 0.0, 0.0, 0
    for pos, layer in enumerate(moe_layers(model)):
        router, X_NH = layer.router, obs.inputs_NH[pos]
        if X_NH is None or X_NH.shape[0] == 0:
            continue
        D_NE = router(X_NH.to(router.weight.dtype))[0].float() - obs.logits_NE[pos]
        head_EH = getattr(router, HEAD)
        err += float(((X_NH @ head_EH.T - D_NE) ** 2).sum())
        drift += float((D_NE ** 2).sum())
        n += D_NE.numel()
        gram_HH = X_NH.T @ X_NH
        lam = RIDGE * float(gram_HH.diagonal().sum()) / gram_HH.shape[0]
        eye = torch.eye(gram_HH.shape[0], device=gram_HH.device)
        head_EH.copy_(torch.linalg.solve(gram_HH + lam * eye, X_NH.T @ D_NE).T)
    # absolute RMS (finite also when a step did not move the router); pred_err < drift: the head beat "no drift"
    return {"pr2/drift_rms": (drift / max(n, 1)) ** 0.5, "pr2/pred_err_rms": (err / max(n, 1)) ** 0.5}
