"""What MoEGRPOTrainer refuses, warns about or says at construction, each in one line.

``check_model``, ``check_reference`` and ``check_router_logits`` run before TRL builds anything (reference model,
vLLM engine, optimizer state): a model with no router of moe_lab's families is refused from its config (a model id
or folder) or its modules; ``beta`` > 0 where TRL could not build its reference model (a model built in memory) or
where the policy would score it (PEFT); output_router_logits=True, on which transformers' generate() fails.
``check_setup`` runs after TRL's own checks, on what TRL decided (on-policy or not). ``say_balancing_loss`` logs
what TRL does with the MoE load-balancing loss (on by default for MoE models).
"""

from __future__ import annotations

import logging
import warnings

from moe_lab.config.mode_specs import OLD_FORWARD, REPLAY_SPECS, ROLLOUT
from moe_lab.models import moe_layers
from moe_lab.models.families import FAMILIES, family_of_model_type

LOG = logging.getLogger("moe_lab.integrations.trl")


def base_model(model):
    """The model generation and the forwards actually call: a PEFT model's base model (``PeftModel.generate``
    calls it directly, so a hook on the PeftModel itself never fires), else the model."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


SERVED = f"the {len(FAMILIES)} MoE families moe_lab serves are listed in docs/trl.md#models"


def check_model(model) -> None:
    """Refuse a model with no supported MoE router before TRL loads or wraps it."""
    if isinstance(model, str):
        model_type = text_config(model).model_type
        if family_of_model_type(model_type) is None:
            raise ValueError(f"MoEGRPOTrainer: model {model!r} has model_type={model_type!r}, not an MoE family "
                             f"moe_lab serves; {SERVED}")
        return
    try:
        moe_layers(base_model(model))
    except ValueError:
        raise ValueError(f"MoEGRPOTrainer: {type(base_model(model)).__name__} has no MoE router of a supported "
                         f"family; {SERVED}") from None


def text_config(model):
    """The text config of a model given as an id or folder, a transformers model or a PEFT-wrapped one."""
    if isinstance(model, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model).get_text_config()
    return base_model(model).config.get_text_config()


def check_router_logits(model, args) -> None:
    """output_router_logits=True makes transformers' generate() (5.24, 5.25) compute the balancing loss at each decoding
    step against the whole attention mask and fail at the second token; TRL adds the loss itself either way."""
    if not args.use_vllm and getattr(text_config(model), "output_router_logits", None) is True:
        raise ValueError("MoEGRPOTrainer: output_router_logits=True in the model config makes transformers' "
                         "generate() fail at its second token (a size mismatch in load_balancing_loss_func), and TRL "
                         "adds the balancing loss whatever it says: set model.config.output_router_logits=False and "
                         "choose the loss with router_aux_loss_coef (0.0: off)")


def check_reference(model, args, peft_config) -> None:
    """beta > 0 needs TRL's reference model: refused with PEFT (the policy would score it) and with a model built
    in memory (TRL loads the reference from config._name_or_path, empty there: "Repo id must use alphanumeric")."""
    if args.beta == 0.0:
        return
    if peft_config is not None or (not isinstance(model, str) and base_model(model) is not model):
        raise ValueError(f"MoEGRPOTrainer: beta={args.beta} with a PEFT model scores the reference by calling the "
                         "policy with its adapter disabled, a second policy call the routing hooks would take for the "
                         "old pass; allowed: beta=0.0, or a model without PEFT (TRL then keeps a separate reference)")
    if not isinstance(model, str) and not getattr(model.config, "_name_or_path", ""):
        raise ValueError(f"MoEGRPOTrainer: beta={args.beta} needs a reference model, which TRL loads from the "
                         "policy's config._name_or_path, empty for a model built in memory: save it "
                         "(model.save_pretrained(DIR)) and pass model=DIR (or from_pretrained(DIR)), or pass beta=0.0")


def check_setup(trainer) -> None:
    args, forces = trainer.args, REPLAY_SPECS[trainer.args.routing_replay].forces
    if forces == ROLLOUT and (trainer.rollout_func is not None or trainer.use_transformers_continuous_batching
                              or trainer.tools):
        raise ValueError("routing_replay='rollout' needs TRL's single-turn generate path (no rollout_func, no tools, "
                         "no continuous batching); allowed there: routing_replay='none' or 'old'")
    if forces == OLD_FORWARD and trainer._moe_on_policy():
        every = args.steps_per_generation * trainer.num_iterations
        warnings.warn("routing_replay='old' (R2) cannot act: this run is on-policy (gradient_accumulation_steps "
                      f"{args.gradient_accumulation_steps} is a multiple of steps_per_generation * num_iterations = "
                      f"{every}), so TRL runs no old-policy pass and every ratio is 1; routing is only recorded",
                      stacklevel=4)


def say_balancing_loss(trainer) -> str:
    """One log line: whether TRL adds the router load-balancing loss, its coefficient, what it sees under replay,
    that the model config's output_router_logits does not switch it off, and (weight replay) that it still moves
    the router."""
    args = trainer.args
    coef, given = trainer.router_aux_loss_coef, args.router_aux_loss_coef
    source = "the model config's, as router_aux_loss_coef=None" if given is None else f"router_aux_loss_coef={given}"
    if not trainer.aux_loss_enabled:
        line = f"MoEGRPOTrainer: TRL adds no MoE load-balancing loss (coefficient {coef}, {source})"
        LOG.info(line)
        return line
    parts = [f"MoEGRPOTrainer: TRL adds the MoE load-balancing loss to the policy loss with coefficient {coef} "
             f"({source}); it is computed from the router logits, i.e. the router's own top-k, not the replayed "
             "experts; logged as routing/aux_loss"]
    if getattr(text_config(trainer.accelerator.unwrap_model(trainer.model)), "output_router_logits", None) is False:
        parts.append("the model config's output_router_logits=False does not turn it off (TRL only checks that the "
                     "field exists)")
    if args.routing_replay_weights and not args.freeze_router:
        parts.append("with routing_replay_weights=True the policy loss sends the router no gradient but this loss "
                     "still does, and Adam moves the router about as far as without weight replay; "
                     "router_aux_loss_coef=0.0 or freeze_router=True holds it still")
    parts.append("moe_lab's runs found it harmful when switched on at RL time; router_aux_loss_coef=0.0 turns it off")
    line = ". ".join(parts)
    LOG.warning(line)
    return line
