"""Step components: the stateful extras of a run, each built once per run with its own state and hooks.

Three parts of a run carry state across steps that is not the policy's weights or the optimizer's:
- ``BiasUpdates`` (``rl.bias_update_rate``): DeepSeek-V3's expert-bias rule; it keeps the router logits of an
  update forward and, after the optimizer step, counts that forward's loads and moves the bias (rl.expert_bias).
- ``RoutePredictor`` (a replay mode whose row says ``predictor``: PR2): heads installed on the routers before the
  rollout copy is made; it observes the routers under the replayed routes before the updates, refits the heads
  after them, and hands the heads to the rollout copy (the sampler routes by them).
- ``RolloutLag`` (``rl.rollout_lag``): the starts of the last k steps; the rollout copy samples with the oldest,
  and the queue is saved with each checkpoint (what an asynchronous run's rollout workers hold).

The loop and the step call the hooks of ``Components`` at fixed points and never ask which parts are present,
so a new extra is one class and one line of ``build``. A hook's order across parts is the order of ``build``;
each part touches state no other part reads, so that order changes no bit. The model state a part moves (the
bias, the heads) is a buffer of the model and is saved with it; a part's own state beyond that (the lag queue)
goes through ``saved``/``resume``.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from moe_lab.config.mode_specs import REPLAY_SPECS
from moe_lab.models import correction_biases
from moe_lab.rl import checkpoint
from moe_lab.rl.expert_bias import ExpertBias
from moe_lab.rl.rollout import forward_logits
from moe_lab.routing import predictor, replay
from moe_lab.routing.bias_counts import counted_ids, router_logits

if TYPE_CHECKING:
    from moe_lab.config import RunConfig
    from moe_lab.rl.collect import StepData


def model_state(model) -> dict[str, torch.Tensor]:
    """What the rollout copy samples with: the weights and the expert correction biases (state outside the
    gradient, moved by rl.bias_update_rate), by name."""
    return {**dict(model.named_parameters()), **correction_biases(model)}


class Component:
    """The hooks, in the order a run calls them; each is a no-op unless a part overrides it."""

    def install(self, policy) -> None:
        """Once, on the loaded policy, before its rollout copy is made and before a checkpoint is resumed."""

    def resume(self, ckpt_dir: Path, device) -> None:
        """Once, after the checkpoint's model and optimizer are loaded: the part's own saved state."""

    def step_start(self, policy) -> None:
        """At the start of a step, before the rollout copy takes its weights."""

    def rollout_source(self, current: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights (by name) the rollout copy samples with this step; ``current``: the trained ones."""
        return current

    def sync(self, policy, rollout_policy) -> None:
        """Model state besides the weights that the rollout copy must take from the policy."""

    def before_updates(self, policy, data, cfg) -> None:
        """After the rollout batch is collected, before its first update."""

    def update_context(self, ctx: UpdateContext) -> contextlib.AbstractContextManager:
        """Around one update's forward and backward (inside the routing regime); yields its handle."""
        return contextlib.nullcontext()

    def after_optimizer_step(self, ctx: UpdateContext, handle, used, latent, metrics: dict) -> dict:
        """After a finite update's optimizer step: its metrics (``metrics``: the update's so far; ``used``,
        ``latent``: the routing the update forward used and the router's own choice)."""
        return {}

    def after_updates(self, policy) -> dict:
        """After the step's last update: its metrics (added to every row of the step)."""
        return {}

    def step_end(self) -> None:
        """After the step's updates."""

    def saved(self) -> dict:
        """Keyword arguments of checkpoint.save for the part's own state."""
        return {}


class BiasUpdates(Component):
    """rl.bias_update_rate: the router logits of each update forward, then the bias step after the optimizer's."""

    def __init__(self, bias):
        """``bias``: the run's rl.section("bias")."""
        self.rate, self.count_dtype, self.counts = bias.bias_update_rate, bias.bias_count_dtype, bias.bias_counts
        self.bias: ExpertBias | None = None

    def install(self, policy) -> None:
        # a checkpoint's family is known only now: refused before the first step
        self.bias = ExpertBias(policy, self.rate, self.count_dtype)

    def update_context(self, ctx: UpdateContext):
        return router_logits(ctx.policy)

    def after_optimizer_step(self, ctx: UpdateContext, handle, used, latent, metrics: dict) -> dict:
        """This optimizer step's loads (its one update forward's real tokens, prompt and response: the tokens the
        router ran on, padding excluded), the bias step, and the routing it alone changes."""
        b, idx_B = ctx.data.batch, ctx.idx_B
        self.bias.count(counted_ids(self.counts, used, latent), b.attention_mask_BS[idx_B][:, :-1])
        return self.bias.update_measured(ctx.policy, handle, b.response_mask_BT[idx_B],
                                         metrics.get("routing/expert_change_latent"))


class RoutePredictor(Component):
    """PR2: heads on the routers, observed under the replayed rollout routes and refitted after the updates."""

    def __init__(self, replay_section):
        """``replay_section``: the run's rl.section("replay")."""
        self.gate = replay_section.replay_gate
        self.observed: predictor.Observation | None = None

    def install(self, policy) -> None:
        predictor.install(policy)  # before any copy and before a resume loads the saved heads

    def sync(self, policy, rollout_policy) -> None:
        current = predictor.heads(policy)  # buffers refitted each step: the sampler routes by them
        for name, dst in predictor.heads(rollout_policy).items():
            dst.copy_(current[name])

    @torch.no_grad()
    def before_updates(self, policy, data, cfg) -> None:
        """Router inputs and logits before the updates, under the replayed (predicted) rollout routing."""
        b = data.batch
        with replay(policy, data.forced_trace, gate=self.gate), \
                predictor.observe(policy, b.response_mask_BT) as observed:
            forward_logits(policy, b.input_ids_BS, b.attention_mask_BS)
        self.observed = observed

    def after_updates(self, policy) -> dict:
        observed, self.observed = self.observed, None
        return predictor.fit(policy, observed)  # learn this step's router drift


