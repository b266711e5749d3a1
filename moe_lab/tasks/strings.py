"""Tasks over one string: sort its digits, reverse its letters, copy it many times. Prompt ``<L chars>=``."""

from __future__ import annotations

import re

import numpy as np

from moe_lab.tasks.base import Task


def _rows_to_strings(alphabet: str, idx_NL: np.ndarray) -> list[str]:
    table = np.array(list(alphabet))
    return ["".join(row) for row in table[idx_NL]]


class _StringTask(Task):
    alphabet = ""

    def _draw(self, n: int, rng: np.random.Generator) -> list[str]:
        idx_NL = rng.integers(0, len(self.alphabet), size=(n, self.length))
        return [s + "=" for s in _rows_to_strings(self.alphabet, idx_NL)]

    def _operand(self, prompt: str) -> str:
        pattern = f"[{re.escape(self.alphabet)}]{{{self.length}}}="
        if not re.fullmatch(pattern, prompt):
            raise ValueError(f"prompt={prompt!r}: expected {self.length} characters of {self.alphabet!r} then '='")
        return prompt[:-1]

    @property
    def num_problems(self) -> int:
        return len(self.alphabet) ** self.length

    @property
    def response_chars(self) -> int:
        return self.length


class SortTask(_StringTask):
    """Sort `length` digits ascending: ``3141=`` -> ``1134``."""

    name = "sort"
    alphabet = "0123456789"

    def answer(self, prompt: str) -> str:
        return "".join(sorted(self._operand(prompt)))


class ReverseTask(_StringTask):
    """Reverse `length` letters of a small alphabet: ``abch=`` -> ``hcba``."""

    name = "reverse"
    alphabet = "abcdefgh"  # 8 letters: 8^16 problems, a vocabulary the model learns quickly

    def answer(self, prompt: str) -> str:
        return self._operand(prompt)[::-1]


class LongCopyTask(_StringTask):
    """Write the `length` letters of the prompt COPIES times: ``abch=`` -> ``abchabch...`` (8 x 4 letters).

    The long-response task: 128 response tokens (+ EOS) at the default length 16, where the
    training-inference mismatch compounds over the sequence (R3 paper). Copying a block at a fixed offset
    is what a tiny attention model learns quickly, so the cold start reaches a partial-credit accuracy
    with room left for RL; exact match needs every one of the 128 letters right.
    """

    name = "long_copy"
    alphabet = "abcdefgh"
    COPIES = 8

    def answer(self, prompt: str) -> str:
        return self._operand(prompt) * self.COPIES

    @property
    def response_chars(self) -> int:
        return self.COPIES * self.length
