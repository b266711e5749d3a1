"""Routing Replay (R2/R3) and moe_lab's routing metrics inside TRL's GRPOTrainer (docs/trl.md).

    from moe_lab.integrations.trl import MoEGRPOConfig, MoEGRPOTrainer

    args = MoEGRPOConfig(output_dir="out", routing_replay="rollout")   # "none" | "old" | "rollout"
    trainer = MoEGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()   # routing/*, mismatch/*, ratio/token_var in trainer.state.log_history

Needs TRL in the tested range (``pip install -e '.[trl]'``); anything else is refused here in one line.
"""

from __future__ import annotations

from moe_lab.integrations.trl_version import require_trl

require_trl()

from moe_lab.integrations.trl_config import MoEGRPOConfig  # noqa: E402
from moe_lab.integrations.trl_trainer import MoEGRPOTrainer  # noqa: E402

__all__ = ["MoEGRPOConfig", "MoEGRPOTrainer"]
