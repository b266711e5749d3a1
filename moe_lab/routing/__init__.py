"""Routing record / replay, traces and routing metrics for transformers MoE models.

The family registry (router classes, choice functions, gate normalisations) lives in ``moe_lab.models.families``.
"""

from moe_lab.routing.hooks import ReplayHandle, check_trace, record, replay, router_logp_probe
from moe_lab.routing.metrics import (expert_change, expert_load_LE, first_divergence, load_metrics, router_gamma,
                                     router_mismatch, router_shift, routing_confidence, routing_metrics,
                                     specialization)
from moe_lab.routing.router_logp import RouterLogp
from moe_lab.routing.trace import Trace, index_dtype

__all__ = ["ReplayHandle", "RouterLogp", "Trace", "check_trace", "expert_change", "expert_load_LE", "first_divergence",
           "index_dtype",
           "load_metrics", "record", "replay", "router_gamma", "router_logp_probe", "router_mismatch", "router_shift",
           "routing_confidence", "routing_metrics", "specialization"]
