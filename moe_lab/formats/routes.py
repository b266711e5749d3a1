"""Routes: one sequence's routed experts in the model's own terms, whatever layout they came in.

``ids_LSK`` (int64) holds, for each of the model's MoE layers L, each position S of the sequence (prompt and
completion tokens, 0-based) and each of the top_k slots, the expert id; ``mask_LS`` says which (layer,
position) slots carry a route. Where the mask is False the ids are -1: a missing route is never expert 0.

Every layout reader goes through ``decode`` (rows of any layer numbering -> Routes), so the layer-axis mapping
(formats.layers), the position window and the missing-route markers are decided in one place (the tests'
writers, tests/trace_writers.py, invert it through the same layer maps).

A layout's rows are missing when an id is negative (NeMo-RL writes -1) or, for top_k > 1, when all of a
row's ids are 0 (vLLM and SGLang zero-fill: a real top-k row never repeats an expert). For top_k == 1 an
all-zero row is expert 0 and is kept (it cannot be told apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moe_lab.formats.layers import LAYOUT_AXES, LayerMap, layer_map, top_k
from moe_lab.routing.trace import Trace, index_dtype

Tensor = torch.Tensor
MISSING = -1


@dataclass
class Routes:
    """One sequence's routes over its positions (see the module docstring)."""

    ids_LSK: Tensor
    mask_LS: Tensor
    layout: str = "moe_lab"
    layer_kind: str = "moe"
    # rows the layout carried past the sequence's last position (dropped here: a fault to report)
    excess: int = 0
    # layer rows the numbering drops (dense, MTP) that carried non-zero ids (a shifted axis shows up here)
    dropped_nonzero: tuple[int, ...] = field(default_factory=tuple)
    # (layer, position) slots of MoE layers whose row was all zero (vLLM/SGLang's "no route"); None: none
    zeroed_LS: Tensor | None = None
    start: int = 0  # first position the layout was asked to cover (SGLang's routed_experts_start_len, prime-rl's start)

    @property
    def num_layers(self) -> int:
        return self.ids_LSK.shape[0]

    @property
    def num_positions(self) -> int:
        return self.ids_LSK.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids_LSK.shape[2]

    def equals(self, other: "Routes") -> bool:
        return (self.ids_LSK.shape == other.ids_LSK.shape and torch.equal(self.mask_LS, other.mask_LS)
                and torch.equal(self.ids_LSK, other.ids_LSK))


@dataclass
class RoutedSequence:
    """One sequence of a dump: its tokens (prompt then completion), the routes over them, and the engine's
    log-probs of the completion tokens when the dump carries them."""

    tokens: Tensor  # int64 [S]
    prompt_len: int
    routes: Routes
    engine_logprobs: Tensor | None = None  # float64 [S - prompt_len]
    where: str = ""  # "FILE line N": named in messages

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


