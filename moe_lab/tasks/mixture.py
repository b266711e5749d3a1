"""A mixture of single tasks, each prompt prefixed with one tag token naming its task: ``s3141=``, ``rabch=``.

The setting where routing can matter: experts may specialise by task, and the tag makes the task visible
from the first token on. Everything else delegates to the sub-task the tag names:

- reward, answer and demonstration are the sub-task's (its own partial credit, its own answer extraction);
- training prompts are the sub-tasks' training prompts, evaluation prompts their held-out ones: the split
  hashes the untagged prompt, so train and eval stay disjoint exactly as for the single tasks;
- each tag is one character of the shared vocabulary that no sub-task writes (letters outside reverse's and
  long_copy's a-h): the vocabulary, and so every single task's tokenisation, is unchanged.

Sub-tasks are drawn uniformly per prompt; ``task.length`` applies to each; ``task.eval_size`` is split
between them (the first ones take the remainder) and the eval list interleaves them, so a prefix of it
(the cold start's accuracy check) stays balanced.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moe_lab.config import TaskConfig
from moe_lab.config.constants import SINGLE_TASKS
from moe_lab.tasks.addition import AdditionTask, LongAdditionTask
from moe_lab.tasks.base import Task
from moe_lab.tasks.strings import LongCopyTask, ReverseTask, SortTask
from moe_lab.tasks.tokenizer import build_tokenizer

SINGLE: dict[str, type[Task]] = {cls.name: cls for cls in (SortTask, AdditionTask, ReverseTask, LongAdditionTask,
                                                           LongCopyTask)}
# One character each, in the shared vocabulary, never written by any task: s(ort), p(lus), r(everse),
# l(ong addition), k (long copy: c is in the a-h alphabet).
TAGS = {"sort": "s", "addition": "p", "reverse": "r", "long_addition": "l", "long_copy": "k"}


class MixtureTask(Task):
    name = "mixture"

    def __init__(self, cfg: TaskConfig, tokenizer=None):
        if cfg.name != self.name:
            raise ValueError(f"task.name={cfg.name!r}: this class implements {self.name!r}; use get_task()")
        names = list(cfg.mixture)
        if len(set(names)) < 2 or len(set(names)) != len(names) or not set(names) <= set(SINGLE_TASKS):
            raise ValueError(f"task.mixture={names!r}: allowed >= 2 distinct tasks of {', '.join(SINGLE_TASKS)}")
        if cfg.eval_size < len(names):
            raise ValueError(f"task.eval_size={cfg.eval_size}: a mixture of {len(names)} tasks needs >= {len(names)}")
        self.cfg, self.length, self._eval = cfg, cfg.length, None
        self.tokenizer = build_tokenizer() if tokenizer is None else tokenizer
        shares = [cfg.eval_size // len(names) + (i < cfg.eval_size % len(names)) for i in range(len(names))]
        self.subtasks = [SINGLE[n](dataclasses.replace(cfg, name=n, mixture=[], eval_size=k), self.tokenizer)
                         for n, k in zip(names, shares)]
        self._by_tag = {TAGS[n]: i for i, n in enumerate(names)}

    # ------------------------------------------------------------------ routing a prompt to its sub-task

    def split(self, prompt: str) -> tuple[int, str]:
        """(index of the sub-task in task.mixture, the untagged prompt); ValueError for an unknown tag."""
        i = self._by_tag.get(prompt[:1])
        if i is None:
            tags = ", ".join(f"{t} ({self.subtasks[i].name})" for t, i in self._by_tag.items())
            raise ValueError(f"prompt={prompt!r}: expected a task tag first, one of {tags}")
        return i, prompt[1:]

    def task_ids(self, prompts: list[str]) -> list[int]:
        """Per prompt, the index of its sub-task in task.mixture (for per-task routing metrics)."""
        return [self.split(p)[0] for p in prompts]

    def _tagged(self, i: int, prompts: list[str]) -> list[str]:
        return [TAGS[self.subtasks[i].name] + p for p in prompts]

    # ------------------------------------------------------------------ the Task API, delegated

    def answer(self, prompt: str) -> str:
        i, rest = self.split(prompt)
        return self.subtasks[i].answer(rest)

    def demonstration(self, prompt: str) -> str:
        i, rest = self.split(prompt)
        return self.subtasks[i].demonstration(rest)

    def reward(self, prompt: str, completion: str) -> float:
        i, rest = self.split(prompt)
        return self.subtasks[i].reward(rest, completion)

    @property
    def num_problems(self) -> int:
        return sum(t.num_problems for t in self.subtasks)

    @property
    def response_chars(self) -> int:
        return max(t.response_chars for t in self.subtasks)

    @property
    def prompt_tokens(self) -> int:
        """The longest sub-task's tagged prompt (a batch pads every prompt to it)."""
        return max(len(self.tokenizer(self._tagged(i, t.eval_prompts()[:1])[0])["input_ids"])
                   for i, t in enumerate(self.subtasks))

    def sample_prompts(self, n: int, rng: np.random.Generator) -> list[str]:
        """n training prompts: a uniform sub-task per prompt, then that sub-task's training prompts."""
        if n < 0:
            raise ValueError(f"n={n}: must be >= 0")
        ids_N = rng.integers(0, len(self.subtasks), size=n)
        out: list[str] = [""] * n
        for i, task in enumerate(self.subtasks):
            where = np.flatnonzero(ids_N == i)
            for pos, prompt in zip(where, self._tagged(i, task.sample_prompts(len(where), rng))):
                out[pos] = prompt
        return out

    def eval_prompts(self) -> list[str]:
        """Every sub-task's held-out prompts, tagged and interleaved (fixed for a mixture and length)."""
        if self._eval is None:
            lists = [self._tagged(i, t.eval_prompts()) for i, t in enumerate(self.subtasks)]
            self._eval = [lst[j] for j in range(max(map(len, lists))) for lst in lists if j < len(lst)]
        return list(self._eval)
