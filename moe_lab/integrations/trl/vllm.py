"""Routed experts from TRL's colocated vLLM engine (vLLM >= 0.22 returns them), for R3 with ``use_vllm=True``.

TRL builds its ``LLM(...)`` inside ``VLLMGeneration`` with fixed arguments and keeps only token ids and
log-probs of what ``llm.generate`` returns. ``routed_llm`` wraps the construction (for the span of TRL's
``__init__`` only) so the engine is built with ``enable_return_routed_experts=True`` and handed back behind a
``RoutedLLM`` that keeps the last ``generate()``'s outputs in an ``EngineOutputs`` the trainer owns.
``rollout_of`` turns them into the trainer's ``Rollout``: vLLM's ``CompletionOutput.routed_experts`` is
[prompt + completion - 1 tokens, layers, top_k] int16 (the last sampled token is never forwarded), read with
moe_lab's vLLM reader (``moe_lab.formats.vllm.read_vllm``: MoE layers kept, missing routes masked).
Verified at the seam (a stand-in engine in the tests), not on a GPU with a real vLLM.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from moe_lab.integrations.trl.config import replays_rollout
from moe_lab.integrations.trl.state import Rollout
from moe_lab.routing.trace import index_dtype

VLLM_MIN = (0, 22)


def vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_rollout_with_vllm(args) -> None:
    """routing_replay='rollout' with use_vllm=True: refused in one line unless TRL's colocated engine can
    return routed experts that cover every sequence of this rank."""
    if not (args.use_vllm and replays_rollout(args)):
        return
    found = vllm_version()
    from packaging.version import Version

    if found is None or Version(found) < Version("%d.%d" % VLLM_MIN):
        raise ValueError(f"routing_replay='rollout' with use_vllm=True needs vllm>={'.'.join(map(str, VLLM_MIN))} "
                         f"(routed experts returned), found {found or 'none'}; allowed: routing_replay='none' or "
                         "'old', or use_vllm=False")
    if args.vllm_mode != "colocate" or args.vllm_tensor_parallel_size != 1:
        raise ValueError(f"routing_replay='rollout' with use_vllm=True: vllm_mode={args.vllm_mode!r}, "
                         f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}; allowed: vllm_mode='colocate' "
                         "with vllm_tensor_parallel_size=1 (the server returns no routes to TRL)")
    if args.routing_replay_weights:
        raise ValueError("routing_replay_weights=True with use_vllm=True: vLLM returns expert ids, not combine "
                         "weights; allowed there: routing_replay_weights=False")


@dataclass
class EngineOutputs:
    """The outputs of the engine's last generate() call (the trainer's own object, read after each call)."""

    outputs: list = field(default_factory=list)


class RoutedLLM:
    """vLLM's LLM, unchanged, except that generate() keeps its outputs (routed experts included) in ``sink``."""

    def __init__(self, llm: Any, sink: EngineOutputs):
        self._llm, self._sink = llm, sink

    def generate(self, *args, **kwargs):
        outputs = self._llm.generate(*args, **kwargs)
        self._sink.outputs = list(outputs)
        return outputs

    def __getattr__(self, name: str):  # sleep, wake_up, llm_engine, reset_prefix_cache: the engine's own
        return getattr(self._llm, name)


@contextmanager
def routed_llm(module: Any, sink: EngineOutputs, on: bool) -> Iterator[None]:
    """While TRL's __init__ runs: ``module.LLM`` (trl.generation.vllm_generation's) builds the engine with
    routed experts returned and wraps it in a RoutedLLM; restored on exit. ``on`` False: nothing changes."""
    real = getattr(module, "LLM", None) if on else None
    if real is None:
        yield
        return

    def build(*args, **kwargs):
        return RoutedLLM(real(*args, **{**kwargs, "enable_return_routed_experts": True}), sink)

    module.LLM = build
    try:
        yield
    finally:
        module.LLM = real


def read_routes(routed: Any, config: Any, layer_idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_LSK int64, mask_LS bool) of one sequence's vLLM rows, MoE layers only, over the rows' positions."""
    try:
        from moe_lab.formats.vllm import read_vllm
    except ImportError:  # the traces issue's reader not installed: the same conversion, from the model's layers
        return _read_by_layers(routed, layer_idx)
    return read_vllm(routed, config=config)


def _read_by_layers(routed: Any, layer_idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids_SLK = torch.as_tensor(routed).long()
    if ids_SLK.dim() != 3:
        raise ValueError(f"routed_experts: expected [tokens, layers, top_k], got shape {tuple(ids_SLK.shape)}")
    if ids_SLK.shape[1] != len(layer_idx):  # one row per decoder layer (dense ones zero): keep the MoE layers'
        ids_SLK = ids_SLK[:, layer_idx]
    ids_LSK = ids_SLK.transpose(0, 1).contiguous()
    return ids_LSK, (ids_LSK >= 0).all(-1)


def rollout_of(outputs: list, config: Any, layer_idx: list[int], num_experts: int) -> Rollout:
    """The Rollout of one vLLM generate(): one row per completion, in TRL's order (requests, then their
    completions). A real token without a route cannot be forced: refused in one line."""
    rows, prompt_lens = [], []
    for request in outputs:
        p = len(request.prompt_token_ids)
        for completion in request.outputs:
            n = p + len(completion.token_ids) - 1
            if completion.routed_experts is None:
                raise ValueError("routing_replay='rollout': vLLM returned no routed_experts (was the engine built "
                                 "with enable_return_routed_experts=True?); allowed: routing_replay='none' or 'old'")
            # the rows may run one position past the last forwarded token (the sampled EOS): cut at n
            ids_LSK, mask_LS = read_routes(completion.routed_experts, config, layer_idx)
            if ids_LSK.shape[1] < n or not bool(mask_LS[:, :n].all()):
                missing = n - int(mask_LS[:, :n].all(0).sum())
                raise ValueError(f"routing_replay='rollout': vLLM's routes miss {missing} of {n} positions of a "
                                 "sequence; allowed: routes for every forwarded token (vLLM >= 0.22, Model Runner V2)")
            rows.append(ids_LSK[:, :n].to(index_dtype(num_experts)))
            prompt_lens.append(p)
    return Rollout(rows=rows, prompt_lens=prompt_lens)


def engine_rollout(outputs: list, config: Any, layer_idx: list[int], num_experts: int, strict: bool) -> Rollout | None:
    """``rollout_of``; not ``strict`` (the routes serve the metrics only, not R3), a generation whose routes do not
    cover its tokens gives None (no ``mismatch/expert_change`` for it) and one warning instead of an error."""
    try:
        return rollout_of(outputs, config, layer_idx, num_experts)
    except ValueError as err:
        if strict:
            raise
        warnings.warn(f"mismatch/expert_change left out for this generation: {err}", stacklevel=3)
        return None


def wants_routes(args) -> bool:
    """Build TRL's engine with routed experts returned: R3, or the metrics (mismatch/expert_change), wherever
    vLLM can return them to this rank (colocate, one GPU per engine, vLLM >= 0.22)."""
    if not args.use_vllm or args.vllm_mode != "colocate" or args.vllm_tensor_parallel_size != 1:
        return False
    found = vllm_version()
    if found is None:
        return False
    from packaging.version import Version

    return (replays_rollout(args) or args.moe_metrics) and Version(found) >= Version("%d.%d" % VLLM_MIN)
