"""moe_lab: measure what RL does to expert routing in Mixture-of-Experts language models."""

__version__ = "0.1.0"
