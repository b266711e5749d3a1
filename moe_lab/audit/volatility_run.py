"""The model side of `moe-lab volatility`: OLD's seeded completions, then three teacher-forced forwards per batch.

Per batch of sequences: OLD free (routing recorded with its router log-probs), NEW free (routing recorded, its
router log-probs read at OLD's experts), NEW with OLD's routing replayed. The routing metrics are moe_lab's own
(``routing_metrics``, ``router_shift``), combined over batches as token means; the log-ratio's variance and
routing share come from ``ratio_decomposition`` over the response tokens of all batches at once.

``run`` holds one checkpoint at a time: OLD generates and runs its forwards on every batch (keeping only the
sequences, OLD's trace and its token log-probs), is freed, and only then is NEW loaded for its two forwards.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, LogitsProcessorList

from moe_lab.algos.ratio_metrics import masked_var, ratio_decomposition
from moe_lab.config.constants import BASELINE_ALGO, PAPER_CLIP
from moe_lab.models import checkpoint_dtype, load_model, moe_layers, resolve_device
from moe_lab.rl.rollout import GroupSampler, forward_logits, token_logprobs
from moe_lab.routing import Trace, record, replay, router_logp_probe, router_shift, routing_metrics

Tensor = torch.Tensor


@dataclass
class Batch:
    seq_BS: Tensor  # left-padded prompt + completion (right-padded after EOS)
    attn_BS: Tensor
    resp_BT: Tensor  # bool: column t predicts a completion token (EOS included); T = S - 1
    prompt_len: int


@dataclass
class Result:
    per_layer: list[dict]
    summary: dict
    sequences: list[dict] = field(default_factory=list)


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = model.config.eos_token_id if eos is None else eos
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def _pad_id(model) -> int:
    pad = model.generation_config.pad_token_id
    pad = model.config.pad_token_id if pad is None else pad
    return int(pad) if pad is not None else (_eos_ids(model) or [0])[0]


def _generation_config(model, max_new_tokens: int) -> GenerationConfig:
    # greedy on the GroupSampler's scores (the sampling draw); every other processor set to its neutral value,
    # so nothing from the checkpoint's own generation_config reshapes OLD's distribution
    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False, temperature=None,
                            top_k=None, top_p=None, repetition_penalty=1.0, encoder_repetition_penalty=1.0,
                            no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
                            suppress_tokens=[], begin_suppress_tokens=[], renormalize_logits=False,
                            pad_token_id=_pad_id(model), eos_token_id=_eos_ids(model) or None, use_cache=True)


@torch.no_grad()
def generate(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
             generator: torch.Generator) -> Batch:
    """OLD's completions of a batch of prompts, sampled with ``generator`` alone (left padding)."""
    device, pad = model.device, _pad_id(model)
    P = max(len(p) for p in prompts)
    prompt_BP = torch.tensor([[pad] * (P - len(p)) + p for p in prompts], device=device)
    mask_BP = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=device)
    sampler = GroupSampler([generator], len(prompts), temperature)
    seq_BS = model.generate(input_ids=prompt_BP, attention_mask=mask_BP,
                            logits_processor=LogitsProcessorList([sampler]),
                            generation_config=_generation_config(model, max_new_tokens))
    new_BN = seq_BS[:, P:]
    is_eos_BN = torch.isin(new_BN, torch.tensor(_eos_ids(model) or [-1], device=device)).long()
    resp_BN = (is_eos_BN.cumsum(-1) - is_eos_BN) == 0  # up to and including the first EOS
    attn_BS = torch.cat([mask_BP, resp_BN.long()], dim=1)
    resp_BT = torch.zeros(len(prompts), seq_BS.shape[1] - 1, dtype=torch.bool, device=device)
    resp_BT[:, P - 1:] = resp_BN
    return Batch(seq_BS, attn_BS, resp_BT, P)


@dataclass
class OldPass:
    """What NEW's forwards need of one batch once OLD is gone."""

    batch: Batch
    prompts: list[list[int]]
    trace: Trace  # OLD's, with its router log-probs
    logp_old_BT: Tensor


@torch.no_grad()
def old_pass(old, batch: Batch, prompts: list[list[int]]) -> OldPass:
    with record(old, router_logp=True) as old_trace:
        logp_old_BT = token_logprobs(forward_logits(old, batch.seq_BS, batch.attn_BS).logits, batch.seq_BS)
    return OldPass(batch, prompts, old_trace, logp_old_BT)


@torch.no_grad()
def teacher_forced(new, part: OldPass) -> dict:
    """NEW's two forwards of one batch and the batch's metrics (token means over the response)."""
    batch, old_trace, logp_old_BT = part.batch, part.trace, part.logp_old_BT
    seq, attn, mask = batch.seq_BS, batch.attn_BS, batch.resp_BT
    with record(new) as new_trace, router_logp_probe(new, old_trace.indices) as probe:
        logp_new_BT = token_logprobs(forward_logits(new, seq, attn).logits, seq)
    with replay(new, old_trace):
        logp_ref_BT = token_logprobs(forward_logits(new, seq, attn).logits, seq)
    L = old_trace.num_layers
    layer_rows = [routing_metrics(old_trace.indices[l:l + 1], new_trace.indices[l:l + 1], mask, prefix="")
                  for l in range(L)]
    overall = routing_metrics(old_trace, new_trace, mask, prefix="")
    _, shift = router_shift(old_trace, probe.at(old_trace.indices), mask, prefix="")
    return dict(tokens=int(mask.sum()), overall=overall, layers=layer_rows, shift=shift,
                logp=(logp_new_BT[mask].float().cpu(), logp_ref_BT[mask].float().cpu(),
                      logp_old_BT[mask].float().cpu()))


