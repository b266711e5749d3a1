"""The engine's log-probs of a sequence's completion tokens, read from a JSONL line in any stack's own field.

Each field below is a stack's own name for the log-probs its engine assigned to the sampled tokens
(docs/traces.md, "Engine log-probs"); a line carries at most one (the first present, in this order, is read).
Every reader is strict, as the routes are: exactly one log-prob per completion token (or, for the fields a
stack aligns with the whole sequence, one per token of prompt and completion, the prompt's ignored), each a
finite number <= 0 (a log-probability; 1e-6 above 0 is let pass as rounding); a field that does not fit is one
ValueError naming it.

| field | stack | form |
|---|---|---|
| ``completion_logprobs`` | moe_lab (native) | one number per completion token |
| ``rollout_log_probs`` | verl (``batch["rollout_log_probs"]``), slime (``Sample.rollout_log_probs``) | idem |
| ``generation_logprobs`` | NeMo-RL (an assistant message's, or ``train_data`` rows aligned with the tokens) | per completion token, or per token of the sequence |
| ``inference_logprobs`` | prime-rl (``TrainingSample.logprobs`` / the micro-batch's ``inference_logprobs``) | idem |
| ``output_token_logprobs`` | SGLang (``meta_info``) | ``[logprob, token_id, text]`` per completion token; the id must be the token's |
| ``logprobs`` | vLLM (``CompletionOutput.logprobs``: ``{token_id: Logprob}`` per token), OpenAI server objects, or numbers | per completion token |
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

Tensor = torch.Tensor


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _checked(values: list, field: str) -> Tensor:
    bad = next((i for i, x in enumerate(values) if not _number(x) or not math.isfinite(x) or x > 1e-6), None)
    if bad is not None:
        raise ValueError(f"{field}[{bad}]={values[bad]!r}: expected a finite log-probability (a number <= 0)")
    return torch.tensor(values, dtype=torch.float64)


def _per_token(value: Any, field: str, prompt: list[int], completion: list[int], whole: bool) -> Tensor:
    """A list of numbers: one per completion token, or (``whole``) one per token of the sequence."""
    n, S = len(completion), len(prompt) + len(completion)
    if not isinstance(value, list) or not all(_number(x) for x in value) or len(value) not in ((n, S) if whole else (n,)):
        also = f" or {S} (one per token of the sequence; the prompt's are ignored)" if whole else ""
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{field}: expected {n} numbers (one per completion token){also}, got {got}")
    return _checked(value[len(value) - n:], field)


def _sglang(value: Any, field: str, prompt: list[int], completion: list[int]) -> Tensor:
    n = len(completion)
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise ValueError(f"{field}: expected {n} [logprob, token_id, text] entries (one per completion token), "
                         f"got {got}")
    for i, (entry, token) in enumerate(zip(value, completion)):
        if not (isinstance(entry, list) and len(entry) >= 2 and _number(entry[0])):
            raise ValueError(f"{field}[{i}]={entry!r}: expected [logprob, token_id, ...]")
        if entry[1] != token:
            raise ValueError(f"{field}[{i}]: token id {entry[1]!r}, the completion's token there is {token}")
    return _checked([entry[0] for entry in value], field)


def _sampled(entry: Any, token: int, field: str, i: int) -> Any:
    """vLLM's {token_id: Logprob} of one position (JSON keys are strings): the sampled token's log-prob."""
    hit = entry.get(str(token), entry.get(token)) if isinstance(entry, dict) else None
    if hit is None:
        raise ValueError(f"{field}[{i}]: no entry for the completion's token {token} (expected vLLM's "
                         "{token_id: logprob} per position, the sampled token among them)")
    return hit.get("logprob") if isinstance(hit, dict) else hit


def _vllm(value: Any, field: str, prompt: list[int], completion: list[int]) -> Tensor:
    if isinstance(value, dict):  # the OpenAI server: chat {"content": [{"logprob": ...}]}, completions token_logprobs
        if isinstance(value.get("content"), list):
            value = [c.get("logprob") if isinstance(c, dict) else c for c in value["content"]]
        elif "token_logprobs" in value:
            value = value["token_logprobs"]
        else:
            raise ValueError(f"{field}: an object without content or token_logprobs (the OpenAI server's forms)")
    elif isinstance(value, list) and value and all(isinstance(e, dict) for e in value):
        if len(value) != len(completion):
            raise ValueError(f"{field}: expected {len(completion)} positions (one per completion token), got "
                             f"{len(value)}")
        value = [_sampled(e, t, field, i) for i, (e, t) in enumerate(zip(value, completion))]
    return _per_token(value, field, prompt, completion, whole=False)


def _plain(whole: bool) -> Callable[[Any, str, list[int], list[int]], Tensor]:
    return lambda value, field, prompt, completion: _per_token(value, field, prompt, completion, whole)


# field -> reader(value, field, prompt_ids, completion_ids); the order is the order of precedence
FIELDS: dict[str, Callable[[Any, str, list[int], list[int]], Tensor]] = {
    "completion_logprobs": _plain(False),
    "rollout_log_probs": _plain(False),
    "generation_logprobs": _plain(True),
    "inference_logprobs": _plain(True),
    "output_token_logprobs": _sglang,
    "logprobs": _vllm,
}


def engine_logprobs(line: dict, prompt: list[int], completion: list[int]) -> Tensor | None:
    """float64 [len(completion)] from the first field of ``FIELDS`` the line carries (None: none does)."""
    field = next((f for f in FIELDS if line.get(f) is not None), None)
    return None if field is None else FIELDS[field](line[field], field, prompt, completion)


def sample_logprobs(value: Any, field: str, n_completion: int) -> Tensor | None:
    """A file layout's per-completion-token list (slime's ``rollout_log_probs``), as strictly; None: absent."""
    if value is None:
        return None
    values = value.tolist() if hasattr(value, "tolist") else value  # a tensor or numpy array: its numbers
    return _per_token(list(values) if isinstance(values, tuple) else values, field, [], [0] * n_completion, False)
