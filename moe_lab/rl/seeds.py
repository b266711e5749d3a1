"""Every random seed of an RL run, derived in one place from (run seed, step, update or group, purpose).

Each purpose has its own stream, so that changing how often one thing happens (evaluations, epochs,
minibatches) never shifts the random numbers of another. The cold start is seeded apart, by model.seed
(moe_lab.rl.coldstart), so that every run of one model config starts from the same weights.

Two sampling regimes (rl.rollout_seeding):
- per_group (the default): each prompt group's responses are drawn under ``group_seed(seed, step, prompt
  index)`` (moe_lab.rl.groups), so a group gets the same responses in a plain run (``moe-lab run``) and on
  whichever rank of a torchrun it lands, any world size;
- sequential (plain runs only; the committed references' sampling, kept so they re-run bit for bit): torch's
  global generator is seeded once (``run_seed``) and every rollout batch is sampled from it in sequence.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

_STEP_MUL, _SEED_MUL = 7919, 1_000_003
_OLD_PASS, _UPDATE = 0, 1  # salts of the router-noise streams: the old-policy forward, update u at 1 + u
_SHUFFLE, _EPOCH_MUL = 999_983, 1_009  # salt of the minibatch shuffles, and its stride per epoch
_GROUP_MUL, _GROUP_SALT = 104_729, 12_345
_ROLLOUT_NOISE = 1 << 40  # rl.rollout_router_noise: far from the trainer's salts (0, 1 + update, 999_983 + ...)
_DECOMPOSITION = 2_000_003  # the ratio decomposition's counterfactual forward: no training stream


def run_seed(seed: int) -> int:
    """torch's global seed of a run, set once after the model is loaded (loading may draw numbers)."""
    return seed


def prompt_rng(seed: int, step: int) -> np.random.Generator:
    """The prompts of one step: a pure function of (seed, step), so a resumed run draws the same ones."""
    return np.random.default_rng([seed, step])


def eval_seed(seed: int, step: int) -> int:
    """Sampling seed of the evaluation at ``step`` (run under torch.random.fork_rng: it draws from no other stream)."""
    return seed * _SEED_MUL + step + 7


def _generator(seed: int, step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * _SEED_MUL + step * _STEP_MUL + salt)


def old_pass_generator(seed: int, step: int) -> torch.Generator:
    """Router noise (rl.router_noise) of the old-policy forward of ``step``."""
    return _generator(seed, step, _OLD_PASS)


def update_generator(seed: int, step: int, update: int) -> torch.Generator:
    """Router noise of update ``update`` (the run's global optimizer-step index)."""
    return _generator(seed, step, _UPDATE + update)


def rollout_noise_generator(seed: int, step: int, prompts: list[str]) -> torch.Generator:
    """Router noise of the sampler (rl.rollout_router_noise) for one collect() call. The prompts' crc32 joins the
    seed: torchrun collects group by group, and each group must draw its own noise (the same for any world
    size), not a copy of its neighbour's."""
    return _generator(seed, step, _ROLLOUT_NOISE + zlib.crc32("\n".join(prompts).encode("utf-8")))


def decomposition_generator(seed: int, step: int, update: int) -> torch.Generator:
    """Router noise of the ratio decomposition's extra forward at update ``update`` (rl.decomp_every)."""
    return _generator(seed, step, _DECOMPOSITION + update)


def shuffle_generator(seed: int, step: int, epoch: int) -> torch.Generator:
    """The minibatch order of one epoch of a plain run's step; epoch 0 keeps the salt single-epoch runs drew."""
    return _generator(seed, step, _SHUFFLE + epoch * _EPOCH_MUL)


def group_seed(seed: int, step: int, prompt_index: int) -> int:
    """Sampling seed of one prompt group (rl.rollout_seeding=per_group): the same on any launcher and rank."""
    return (seed * _SEED_MUL + step * _STEP_MUL + prompt_index * _GROUP_MUL + _GROUP_SALT) % (2 ** 63)


def group_shuffle_generator(seed: int, step: int, prompt_index: int, epoch: int) -> torch.Generator:
    """The order of one group's responses in the minibatches of one epoch (group-local minibatches)."""
    return torch.Generator().manual_seed(group_seed(seed, step, prompt_index) + _SHUFFLE + epoch * _EPOCH_MUL)
