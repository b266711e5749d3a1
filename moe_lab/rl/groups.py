"""Per-group sampling: every prompt group of a step samples from its own generator, seeded by (run seed, step,
prompt index).

A group's responses are then a function of that seed and the policy only: not of the launcher, of the world
size or of the rank the group lands on. So a plain run (``moe-lab run``), a 1-rank and an N-rank torchrun of one
config sample the same responses (``rl.rollout_seeding=per_group``, the default): bit for bit between a plain
run and a 1-rank torchrun (same batch), to float rounding of the logits at N ranks (other batch shapes; a token
differs only where two perturbed scores tie to rounding). The whole batch is sampled in one generate() call
(``moe_lab.rl.rollout.GroupSampler``): one call per group took 6x the rollout time (measured on the main job's
config, 2-core CPU). With sampler-side router noise (rl.rollout_router_noise) each group is generated on its
own, so that its noise draws are its own too, and the groups are joined (``join_batches``).

The ``sequential`` mode samples the whole batch from the run's global generator in one call: the sampling of the
committed references' plain runs, kept so that they re-run bit for bit (``moe_lab.config.legacy.LEGACY_VALUES``).
"""

from __future__ import annotations

import torch

from moe_lab.rl import seeds
from moe_lab.rl.rollout import RolloutBatch
from moe_lab.routing import Trace


def group_generators(seed: int, step: int, first_group: int, n_groups: int, device: torch.device) -> list[torch.Generator]:
    """The sampling generators of n_groups consecutive prompt groups, the first being group ``first_group`` of the
    step's batch: group i's seed is ``seeds.group_seed(seed, step, i)`` on any launcher and rank."""
    return [torch.Generator(device=device).manual_seed(seeds.group_seed(seed, step, first_group + j))
            for j in range(n_groups)]


def group_minibatch_indices(group_indices, group_size: int, minibatches: int, seed: int, step: int,
                         epoch: int = 0) -> list[torch.Tensor]:
    """Indices (into the rank's batch) of each minibatch: G/M responses of every local group.

    Each group's shuffle is seeded by its global index, so the global minibatch does not depend on the split;
    every epoch (rl.epochs) draws its own shuffle, epoch 0 the one single-epoch runs always drew.
    """
    parts: list[list[torch.Tensor]] = [[] for _ in range(minibatches)]
    for j, gi in enumerate(group_indices):
        gen = seeds.group_shuffle_generator(seed, step, gi, epoch)
        for m, chunk in enumerate(torch.randperm(group_size, generator=gen).chunk(minibatches)):
            parts[m].append(chunk + j * group_size)
    return [torch.cat(p) for p in parts]


def _prompt_len(response_mask_BT: torch.Tensor) -> int:
    # generate() emits at least one token, so column P-1 is a response column in every row
    return int(response_mask_BT[0].nonzero()[0]) + 1


def _pad_cols(x: torch.Tensor, left: int, right: int, value, dim: int = 1) -> torch.Tensor:
    if not left and not right:
        return x
    shape_l, shape_r = list(x.shape), list(x.shape)
    shape_l[dim], shape_r[dim] = left, right
    return torch.cat([x.new_full(shape_l, value), x, x.new_full(shape_r, value)], dim=dim)


def _pad_trace(trace: Trace, left: int, right: int) -> Trace:
    if not left and not right:
        return trace
    ids = trace.indices
    K = ids.shape[-1]
    # pad positions get distinct ids 0..K-1: never read (masked), but a valid top-k for replay to force
    fill = torch.arange(K, dtype=ids.dtype, device=ids.device)

    def pad(x, filler):
        L, B, _, _ = x.shape
        blocks = [filler.expand(L, B, n, K) for n in (left, right)]
        return torch.cat([blocks[0], x, blocks[1]], dim=2)

    w, lp = trace.weights, trace.router_logp_LBTK
    zeros = torch.zeros(K, dtype=torch.float32, device=ids.device)  # never read either: masked positions
    return Trace(pad(ids, fill), None if w is None else pad(w, zeros), num_experts=trace.num_experts,
                 family=trace.family, router_logp=None if lp is None else pad(lp, zeros))


def join_batches(parts: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """One batch from the rollouts of single prompt groups: prompts left-padded, responses right-padded, as one
    generate() call over the whole batch lays them out (pad tokens after EOS carry attention 1, as generate()'s
    do: causal attention never reads them)."""
    if len(parts) == 1:
        return parts[0]
    P = [_prompt_len(b.response_mask_BT) for b in parts]
    N = [b.input_ids_BS.shape[1] - p for b, p in zip(parts, P)]
    pads = [(max(P) - p, max(N) - n) for p, n in zip(P, N)]

    def cat(get, value):
        return torch.cat([_pad_cols(get(b), left, right, value) for b, (left, right) in zip(parts, pads)])

    trace = None
    if parts[0].trace is not None:
        trace = Trace.cat([_pad_trace(b.trace, left, right) for b, (left, right) in zip(parts, pads)])
    ids = torch.cat([_pad_cols(_pad_cols(b.input_ids_BS, left, 0, pad_token_id), 0, right, pad_token_id)
                     for b, (left, right) in zip(parts, pads)])
    attn = torch.cat([_pad_cols(_pad_cols(b.attention_mask_BS, left, 0, 0), 0, right, 1)
                      for b, (left, right) in zip(parts, pads)])
    return RolloutBatch(prompts=[p for b in parts for p in b.prompts],
                        completions=[c for b in parts for c in b.completions], input_ids_BS=ids,
                        attention_mask_BS=attn, response_mask_BT=cat(lambda b: b.response_mask_BT, False),
                        logp_rollout_BT=cat(lambda b: b.logp_rollout_BT, 0.0), trace=trace,
                        response_len_B=torch.cat([b.response_len_B for b in parts]))
