"""The RL trainer: rollout (generation with routing recorded), one step (collect, then minibatch updates),
the run loop shared by a plain run and torchrun (``loop``; ``distributed`` adds only the process group, the
batch split and the reduction of metrics), cold start (SFT warm-up, cached), optimizer, checkpoints, the
collapse rules and the run log (metrics.parquet, manifest) that one run writes. It reads ``config`` and
drives ``algos``, ``models``, ``routing`` and ``tasks``; it knows nothing of experiment grids or plots."""
