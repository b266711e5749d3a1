"""Addition of two `length`-digit numbers, answered directly or with a digit-by-digit scratchpad.

Addends are zero-padded to `length` digits and the sum to `length` + 1, so every prompt and every answer of
a task has one length and position-wise partial credit compares aligned digits.
"""

from __future__ import annotations

import re

import numpy as np

from moe_lab.tasks.base import Task

COLUMN_SEP, ANSWER_SEP = ",", ";"


class AdditionTask(Task):
    """``0347+0085=`` -> ``00432``."""

    name = "addition"

    def _draw(self, n: int, rng: np.random.Generator) -> list[str]:
        digits_N2L = rng.integers(0, 10, size=(n, 2, self.length))
        rows = ["".join(map(str, row)) for row in digits_N2L.reshape(n, 2 * self.length)]
        return [f"{r[:self.length]}+{r[self.length:]}=" for r in rows]

    def operands(self, prompt: str) -> tuple[str, str]:
        """The two zero-padded addends of a prompt; ValueError if it is not ``<L digits>+<L digits>=``."""
        m = re.fullmatch(rf"(\d{{{self.length}}})\+(\d{{{self.length}}})=", prompt)
        if m is None:
            raise ValueError(f"prompt={prompt!r}: expected <{self.length} digits>+<{self.length} digits>=")
        return m.group(1), m.group(2)

    def answer(self, prompt: str) -> str:
        a, b = self.operands(prompt)
        return str(int(a) + int(b)).zfill(self.length + 1)

    @property
    def num_problems(self) -> int:
        return 10 ** (2 * self.length)

    @property
    def response_chars(self) -> int:
        return self.length + 1


class LongAdditionTask(AdditionTask):
    """Addition written out column by column, least significant first, then the answer.

    Each column is ``x+y+c=cs``: the two digits, the carry in, and their two-digit total (carry out, digit).
    ``47+85=`` -> ``7+5+0=12,4+8+1=13;132``. The response has 10 * length + 1 characters (162 with EOS at
    length 16): long responses are where the paper sees token-level ratios destabilise training. The reward
    grades the final answer after ``;`` only; the scratchpad is the model's own business.
    """

    name = "long_addition"

    def demonstration(self, prompt: str) -> str:
        a, b = self.operands(prompt)
        columns, carry = [], 0
        for x, y in zip(map(int, reversed(a)), map(int, reversed(b))):
            total = x + y + carry
            columns.append(f"{x}+{y}+{carry}={total:02d}")
            carry = total // 10
        return COLUMN_SEP.join(columns) + ANSWER_SEP + self.answer(prompt)

    def extract_answer(self, completion: str) -> str:
        # No separator means no answer was given: grade the empty string, not the scratchpad.
        head, sep, tail = completion.rpartition(ANSWER_SEP)
        return tail if sep else ""

    @property
    def response_chars(self) -> int:
        return 9 * self.length - 1 + 1 + self.length + 1
