"""AdamW with a separate router learning rate, and a linear warmup."""

from __future__ import annotations

import torch

from moe_lab.config.rl import RLSchedule
from moe_lab.models import moe_layers


def router_parameters(model) -> list[torch.nn.Parameter]:
    return [p for _, router, _ in moe_layers(model) for p in router.parameters()]


def build_optimizer(model, schedule: RLSchedule) -> torch.optim.Optimizer:
    """Router weights get lr * router_lr_mult: a knob that makes routing move faster than the rest.

    rl.freeze_router: the router weights are set requires_grad=False (prime-rl's freeze_moe_router), so no
    gradient reaches them and AdamW, which skips parameters whose grad is None, never updates, decays or keeps
    state for them; they stay in their (router) group so the optimizer's layout, and its checkpoints, do not
    depend on the flag. Done here, where the trained model meets its optimizer, so a resumed run refreezes too.
    """
    if schedule.freeze_router:
        for p in router_parameters(model):
            p.requires_grad_(False)
    router = {id(p) for p in router_parameters(model)}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in router]
    lr, router_lr = schedule.lr, schedule.lr * schedule.router_lr_mult
    groups = [{"params": rest, "lr": lr, "base_lr": lr, "name": "body"},
              {"params": [p for p in model.parameters() if id(p) in router], "lr": router_lr, "base_lr": router_lr,
               "name": "router"}]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=schedule.weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, schedule: RLSchedule, update: int) -> float:
    """Linear warmup over the first warmup_steps optimizer updates, then constant.

    A pure function of the update index (no scheduler state), so a resumed run needs nothing extra.
    """
    factor = min(1.0, (update + 1) / (schedule.warmup_steps + 1)) if schedule.warmup_steps else 1.0
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
    return schedule.lr * factor
