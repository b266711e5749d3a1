"""Routing record / replay, traces and routing metrics for transformers MoE models.

The family registry (router classes, choice rules, gate normalisations) lives in ``moe_lab.families``.
"""

from moe_lab.routing.hooks import ReplayHandle, check_trace, record, replay
from moe_lab.routing.metrics import expert_change, expert_load_LE, load_metrics, routing_metrics
from moe_lab.routing.trace import Trace, index_dtype

__all__ = ["ReplayHandle", "Trace", "check_trace", "expert_change", "expert_load_LE", "index_dtype",
           "load_metrics", "record", "replay", "routing_metrics"]
