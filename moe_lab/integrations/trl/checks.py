"""What MoEGRPOTrainer refuses, warns about or says at construction, each in one line.

``check_model`` runs before TRL builds anything (reference model, vLLM engine, optimizer state): a model with no
router of moe_lab's families is refused from its config (a model id or folder) or its modules.
``check_setup`` runs after TRL's own checks, on what TRL decided (on-policy or not, reference model).
``say_balancing_loss`` logs what TRL does with the MoE load-balancing loss (on by default for MoE models).
"""

from __future__ import annotations

import logging
import warnings

from moe_lab.models import moe_layers
from moe_lab.models.families import FAMILIES, family_of_model_type

LOG = logging.getLogger("moe_lab.integrations.trl")


def base_model(model):
    """The model generation and the forwards actually call: a PEFT model's base model (``PeftModel.generate``
    calls it directly, so a hook on the PeftModel itself never fires), else the model."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def check_model(model) -> None:
    """Refuse a model with no supported MoE router before TRL loads or wraps it."""
    if isinstance(model, str):
        from transformers import AutoConfig

        model_type = AutoConfig.from_pretrained(model).get_text_config().model_type
        if family_of_model_type(model_type) is None:
            raise ValueError(f"MoEGRPOTrainer: model {model!r} has model_type={model_type!r}, not an MoE family "
                             f"moe_lab supports; allowed {', '.join(s.model_type for s in FAMILIES.values())}")
        return
    try:
        moe_layers(base_model(model))
    except ValueError as err:
        raise ValueError(f"MoEGRPOTrainer: model: {err}") from None


def check_setup(trainer) -> None:
    args, mode = trainer.args, trainer.args.routing_replay
    if mode == "rollout" and (trainer.rollout_func is not None or trainer.use_transformers_continuous_batching
                              or trainer.tools):
        raise ValueError("routing_replay='rollout' needs TRL's single-turn generate path (no rollout_func, no tools, "
                         "no continuous batching); allowed there: routing_replay='none' or 'old'")
    if trainer.beta != 0.0 and trainer.ref_model is None:
        raise ValueError("MoEGRPOTrainer: beta != 0 with a PEFT model scores the reference by calling the policy "
                         "with its adapter disabled, a second policy call the routing hooks would take for the old "
                         "pass; allowed: beta=0, or a model without PEFT (TRL then keeps a separate reference)")
    if mode == "old" and trainer._moe_on_policy():
        every = args.steps_per_generation * trainer.num_iterations
        warnings.warn("routing_replay='old' (R2) cannot act: this run is on-policy (gradient_accumulation_steps "
                      f"{args.gradient_accumulation_steps} is a multiple of steps_per_generation * num_iterations = "
                      f"{every}), so TRL runs no old-policy pass and every ratio is 1; routing is only recorded",
                      stacklevel=4)


def say_balancing_loss(trainer) -> str:
    """One log line: whether TRL adds the router load-balancing loss, its coefficient, what it sees under replay."""
    coef, given = trainer.router_aux_loss_coef, trainer.args.router_aux_loss_coef
    source = "the model config's, as router_aux_loss_coef=None" if given is None else f"router_aux_loss_coef={given}"
    if trainer.aux_loss_enabled:
        line = (f"MoEGRPOTrainer: TRL adds the MoE load-balancing loss to the policy loss with coefficient {coef} "
                f"({source}); it is computed from the router logits, i.e. the router's own top-k, not the replayed "
                "experts; logged as routing/aux_loss. moe_lab's runs found it harmful when switched on at RL time; "
                "router_aux_loss_coef=0.0 turns it off")
        LOG.warning(line)
    else:
        line = f"MoEGRPOTrainer: TRL adds no MoE load-balancing loss (coefficient {coef}, {source})"
        LOG.info(line)
    return line
