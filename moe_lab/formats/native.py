"""moe_lab's own trace file (routing.Trace, safetensors) with the tokens it routed, as check-trace input.

``Trace.save`` keeps ids only; ``save_with_tokens`` adds ``input_ids`` and ``attention_mask`` [B, S] (the
left-padded batch fed to the model) and optionally ``prompt_lens`` [B], in the same file, so that one file is
both a trace ``Trace.load`` reads (it takes only the tensors it knows) and a check-trace input. The trace's columns are the batch's first columns: S of them for a teacher-forced forward, S - 1 for
generate() (its last sampled token is never forwarded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_lab.formats.layers import moe_layer_indices
from moe_lab.formats.routes import Routes, RoutedSequence
from moe_lab.routing.trace import Trace

TOKEN_KEYS = ("input_ids", "attention_mask")


def save_with_tokens(path: str | Path, trace: Trace, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor,
                     prompt_lens_B: torch.Tensor | None = None) -> None:
    trace.save(path)
    with safe_open(str(path), framework="pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    tensors["input_ids"] = input_ids_BS.detach().cpu().long().contiguous()
    tensors["attention_mask"] = attention_mask_BS.detach().cpu().long().contiguous()
    if prompt_lens_B is not None:
        tensors["prompt_lens"] = torch.as_tensor(prompt_lens_B).cpu().long().contiguous()
    save_file(tensors, str(path), metadata=meta)


def read_trace_file(path: str | Path, config: Any) -> list[RoutedSequence]:
    """One RoutedSequence per batch row; ValueError (one line) when the file holds no tokens or its layers
    are not the model's MoE layers."""
    trace = Trace.load(path)
    with safe_open(str(path), framework="pt") as fh:
        keys = set(fh.keys())
        missing = [k for k in TOKEN_KEYS if k not in keys]
        if missing:
            raise ValueError(f"{path}: a moe_lab trace without its tokens (no {', '.join(missing)}); write it with "
                             "moe_lab.formats.native.save_with_tokens")
        ids_BS, mask_BS = fh.get_tensor("input_ids").long(), fh.get_tensor("attention_mask").bool()
        prompt_lens = fh.get_tensor("prompt_lens").tolist() if "prompt_lens" in keys else None
    n_moe = len(moe_layer_indices(config))
    if trace.num_layers != n_moe or ids_BS.shape[0] != trace.batch_size or ids_BS.shape[1] < trace.seq_len:
        raise ValueError(f"{path}: trace {trace.shape} (layers, batch, columns, top_k) does not fit the model's "
                         f"{n_moe} MoE layers and tokens {tuple(ids_BS.shape)}")
    return [_row(trace, b, ids_BS[b], mask_BS[b], prompt_lens[b] if prompt_lens else 0, f"{path} row {b}")
            for b in range(trace.batch_size)]


def _row(trace: Trace, b: int, ids_S: torch.Tensor, mask_S: torch.Tensor, prompt_len: int,
         where: str) -> RoutedSequence:
    C = trace.seq_len
    tokens = ids_S[mask_S]
    cols = mask_S[:C].nonzero().squeeze(1)
    ids_LSK = torch.full((trace.num_layers, tokens.numel(), trace.top_k), -1, dtype=torch.int64)
    mask_LS = torch.zeros(trace.num_layers, tokens.numel(), dtype=torch.bool)
    ids_LSK[:, : cols.numel()] = trace.indices[:, b, cols].long()
    mask_LS[:, : cols.numel()] = True
    routes = Routes(ids_LSK, mask_LS, layout="moe_lab", layer_kind="moe")
    return RoutedSequence(tokens, int(prompt_len), routes, where=where)
