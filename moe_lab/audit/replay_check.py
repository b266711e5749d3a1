"""`moe-lab check-trace` inside a trainer's loop or CI: ``verify_replay(model, routes, input_ids)`` gives, for
one batch already in memory, the verdict the command gives for a dump of the same sequences (the same code:
``trace_audit.run_check``, the same report lines, agreement and fault names), and ``assert_replay_ok`` raises
AssertionError carrying that verdict (docs/traces.md, "In a trainer's test").

``model``: a transformers model of a family moe_lab serves (unwrap DDP/FSDP first); it runs in eval() mode
and is put back in the mode it was in. ``input_ids``: [B, S] (or [S]), each row one sequence (a packed row
must be split into its sequences first: attention crosses them). ``routes``, in any of:

- ``Routes`` (moe_lab.formats.routes; one sequence) or a list of them, one per row, over the row's real tokens;
- an integer tensor [B, S, A, K] aligned with ``input_ids`` (verl's ``batch["routed_experts"]``, NeMo-RL's
  ``data["routed_experts"]`` [batch, seq, num_moe_layers, topk], prime-rl's [batch, seq, layers, topk]);
- an integer tensor [A, N, K]: one [N, K] row per layer, as Megatron's RouterReplay takes them (verl's
  ``layers_topk_idx`` once padding is removed): N = B * S, or the number of real tokens (``attention_mask``
  row-major) when a mask is given.

A, the layer axis, is any numbering of the model's layers (every decoder layer, the MoE layers only, with MTP
rows appended), decided from the model's config exactly as for a dump (moe_lab.formats.layers). A route is
missing where its ids are negative or (top_k > 1) all zero; columns where ``attention_mask`` is 0 are not the
sequence's. ``prompt_len`` (an int, or one per row) only enables the ``completion-only`` diagnosis.

Torch is imported inside the functions: ``moe_lab.audit`` stays importable without it (the command line's
parsers are built for every command).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from moe_lab.audit.trace_audit import check_inputs, report_lines, run_check  # torch-free at import


@dataclass(frozen=True)
class ReplayVerdict:
    """What check-trace concludes for one batch."""

    agreement: float  # over usable slots, the share whose top-k set equals the model's own (nan: none usable)
    faults: tuple[tuple[str, str], ...]  # (name, detail), as the command prints ``fault: <name>: <detail>``
    lines: tuple[str, ...]  # the command's report after its header line; ``agreement <fraction>`` last

    @property
    def ok(self) -> bool:
        """The command's exit 0: no fault (agreement may still be below 1: docs/traces.md)."""
        return not self.faults

    @property
    def fault_names(self) -> list[str]:
        return [name for name, _ in self.faults]

    def __str__(self) -> str:
        return "\n".join(self.lines)


def verify_replay(model: Any, routes: Any, input_ids: Any, *, attention_mask: Any = None,
                  prompt_len: int | Sequence[int] = 0) -> ReplayVerdict:
    """The check-trace verdict for one batch (see the module docstring for what each argument may be).
    ValueError (one line) where the command would exit 2."""
    from moe_lab.audit.trace_run import input_device

    config = json.loads(model.config.to_json_string(use_diff=True))  # what save_pretrained writes: config.json
    sequences = routed_sequences(routes, input_ids, config, attention_mask=attention_mask, prompt_len=prompt_len)
    check_inputs(sequences, config)
    was_training = model.training
    model.eval()
    try:
        lines, faults, agreement = run_check(sequences, model, config, input_device(model))
    finally:
        model.train(was_training)
    return ReplayVerdict(agreement, tuple(faults), tuple(report_lines(lines, faults, agreement)))


def assert_replay_ok(model: Any, routes: Any, input_ids: Any, *, min_agreement: float | None = None,
                     **kwargs: Any) -> ReplayVerdict:
    """``verify_replay``, raising AssertionError with the whole verdict when it names a fault (or, with
    ``min_agreement``, when agreement is below it); returns the verdict otherwise."""
    verdict = verify_replay(model, routes, input_ids, **kwargs)
    low = min_agreement is not None and not verdict.agreement >= min_agreement
    if verdict.faults or low:
        why = ", ".join(verdict.fault_names) or f"agreement {verdict.agreement:.4f} < {min_agreement}"
        raise AssertionError(f"routing replay check failed ({why}):\n{verdict}")
    return verdict


