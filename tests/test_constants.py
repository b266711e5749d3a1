"""Each registry holds exactly the names of moe_lab/config/constants.py, which the config accepts."""

import dataclasses
import subprocess
import sys

from moe_lab import config
from moe_lab.config import constants as C
from moe_lab.algos.objectives import OBJECTIVES
from moe_lab.algos.rollout_correction import DEFAULT_BOUNDS, MODES
from moe_lab.tasks import TASKS
from moe_lab.tasks.mixture import SINGLE


def _choices(cls, name: str) -> tuple:
    return next(f for f in dataclasses.fields(cls) if f.name == name).metadata["choices"]


def test_registries_match_the_constants():
    assert list(OBJECTIVES) == list(C.ALGOS)
    assert set(C.PAPER_CLIP) == set(C.ALGOS)
    assert set(TASKS) == set(C.TASKS) and set(SINGLE) == set(C.SINGLE_TASKS)
    assert set(DEFAULT_BOUNDS) == set(MODES) == set(C.ROLLOUT_CORRECTION_MODES)


def test_config_choices_are_the_constants():
    rl, model = config.RLConfig, config.ModelConfig
    assert _choices(rl, "algo") == C.ALGOS
    assert _choices(rl, "loss_agg") == C.LOSS_AGGS
    assert _choices(rl, "kl_kind") == C.KL_KINDS
    assert _choices(rl, "replay") == C.REPLAY_MODES
    assert _choices(rl, "rollout_correction") == C.ROLLOUT_CORRECTION_MODES
    assert _choices(rl, "train_dtype") == C.DTYPES and _choices(rl, "rollout_dtype") == C.ROLLOUT_DTYPES
    assert _choices(rl, "rollout_kernels") == C.ROLLOUT_KERNELS
    assert _choices(model, "family") == C.FAMILIES
    assert _choices(model, "experts_impl") == C.EXPERTS_KERNELS
    assert _choices(config.TaskConfig, "name") == C.TASKS
    assert _choices(config.TaskConfig, "mixture") == C.SINGLE_TASKS == tuple(t for t in C.TASKS if t != "mixture")
    assert config.PAPER_CLIP is C.PAPER_CLIP


def test_constants_and_config_import_without_torch():
    code = "import sys, moe_lab.config.constants, moe_lab.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
