"""Synthetic experiment folders in the runner's layout, for the results/plots/figures/notebook tests.

Values follow simple per-arm formulas plus small seeded noise (no training): GSPO clips about two orders
of magnitude more tokens than GRPO (as in the paper), replay arms have zero forced expert change and a
non-zero latent one, and the volatility knob (rl.router_lr_mult) raises expert change.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pandas as pd

from moe_lab.config import dump_yaml, from_dict, load_yaml, to_dict, validate
from moe_lab.launch.compose import compose

# The main job's arms, read from the file `moe-lab reproduce` runs, so the fixtures follow it.
PAPER_ARMS = compose(load_yaml(str(Path(__file__).resolve().parents[1] / "experiments" / "paper.yaml")))["arms"]
CLIP_POINTS = {"grpo": [(0.1, 0.13), (0.2, 0.27), (0.4, 0.54)], "gspo": [(1e-4, 1.3e-4), (3e-4, 4e-4), (1e-3, 1.3e-3)]}
LR_MULTS = (1.0, 10.0, 100.0)


def _base(layers: int, steps: int, minibatches: int, eval_every: int) -> dict:
    return {"model": {"num_layers": layers, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1},
            "rl": {"steps": steps, "prompts_per_step": 4, "group_size": 4, "minibatches": minibatches,
                   "eval_every": eval_every}}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def metric_rows(info: dict, cfg: dict, steps: int, minibatches: int, layers: int) -> list[dict]:
    rl = cfg["rl"]
    gspo = rl["algo"].startswith("gspo")
    replay = rl["replay"] != "none"
    mult = float(rl["router_lr_mult"])
    clip_scale = (rl["clip_high"] or (4e-4 if gspo else 0.27)) / (4e-4 if gspo else 0.27)
    rng = np.random.default_rng([info["seed"], zlib.crc32(info["arm"].encode())])
    rows = []
    for step in range(steps):
        for mb in range(minibatches):
            noise = 1.0 + 0.1 * rng.standard_normal()
            out = (0.15 if gspo else 0.0015) * noise / clip_scale
            latent = 0.05 * (1 + np.log10(mult)) * noise
            layer = {f"routing/layer_{i}/expert_change": 0.0 if replay else latent * (1 + i) / layers
                     for i in range(layers)}
            rows.append({**info, "step": step, "minibatch": mb, "update": step * minibatches + mb,
                         "loss": 0.1 * noise, "clip_frac/out_of_range": out, "clip_frac/active": out / 2,
                         "clip_frac/low": out / 4, "clip_frac/high": out / 4, "clip_frac/seq": min(1.0, 3 * out),
                         "ratio/token_var": (1e-4 if gspo else 1e-3) * noise, "ratio/extreme_frac": 1e-3 * noise,
                         "routing/expert_change": 0.0 if replay else latent, "routing/expert_change_latent": latent,
                         **layer, "reward/mean": min(1.0, 0.3 + 0.02 * step / mult ** 0.25) * noise,
                         "reward/std": 0.4, "optim/grad_norm": noise, **_decomposition(replay, gspo, noise)})
    return rows


def _decomposition(replay: bool, gspo: bool, noise: float) -> dict:
    """The ratio decomposition's columns: routing makes up half of GRPO's log-ratio noise, less elsewhere."""
    route, weight = (1e-4 if replay or gspo else 1e-3) * noise, 1e-3 * noise
    return {"ratio/d_route_var": route, "ratio/d_weight_var": weight, "ratio/d_cov": 0.0,
            "ratio/routing_share": route / (route + weight), "ratio/route_extreme_frac": 1e-3 * noise,
            "ratio/route_clip_exit_frac": 1e-4 * noise}


def eval_rows(info: dict, steps: int, eval_every: int) -> list[dict]:
    rng = np.random.default_rng([info["seed"], 7, zlib.crc32(info["arm"].encode())])
    return [{**info, "step": s, "eval/acc_greedy": 0.3 + 0.01 * s + 0.02 * rng.standard_normal(),
             "eval/acc_sampled": 0.25 + 0.01 * s + 0.02 * rng.standard_normal(), "perf/eval_s": 0.5}
            for s in [*range(0, steps, eval_every), steps]]


def write_run(run_dir: Path, cfg: dict, arm: str, *, steps: int, minibatches: int, layers: int, eval_every: int,
              status: str = "done") -> Path:
    config = validate(from_dict(cfg))
    info = {"run_id": run_dir.name, "arm": arm, "algo": config.rl.algo, "replay": config.rl.replay,
            "seed": config.seed}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(config))
    (run_dir / "manifest.json").write_text(json.dumps({**info, "status": status, "reason": ""}))
    pd.DataFrame(metric_rows(info, to_dict(config), steps, minibatches, layers)).to_parquet(run_dir / "metrics.parquet")
    pd.DataFrame(eval_rows(info, steps, eval_every)).to_parquet(run_dir / "eval.parquet")
    return run_dir


def write_experiment(root: Path, arms: dict[str, dict], seeds=(0, 1, 2), *, steps: int = 8, minibatches: int = 2,
                     layers: int = 3, eval_every: int = 4) -> Path:
    """An experiment folder; arms maps an arm name (with its sweep label, if any) to its config overrides."""
    root = Path(root)
    base = _base(layers, steps, minibatches, eval_every)
    for arm, overrides in arms.items():
        for seed in seeds:
            cfg = _merge(_merge(base, overrides), {"seed": seed})
            write_run(root / "runs" / f"{arm}-s{seed}", cfg, arm, steps=steps, minibatches=minibatches,
                      layers=layers, eval_every=eval_every)
    (root / "experiment.yaml").write_text(json.dumps({"name": root.name, "arms": arms}))
    return root


def clip_sweep_arms() -> dict[str, dict]:
    return {f"{algo}__rl.clip_low={lo:g}__rl.clip_high={hi:g}": {"rl": {"algo": algo, "clip_low": lo, "clip_high": hi}}
            for algo, points in CLIP_POINTS.items() for lo, hi in points}


def volatility_sweep_arms() -> dict[str, dict]:
    return {f"{algo}__rl.router_lr_mult={m:g}": {"rl": {"algo": algo, "router_lr_mult": m}}
            for algo in ("grpo", "gspo") for m in LR_MULTS}


ATLAS_FACTORS = {"router_lr": {"x1": {}, "x10": {"rl.router_lr_mult": 10.0}},
                 "noise": {"0": {}, "0.1": {"rl.router_noise": 0.1}}}


def atlas_arms() -> dict[str, dict]:
    """A `factors` design's cells: every arm at the shared base and at each non-base level."""
    arms = {}
    for base in ("grpo", "grpo_r2", "grpo_r3", "gspo"):
        arms[f"{base}__base"] = PAPER_ARMS[base]
        arms[f"{base}__router_lr=x10"] = _merge(PAPER_ARMS[base], {"rl": {"router_lr_mult": 10.0}})
        arms[f"{base}__noise=0.1"] = _merge(PAPER_ARMS[base], {"rl": {"router_noise": 0.1}})
    return arms


