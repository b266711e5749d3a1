"""vLLM's routed experts: integer rows [tokens, layers, top_k] (docs/traces.md, "vLLM").

vLLM fills a buffer of [tokens, num_hidden_layers, num_experts_per_tok] int32 zeros and writes each MoE layer's
top-k ids into it, so a dense decoder layer stays all zero; other versions (those NeMo-RL reads) carry the MoE
layers only. The OpenAI server returns the same rows as int16 lists: ``prompt_routed_experts`` on the response
(the prompt's positions) and ``routed_experts`` on each choice (the generated positions). Which layer
numbering a dump uses is decided from the model's config by the axis length (formats.layers), never guessed.
Rows start at position 0 of the sequence (or at the first completion token, for the per-choice rows when
the prompt's rows come separately); the last sampled token is never fed to the engine, so the rows may end
one position early: that position is missing, not invented.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_lab.formats.routes import Routes, as_int_tensor, decode

Tensor = torch.Tensor


def decode_vllm(routed_experts: Any, *, config: Any, prompt_routed_experts: Any = None,
                num_tokens: int | None = None, layers: str = "auto") -> Routes:
    """vLLM rows -> Routes. With ``prompt_routed_experts`` (the OpenAI server's split), its rows are the
    prompt's positions and ``routed_experts`` continue after them; else ``routed_experts`` start at 0."""
    rows = as_int_tensor(routed_experts, "routed_experts")
    if prompt_routed_experts is not None:
        prompt = as_int_tensor(prompt_routed_experts, "prompt_routed_experts")
        if prompt.dim() != 3 or (rows.numel() and prompt.shape[1:] != rows.shape[1:]):
            raise ValueError(f"prompt_routed_experts: shape {tuple(prompt.shape)} does not continue into "
                             f"routed_experts {tuple(rows.shape)} (expected [tokens, layers, top_k] of the same "
                             "layers and top_k)")
        rows = torch.cat([prompt, rows.reshape(0, *prompt.shape[1:]) if rows.numel() == 0 else rows])
    return decode(rows, config, num_tokens=num_tokens, layers=layers, layout="vllm")


def read_vllm(routed_experts: Any, *, config: Any, num_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """vLLM's ``routed_experts`` [tokens, layers, top_k] (from position 0) -> (ids_LSK int64, mask_LS bool).

    L: the model's MoE layers (dense rows dropped by the HF ``config``); S: ``num_tokens`` positions (default:
    the rows' length); positions or slots without a route have mask False and ids -1. Raises ValueError
    when the rows are longer than ``num_tokens`` or fit no layer numbering of the model.
    """
    routes = decode_vllm(routed_experts, config=config, num_tokens=num_tokens)
    if routes.excess:
        raise ValueError(f"routed_experts: {routes.excess} rows beyond num_tokens={num_tokens} (a trace longer "
                         "than its tokens)")
    return routes.ids_LSK, routes.mask_LS
