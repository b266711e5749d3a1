"""Integrations of moe_lab's routing record/replay and routing metrics into other trainers.

The top layer of the package: it imports routing/, algos/ and rl/ (their metric functions and cross-rank
reductions) and nothing in moe_lab imports it, so ``import moe_lab`` never needs a third-party trainer.
``moe_lab.integrations.trl`` (a package) holds ``MoEGRPOConfig`` and ``MoEGRPOTrainer`` (TRL's GRPOTrainer with
Routing Replay R2/R3 and moe_lab's metrics in TRL's logs; install with ``pip install 'moe_lab[trl]'``). What any
trainer integration can use lives beside it: ``batch_routing`` (routing carried batch-first in a trainer's batch
dict, record/replay around one model call) and ``metric_row`` (the metrics of a loss step, combined over
microbatches and ranks, per-layer columns named by decoder layer); ``trainer_state_plot`` draws the routing
columns of a Hugging Face ``trainer_state.json``.
"""
