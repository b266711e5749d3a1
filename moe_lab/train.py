"""``python -m moe_lab.train RUN.yaml --out DIR`` (under torchrun or alone) and the names that callers have
always imported from here (``train``, ``run_info``, ``TrainState``): the run loop lives in moe_lab.rl.loop."""

from moe_lab.rl.loop import TrainState, run_info, step_prompts, train

__all__ = ["TrainState", "run_info", "step_prompts", "train"]

if __name__ == "__main__":  # torchrun [--nproc-per-node N] -m moe_lab.train RUN.yaml --out DIR
    import sys

    from moe_lab.rl.distributed import main

    sys.exit(main())
