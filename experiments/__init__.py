"""Experiment definitions (YAML), shipped inside the package as ``moe_lab.experiments``."""
