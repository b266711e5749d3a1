"""Pure tensor math of RL: the policy losses and the objective registry, advantages, rollout correction and
the ratio metrics. Functions take tensors and plain numbers and return ``(loss, metrics)`` or tensors; nothing
here reads a config, a model or a file (``moe_lab.rl.step`` turns the run's config into their arguments)."""
