"""Tasks with verifiable rewards: prompts, ``reward()``, demonstrations and the shared tokenizer.

``get_task(cfg)`` is the only constructor callers need; ``TASKS`` maps each ``TaskConfig.name`` (``constants.TASKS``) to its class.
"""

from __future__ import annotations

from moe_lab.config import TaskConfig
from moe_lab.tasks.addition import AdditionTask, LongAdditionTask
from moe_lab.tasks.base import Task, is_eval_prompt, position_score
from moe_lab.tasks.mixture import TAGS, MixtureTask
from moe_lab.tasks.strings import LongCopyTask, ReverseTask, SortTask
from moe_lab.tasks.tokenizer import VOCAB, build_tokenizer, encode_response, load_tokenizer, task_tokenizer

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (SortTask, AdditionTask, ReverseTask, LongAdditionTask,
                                                          LongCopyTask, MixtureTask)}


def get_task(cfg: TaskConfig, tokenizer=None) -> Task:
    """The task named by cfg.name, configured by cfg (length, partial_credit, eval_size; mixture's sub-tasks).

    tokenizer: the policy's, when it is not the shared character tokenizer (a loaded checkpoint's).
    """
    if cfg.name not in TASKS:
        raise ValueError(f"task.name={cfg.name!r}: allowed one of {', '.join(TASKS)}")
    return TASKS[cfg.name](cfg, tokenizer)


__all__ = ["TAGS", "TASKS", "VOCAB", "AdditionTask", "LongAdditionTask", "LongCopyTask", "MixtureTask", "ReverseTask",
           "SortTask", "Task",
           "build_tokenizer", "encode_response", "get_task", "load_tokenizer", "task_tokenizer", "is_eval_prompt", "position_score"]
