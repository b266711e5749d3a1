"""ReplayHandle: what routing.replay() yields to its caller (the forced and the latent traces, the gate's
replacements, the current router's log-probs). Apart from hooks.py, which installs the hooks that fill it."""

from __future__ import annotations

import torch

from moe_lab.routing.gate import replace_frac
from moe_lab.routing.router_logp import RouterLogp
from moe_lab.routing.trace import Trace

Tensor = torch.Tensor


class ReplayHandle:
    """What replay() yields: ``trace`` (forced) and ``latent`` (the router's own choice on the current logits).

    With router_logp=True: ``router_logp`` (a RouterLogp of the current router: ``router_logp_at(ids)``,
    ``router_logp_LBTE``), ``router_logp_LBTK`` at the forced ids, and ``latent`` carries its own."""

    def __init__(self, trace: Trace, latent: Trace, router_logp: RouterLogp | None = None):
        self.trace, self.latent, self.router_logp = trace, latent, router_logp
        self.used = trace  # the routing that ran: the trace, or (gate > 0) the gated ids once the call is done
        self.replaced_LBSK: Tensor | None = None  # gate > 0: which forced (layer, token, slot)s were replaced

    def replace_frac(self, mask_BS: Tensor) -> float:
        """Share of the replayed (layer, token, slot)s at masked positions that the gate replaced (0 if no gate)."""
        return 0.0 if self.replaced_LBSK is None else replace_frac(self.replaced_LBSK, mask_BS)

    def _need_logp(self) -> RouterLogp:
        if self.router_logp is None:
            raise RuntimeError("router log-probs were not kept: open replay(..., router_logp=True)")
        return self.router_logp

    @property
    def router_logp_LBTE(self) -> Tensor:
        return self._need_logp().logp_LBSE

    def router_logp_at(self, ids_LBTK: Tensor) -> Tensor:
        return self._need_logp().at(ids_LBTK)

    @property
    def router_logp_LBTK(self) -> Tensor:
        """The current router's log-probs of the experts that ran (the forced ones, unless gated)."""
        return self.router_logp_at(self.used.indices)
