"""RouterLogp: the router log-probs that ``replay(..., router_logp=True)`` and ``router_logp_probe()`` keep.

A container with no hooks of its own: the routing hooks (``moe_lab.routing.hooks``) append one router
output at a time; it is read after the forward, dense (L, B, S, E) or only at the ids it was opened with.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


class RouterLogp:
    """Router log-probs of one context's call(s), fp32 and detached: dense ``logp_LBSE``, read at any ids with
    ``at(ids_LBSK)``; or, when built with ``ids_LBSK``, only the log-probs at those ids (k/E of the memory)."""

    def __init__(self, num_layers: int, ids_LBSK: Tensor | None = None):
        self._parts: list[list[Tensor]] = [[] for _ in range(num_layers)]
        self._ids = ids_LBSK
        self._joined: Tensor | None = None

    def _append(self, pos: int, logp_BSE: Tensor, col0: int = 0) -> None:
        if self._ids is not None:
            ids_BSK = self._ids[pos][:, col0:col0 + logp_BSE.shape[1]]
            logp_BSE = logp_BSE.gather(-1, ids_BSK.to(device=logp_BSE.device, dtype=torch.long))
        self._parts[pos].append(logp_BSE)
        self._joined = None

    def _join(self) -> Tensor:
        if self._joined is None:
            if not all(self._parts) or len({len(p) for p in self._parts}) != 1:
                raise RuntimeError("router log-probs: not every MoE layer's router ran in each call (yet)")
            self._joined = torch.stack([torch.cat(p, dim=1) for p in self._parts])
        return self._joined

    @property
    def logp_LBSE(self) -> Tensor:
        if self._ids is not None:
            raise RuntimeError("router log-probs: this probe kept only the log-probs at its ids; read them with at()")
        return self._join()

    def at(self, ids_LBSK: Tensor) -> Tensor:
        """log p_router(e) at the given experts (e.g. the old routing's top-k), float32 (L, B, S, K)."""
        if self._ids is not None:
            if ids_LBSK is not self._ids and not torch.equal(ids_LBSK, self._ids):
                raise ValueError("ids: this probe kept the log-probs at other ids only; pass the ids it was opened with")
            return self._join()
        dense = self._join()
        if tuple(ids_LBSK.shape[:3]) != tuple(dense.shape[:3]):
            raise ValueError(f"ids: expected (L, B, S)={tuple(dense.shape[:3])} of the forward, got "
                             f"{tuple(ids_LBSK.shape[:3])}")
        return dense.gather(-1, ids_LBSK.to(device=dense.device, dtype=torch.long))
