"""verl's routed experts: the [batch, seq, layers, top_k] tensor its actor receives (docs/traces.md, "verl").

The batch is verl's padded layout: each row is the left-padded prompt followed by the right-padded response,
``attention_mask`` [batch, seq] is 1 on real tokens, and the routed-experts tensor is aligned with those
columns. A row's routes are its real columns in order; the layer axis is decided from the model's config
like every layout (formats.layers) - the offset of dense layers is the bug verl #5037 met.
"""

from __future__ import annotations

from typing import Any

from moe_lab.formats.routes import Routes, as_int_tensor, decode


def decode_verl(routed_experts_BSAK: Any, attention_mask_BS: Any, *, config: Any,
                layers: str = "auto") -> list[Routes]:
    """One Routes per batch row, over the row's real tokens (attention_mask == 1), in column order."""
    rows = as_int_tensor(routed_experts_BSAK, "routed_experts")
    mask = as_int_tensor(attention_mask_BS, "attention_mask").bool()
    if rows.dim() != 4 or mask.shape != rows.shape[:2]:
        raise ValueError(f"routed_experts: expected [batch, seq, layers, top_k] over attention_mask "
                         f"{tuple(mask.shape)}, got {tuple(rows.shape)}")
    return [decode(rows[b][mask[b]], config, layers=layers, layout="verl") for b in range(rows.shape[0])]