def routed_sequences(routes: Any, input_ids: Any, config: dict, *, attention_mask: Any = None,
                     prompt_len: int | Sequence[int] = 0) -> list:
    """One moe_lab RoutedSequence per row of ``input_ids`` (its real tokens) with its Routes."""
    import torch

    from moe_lab.formats.routes import RoutedSequence, Routes, as_int_tensor

    ids_BS = as_int_tensor(input_ids, "input_ids")
    ids_BS = ids_BS[None] if ids_BS.dim() == 1 else ids_BS
    if ids_BS.dim() != 2:
        raise ValueError(f"input_ids: expected [batch, seq] (or [seq]), got shape {tuple(ids_BS.shape)}")
    if attention_mask is None:
        mask_BS = torch.ones_like(ids_BS, dtype=torch.bool)
    else:  # bool or 0/1 integers
        mask = torch.as_tensor(attention_mask).detach().cpu()
        mask_BS = mask if mask.dtype == torch.bool else as_int_tensor(mask, "attention_mask") != 0
    mask_BS = mask_BS[None] if mask_BS.dim() == 1 else mask_BS
    if mask_BS.shape != ids_BS.shape:
        raise ValueError(f"attention_mask: shape {tuple(mask_BS.shape)}, input_ids {tuple(ids_BS.shape)}")
    B = ids_BS.shape[0]
    starts = [prompt_len] * B if isinstance(prompt_len, int) else list(prompt_len)
    if len(starts) != B:
        raise ValueError(f"prompt_len: {len(starts)} values for {B} rows")
    if isinstance(routes, Routes) or (isinstance(routes, (list, tuple)) and routes and
                                      all(isinstance(r, Routes) for r in routes)):
        per_row = [routes] if isinstance(routes, Routes) else list(routes)
    else:
        per_row = _decode_tensor(as_int_tensor(routes, "routes"), mask_BS, config)
    if len(per_row) != B:
        raise ValueError(f"routes: {len(per_row)} sequences, input_ids {B} rows")
    out = []
    for b, r in enumerate(per_row):
        tokens = ids_BS[b][mask_BS[b]]
        if r.num_positions != tokens.numel():
            raise ValueError(f"routes: row {b} covers {r.num_positions} positions, its input_ids {tokens.numel()} "
                             "real tokens")
        out.append(RoutedSequence(tokens, int(starts[b]), r, None, f"row {b}"))
    return out


def _decode_tensor(rows: Any, mask_BS: Any, config: dict) -> list:
    """[B, S, A, K] (aligned with input_ids) or [A, N, K] (per layer, N = B * S or the real tokens) -> Routes."""
    import torch

    from moe_lab.formats.verl import decode_verl

    B, S = mask_BS.shape
    if rows.dim() == 3:
        A, N, K = rows.shape
        if N not in (B * S, int(mask_BS.sum())):
            raise ValueError(f"routes: [layers, tokens, top_k] {tuple(rows.shape)} has {N} tokens; input_ids has "
                             f"{B * S} ({int(mask_BS.sum())} real). For one sequence's [S, layers, top_k] (vLLM) "
                             "pass routes[None] with input_ids[None]")
        full = torch.zeros(B, S, A, K, dtype=rows.dtype)
        full.view(B * S, A, K)[mask_BS.reshape(-1) if N != B * S else slice(None)] = rows.permute(1, 0, 2)
        rows = full
    if rows.dim() != 4 or tuple(rows.shape[:2]) != (B, S):
        raise ValueError(f"routes: expected [batch, seq, layers, top_k] over input_ids {(B, S)} or [layers, "
                         f"batch * seq, top_k]; got shape {tuple(rows.shape)}")
    return decode_verl(rows, mask_BS.long(), config=config)
