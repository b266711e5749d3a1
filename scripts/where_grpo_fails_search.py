"""The dynamics search of issue 62, part 2, declared before it runs: one factor at a time from the routing_matters
organism, towards an organism with the published dynamics (a gradient clip that catches spikes only, long
responses, routers that move), read out by `moe-lab fidelity` and a GRPO-without-replay pilot whose collapses are
counted.

BASE is experiments/routing_matters.yaml (organism routing_matters: glm4_moe sigmoid scores, 8 layers, 64 experts
of width 16, top-8, float8 + batch-variant rollouts, fp32 training; sort of 16 digits, 17 response tokens).

Each level runs, in this order:
1. ``moe-lab fidelity BASE rl.minibatches=4 OVERRIDES --prompts 32 --update-steps 3 --no-dense --json`` on cold
   start 701 (the file's first cell, at the pilot arm's 4 mini-batches unless the level sets them: the first cell
   runs 1, where every update is on-policy and the update rows are empty): router disagreement, k3 and routing's share, expert change after updates 1 and 3, the clip
   ratio, the gradient rows of the first updates;
2. the pilot: ``moe-lab run BASE --arms grpo_mb4 --seeds 7010,7020 rl.steps=150 rl.eval_every=10 OVERRIDES``
   (GRPO, no replay, no correction, 4 mini-batches unless the level sets them; cold starts 701 and 702, one RL seed
   each), then ``moe-lab fidelity PILOT_FOLDER --json``, which reads the finished runs' own metrics: the median
   gradient norm and the share of updates the clip bound on, the response length, the slope test of the learning
   curve over the last third of evaluations;
3. collapses: the pilot runs whose manifest says collapsed (moe_lab's collapse rules), out of 2.

In the table a row that both measure (router disagreement, expert change after update 1, the gradient rows) is
the pilot's, over its 150 steps; the clip ratio, k3 and routing's share are the fidelity call's (the pilot runs
GRPO alone).

Fixed before any run:
- the gradient-clip levels come from routing_matters' committed runs: the median ``optim/grad_norm`` of arm grpo_mb4
  over its 3,840 updates is 0.92 (the clip of 1.0 bound on 43% of them), so x3 = 2.76, x10 = 9.2, and off (0);
- response length: sort of 32 digits (33 response tokens) and 64 digits (65 tokens, the task's largest), sort being
  the task with the longer learning curve (routing_matters' arms still rose until step 10-20); long_copy of 4, 8
  and 16 letters (32, 64 and 128 response tokens + EOS), the only task that reaches 128 tokens; its cold start
  learns a fixed-offset copy quickly, so its curve may plateau early (read off the slope row). A level that
  changes the task makes its own cold starts (701 and 702 with that task), at most 1000 supervised steps as the
  organism's;
- router sensitivity: ``rl.router_lr_mult`` 10 and 100 (the atlas: x100 moved expert change 4.6x), and the expert
  bias updated during RL at the cold start's rate (``rl.bias_update_rate=1e-3``);
- off-policy degree: 8 and 16 mini-batches per rollout batch (the base: 4);
- step cost: a pilot's wall seconds per step (manifest wall_s / steps_done, median over its two runs) over the
  base level's, both on a shared 2-core machine (noisy);
- target (issue 62), every row judged on its interval: clip ratio (GSPO over GRPO + R2) 50-250, expert change per
  update within 2x of 10% (5-20%), the gradient clip binding on at most 10% of updates, router disagreement 5-20%,
  routing's share of k3 >= 2/3, learning still rising at step 100 (the slope test), a step cost that lets the
  headline experiment (5 arms x 8 cold starts x 2 RL seeds) fit about 15 h of 2 cores.
- then one combined level (declared rule, run after every single level): for each factor, the level with the
  most target rows in band on their intervals and no more collapses than the base (ties: the cheaper), all such
  levels combined into one config; its fidelity and pilot run on cold starts 703 and 704 (fresh for the search),
  so the chosen organism is not judged on the cold starts it was chosen on. A factor none of whose levels beats
  the base is left at the base.

Why a script and not an experiment file: the readout is `moe-lab fidelity` plus pilots, not endpoints `moe-lab
compare` reads; nothing here is a contrast. The experiment the search chooses an organism for is declared in its
own file before its runs (issue 62, part 3).

Usage: python scripts/where_grpo_fails_search.py OUT [--only LEVEL,...] [--jobs N] [--table-only]
Writes OUT/levels.jsonl (one line per finished level; resumable), OUT/fidelity/<level>.json (each fidelity call,
kept for a resume), OUT/pilots/<level>/ (the pilot runs) and OUT/table.md, OUT/table.csv: factor, level -> fidelity
rows -> collapses -> step cost.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from search_levels import arguments, load, markdown, run_json, run_levels

BASE = "experiments/routing_matters.yaml"
FIDELITY_BASE = ["rl.minibatches=4"]  # the pilot arm's; a level's own rl.minibatches comes after it and wins
FIDELITY_ARGS = ["--prompts", "32", "--update-steps", "3", "--no-dense", "--json"]
PILOT_ARM = "grpo_mb4"
PILOT_SEEDS = "7010,7020"  # cold starts 701 and 702 (the file's blocks), one RL seed each
PILOT_ARGS = ["rl.steps=150", "rl.eval_every=10"]
COMBINED_SEEDS = ("model.seed=703", "7030,7040")  # fresh for the search: the combined level's fidelity and pilot

# (factor, level, overrides)
LEVELS = [
    ("base", "routing_matters", []),
    ("grad_clip", "clip_x3", ["rl.grad_clip=2.76"]),
    ("grad_clip", "clip_x10", ["rl.grad_clip=9.2"]),
    ("grad_clip", "clip_off", ["rl.grad_clip=0"]),
    ("off_policy", "minibatches_8", ["rl.minibatches=8"]),
    ("off_policy", "minibatches_16", ["rl.minibatches=16"]),
    ("router", "router_lr_x10", ["rl.router_lr_mult=10"]),
    ("router", "router_lr_x100", ["rl.router_lr_mult=100"]),
    ("router", "bias_updated_1e-3", ["rl.bias_update_rate=0.001"]),
    ("length", "sort_32", ["task.length=32"]),
    ("length", "sort_64", ["task.length=64"]),
    # amended before the level ran: long_copy of 4 letters has 4,096 problems, about 256 held out, too few for the
    # organism's 128 evaluation prompts (the task refuses it: 4x headroom); 64 prompts, so its slope row is noisier
    ("length", "long_copy_32", ["task.name=long_copy", "task.length=4", "task.eval_size=64"]),
    ("length", "long_copy_64", ["task.name=long_copy", "task.length=8"]),
    ("length", "long_copy_128", ["task.name=long_copy", "task.length=16"]),
]

# Target bands (issue 62); a row is in band when its whole interval lies inside (fidelity's rule). The clip's
# share is "at most 10%": no lower bound (a t-interval of a share near 0 reaches below 0).
TARGET = {"clip_ratio_replay": (50.0, 250.0), "expert_change_update": (0.05, 0.20), "grad_clip_share": (-math.inf, 0.10),
          "router_disagreement": (0.05, 0.20), "routing_share": (2 / 3, math.inf), "learning_slope": (0.0, math.inf)}


def fidelity_rows(record: dict) -> dict:
    """key -> (value, low, high) of a fidelity --json record (rows without an interval give value, value)."""
    rows = {}
    for row in record.get("rows", []):
        value = math.nan if row.get("value") is None else row["value"]
        low, high = row.get("lo", value), row.get("hi", value)
        rows[row["key"]] = (value, math.nan if low is None else low, math.nan if high is None else high)
    return rows


def pilot(out: Path, name: str, overrides: list[str], seeds: str) -> dict:
    folder = out / "pilots" / name
    cmd = [sys.executable, "-m", "moe_lab.cli", "run", BASE, "--out", str(folder), "--arms", PILOT_ARM, "--seeds",
           seeds, "--no-progress", *PILOT_ARGS, *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True)
    manifests = [json.loads(p.read_text()) for p in sorted(folder.glob("runs/*/manifest.json"))]
    if not manifests:
        manifests = [json.loads(p.read_text()) for p in sorted(folder.glob("*/manifest.json"))]
    steps = [m["wall_s"] / max(m["steps_done"], 1) for m in manifests if m.get("wall_s")]
    record = {"runs": len(manifests), "collapsed": sum(m.get("status") == "collapsed" for m in manifests),
              "step_s": sorted(steps)[len(steps) // 2] if steps else math.nan, "exit": done.returncode}
    return {**record, "fidelity": run_json([sys.executable, "-m", "moe_lab.cli", "fidelity", str(folder), "--json"])}


def fidelity_call(out: Path, name: str, cmd: list[str]) -> dict:
    """The level's fidelity call, kept in OUT/fidelity/<level>.json with its command, so that a search stopped
    during the pilot (a session's end) does not repeat it on resuming: at 65-129 response tokens it takes 10-20
    minutes. A kept record whose command differs (an amended level), or that failed, is run again."""
    kept = out / "fidelity" / f"{name}.json"
    args = cmd[1:]  # not the interpreter's path
    if kept.is_file():
        record = json.loads(kept.read_text())
        if record.get("command") == args and "error" not in record["fidelity"]:
            return record["fidelity"]
    fidelity = run_json(cmd)
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps({"command": args, "fidelity": fidelity}) + "\n", encoding="utf-8")
    return fidelity


def run_level(out: Path, level: tuple, seed_override: tuple = ()) -> dict:
    factor, name, overrides = level
    fidelity = fidelity_call(out, name, [sys.executable, "-m", "moe_lab.cli", "fidelity", BASE, *FIDELITY_BASE,
                                         *overrides, *seed_override[:1], *FIDELITY_ARGS])
    seeds = seed_override[1] if seed_override else PILOT_SEEDS
    return {"factor": factor, "level": name, "overrides": overrides, "fidelity": fidelity,
            "pilot": pilot(out, name, overrides, seeds)}


def in_band(rows: dict, key: str) -> bool | None:
    if key not in rows or not all(math.isfinite(v) for v in rows[key][1:]):
        return None
    lo, hi = TARGET[key]
    _, low, high = rows[key]
    return bool(low >= lo and high <= hi)


def table(records: list[dict]) -> list[dict]:
    base = next((r for r in records if r["factor"] == "base"), None)
    base_step = base["pilot"]["step_s"] if base else math.nan
    order = {lv[1]: i for i, lv in enumerate(LEVELS)}  # declared order, the combined level last
    out = []
    for r in sorted(records, key=lambda r: order.get(r["level"], len(order))):
        rows = {**fidelity_rows(r["fidelity"]), **fidelity_rows(r["pilot"].get("fidelity", {}))}
        row = {"factor": r["factor"], "level": r["level"]}
        if "error" in r["fidelity"]:
            row["error"] = r["fidelity"]["error"]
        row.update({key: rows.get(key, (math.nan,))[0] for key in (*TARGET, "grad_norm_median", "response_length")})
        row["in_band"] = "/".join("-" if h is None else "y" if h else "n" for h in (in_band(rows, k) for k in TARGET))
        row["collapses"] = f"{r['pilot']['collapsed']}/{r['pilot']['runs']}"
        row["step_cost"] = r["pilot"]["step_s"] / base_step
        out.append(row)
    return out


def combined(records: list[dict]) -> tuple | None:
    """The declared combination: per factor, the level with the most target rows in band and no more collapses
    than the base (ties: the cheaper); None until every single level has a record."""
    if {lv[1] for lv in LEVELS} - {r["level"] for r in records}:
        return None
    rows = table(records)
    base = next(row for row in rows if row["factor"] == "base")
    score = {row["level"]: (row["in_band"].count("y"), -row["step_cost"]) for row in rows}
    collapses = {r["level"]: r["pilot"]["collapsed"] for r in records}
    overrides = []
    for factor in dict.fromkeys(lv[0] for lv in LEVELS if lv[0] != "base"):
        best = max((lv for lv in LEVELS if lv[0] == factor and collapses[lv[1]] <= collapses[base["level"]]),
                   key=lambda lv: score[lv[1]], default=None)
        if best and score[best[1]][0] > score[base["level"]][0]:
            overrides += best[2]
    return ("combined", "combined", overrides)


def write_table(out: Path, records: list[dict]) -> None:
    import pandas as pd

    frame = pd.DataFrame(table(records))
    frame.to_csv(out / "table.csv", index=False)
    note = ("in_band (on intervals): " + " / ".join(f"{k} in [{lo:g}, {hi:g}]" for k, (lo, hi) in TARGET.items())
            + " (- : not measured); collapses: pilot runs collapsed of those run; step_cost: over the base's\n\n")
    (out / "table.md").write_text(note + markdown(frame) + "\n", encoding="utf-8")


def main() -> int:
    args = arguments(__doc__)
    out = args.out
    done = {r["level"] for r in load(out)}
    wanted = set(args.only.split(",")) if args.only else None
    todo = [lv for lv in LEVELS if lv[1] not in done and (wanted is None or lv[1] in wanted)]
    if not args.table_only:
        # the base alone first: every level's step cost is over its pilot's, and it warms the shared cold starts
        run_levels(out, todo, lambda lv: run_level(out, lv), write_table, args.jobs,
                   first=lambda lv: lv[0] == "base")
        level = combined(load(out))
        if level and "combined" not in done and wanted is None:
            run_levels(out, [level], lambda lv: run_level(out, lv, COMBINED_SEEDS), write_table, 1)
    write_table(out, load(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
