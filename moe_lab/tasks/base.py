"""What every task shares: the train/eval split, reward scoring, seeded prompt sampling.

A task is a problem generator plus a verifier. Subclasses say how to draw problems, what the correct
answer to a prompt is and how many problems exist; everything else (held-out split, exact-match and
partial-credit rewards, determinism) lives here once.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import ClassVar

import numpy as np

from moe_lab.config import TaskConfig
from moe_lab.tasks.tokenizer import build_tokenizer

# One problem in EVAL_MODULUS is held out. The split hashes the prompt text itself (not a sample index),
# so it does not depend on the seed, the batch size or the order prompts are drawn in: no training draw,
# from any generator, can ever return an evaluation prompt.
EVAL_MODULUS = 16
# The held-out share must hold this many times eval_size problems, so that drawing eval_size distinct
# ones by rejection stays cheap and training keeps most of the problem space.
EVAL_HEADROOM = 4


def is_eval_prompt(prompt: str) -> bool:
    """True for prompts in the held-out bucket (stable across processes: blake2b, not Python's salted hash)."""
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % EVAL_MODULUS == 0


def position_score(answer: str, got: str) -> float:
    """Share of answer characters reproduced at the same position, in [0, 1].

    The denominator is max(len(answer), len(got)): extra characters count as errors, so 1.0 is reached by the
    exact answer only and partial credit never rewards running past the answer instead of stopping.
    """
    if not answer:
        raise ValueError("answer: the correct answer of a task is never empty")
    same = sum(a == b for a, b in zip(answer, got))
    return same / max(len(answer), len(got))


class Task:
    """Base class; subclasses set ``name`` and implement the four problem-specific hooks below."""

    name: ClassVar[str] = ""

    def __init__(self, cfg: TaskConfig, tokenizer=None):
        if cfg.name != self.name:
            raise ValueError(f"task.name={cfg.name!r}: this class implements {self.name!r}; use get_task()")
        self.cfg = cfg
        self.length = cfg.length
        self._check_capacity()
        self.tokenizer = build_tokenizer() if tokenizer is None else tokenizer
        self._eval: list[str] | None = None

    # ------------------------------------------------------------------ problem-specific hooks

    def _draw(self, n: int, rng: np.random.Generator) -> list[str]:
        """n random prompts from the whole problem space (train and eval buckets alike)."""
        raise NotImplementedError

    def answer(self, prompt: str) -> str:
        """The correct final answer of a prompt (what the reward compares against)."""
        raise NotImplementedError

    @property
    def num_problems(self) -> int:
        """Number of distinct prompts the task can produce."""
        raise NotImplementedError

    @property
    def response_chars(self) -> int:
        """Upper bound on the characters of a demonstration."""
        raise NotImplementedError

    def demonstration(self, prompt: str) -> str:
        """The correct completion text (no EOS); tasks with a scratchpad override it."""
        return self.answer(prompt)

    def extract_answer(self, completion: str) -> str:
        """The part of a completion that is graded; tasks with a scratchpad override it."""
        return completion

    # ------------------------------------------------------------------ shared API

    @property
    def max_new_tokens(self) -> int:
        """Longest correct response plus its EOS: generation never needs more."""
        return self.response_chars + 1

    @property
    def prompt_tokens(self) -> int:
        """Tokens of an encoded prompt, BOS included (every task's prompts have one fixed length)."""
        return len(self.tokenizer(self.eval_prompts()[0])["input_ids"])

    def reward(self, prompt: str, completion: str) -> float:
        """Exact match (0/1), or with cfg.partial_credit the position-wise share of correct answer characters.

        Never raises on a malformed completion: any string is simply (partly) wrong.
        """
        answer, got = self.answer(prompt), self.extract_answer(str(completion))
        if self.cfg.partial_credit:
            return position_score(answer, got)
        return float(got == answer)

    def sample_prompts(self, n: int, rng: np.random.Generator) -> list[str]:
        """n training prompts (never in the held-out bucket); deterministic given the generator's state."""
        if n < 0:
            raise ValueError(f"n={n}: must be >= 0")
        out: list[str] = []
        while len(out) < n:
            out += [p for p in self._draw(n - len(out), rng) if not is_eval_prompt(p)]
        return out

    def eval_prompts(self) -> list[str]:
        """cfg.eval_size distinct held-out prompts, fixed for a (task, length): same list in every process."""
        if self._eval is None:
            # The seed depends only on the task and its length, so eval sets never move with the run seed.
            rng = np.random.default_rng([zlib.crc32(self.name.encode()), self.length])
            seen: dict[str, None] = {}
            while len(seen) < self.cfg.eval_size:
                for p in self._draw(EVAL_MODULUS * self.cfg.eval_size, rng):
                    if is_eval_prompt(p) and len(seen) < self.cfg.eval_size:
                        seen.setdefault(p)
            self._eval = list(seen)
        return list(self._eval)

    def _check_capacity(self) -> None:
        held_out = self.num_problems // EVAL_MODULUS
        if held_out < EVAL_HEADROOM * self.cfg.eval_size:
            raise ValueError(
                f"task.length={self.length}: {self.name} has only {self.num_problems} distinct problems (about "
                f"{held_out} held out), too few for task.eval_size={self.cfg.eval_size}; allowed: a length with "
                f">= {EVAL_HEADROOM * EVAL_MODULUS * self.cfg.eval_size} problems or a smaller eval_size")