def write_reference(root: Path, seeds=(0, 1)) -> Path:
    """A results/reference look-alike: paper/, clip_sweep/, volatility_sweep/, atlas/, instability/,
    stabilizers/, replay_rescue/, replay_map/."""
    root = Path(root)
    write_experiment(root / "paper", PAPER_ARMS, seeds)
    write_experiment(root / "clip_sweep", clip_sweep_arms(), seeds, steps=4)
    write_experiment(root / "volatility_sweep", volatility_sweep_arms(), seeds, steps=4)
    atlas = write_experiment(root / "atlas", atlas_arms(), (0,), steps=4)
    (atlas / "experiment.yaml").write_text(json.dumps({"name": "atlas", "factors": ATLAS_FACTORS}))
    write_experiment(root / "instability", PAPER_ARMS, seeds, steps=4)
    write_experiment(root / "stabilizers", {**PAPER_ARMS, "sapo": {"rl": {"algo": "sapo"}},
                                            "cispo": {"rl": {"algo": "cispo"}}}, seeds, steps=4)
    write_experiment(root / "replay_rescue", PAPER_ARMS, seeds, steps=4)
    map_arms = {f"{a}__{label}": _merge(PAPER_ARMS[a], over) for a in ("grpo", "grpo_r2", "gspo")
                for label, over in (("base", {}), ("top_k=2", {"model": {"top_k": 2}}))}
    replay = write_experiment(root / "replay_map", map_arms, seeds, steps=4)
    (replay / "experiment.yaml").write_text(json.dumps({"name": "replay_map",
                                                        "factors": {"top_k": {"1": {}, "2": {"model.top_k": 2}}}}))
    return root