class RolloutLag(Component):
    """rl.rollout_lag = k: fp32 copies of the weights (and expert biases) at the starts of the last k steps."""

    def __init__(self, rollout):
        """``rollout``: the run's rl.section("rollout")."""
        self.lag = rollout.rollout_lag
        self.queue: collections.deque = collections.deque()
        self._start: dict | None = None

    def resume(self, ckpt_dir: Path, device) -> None:
        self.queue = collections.deque(checkpoint.load_snapshots(ckpt_dir, device))

    def step_start(self, policy) -> None:
        """What a rollout worker k steps behind would hold from now on."""
        self._start = {name: p.detach().clone() for name, p in model_state(policy).items()}

    def rollout_source(self, current):
        # A snapshot without biases keeps the current ones: a run that saved none never moved them.
        return {**current, **self.queue[0]} if self.queue else current

    def step_end(self) -> None:
        """Keep the starts of the last k steps: queue[0] is then the policy of step t - k (or the initial
        weights while t < k, as an asynchronous run starts with every worker on them)."""
        self.queue.append(self._start)
        while len(self.queue) > self.lag:
            self.queue.popleft()

    def saved(self) -> dict:
        return {"snapshots": list(self.queue)}


@dataclass
class Components:
    """The run's step components, in hook order."""

    parts: tuple[Component, ...] = ()

    @classmethod
    def build(cls, rl) -> "Components":
        """The parts a run's RL settings ask for (none for a plain run), each asked for and handed by its section."""
        bias, replay_section, rollout = rl.section("bias"), rl.section("replay"), rl.section("rollout")
        parts = []
        if bias.bias_update_rate:
            parts.append(BiasUpdates(bias))
        if REPLAY_SPECS[replay_section.replay].predictor:
            parts.append(RoutePredictor(replay_section))
        if rollout.rollout_lag:
            parts.append(RolloutLag(rollout))
        return cls(tuple(parts))

    def install(self, policy) -> None:
        for part in self.parts:
            part.install(policy)

    def resume(self, ckpt_dir: Path, device) -> None:
        for part in self.parts:
            part.resume(ckpt_dir, device)

    def step_start(self, policy) -> None:
        for part in self.parts:
            part.step_start(policy)

    @torch.no_grad()
    def sync_rollout_policy(self, policy, rollout_policy) -> None:
        """The rollout copy takes the weights (and expert biases) it samples with, cast to the rollout dtype (bf16
        mismatch knob), and every part's state it samples by (nothing when it is the policy itself)."""
        if rollout_policy is policy:
            return
        source = model_state(policy)
        for part in self.parts:
            source = part.rollout_source(source)
        for name, dst in model_state(rollout_policy).items():
            dst.copy_(source[name])
        for part in self.parts:
            part.sync(policy, rollout_policy)

    def before_updates(self, policy, data, cfg) -> None:
        for part in self.parts:
            part.before_updates(policy, data, cfg)

    @contextlib.contextmanager
    def update_context(self, ctx: UpdateContext) -> Iterator[list]:
        """Every part's context around one update forward and backward; yields their handles, in part order."""
        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(part.update_context(ctx)) for part in self.parts]

    def after_optimizer_step(self, ctx: UpdateContext, handles: list, used, latent, metrics: dict) -> dict:
        out = {}
        for part, handle in zip(self.parts, handles):
            out.update(part.after_optimizer_step(ctx, handle, used, latent, {**metrics, **out}))
        return out

    def after_updates(self, policy) -> dict:
        out = {}
        for part in self.parts:
            out.update(part.after_updates(policy))
        return out

    def step_end(self) -> None:
        for part in self.parts:
            part.step_end()

    def saved(self) -> dict:
        out = {}
        for part in self.parts:
            out.update(part.saved())
        return out


def installed(policy, rl) -> Components:
    """The components ``rl`` asks for, installed on ``policy`` (outside a run: fidelity, benchmarks); install them
    before making a rollout copy, which must carry their buffers."""
    parts = Components.build(rl)
    parts.install(policy)
    return parts


@dataclass
class Trainee:
    """What a step trains and samples with: the policy, its rollout copy (the policy itself unless the rollout
    numerics or a lag differ), the KL reference (None without rl.kl_coef), the optimizer and the run's step
    components."""

    policy: torch.nn.Module
    rollout_policy: torch.nn.Module
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    components: Components


@dataclass(frozen=True)
class UpdateContext:
    """One optimizer update as ``step.update`` and the components' update hooks see it: the module it runs
    through (DDP's wrapper under torchrun), the rest of what it trains with, the run's config, and which update of
    which step it is, on which rows of the step's data."""

    policy: torch.nn.Module
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    components: Components
    cfg: RunConfig
    data: StepData
    step: int
    index: int  # the update's index in the run: its learning rate and generators
    idx_B: torch.Tensor  # its minibatch's rows of the rollout batch
