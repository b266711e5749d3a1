"""Routing Replay (R2/R3) and moe_lab's routing metrics inside TRL's GRPOTrainer (docs/trl.md).

    from moe_lab.integrations.trl import MoEGRPOConfig, MoEGRPOTrainer

    args = MoEGRPOConfig(output_dir="out", routing_replay="rollout")   # "none" | "old" | "rollout"
    trainer = MoEGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()   # routing/*, mismatch/*, ratio/token_var in trainer.state.log_history

Needs TRL in the tested range (``pip install 'moe_lab[trl]'``); anything else is refused here in one line
(``MOE_LAB_ALLOW_UNTESTED_TRL=1``: a warning instead). Modules: ``config`` (MoEGRPOConfig), ``trainer``
(MoEGRPOTrainer), ``state`` (its per-trainer routing state), ``checks`` (what is refused or said at
construction), ``resume`` (a checkpoint's experts read in the layout transformers saved them), ``vllm`` (routed
experts from TRL's colocated vLLM engine), ``version``. What is not TRL-specific
lives one level up: ``moe_lab.integrations.batch_routing`` and ``moe_lab.integrations.metric_row``.
"""

from __future__ import annotations

from moe_lab.integrations.trl.version import require_trl

require_trl()

from moe_lab.integrations.trl.config import MoEGRPOConfig  # noqa: E402
from moe_lab.integrations.trl.trainer import MoEGRPOTrainer  # noqa: E402

__all__ = ["MoEGRPOConfig", "MoEGRPOTrainer"]