class _TokenMeans:
    """Token-weighted means of per-batch token means (exact: each batch's mean times its token count)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.tokens = 0

    def add(self, values: dict[str, float], tokens: int) -> None:
        if tokens:
            for key, value in values.items():
                self.sums[key] = self.sums.get(key, 0.0) + value * tokens

    def means(self) -> dict[str, float]:
        return {key: total / self.tokens if self.tokens else float("nan") for key, total in self.sums.items()}


def _combine(parts: list[dict], layer_idx: list[int]) -> tuple[list[dict], dict]:
    acc = _TokenMeans()
    for part in parts:
        acc.tokens += part["tokens"]
        acc.add({"expert_change": part["overall"]["expert_change"], "any_change": part["overall"]["any_change"],
                 "router_shift": part["shift"]["router_shift"]}, part["tokens"])
        for l, row in enumerate(part["layers"]):
            acc.add({f"{l}/expert_change": row["expert_change"], f"{l}/any_change": row["any_change"],
                     f"{l}/router_shift": part["shift"][f"layer_{l}/router_shift"]}, part["tokens"])
    means = acc.means()
    per_layer = [dict(layer=idx, expert_change=means.get(f"{l}/expert_change", float("nan")),
                      any_change=means.get(f"{l}/any_change", float("nan")),
                      router_shift=means.get(f"{l}/router_shift", float("nan"))) for l, idx in enumerate(layer_idx)]
    new_N, ref_N, old_N = (torch.cat([p["logp"][i] for p in parts])[None] for i in range(3))
    ones_N = torch.ones_like(new_N, dtype=torch.bool)
    decomp = ratio_decomposition(new_N, ref_N, old_N, ones_N, *PAPER_CLIP[BASELINE_ALGO])
    summary = dict(response_tokens=acc.tokens, expert_change=means.get("expert_change", float("nan")),
                   any_change=means.get("any_change", float("nan")),
                   router_shift=means.get("router_shift", float("nan")),
                   logratio_var=float(masked_var(new_N - old_N, ones_N)),
                   routing_share=decomp["ratio/routing_share"], d_route_var=decomp["ratio/d_route_var"],
                   d_weight_var=decomp["ratio/d_weight_var"])
    return per_layer, summary


def _sequence_rows(batch: Batch, prompts: list[list[int]]) -> list[dict]:
    new_BN = batch.seq_BS[:, batch.prompt_len:]
    keep_BN = batch.resp_BT[:, batch.prompt_len - 1:]
    return [dict(prompt_ids=p, completion_ids=ids[keep].tolist()) for p, ids, keep in zip(prompts, new_BN.cpu(),
                                                                                          keep_BN.cpu())]


@torch.no_grad()
def old_side(old, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, seed: int,
             batch_size: int) -> tuple[list[OldPass], list[int], str]:
    """OLD's part of every batch: its completions and forwards; (parts, MoE layer indices, family)."""
    generator = torch.Generator(device=old.device).manual_seed(seed)
    parts = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        batch = generate(old, chunk, max_new_tokens=max_new_tokens, temperature=temperature, generator=generator)
        parts.append(old_pass(old, batch, chunk))
    layers = moe_layers(old)
    return parts, [layer.layer_idx for layer in layers], layers[0].family.name


def new_side(new, parts: list[OldPass], layer_idx: list[int], family: str) -> Result:
    """NEW's forwards of every batch OLD ran, and the figures."""
    per_layer, summary = _combine([teacher_forced(new, part) for part in parts], layer_idx)
    summary = dict(family=family, sequences=sum(len(p.prompts) for p in parts), **summary)
    return Result(per_layer, summary, [row for p in parts for row in _sequence_rows(p.batch, p.prompts)])


def measure(old, new, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, seed: int,
            batch_size: int) -> Result:
    """Volatility of loaded NEW against loaded OLD on OLD's completions of ``prompts`` (one device)."""
    parts, layer_idx, family = old_side(old, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                        seed=seed, batch_size=batch_size)
    return new_side(new, parts, layer_idx, family)


def _load(path, dtype: torch.dtype, where: torch.device):
    # read straight onto the device in the asked dtype: never built whole in CPU memory first
    return load_model(path, dtype=dtype, device_map=None if where.type == "cpu" else {"": str(where)})


def run(old_path, new_path, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, seed: int,
        batch_size: int, dtype: str, device: str) -> Result:
    """Load OLD, run its part, free it, then load NEW and run its part (``dtype``, on ``device``; see
    moe_lab.audit.volatility): one checkpoint in memory at a time. ``dtype="auto"``: OLD's own, for both."""
    where = resolve_device(device)
    dtype = checkpoint_dtype(old_path) if dtype == "auto" else getattr(torch, dtype)
    old = _load(old_path, dtype, where)
    parts, layer_idx, family = old_side(old, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                        seed=seed, batch_size=batch_size)
    del old
    gc.collect()
    if where.type == "cuda":
        torch.cuda.empty_cache()
    return new_side(_load(new_path, dtype, where), parts, layer_idx, family)


def write(result: Result, out: Path) -> None:
    """volatility.parquet (a row per MoE layer, then the ``all`` row) and sequences.jsonl into ``out``."""
    import json

    import pandas as pd

    rows = [dict(scope="layer", **row) for row in result.per_layer]
    rows.append(dict(scope="all", layer=-1, **{k: v for k, v in result.summary.items() if k != "family"}))
    frame = pd.DataFrame(rows)
    frame.insert(0, "family", result.summary["family"])
    frame.to_parquet(out / "volatility.parquet", index=False)
    with open(out / "sequences.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in result.sequences)
