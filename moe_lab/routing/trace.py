"""Trace: the top-k expert ids (and gate weights) of every MoE layer for every position of a batch.

``indices`` is ids_LBSK: uint8 when num_experts <= 256 (the paper's storage), else int16; ``weights`` is
float32 w_LBSK or None; ``router_logp_LBTK`` is float32 or None: the router's log-probability of each
chosen expert (over ALL experts, see ``FamilySpec.router_logp``), kept only when record() was asked for it
(RSPO's router shift). Positions are the columns of the (left-padded) batch fed to the model.
Saved with safetensors plus metadata; never pickle (a trace file from elsewhere must not run code).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_lab.routing.metrics import expert_load_LE, load_stats

Tensor = torch.Tensor
_FORMAT = "moe_lab.trace/1"


def index_dtype(num_experts: int) -> torch.dtype:
    if not 1 <= num_experts <= 32768:
        raise ValueError(f"num_experts={num_experts} is out of range: allowed 1..32768")
    return torch.uint8 if num_experts <= 256 else torch.int16


class Trace:
    """Routing of one batch. Built by record(); select batch rows with ``trace[idx_B]``; join with ``Trace.cat``."""

    def __init__(self, indices: Tensor, weights: Tensor | None = None, *, num_experts: int, family: str,
                 router_logp: Tensor | None = None):
        if indices.dim() != 4 or indices.dtype != index_dtype(num_experts):
            raise ValueError(f"indices: expected ids_LBSK of 4 dims and dtype {index_dtype(num_experts)} for "
                             f"num_experts={num_experts}, got {tuple(indices.shape)} {indices.dtype}")
        if weights is not None and (weights.shape != indices.shape or weights.dtype != torch.float32):
            raise ValueError(f"weights: expected float32 of shape {tuple(indices.shape)}, "
                             f"got {weights.dtype} {tuple(weights.shape)}")
        if router_logp is not None and (router_logp.shape != indices.shape or router_logp.dtype != torch.float32):
            raise ValueError(f"router_logp: expected float32 of shape {tuple(indices.shape)}, "
                             f"got {router_logp.dtype} {tuple(router_logp.shape)}")
        self._indices, self._weights, self._router_logp = indices, weights, router_logp
        self.num_experts, self.family = int(num_experts), str(family)
        self._parts: list[list[tuple[Tensor, Tensor | None, Tensor | None]]] | None = None  # per layer, recording
        self._dirty = False

    @classmethod
    def _recording(cls, num_layers: int, top_k: int, num_experts: int, family: str, weights: bool,
                   router_logp: bool = False) -> "Trace":
        empty = torch.zeros(num_layers, 0, 0, top_k, dtype=index_dtype(num_experts))
        trace = cls(empty, torch.zeros(empty.shape) if weights else None, num_experts=num_experts, family=family,
                    router_logp=torch.zeros(empty.shape) if router_logp else None)
        trace._parts = [[] for _ in range(num_layers)]
        return trace

    def _append(self, layer: int, ids_BSK: Tensor, w_BSK: Tensor | None, logp_BSK: Tensor | None = None) -> None:
        """Add the columns of one forward call of one layer (a prefill, or one decode step)."""
        w = None if self._weights is None else w_BSK.detach().to(torch.float32, copy=True)
        lp = None if self._router_logp is None else logp_BSK.detach().to(torch.float32, copy=True)
        self._parts[layer].append((ids_BSK.detach().to(self._indices.dtype), w, lp))
        self._dirty = True

    def _flush(self) -> None:
        if not self._dirty:
            return
        counts = {len(p) for p in self._parts}
        if len(counts) != 1:
            missing = [l for l, p in enumerate(self._parts) if len(p) < max(counts)]
            raise RuntimeError(f"trace: MoE layers {missing} recorded fewer forward calls than the others; "
                               "a path that bypasses the router module ran (no consistent trace)")
        # a model spread over devices (device_map) records each layer on its own: joined on the first layer's
        dev = self._parts[0][0][0].device

        def join(i: int) -> Tensor:
            return torch.stack([torch.cat([part[i].to(dev) for part in p], dim=1) for p in self._parts])
        self._indices = join(0)
        if self._weights is not None:
            self._weights = join(1)
        if self._router_logp is not None:
            self._router_logp = join(2)
        self._parts = [[(self._indices[l], None if self._weights is None else self._weights[l],
                         None if self._router_logp is None else self._router_logp[l])]
                       for l in range(len(self._parts))]
        self._dirty = False

    def _finish(self) -> None:
        """End of recording: consolidate the parts and stop accepting new ones."""
        self._flush()
        self._parts = None

    # ----------------------------------------------------------------------- data and shape

    @property
    def indices(self) -> Tensor:
        self._flush()
        return self._indices

    @property
    def weights(self) -> Tensor | None:
        self._flush()
        return self._weights

    @property
    def router_logp_LBTK(self) -> Tensor | None:
        self._flush()
        return self._router_logp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.indices.shape)

    num_layers = property(lambda self: self.shape[0])
    batch_size = property(lambda self: self.shape[1])
    seq_len = property(lambda self: self.shape[2])
    top_k = property(lambda self: self.shape[3])
    device = property(lambda self: self.indices.device)

    @property
    def nbytes(self) -> int:
        w, lp = self.weights, self.router_logp_LBTK
        return self.indices.nbytes + (0 if w is None else w.nbytes) + (0 if lp is None else lp.nbytes)

    def __len__(self) -> int:
        return self.batch_size

    def __repr__(self) -> str:
        L, B, S, K = self.shape
        return (f"Trace(family={self.family!r}, layers={L}, batch={B}, seq={S}, top_k={K}, "
                f"num_experts={self.num_experts}, weights={self.weights is not None}, "
                f"router_logp={self.router_logp_LBTK is not None}, device={self.device})")

    def _like(self, indices: Tensor, weights: Tensor | None, router_logp: Tensor | None = None) -> "Trace":
        return Trace(indices, weights, num_experts=self.num_experts, family=self.family, router_logp=router_logp)

    def with_router_logp(self, router_logp_LBTK: Tensor) -> "Trace":
        """The same routing with the router's log-probs of its ids attached (e.g. computed under replay)."""
        return self._like(self.indices, self.weights, router_logp_LBTK.detach().to(torch.float32))

    # ----------------------------------------------------------------------- slicing, joining, moving

    def select(self, rows: int | slice | Sequence[int] | Tensor) -> "Trace":
        """Batch rows (a minibatch) as a new Trace; an int keeps the batch axis (one row)."""
        if isinstance(rows, int):
            rows = slice(rows, rows + 1) if rows != -1 else slice(-1, None)
        elif not isinstance(rows, slice):
            rows = torch.as_tensor(rows, device=self.device)
            if rows.dtype == torch.bool:
                if rows.shape != (self.batch_size,):
                    raise ValueError(f"rows: a bool mask needs shape ({self.batch_size},), got {tuple(rows.shape)}")
                rows = rows.nonzero().squeeze(1)
            rows = rows.long()
        w, lp = self.weights, self.router_logp_LBTK
        return self._like(self.indices[:, rows], None if w is None else w[:, rows], None if lp is None else lp[:, rows])

    __getitem__ = select

    @classmethod
    def cat(cls, traces: Sequence["Trace"]) -> "Trace":
        """Join traces along the batch axis; they must agree on everything else."""
        if not traces:
            raise ValueError("traces: expected at least one Trace")
        first = traces[0]
        for i, t in enumerate(traces[1:], 1):
            diffs = _differences(first, t, with_batch=False)
            if diffs:
                raise ValueError(f"traces[{i}] cannot be joined with traces[0]: " + "; ".join(diffs))
        weights = None if first.weights is None else torch.cat([t.weights for t in traces], dim=1)
        logp = None if first.router_logp_LBTK is None else torch.cat([t.router_logp_LBTK for t in traces], dim=1)
        return first._like(torch.cat([t.indices for t in traces], dim=1), weights, logp)

    def to(self, device: torch.device | str) -> "Trace":
        w, lp = self.weights, self.router_logp_LBTK
        return self._like(self.indices.to(device), None if w is None else w.to(device),
                          None if lp is None else lp.to(device))

    # ----------------------------------------------------------------------- files

    def save(self, path: str | Path) -> None:
        tensors = {"indices": self.indices.detach().cpu().contiguous()}
        if self.weights is not None:
            tensors["weights"] = self.weights.detach().cpu().contiguous()
        if self.router_logp_LBTK is not None:
            tensors["router_logp"] = self.router_logp_LBTK.detach().cpu().contiguous()
        meta = {"format": _FORMAT, "num_experts": str(self.num_experts), "family": self.family,
                "top_k": str(self.top_k)}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("format") != _FORMAT:
                raise ValueError(f"{path}: not a moe_lab trace (metadata format={meta.get('format')!r}, "
                                 f"expected {_FORMAT!r})")
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}
        trace = cls(tensors["indices"], tensors.get("weights"), num_experts=int(meta["num_experts"]),
                    family=meta["family"], router_logp=tensors.get("router_logp"))
        if trace.top_k != int(meta["top_k"]):
            raise ValueError(f"{path}: metadata top_k={meta['top_k']} but indices have k={trace.top_k}")
        return trace

    # ----------------------------------------------------------------------- diagnostics

    def summary(self, mask: Tensor | None = None) -> pd.DataFrame:
        """One row per MoE layer: masked positions, load entropy (normalised), busiest expert's share, its
        excess over uniform (share * E - 1), unused experts, mean top-1 gate weight (when recorded)."""
        load_LE = expert_load_LE(self.indices, self.num_experts, mask)
        st = load_stats(load_LE)
        frame = pd.DataFrame({
            "layer": range(self.num_layers),
            "tokens": (load_LE.sum(1) / self.top_k).round().long().cpu().numpy(),
            "load_entropy": st["entropy"].cpu().numpy(),
            "max_load_share": st["max_share"].cpu().numpy(),
            "load_max_violation": st["max_violation"].cpu().numpy(),
            "unused_experts": st["unused"].cpu().numpy(),
        })
        if self.weights is not None:
            frame["mean_top_weight"] = _masked_mean_top_weight(self.weights, mask).cpu().numpy()
        return frame


def _masked_mean_top_weight(w_LBSK: Tensor, mask: Tensor | None) -> Tensor:
    top_LBS = w_LBSK.max(-1).values
    mask_BS = torch.ones(top_LBS.shape[1:], device=top_LBS.device) if mask is None else mask.to(top_LBS.device).float()
    return (top_LBS * mask_BS).sum((1, 2)) / mask_BS.sum()


def _differences(a: Any, b: Any, with_batch: bool) -> list[str]:
    """'field: a vs b' for every field that differs (shape fields, experts, family, weights present)."""
    (La, Ba, Sa, Ka), (Lb, Bb, Sb, Kb) = a.shape, b.shape
    pairs = [("num_layers", La, Lb), ("top_k", Ka, Kb), ("num_experts", a.num_experts, b.num_experts),
             ("family", a.family, b.family), ("seq_len", Sa, Sb),
             ("weights", a.weights is not None, b.weights is not None),
             ("router_logp", a.router_logp_LBTK is not None, b.router_logp_LBTK is not None)]
    if with_batch:
        pairs.append(("batch_size", Ba, Bb))
    return [f"{name}: {x!r} vs {y!r}" for name, x, y in pairs if x != y]
