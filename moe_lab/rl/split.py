"""What differs between one process and data-parallel, declared: the members a split supplies.

``rl_step`` (moe_lab/rl/step.py) runs one step over a ``StepSplit``; ``loop.train`` runs a whole run over a
``RunSplit``, a StepSplit plus the run-level part. A plain run's are ``step.SingleProcess`` and ``loop.PlainRun``;
torchrun's is ``distributed.DataParallel``. Nothing else in a run asks how many processes there are.
tests/test_split.py checks that each split has every member, with the same parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from moe_lab.config import RunConfig
    from moe_lab.rl.collect import StepData
    from moe_lab.store.run_folder import RunFolder
# TrainState (moe_lab.rl.loop, which imports this module) is named in an annotation only, never imported


class StepSplit(Protocol):
    """One RL step over a batch split: who holds which rows, and how the ranks' metrics combine."""

    def trained(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The module the updates run through (DDP's wrapper under torchrun)."""

    def collect(self, policy, rollout_policy, ref_model, task, cfg: RunConfig, step: int,
                prompts: list[str]) -> tuple[StepData, dict, float]:
        """This process's share of the step's data, the batch metrics of all of it, and its response tokens."""

    def schedule(self, data: StepData, cfg: RunConfig, step: int,
                 first_update: int) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """(epoch, minibatch, update index, idx_B) of every update of the step, in order."""

    def checked(self, metrics: dict, step: int, update_idx: int, first_update: int) -> dict:
        """An update's metrics as the split sees them (a test hook under torchrun)."""

    def all_finite(self, metrics: dict, device) -> bool:
        """Whether the step's updates may go on (the same answer on every process)."""

    def reduce(self, updates: list[tuple[tuple, dict, torch.Tensor]], data: StepData) -> list[tuple[tuple, dict]]:
        """[((epoch, minibatch, update), metrics)] of the whole batch: the same rows on every process."""


class RunSplit(StepSplit, Protocol):
    """A whole run over the split: which process writes, setup, resume, and the points where processes meet."""

    writer: bool  # whether this process holds the run log and writes the run folder

    def check(self, cfg: RunConfig) -> None:
        """Refuse (ConfigError, one line) what this split cannot run."""

    def setup(self, claim: Callable[[], None], setup: Callable[[], tuple]) -> tuple:
        """The run folder claimed and the model set up: (task, Trainee) on every process."""

    def resume_state(self, folder: RunFolder, policy, optimizer) -> TrainState:  # noqa: F821
        """Where the run stands (loop.TrainState), its checkpoint (if any) loaded into the policy and optimizer."""

    def broadcast(self, obj: Any) -> Any:
        """The writer's object on every process."""

    def barrier(self) -> None:
        """Every process waits here for the others."""

    def manifest_extra(self) -> dict:
        """What the split adds to the run's manifest."""