def as_int_tensor(data: Any, what: str) -> Tensor:
    """An integer array of any kind (list, numpy, torch) as an int64 tensor on the CPU."""
    if isinstance(data, Tensor):
        t = data.detach().cpu()
    else:
        try:
            t = torch.from_numpy(np.ascontiguousarray(np.asarray(data)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what}: not a rectangular integer array ({exc})") from None
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{what}: expected integer expert ids, got dtype {t.dtype}")
    return t.to(torch.int64)


def _missing_SA(rows_SAK: Tensor) -> Tensor:
    missing = (rows_SAK < 0).any(-1)
    if rows_SAK.shape[-1] > 1:
        missing |= (rows_SAK == 0).all(-1)
    return missing


def decode(rows_SAK: Any, config: Any, *, start: int = 0, num_tokens: int | None = None,
           layers: str = "auto", layout: str, what: str = "routed_experts") -> Routes:
    """Rows [positions, layer axis, top_k] covering positions [start, start + rows) -> Routes.

    ``num_tokens``: the sequence's length (prompt + completion); positions it has beyond the rows are missing,
    rows beyond it are dropped and counted in ``Routes.excess``. Without it the sequence ends with the rows.
    """
    rows = as_int_tensor(rows_SAK, what)
    if rows.dim() != 3:
        raise ValueError(f"{what}: expected 3 dims [positions, layers, top_k], got shape {tuple(rows.shape)}")
    k = top_k(config)
    if rows.shape[2] != k:
        raise ValueError(f"{what}: top_k axis has {rows.shape[2]} ids, the model's config has "
                         f"num_experts_per_tok={k}")
    if start < 0:
        raise ValueError(f"{what}: start={start}; allowed an int >= 0")
    if layout not in LAYOUT_AXES:  # a layout added without saying which numberings its producer writes
        raise ValueError(f"layout={layout!r} has no entry in formats.layers.LAYOUT_AXES; allowed "
                         f"{', '.join(LAYOUT_AXES)}")
    # a row without a route at any position: evidence for a numbering that drops it (formats.layers.layer_map)
    empty = tuple(_missing_SA(rows).all(0).nonzero().flatten().tolist()) if rows.shape[0] else ()
    lmap = layer_map(config, rows.shape[1], layers, what=what, allowed=LAYOUT_AXES[layout], empty_rows=empty)
    S = start + rows.shape[0] if num_tokens is None else int(num_tokens)
    excess = max(0, start + rows.shape[0] - S)
    rows = rows[: max(0, rows.shape[0] - excess)]
    ids_LSK = torch.full((len(lmap.rows), S, k), MISSING, dtype=torch.int64)
    mask_LS = torch.zeros(len(lmap.rows), S, dtype=torch.bool)
    kept_SLK = rows[:, list(lmap.rows)]
    present_LS = ~_missing_SA(kept_SLK).T
    zeroed_LS = torch.zeros_like(mask_LS)
    if k > 1:
        zeroed_LS[:, start:start + rows.shape[0]] = (kept_SLK == 0).all(-1).T
    ids_LSK[:, start:start + rows.shape[0]] = kept_SLK.permute(1, 0, 2).masked_fill(~present_LS[..., None], MISSING)
    mask_LS[:, start:start + rows.shape[0]] = present_LS
    return Routes(ids_LSK, mask_LS, layout=layout, layer_kind=lmap.kind, excess=excess,
                  dropped_nonzero=_dropped_nonzero(rows, lmap), zeroed_LS=zeroed_LS, start=start)


def _dropped_nonzero(rows_SAK: Tensor, lmap: LayerMap) -> tuple[int, ...]:
    dropped = list(lmap.dropped)
    if not dropped or rows_SAK.shape[0] == 0:
        return ()
    carries_A = (~_missing_SA(rows_SAK[:, dropped])).any(0)  # a missing-route marker is not an id
    return tuple(r for r, nz in zip(dropped, carries_A.tolist()) if nz)


def to_trace(routes: list[Routes], *, num_experts: int, family: str, positions: int | None = None) -> Trace:
    """Routes of one length -> a moe_lab Trace (batch in order) over their first ``positions`` positions
    (default all), ready for routing.replay. Every slot must carry a route: a missing one is refused, never
    filled with expert 0 (fill it yourself, e.g. with the model's own choice, as check-trace does)."""
    if not routes:
        raise ValueError("routes: expected at least one")
    S = routes[0].num_positions if positions is None else positions
    ids, masks = [r.ids_LSK[:, :S] for r in routes], [r.mask_LS[:, :S] for r in routes]
    if any(i.shape != ids[0].shape or i.shape[1] != S for i in ids):
        raise ValueError(f"routes: shapes {[tuple(i.shape) for i in ids]} differ or cover fewer than {S} positions")
    missing = [b for b, m in enumerate(masks) if not bool(m.all())]
    if missing:
        raise ValueError(f"routes: rows {missing} have missing routes in positions [0, {S}); a Trace forces every "
                         "slot")
    ids_LBSK = torch.stack(ids, dim=1)
    if int(ids_LBSK.max()) >= num_experts:
        raise ValueError(f"routes: expert id {int(ids_LBSK.max())} out of range for num_experts={num_experts}")
    return Trace(ids_LBSK.to(index_dtype(num_experts)), num_experts=num_experts, family=family)
