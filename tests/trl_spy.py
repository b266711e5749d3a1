"""The TRL tests' own observation of a model: hooks on the experts modules (the ids AND combine weights each one
received) and on the routers (their raw logits and top-k), per model call, never the replay machinery's records.
Works for any number of MoE layers (dense layers have no experts module and are skipped)."""

from __future__ import annotations

import torch

from moe_lab.models import moe_layers


class LayerSpy:
    """Per call of ``model`` (ids, mask, grad mode): for each MoE layer the experts' received ids and weights and
    the router's own logits and top-k (runs after the first, e.g. checkpointing's recompute, kept apart)."""

    def __init__(self, model):
        layers = moe_layers(model)
        self.layer_idx = [layer.layer_idx for layer in layers]
        blocks = {id(m.gate if hasattr(m, "gate") else m.router): m for m in model.modules()
                  if hasattr(m, "experts") and (hasattr(m, "gate") or hasattr(m, "router"))}
        experts = [blocks[id(layer.router)].experts for layer in layers]
        self.calls: list[dict] = []
        self.handles = [model.register_forward_pre_hook(self._call, with_kwargs=True)]
        for pos, (ex, layer) in enumerate(zip(experts, layers)):
            self.handles.append(ex.register_forward_pre_hook(
                lambda m, a, pos=pos: self._add(pos, ids=a[1], w=a[2])))
            self.handles.append(layer.router.register_forward_hook(
                lambda m, a, out, pos=pos: self._add(pos, logits=out[0], own=out[2]), prepend=True))

    def _call(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        n = len(self.layer_idx)
        self.calls.append(dict(ids=ids.detach().clone(), mask=kwargs.get("attention_mask"),
                               grad=torch.is_grad_enabled(),
                               **{k: [[] for _ in range(n)] for k in ("ids_used", "w", "logits", "own")}))

    def _add(self, pos, **seen):
        call = self.calls[-1]
        for key, value in seen.items():
            call["ids_used" if key == "ids" else key][pos].append(value.detach().clone())

    def remove(self):
        for h in self.handles:
            h.remove()

    def LBSK(self, call: dict, kind: str, run: int = 0, sort: bool = True) -> torch.Tensor:
        """(L, B, S, K) of one call: ``ids_used``/``own`` sorted along K, or ``w`` ordered like the ids."""
        B, S = call["ids"].shape
        x = torch.stack([call[kind][pos][run].reshape(B, S, -1) for pos in range(len(self.layer_idx))])
        if kind == "w":
            ids = torch.stack([call["ids_used"][pos][run].reshape(B, S, -1) for pos in range(len(self.layer_idx))])
            return x.gather(-1, ids.argsort(-1))
        return x.sort(-1).values if sort else x


def train(trainer, model=None) -> LayerSpy:
    spy = LayerSpy(model if model is not None else trainer.model)
    try:
        trainer.train()
    finally:
        spy.remove()
    return spy


def match_rows(ids_BS: torch.Tensor, pool_BS: torch.Tensor) -> list[int]:
    """For each row, a row of the pool with the same tokens (identical sequences route identically)."""
    out = []
    for row in ids_BS:
        hits = (pool_BS[:, :row.shape[0]] == row).all(-1).nonzero()
        assert len(hits), "a loss row is missing from the pool"
        out.append(int(hits[0]))
    return out


def old_vs_loss(spy: LayerSpy, kind: str = "ids_used"):
    """(old pass's, loss forward's, real-token mask) per loss call, old rows matched to loss rows by tokens."""
    out = []
    for call in [c for c in spy.calls if c["grad"]]:
        S = call["ids"].shape[1]
        old = [c for c in spy.calls if not c["grad"] and c["ids"].shape[1] == S]
        rows = match_rows(call["ids"], torch.cat([c["ids"] for c in old]))
        old_x = torch.cat([spy.LBSK(c, kind) for c in old], dim=1)[:, rows]
        out.append((old_x, spy.LBSK(call, kind), call["mask"].bool()))
    return out
