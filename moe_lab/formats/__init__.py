"""Routed experts recorded by other stacks, read into moe_lab's terms.

Inference engines (vLLM, SGLang) and RL trainers (NeMo-RL, prime-rl, verl, slime) each carry the experts the
engine routed every token to, for Rollout Routing Replay, in their own layout. Each module here reads one
layout into ``Routes`` (routes.py: ids over the model's MoE layers, positions and top-k, with a mask for
missing routes); ``layers`` maps a layout's layer axis onto the model's MoE layers from the
HF config; ``jsonl`` reads the `moe-lab check-trace` input and detects the layout. The layer sits beside
routing: it may import models and routing, and nothing below it imports it (docs/traces.md). moe_lab never
writes these layouts (the engines and trainers do): the writers that make dumps for the tests and benchmarks
are tests/trace_writers.py.
"""
