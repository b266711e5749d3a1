"""The organism search of issue 55, part 2, declared before it ran: one factor at a time from the rollout_mismatch
organism, read out by `moe-lab fidelity`.

Why a script and not an experiment file: an experiment's cells are RL runs whose endpoints `moe-lab compare`
reads; the readout here is `moe-lab fidelity` (rollouts, forwards and a few updates per level), which the runner
does not run. Each level is one `moe-lab fidelity BASE OVERRIDES --json` call.

BASE is experiments/rollout_mismatch.yaml; fidelity measures its first cell (arm grpo, cold start model.seed 601).
LEVELS below is the declaration, in the order it runs (the cheap rollout-side levels first, then the levels that
need a cold start of their own, in the order of their expected effect on routing's share of k3). Fixed before any
run:

- every level: ``--prompts 32 --update-steps 3`` (32 prompts x 8 rollouts for the mismatch rows; 3 RL steps of
  GRPO and of GSPO for the update rows);
- the dense control (``moe_dense_k3``) only where its cold start is the base's (the rollout-side levels): a model
  level would need a second cold start of its own dense control;
- a level that changes the model adds ``coldstart.max_steps=1000`` (the base reached its target in 400 supervised
  steps): a cold start that stops short of the target is run anyway and says so (``coldstart_reached``);
- step cost: the GRPO step time of the level over the base's, each measured in its own process on a shared CPU
  (noisy: other jobs share the 2 cores);
- target (issue 55): routing_share >= 2/3, router_disagreement within 2x of 10%, MoE/dense k3 > 1, step cost <= 2x.

Router logit scale is declared but not run: no config field sets it (it would need a model field that scales the
router's logits before the top-k; a follow-up). A level whose fidelity call fails (e.g. a family that refuses a
setting) is recorded with its error line.

Usage: python scripts/routing_matters_search.py OUT [--only LEVEL,...] [--jobs N] [--table-only]
Writes OUT/levels.jsonl (one line per finished level, resumable: finished levels are skipped) and OUT/table.md,
OUT/table.csv (factor, level -> each fidelity row -> step cost).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from search_levels import arguments, load, markdown, run_json, run_levels

BASE = "experiments/rollout_mismatch.yaml"
FIDELITY_ARGS = ["--prompts", "32", "--update-steps", "3"]
COLD = ["coldstart.max_steps=1000"]  # added to every level that changes the model (see the docstring)

# (factor, level, overrides, changes the model)
LEVELS = [
    ("base", "rollout_mismatch", [], False),
    ("numerics", "bf16_both_batch_variant", ["rl.train_dtype=bfloat16", "rl.rollout_dtype=bfloat16",
                                             "rl.rollout_kernels=batch_variant"], False),
    ("numerics", "bf16_both", ["rl.train_dtype=bfloat16", "rl.rollout_dtype=bfloat16"], False),
    ("numerics", "bf16_rollout_fp32_train", ["rl.rollout_dtype=bfloat16"], False),
    ("top_k", "top2_width16", ["model.top_k=2"], True),
    ("experts_shape", "16x64_top2_equal_flops", ["model.num_experts=16", "model.moe_intermediate_size=64",
                                                 "model.top_k=2"], True),
    ("experts_shape", "8x128_top1_equal_flops", ["model.num_experts=8", "model.moe_intermediate_size=128",
                                                 "model.top_k=1"], True),
    ("balancing", "aux_loss_0.01", ["coldstart.aux_loss_coef=0.01"], True),
    ("specialisation", "mixture_sort_reverse", ["task.name=mixture", "task.mixture=[sort,reverse]"], True),
    ("depth", "16_layers", ["model.num_layers=16"], True),
    ("shared_expert", "qwen2_moe_shared", ["model.family=qwen2_moe", "model.shared_expert=true"], True),
    ("shared_expert", "qwen2_moe_no_shared", ["model.family=qwen2_moe", "model.shared_expert=false"], True),
    ("scores", "sigmoid_glm4_moe", ["model.family=glm4_moe", "model.shared_expert=false"], True),
    ("balancing", "sigmoid_bias_1e-3", ["model.family=glm4_moe", "model.shared_expert=false",
                                        "coldstart.bias_update_rate=0.001"], True),
    ("task_tail", "sort_length_32", ["task.length=32"], True),
]
# Added after the declaration had run (16:5x UTC): the base already sets rl.rollout_kernels=batch_variant, so the
# declared bf16_both level ran the same config as bf16_both_batch_variant (identical rows); this level is what
# bf16_both meant, bf16 on both sides with the platform's kernels. Reported as a post-declaration addition.
LEVELS.append(("numerics", "bf16_both_batch_invariant", ["rl.train_dtype=bfloat16", "rl.rollout_dtype=bfloat16",
                                                         "rl.rollout_kernels=batch_invariant"], False))
NOT_RUN = [("router_logit_scale", "no config field scales the router logits (a follow-up)")]

ROWS = ("router_disagreement", "token_share", "k3", "k3_replayed", "routing_share", "moe_dense_k3", "extreme_ln2",
        "extreme_ln5", "expert_change_update", "expert_change_depth", "clip_ratio")


def command(overrides: list[str], model: bool) -> list[str]:
    extra = COLD if model else []
    dense = [] if not model else ["--no-dense"]
    return [sys.executable, "-m", "moe_lab.cli", "fidelity", BASE, *overrides, *extra, *FIDELITY_ARGS, *dense,
            "--json"]


def run_level(level: tuple) -> dict:
    factor, name, overrides, model = level
    cmd = command(overrides, model)
    return {"factor": factor, "level": name, "overrides": overrides, "command": " ".join(cmd[1:]), **run_json(cmd)}


def _value(record: dict, key: str) -> float:
    for row in record.get("rows", []):
        if row["key"] == key:
            return math.nan if row["value"] is None else row["value"]
    return math.nan


def table(records: list[dict]) -> list[dict]:
    """factor, level -> each fidelity row's value -> step cost over the base's -> the target's parts."""
    base = next((r for r in records if r["factor"] == "base" and "rows" in r), None)
    base_step = base["timings"].get("step_s", math.nan) if base else math.nan
    out = []
    for r in records:
        row = {"factor": r["factor"], "level": r["level"]}
        if "error" in r:
            out.append({**row, "error": r["error"]})
            continue
        row.update({key: _value(r, key) for key in ROWS})
        row["step_s"] = r["timings"].get("step_s", math.nan)
        row["step_cost"] = row["step_s"] / base_step
        row["coldstart_reached"] = r.get("coldstart", {}).get("reached")
        hits = [row["routing_share"] >= 2 / 3, 0.05 <= row["router_disagreement"] <= 0.20,
                row["moe_dense_k3"] > 1 if math.isfinite(row["moe_dense_k3"]) else None, row["step_cost"] <= 2]
        row["target_met"] = "/".join("-" if h is None else "y" if h else "n" for h in hits)
        out.append(row)
    return out


def write_table(out: Path, records: list[dict]) -> None:
    import pandas as pd

    frame = pd.DataFrame(table(records))
    frame.to_csv(out / "table.csv", index=False)
    note = ("target_met: routing_share >= 2/3 / router_disagreement in [0.05, 0.20] / MoE-dense k3 > 1 "
            "(- : not measured) / step cost <= 2x the base's\n\n")
    not_run = "".join(f"- {f}: not run ({why})\n" for f, why in NOT_RUN)
    (out / "table.md").write_text(note + markdown(frame) + "\n\n" + not_run, encoding="utf-8")


def main() -> int:
    args = arguments(__doc__)
    out = args.out
    done = {(r["factor"], r["level"]) for r in load(out)}
    wanted = set(args.only.split(",")) if args.only else None
    todo = [lv for lv in LEVELS if (lv[0], lv[1]) not in done and (wanted is None or lv[1] in wanted)]
    if args.table_only:
        write_table(out, load(out))
        return 0
    # the base level alone first: it builds the dense control's cold start, which the rollout-side levels share
    # (two processes would otherwise build the same entry at once)
    run_levels(out, todo, run_level, write_table, args.jobs, first=lambda level: level[0] == "base")
    return 0


if __name__ == "__main__":
    sys.exit(main())
