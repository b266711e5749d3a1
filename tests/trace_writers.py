"""Routes written back out in the layouts moe_lab.formats reads: the dumps the tests and benchmarks feed to
`moe-lab check-trace`. moe_lab itself never writes these layouts (the engines and trainers do), so the writers
live beside the tests rather than in the package.

Every writer goes through ``encode`` (Routes -> rows of a chosen layer numbering), the inverse of the readers'
``formats.routes.decode``: the layer axis comes from the same ``formats.layers.layer_map`` the readers use,
and each layout's own facts (NeMo-RL's envelope prefix, dtypes and placeholder route, SGLang's id dtype,
prime-rl's dtypes) are the reader module's declarations, never copied here.

The benchmarks import this file by putting the tests folder on sys.path (tests/ is not a package and is not
installed).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_lab.formats import nemo_rl, prime_rl, sglang
from moe_lab.formats.layers import layer_map, layer_maps
from moe_lab.formats.logprobs import FIELDS
from moe_lab.formats.routes import Routes, RoutedSequence


def encode(routes: Routes, config: Any, *, layers: str = "moe", missing: int = 0, start: int = 0,
           stop: int | None = None) -> torch.Tensor:
    """Routes -> int64 rows [positions start..stop, layer axis of numbering ``layers``, top_k].

    Missing slots and the rows the numbering adds (dense, MTP) are filled with ``missing`` (0: vLLM, SGLang;
    -1: NeMo-RL).
    """
    maps = layer_maps(config)
    if layers not in maps:
        raise ValueError(f"layers={layers!r} is not a numbering of this model; allowed {', '.join(maps)}")
    lmap = maps[layers]
    if len(lmap.rows) != routes.num_layers:
        raise ValueError(f"routes: {routes.num_layers} MoE layers, the model's config has {len(lmap.rows)}")
    stop = routes.num_positions if stop is None else stop
    ids_SLK = routes.ids_LSK[:, start:stop].permute(1, 0, 2)
    ids_SLK = ids_SLK.masked_fill(~routes.mask_LS[:, start:stop].T[..., None], missing)
    rows = torch.full((ids_SLK.shape[0], lmap.axis_len, routes.top_k), missing, dtype=torch.int64)
    rows[:, list(lmap.rows)] = ids_SLK
    return rows


def write_vllm(routes: Routes, *, config: Any, layers: str = "decoder", stop: int | None = None) -> np.ndarray:
    """Routes -> vLLM rows [positions 0..stop, layers, top_k] int16 (the OpenAI server's lists) with zeros for
    dense layers and missing routes (``layers="moe"``: the MoE layers only)."""
    return encode(routes, config, layers=layers, missing=0, stop=stop).numpy().astype(np.int16)


def write_vllm_split(routes: Routes, *, config: Any, prompt_len: int, layers: str = "decoder",
                     stop: int | None = None) -> tuple[list, list]:
    """The OpenAI server's two fields as JSON lists: (prompt_routed_experts, routed_experts)."""
    rows = write_vllm(routes, config=config, layers=layers, stop=stop)
    return rows[:prompt_len].tolist(), rows[prompt_len:].tolist()


def write_sglang(routes: Routes, *, config: Any, start: int = 0, stop: int | None = None,
                 layers: str = "moe") -> str:
    """Routes -> SGLang's base64 string over positions [start, stop) (default stop: the last position, which
    SGLang never covers)."""
    stop = routes.num_positions - 1 if stop is None else stop
    rows = encode(routes, config, layers=layers, missing=0, start=start, stop=stop)
    return base64.b64encode(rows.numpy().astype(sglang.ID_DTYPE).tobytes()).decode("ascii")


def write_nemo_rl(routes: Routes, *, config: Any, dtype: str = "int16", layers: str = "moe",
                  stop: int | None = None) -> str:
    """Routes -> the envelope as NeMo-RL writes it: -1 where a route is missing inside the engine's rows, the
    placeholder route in the rows of dense or MTP layers and in the trailing positions without any route
    (``pad_and_align_routed_expert_indices``)."""
    if dtype not in nemo_rl.DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed {', '.join(nemo_rl.DTYPES)}")
    rows = encode(routes, config, layers=layers, missing=-1, stop=stop)
    lmap = layer_map(config, rows.shape[1], layers)
    placeholder = nemo_rl.placeholder_route(rows.shape[2])
    rows[:, list(lmap.dropped)] = placeholder
    covered = routes.mask_LS[:, : rows.shape[0]].any(0)
    last = int(covered.nonzero().max()) + 1 if covered.any() else 0
    rows[last:] = placeholder
    rows = rows.numpy().astype(np.dtype(dtype).newbyteorder("<"))
    S, L, K = rows.shape
    return f"{nemo_rl.PREFIX}:{dtype}:{S}x{L}x{K}:{base64.b64encode(rows.tobytes()).decode('ascii')}"


def write_prime_rl(routes: Routes, *, config: Any, start: int = 0, stop: int | None = None,
                   dtype: str | None = None, layers: str = "moe") -> dict:
    """Routes -> prime-rl's dict; its narrowest unsigned dtype that holds every id unless ``dtype`` names one."""
    rows = encode(routes, config, layers=layers, missing=0, start=start, stop=stop)
    if dtype is None:
        top = int(rows.max()) if rows.numel() else 0
        dtype = next(d for d in prime_rl.DTYPES if top <= np.iinfo(d).max)
    if dtype not in prime_rl.DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed {', '.join(prime_rl.DTYPES)}")
    data = rows.numpy().astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    return {"data": base64.b64encode(data).decode("ascii"), "shape": list(rows.shape), "start": start,
            "dtype": dtype}


def write_verl(routes: list[Routes], *, config: Any, seq_len: int, prompt_lens: list[int],
               prompt_width: int, layers: str = "decoder") -> tuple[torch.Tensor, torch.Tensor]:
    """Routes -> (routed_experts [batch, seq_len, layers, top_k] int64, attention_mask [batch, seq_len]):
    prompt right-aligned in the first ``prompt_width`` columns, response from column ``prompt_width`` on."""
    out, mask = None, torch.zeros(len(routes), seq_len, dtype=torch.int64)
    for b, (r, p) in enumerate(zip(routes, prompt_lens)):
        rows = encode(r, config, layers=layers, missing=0)
        if out is None:
            out = torch.zeros(len(routes), seq_len, *rows.shape[1:], dtype=torch.int64)
        cols = [*range(prompt_width - p, prompt_width), *range(prompt_width, prompt_width + r.num_positions - p)]
        out[b, cols] = rows
        mask[b, cols] = 1
    return out, mask


def write_slime(path: str | Path, sequences: list[RoutedSequence], *, config: Any, layers: str = "decoder",
                rollout_id: int = 0) -> None:
    """Sequences -> a slime-shaped debug file (int32 ids [len(tokens) - 1, layers, top_k], zeros missing)."""
    samples = []
    for seq in sequences:
        rows = encode(seq.routes, config, layers=layers, missing=0, stop=seq.num_tokens - 1)
        sample = {"tokens": seq.tokens.tolist(), "response_length": seq.num_tokens - seq.prompt_len,
                  "rollout_routed_experts": rows.to(torch.int32), "status": "completed"}
        if seq.engine_logprobs is not None:
            sample["rollout_log_probs"] = seq.engine_logprobs.tolist()
        samples.append(sample)
    torch.save({"rollout_id": rollout_id, "samples": samples}, str(path))


def write_logprobs(seq: RoutedSequence, stack: str = "moe_lab") -> dict:
    """The engine's log-probs of ``seq``'s completion tokens as ``stack`` holds them, in its own field (the
    reader's names, formats.logprobs.FIELDS): one per completion token, or aligned with the whole sequence with
    0.0 on the prompt (NeMo-RL's train_data rows, prime-rl's TrainingSample), SGLang's [logprob, token_id,
    text] triples, vLLM's {token_id: Logprob} per position, the OpenAI server's chat object."""
    lp, completion = seq.engine_logprobs.tolist(), seq.tokens[seq.prompt_len:].tolist()
    whole = [0.0] * seq.prompt_len + lp
    fields = {"moe_lab": ("completion_logprobs", lp), "verl": ("rollout_log_probs", lp),
              "slime": ("rollout_log_probs", lp), "nemo_rl": ("generation_logprobs", whole),
              "prime_rl": ("inference_logprobs", whole),
              "sglang": ("output_token_logprobs", [[x, t, None] for x, t in zip(lp, completion)]),
              "vllm": ("logprobs", [{str(t): {"logprob": x, "rank": 1, "decoded_token": None}}
                                    for x, t in zip(lp, completion)]),
              "openai": ("logprobs", {"content": [{"token": "", "logprob": x, "bytes": None, "top_logprobs": []}
                                                  for x in lp]})}
    field, value = fields[stack]
    if field not in FIELDS:
        raise ValueError(f"{field} is not a field formats.logprobs reads")
    return {field: value}


def write_line(seq: RoutedSequence, line_routes: dict, logprobs: str = "moe_lab") -> str:
    """One JSONL line: the tokens of ``seq``, the layout fields in ``line_routes`` and, when ``seq`` carries
    them, the engine's log-probs in stack ``logprobs``'s field (``write_logprobs``)."""
    completion = seq.tokens[seq.prompt_len:].tolist()
    line = {"prompt_ids": seq.tokens[: seq.prompt_len].tolist(), "completion_ids": completion, **line_routes}
    if seq.engine_logprobs is not None:
        line.update(write_logprobs(seq, logprobs))
    return json.dumps(line)
