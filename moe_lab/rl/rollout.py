"""Rollouts: sample responses with the KV cache, record their routing, and score token log-probs.

Token alignment used everywhere downstream (losses, traces, metrics): a sequence of S tokens is
forwarded as ``input_ids[:, :-1]`` (the last token's logits are never needed), so column ``t`` of every
``*_BT`` tensor (T = S - 1) holds the log-prob of token ``t + 1`` and the routing of position ``t``,
which is the routing that produced that log-prob. ``generate()`` never forwards its last sampled token
either, so the rollout trace has exactly the same T columns as a training forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from moe_lab.models import position_ids_from_mask as position_ids
from moe_lab.routing import Trace, record
from moe_lab.routing.predictor import record_predicted


@dataclass
class RolloutBatch:
    """One batch of prompts with their sampled responses, left-padded prompts, right-padded responses."""

    prompts: list[str]
    completions: list[str]
    input_ids_BS: torch.Tensor
    attention_mask_BS: torch.Tensor
    response_mask_BT: torch.Tensor  # bool, True where token t+1 is a response token (EOS included)
    logp_rollout_BT: torch.Tensor  # fp32 log-probs of the sampler (0 outside the response)
    trace: Trace | None = None  # routing recorded during generation (R3), T positions
    response_len_B: torch.Tensor = field(default_factory=lambda: torch.empty(0))


def _generation_config(tokenizer, max_new_tokens: int, temperature: float, greedy: bool) -> GenerationConfig:
    # top_k=0 and top_p=1 matter: transformers' default top_k=50 would silently truncate the policy,
    # and logp_rollout would then no longer be the log-prob of the distribution we sample from. For the
    # same reason every other logits processor is set to its neutral value explicitly: generate() fills
    # fields left as None from the checkpoint's own generation_config (repetition penalty, typical_p, ...).
    return GenerationConfig(
        repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
        min_new_tokens=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, suppress_tokens=[],
        begin_suppress_tokens=[], renormalize_logits=False,
        max_new_tokens=max_new_tokens, do_sample=not greedy, temperature=None if greedy else temperature,
        top_k=None if greedy else 0, top_p=None if greedy else 1.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, use_cache=True,
        return_dict_in_generate=True, output_logits=True,
    )


class GroupSampler(LogitsProcessor):
    """Sampling from softmax(logits / T) with each prompt group's own generator, in one batched generate().

    generate() runs greedy with this processor: the exponential race argmax_i p_i / E_i, E_i ~ Exp(1) iid, is an
    exact draw from p (the Gumbel-max trick, as vLLM and FlashInfer sample). Rows [j*G, (j+1)*G) draw their E
    from ``generators[j]`` alone, so a group's tokens depend on its own stream, never on which groups share
    the batch (moe_lab.rl.groups). E is drawn in float64: a draw of exactly 0, which would pick a token whatever
    its probability, has probability 2**-53 instead of float32's 2**-24.
    """

    def __init__(self, generators: list[torch.Generator], group_size: int, temperature: float):
        self.generators, self.group_size, self.temperature = generators, group_size, temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        B, V = scores.shape
        if B != len(self.generators) * self.group_size:
            raise ValueError(f"GroupSampler: {B} rows, expected {len(self.generators)} groups of {self.group_size}")
        e_BV = torch.cat([torch.empty(self.group_size, V, dtype=torch.float64, device=scores.device)
                          .exponential_(generator=g) for g in self.generators])
        logp_BV = torch.log_softmax(scores.double() / self.temperature, dim=-1)
        return logp_BV - e_BV.log()  # float64: only its argmax is read


def _response_mask(new_ids_BN: torch.Tensor, eos_id: int) -> torch.Tensor:
    """True up to and including the first EOS of each response."""
    is_eos = (new_ids_BN == eos_id).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # EOS strictly before this position
    return eos_before == 0


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float = 1.0,
             greedy: bool = False, record_routing: bool = False, router_noise: float = 0.0,
             noise_generator: torch.Generator | None = None, predictive: bool = False,
             sampler: GroupSampler | None = None) -> RolloutBatch:
    """Sample one response per prompt (repeat prompts for groups) with the KV cache.

    Sampling draws from torch's default generator (seed it for reproducibility), or, given ``sampler``, from
    each group's own generator (rl.rollout_seeding=per_group).
    router_noise > 0 adds N(0, router_noise^2) to every router logit of the generation forwards, drawn from
    noise_generator only (so the sampling RNG stream is not consumed); the recorded trace is the noisy routing.
    """
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    prompt_ids, prompt_mask = enc["input_ids"].to(model.device), enc["attention_mask"].to(model.device)
    # a GroupSampler does the sampling: generate() then runs greedy on the scores it returns (raw logits kept)
    cfg = _generation_config(tokenizer, max_new_tokens, temperature, greedy or sampler is not None)
    processors = LogitsProcessorList([sampler] if sampler is not None else [])
    # router log-probs ride along (one log-softmax per layer and step): with rl.old_logp=rollout this trace is
    # the reference of routing/router_shift and RSPO's gamma
    # (predictive: route by the PR2 predictor's logits, moe_lab/routing/predictor.py)
    noisy = dict(noise_std=router_noise, generator=noise_generator) if router_noise else {}
    recorder = record_predicted if predictive else record
    ctx = recorder(model, router_logp=True, **noisy) if record_routing or noisy else contextlib.nullcontext()
    with ctx as trace:
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=cfg,
                             logits_processor=processors)
    seq_BS = out.sequences
    B, P = prompt_ids.shape
    new_BN = seq_BS[:, P:]
    N = new_BN.shape[1]
    resp_BN = _response_mask(new_BN, tokenizer.eos_token_id)
    attn_BS = torch.cat([prompt_mask, torch.ones_like(new_BN)], dim=1)
    logits_BNV = torch.stack(out.logits, dim=1).float()
    scale = 1.0 if greedy else temperature
    logp_BN = torch.log_softmax(logits_BNV / scale, dim=-1).gather(-1, new_BN.unsqueeze(-1)).squeeze(-1)
    T = P + N - 1
    resp_mask_BT = torch.zeros(B, T, dtype=torch.bool, device=seq_BS.device)
    resp_mask_BT[:, P - 1:] = resp_BN
    logp_BT = torch.zeros(B, T, dtype=torch.float32, device=seq_BS.device)
    logp_BT[:, P - 1:] = torch.where(resp_BN, logp_BN, torch.zeros_like(logp_BN))
    completions = decode_responses(tokenizer, new_BN, resp_BN)
    return RolloutBatch(prompts=list(prompts), completions=completions, input_ids_BS=seq_BS, attention_mask_BS=attn_BS,
                        response_mask_BT=resp_mask_BT, logp_rollout_BT=logp_BT,
                        trace=trace if record_routing else None, response_len_B=resp_BN.sum(-1))


def decode_responses(tokenizer, new_BN: torch.Tensor, resp_BN: torch.Tensor) -> list[str]:
    """Response text without EOS or padding."""
    eos = tokenizer.eos_token_id  # read once: each read is a vocabulary lookup, once per token it was 8% of a rollout
    rows = [[t for t, k in zip(ids, keep) if k and t != eos] for ids, keep in zip(new_BN.tolist(), resp_BN.tolist())]
    return [text.replace(" ", "") for text in tokenizer.batch_decode(rows, skip_special_tokens=True)]


def forward_logits(model, input_ids_BS: torch.Tensor, attention_mask_BS: torch.Tensor, **kwargs):
    """Teacher-forced forward on ``input_ids[:, :-1]`` with generate()'s position ids."""
    pos_BS = position_ids(attention_mask_BS)
    return model(input_ids=input_ids_BS[:, :-1], attention_mask=attention_mask_BS[:, :-1],
                 position_ids=pos_BS[:, :-1], use_cache=False, **kwargs)


def token_logprobs(logits_BTV: torch.Tensor, input_ids_BS: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-prob of each next token: column t scores token t+1."""
    logp_BTV = torch.log_softmax(logits_BTV.float() / temperature, dim=-1)
    return logp_BTV.gather(-1, input_ids_BS[:, 1:].unsqueeze(-1)).squeeze(-1)


def token_entropy(logits_BTV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats) of the sampling distribution at each position."""
    logp_BTV = torch.log_softmax(logits_BTV.detach().float() / temperature, dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(-1)


@torch.no_grad()
def accuracy(model, task, prompts: list[str], *, greedy: bool, temperature: float = 1.0, batch_size: int = 256) -> float:
    """Mean task reward of one response per prompt."""
    total = 0.0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        batch = generate(model, task.tokenizer, chunk, max_new_tokens=task.max_new_tokens,
                         temperature=temperature, greedy=greedy)
        total += sum(task.reward(p, c) for p, c in zip(chunk, batch.completions))
    return total / max(len(prompts), 1)
