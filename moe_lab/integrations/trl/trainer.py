"""MoEGRPOTrainer: TRL's GRPOTrainer with moe_lab's Routing Replay (R2/R3) and routing metrics.

TRL's hooks overridden, each calling TRL's own code (trl 1.16):
- ``_generate_single_turn``: routing recorded during HF generate (R3's trace, with the combine weights under
  ``routing_replay_weights``, the router's log-probs and the sampled tokens' log-probs when metrics are on), or
  read from the colocated vLLM engine's routed experts (``trl/vllm.py``);
- ``_get_per_token_logps_and_entropies``: position ids from the attention mask in every training forward; in
  TRL's old-policy pass, one record() (R3: replay() of the rollout's routing) per model call (TRL's chunks);
- ``_generate_and_score_completions``: the traces join the batch dict batch-first (TRL's shuffle/split keep
  them on their rows);
- ``_prepare_inputs`` + ``training_step``: the loss forward AND its backward run inside one replay() (or
  record()) of the batch's routing, so gradient checkpointing's recompute routes as the forward did;
- ``log``: the metric parts of every microbatch since the last log, combined over microbatches and ranks;
- transformers' ``_load_from_checkpoint``: a resume reads the experts in the layout they were saved in (resume.py).
Every hook sits on the model generation and the forwards actually call (a PEFT model's base model). The
routing state is one explicit object per trainer (``MoEState``).
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack

import torch

# first: config checks TRL's version (one-line ImportError) before anything below imports trl
from moe_lab.integrations.trl.config import MoEGRPOConfig, replays_rollout  # isort: skip
import trl.generation.vllm_generation as trl_vllm
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from moe_lab.algos.ratio_metrics import ratio_decomposition
from moe_lab.integrations import metric_row as M
from moe_lab.integrations.batch_routing import (RolloutLogp, position_ids, response_mask_BS, routing_run, to_batch,
                                                to_trace)
from moe_lab.integrations.trl.checks import (base_model, check_model, check_reference, check_router_logits,
                                             check_setup, say_balancing_loss)
from moe_lab.integrations.trl.resume import load_full_checkpoint
from moe_lab.integrations.trl.vllm import (EngineOutputs, check_rollout_with_vllm, engine_rollout, routed_llm,
                                          wants_routes)
from moe_lab.integrations.trl.state import LossScope, MoEState, Rollout, join_chunks, old_reference
from moe_lab.config.mode_specs import REPLAY_SPECS
from moe_lab.models import moe_layers
from moe_lab.routing import record, router_logp_probe

TRL_TEXT_ONLY = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                 "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_images", "num_tiles")

GRPO_INIT = inspect.signature(GRPOTrainer.__init__)  # where peft_config sits among GRPOTrainer's arguments


class MoEGRPOTrainer(GRPOTrainer):
    """GRPOTrainer, used the same way, for transformers MoE models of moe_lab's families (PEFT-wrapped too);
    ``args`` is a MoEGRPOConfig (``routing_replay``, ``routing_replay_weights``, ``freeze_router``,
    ``moe_metrics``, ``moe_decomp_every``, ``moe_position_ids``)."""

    def __init__(self, model, reward_funcs, args: MoEGRPOConfig | None = None, *rest, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = MoEGRPOConfig(f"{str(name).split('/')[-1] or 'model'}-MoE-GRPO")
        if not isinstance(args, MoEGRPOConfig):
            raise ValueError(f"args: expected a MoEGRPOConfig (GRPOConfig plus routing_replay, moe_metrics), got "
                             f"{type(args).__name__}")
        check_model(model)  # before TRL builds a reference model, an engine or optimizer state
        check_reference(model, args, self._moe_peft_config(model, reward_funcs, args, rest, kwargs))
        check_router_logits(model, args)
        check_rollout_with_vllm(args)
        engine = EngineOutputs()
        with routed_llm(trl_vllm, engine, wants_routes(args)):
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        layers = moe_layers(self._moe_net)
        self._moe_like = {"E": layers[0].router.num_experts, "family": layers[0].family.name}
        self._moe_layer_idx = [layer.layer_idx for layer in layers]
        self._moe, self._moe_engine = MoEState(), engine
        self._moe_row = M.MetricRow(self._moe_layer_idx)
        if args.freeze_router:  # before train() builds the optimizer: no gradient, no update, no AdamW state
            for layer in layers:
                layer.router.requires_grad_(False)
        check_setup(self)
        say_balancing_loss(self)

    # ------------------------------------------------------------------------------------------- setup

    @staticmethod
    def _moe_peft_config(model, reward_funcs, args, rest, kwargs):
        """The peft_config given to GRPOTrainer, by keyword or position."""
        bound = GRPO_INIT.bind_partial(None, model, reward_funcs, args, *rest, **kwargs)
        return bound.arguments.get("peft_config")

    @property
    def _moe_net(self):
        """The model every routing hook sits on: what generate() and TRL's forwards actually call."""
        return base_model(self.accelerator.unwrap_model(self.model))

    def _moe_on_policy(self) -> bool:
        """TRL's own condition for skipping the old pass: then old log-probs = the loss's, detached (ratio 1)."""
        every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % every == 0 and not (
            self.use_vllm and self.vllm_importance_sampling_correction)

    def _moe_is_policy(self, model) -> bool:
        return model is self.model or model is self.model_wrapped or self.accelerator.unwrap_model(model) is self.model

    def _moe_records_rollout(self) -> bool:
        # with tools TRL generates again after each tool call: one trace would not cover the final sequences
        return (self.model.training and not self.use_transformers_continuous_batching and not self.tools
                and (replays_rollout(self.args) or self.args.moe_metrics))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """transformers' resume, except that a full-model checkpoint is read through ``from_pretrained``'s
        conversion (the experts saved one per expert, merged back into the model's fused layout) instead of a
        plain ``load_state_dict`` that leaves them at their initial weights (trl/resume.py)."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or not load_full_checkpoint(
                self.accelerator.unwrap_model(model if model is not None else self.model), resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    # ------------------------------------------------------------------------------------------- generation

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        call = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if not self._moe_records_rollout() or (self.use_vllm and not wants_routes(self.args)):
            return super()._generate_single_turn(*call)
        if self.use_vllm:
            out = super()._generate_single_turn(*call)
            self._moe.rollout = engine_rollout(self._moe_engine.outputs, self._moe_net.config,
                                                    self._moe_layer_idx, self._moe_like["E"],
                                                    strict=replays_rollout(self.args))
            return out
        metrics, net = self.args.moe_metrics, self._moe_net
        logp = RolloutLogp(self.temperature) if metrics else None
        with ExitStack() as stack:
            trace = stack.enter_context(record(net, weights=self.args.routing_replay_weights, router_logp=metrics))
            if logp is not None:
                stack.callback(net.register_forward_hook(logp.hook, with_kwargs=True).remove)
            completion_ids, logprobs = super()._generate_single_turn(*call)
        self._moe.rollout = Rollout(trace=trace, logp_BC=None if logp is None else logp.finish(completion_ids))
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        state = self._moe
        state.phase, state.old_runs = "old", []
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            state.phase = None
        out.update(self._moe_batch_routing(out["prompt_ids"].size(1), out["completion_ids"].size(1)))
        return out

    def _moe_batch_routing(self, P: int, C: int) -> dict[str, torch.Tensor]:
        """The generation's and the old pass's routing as batch-first tensors over the S = P + C columns."""
        state, out = self._moe, {}
        rollout, state.rollout = state.rollout, None
        if rollout is not None:
            out.update(rollout.batch(P, C, self.args.routing_replay_weights))
        if state.old_runs:
            out.update(join_chunks(state.old_runs))
            state.old_runs = []
        return out

    # ------------------------------------------------------------------------------------------- forwards

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs):
        state, policy = self._moe, self._moe_is_policy(model)
        net = base_model(self.accelerator.unwrap_model(model))
        with position_ids(net, self.args.moe_position_ids):
            if state.phase == "old" and policy:
                return self._moe_old_pass(model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs)
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                             batch_size, **kwargs)
        if state.loss is not None and policy and torch.is_grad_enabled():
            state.loss.logp_BC = out[0].detach()
            state.loss.aux_loss = None if out[2] is None else float(out[2].detach())
        return out

    def _moe_old_pass(self, model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs):
        """TRL's old pass, one routing context per model call (TRL's chunks of batch_size rows): free routing
        recorded (R2's trace), or under R3 the rollout's routing replayed, as moe_lab's own old pass does."""
        extra = [k for k in TRL_TEXT_ONLY if kwargs.get(k) is not None]
        if extra:
            raise ValueError(f"MoEGRPOTrainer: text models only; this batch carries {extra}")
        weights, forced_batch = self.args.routing_replay_weights, None
        if replays_rollout(self.args):
            S = input_ids.size(1)
            forced_batch = self._moe.rollout.batch(S - logits_to_keep, logits_to_keep, weights)
        step, parts = batch_size or input_ids.size(0), []
        for start in range(0, input_ids.size(0), step):
            rows = slice(start, start + step)
            forced = None if forced_batch is None else to_trace(
                forced_batch["moe_rollout_ids"][rows], self._moe_like,
                weights_BLSK=forced_batch["moe_rollout_weights"][rows] if weights else None)
            with routing_run(self._moe_net, forced, router_logp=True, weights=weights) as run:
                parts.append(super()._get_per_token_logps_and_entropies(
                    model, input_ids[rows], attention_mask[rows], logits_to_keep, None, **kwargs))
            self._moe.old_runs.append(run)
        aux = [p[2] for p in parts if p[2] is not None]
        return (torch.cat([p[0] for p in parts]),
                None if parts[0][1] is None else torch.cat([p[1] for p in parts]),
                torch.stack(aux).mean() if aux else None)

    # ------------------------------------------------------------------------------------------- loss step

    def training_step(self, model, inputs, num_items_in_batch=None):
        state = self._moe
        with ExitStack() as stack:
            state.stack = stack
            try:
                loss = super().training_step(model, inputs, num_items_in_batch)
            finally:
                state.stack = None
        scope, state.loss = state.loss, None  # the replay context has exited: backward ran inside it
        if scope is not None and self.args.moe_metrics:
            self._moe_measure(model, scope)
        return loss

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        state = self._moe
        if state.stack is not None and self.model.training:
            state.loss = self._moe_open_loss_scope(state.stack, inputs)
        return inputs

    def _moe_open_loss_scope(self, stack: ExitStack, inputs: dict) -> LossScope:
        """Replay (or record) around the loss forward; the ExitStack closes after training_step's backward."""
        mode, metrics = self.args.routing_replay, self.args.moe_metrics
        ref = old_reference(inputs, mode, self._moe_like)
        forced = ref if REPLAY_SPECS[mode].replays else None
        weights = self.args.routing_replay_weights and forced is not None
        run = stack.enter_context(routing_run(self._moe_net, forced, router_logp=metrics, weights=weights))
        probe = None
        if metrics and forced is None and ref is not None and ref.router_logp_LBTK is not None:
            probe = stack.enter_context(router_logp_probe(self._moe_net, ref.indices))
        return LossScope(inputs, ref, forced, run, probe)

    # ------------------------------------------------------------------------------------------- metrics

    def _moe_measure(self, model, scope: LossScope) -> None:
        """moe_lab's metrics of this loss step, kept with its sequence and token counts until the next log."""
        inputs, run = scope.inputs, scope.run
        mask_BC = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        mask_BS = response_mask_BS(mask_BC, inputs["prompt_ids"].size(1))
        logp_BC = scope.logp_BC
        logp_old_BC = inputs.get("old_per_token_logps", logp_BC)
        # On-policy TRL runs no old pass: the loss forward is the old policy itself, so it is its own reference
        # (change and shift 0, as TRL's ratio is 1) and the columns stay the same in every configuration.
        ref = run.used if scope.ref is None else scope.ref
        if scope.probe is not None:
            new_at_ref = scope.probe.at(ref.indices)
        else:
            new_at_ref = run.used.router_logp_LBTK if scope.forced is not None or scope.ref is None else None
        rollout = inputs.get("moe_rollout_ids")
        old_free = inputs.get("moe_old_free_ids")
        free_ref = run.free if old_free is None else to_trace(old_free, self._moe_like)
        metrics = {**M.ratio_part(logp_BC, logp_old_BC, mask_BC),
                   **M.routing_part(ref, run.used, run.free, mask_BS, new_at_ref),
                   **M.mismatch_part(None if rollout is None else to_trace(rollout, self._moe_like), free_ref,
                                     mask_BS, self._moe_rollout_logp(inputs), logp_old_BC, mask_BC),
                   **self._moe_decomposition(model, scope, logp_old_BC, mask_BC)}
        if scope.aux_loss is not None:
            metrics["routing/aux_loss"] = scope.aux_loss
        self._moe_row.add(metrics, mask_BC.size(0), int(mask_BC.sum()))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with moe_lab's columns of every loss step since the last log combined across microbatches
        and ranks by their token (or sequence) counts as each metric declares, not TRL's unweighted mean."""
        if self.model.training and self.args.moe_metrics:
            for key, value in self._moe_row.take(self._moe_gather).items():
                self._metrics["train"][key] = [value]
        super().log(logs, start_time)

    @staticmethod
    def _moe_rollout_logp(inputs: dict):
        """The sampler's log-probs: recorded during HF generate, or vLLM's (TRL keeps them; NaN where missing)."""
        return inputs.get("moe_rollout_logp", inputs.get("sampling_per_token_logps"))

    def _moe_gather(self, obj: list) -> list:
        from accelerate.utils import gather_object

        return gather_object(obj) if self.accelerator.num_processes > 1 else obj

    def _moe_decomposition(self, model, scope: LossScope, logp_old_BC, mask_BC) -> dict[str, float]:
        """ratio/routing_share and ratio/d_* every moe_decomp_every-th loss step: one no-grad forward of the
        batch under the routing the loss forward did not use (same weights: before the optimizer step)."""
        every, state = self.args.moe_decomp_every, self._moe
        if every == 0 or scope.ref is None or "old_per_token_logps" not in scope.inputs:
            return {}
        state.loss_steps += 1
        if state.loss_steps % every:
            return {}
        inputs = scope.inputs
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        other = scope.ref if scope.forced is None else None
        # fork_rng: dropout draws of this extra forward stay out of the training streams
        with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), \
                routing_run(self._moe_net, other):
            other_BC = self._get_per_token_logps_and_entropies(model, ids, attn, inputs["completion_ids"].size(1))[0]
        free_BC, ref_BC = (scope.logp_BC, other_BC) if scope.forced is None else (other_BC, scope.logp_BC)
        return ratio_decomposition(free_BC, ref_BC, logp_old_BC, mask_BC, self.epsilon_low, self.epsilon_high)
