"""Resuming from a Trainer checkpoint with the experts it saved, in whatever layout transformers wrote them.

transformers 5 holds an MoE layer's experts fused (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) but
``save_pretrained`` writes them one per expert (``mlp.experts.<e>.gate_proj.weight``, ...), reversing the model's
conversion mapping. Its Trainer resumes with a plain ``load_state_dict(strict=False)`` of that file (5.24): the
fused keys are missing, the per-expert ones unexpected, and the experts keep the weights the model was built with,
logged only as "missing keys". ``from_pretrained`` applies the conversion mapping (its ``WeightConverter``s merge
the experts back), so the checkpoint is read through it here and copied into the live model in place (the same
Parameter objects: the optimizer state restored next, hooks and frozen weights keep theirs). A checkpoint that
still leaves a weight of the model unfilled after the conversion is refused in one line naming the file.
"""

from __future__ import annotations

import copy
from pathlib import Path

from transformers import PreTrainedModel
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

FULL_WEIGHTS = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)


def full_weights_file(folder: str | Path) -> Path | None:
    """The file of a full-model checkpoint in ``folder`` (as transformers' Trainer looks for it), None when the
    folder holds only adapters (PEFT) or nothing."""
    for name in FULL_WEIGHTS:
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def load_full_checkpoint(model, folder: str | Path) -> bool:
    """Load a full-model checkpoint into ``model`` in place, converted by transformers to the model's layout.

    False (nothing done) when the folder holds no full weights or ``model`` is not a transformers model: the
    Trainer's own resume applies (PEFT adapters). ValueError in one line when a weight of the model is missing
    from the checkpoint or has another shape after the conversion."""
    file = full_weights_file(folder)
    if file is None or not isinstance(model, PreTrainedModel):
        return False
    # the live model's own config: the checkpoint is read into the architecture it will be copied into; only its
    # weights are kept, so no hub kernels (transformers >= 5.25 would otherwise need the `kernels` package)
    try:
        loaded, info = type(model).from_pretrained(str(folder), config=copy.deepcopy(model.config), dtype=model.dtype,
                                                   local_files_only=True, output_loading_info=True,
                                                   ignore_mismatched_sizes=True, use_kernels=False)
    except (RuntimeError, OSError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"MoEGRPOTrainer: cannot resume from {file}: transformers could not read it ({first})") \
            from None
    missing = sorted(info["missing_keys"]) + sorted(str(m[0]) for m in info["mismatched_keys"])
    if missing:
        raise ValueError(f"MoEGRPOTrainer: cannot resume from {file}: {len(missing)} of the model's weights are "
                         f"missing or of another shape after transformers' conversion (first: {missing[0]}); resuming "
                         "would train on weights the checkpoint does not hold")
    model.load_state_dict(loaded.state_dict(), strict=True)
    return True
