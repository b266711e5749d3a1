"""Integrations of moe_lab's routing record/replay and routing metrics into other trainers.

The top layer of the package: it imports routing/, algos/ and rl/ (their metric functions and cross-rank
reductions) and nothing in moe_lab imports it, so ``import moe_lab`` never needs a third-party trainer.
``moe_lab.integrations.trl`` holds ``MoEGRPOConfig`` and ``MoEGRPOTrainer`` (TRL's GRPOTrainer with Routing
Replay R2/R3 and moe_lab's metrics in TRL's logs; install with ``pip install -e '.[trl]'``).
"""
