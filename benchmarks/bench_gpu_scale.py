"""A GPU-scale RL run: a MoE no CPU session here can train, GRPO vs GRPO + R2 vs GSPO (prints figures; not a test).

The main job's task and RL settings (experiments/paper.yaml) with a bigger policy: by default 16 layers,
hidden 1024, 64 experts of width 256, top-8 (0.85 B parameters, 0.14 B active per token). One cold
start (cached, shared by the arms), then each arm trains `--steps` RL steps in this process with the
runner's own `train`, so every figure comes from the run's metrics table. Per arm it prints the median
step time, response tokens per second, peak GPU memory, the mean fraction of activated experts changed
per update, the token-ratio variance and the clip fraction. A short run measures cost and routing
movement; it is too short to say which arm learns better.

    python benchmarks/bench_gpu_scale.py --out DIR [--steps 10] [--layers 16] [--hidden 1024] ...
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import pandas as pd
import torch

from moe_lab.config import apply_overrides, from_dict, load_yaml, validate
from moe_lab.launch.compose import compose
from moe_lab.rl.loop import train

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"grpo": ["rl.algo=grpo", "rl.replay=none"], "grpo_r2": ["rl.algo=grpo", "rl.replay=old"],
        "gspo": ["rl.algo=gspo", "rl.replay=none"]}


def model_overrides(a: argparse.Namespace) -> list[str]:
    return [f"model.num_layers={a.layers}", f"model.hidden_size={a.hidden}", f"model.num_heads={a.heads}",
            f"model.num_kv_heads={a.kv_heads}", f"model.num_experts={a.experts}", f"model.top_k={a.top_k}",
            f"model.moe_intermediate_size={a.expert_width}", f"model.intermediate_size={4 * a.hidden}",
            f"model.device={a.device}"]


def summarize(arm: str, run_dir: Path, peak_gib: float, wall_s: float) -> dict:
    df = pd.read_parquet(run_dir / "metrics.parquet")
    steps = df.groupby("step").first()  # perf/step_s and perf/tokens_per_s are per RL step
    return {"arm": arm, "steps": len(steps), "wall_s": round(wall_s, 1),
            "step_s_median": steps["perf/step_s"].median(), "tokens_per_s_median": steps["perf/tokens_per_s"].median(),
            "peak_gpu_gib": round(peak_gib, 2), "expert_change_mean": df["routing/expert_change"].mean(),
            # under replay expert_change is the forced routing's (0 by construction); the router's own drift:
            "expert_change_latent_mean": df.get("routing/expert_change_latent", df["routing/expert_change"]).mean(),
            "token_ratio_var_max": df["ratio/token_var"].max(), "clip_active_mean": df["clip_frac/active"].mean(),
            "reward_first": steps["reward/mean"].iloc[0], "reward_last": steps["reward/mean"].iloc[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--coldstart-steps", type=int, default=300)
    ap.add_argument("--coldstart-lr", type=float, default=1e-3)
    ap.add_argument("--cache", type=Path, help="cold-start cache folder (default OUT/coldstart)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: only to try the script at toy size")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu_scale: no CUDA device visible (this benchmark runs on a GPU only)")
    base = compose(load_yaml(str(ROOT / "experiments" / "paper.yaml")))["base"]  # the organism under the base
    common = [*model_overrides(a), f"rl.steps={a.steps}", f"rl.eval_every={a.steps}",
              f"coldstart.max_steps={a.coldstart_steps}", f"coldstart.lr={a.coldstart_lr}", "coldstart.eval_every=20",
              f"coldstart.cache_dir={a.cache or a.out / 'coldstart'}",
              f"rl.checkpoint_every={a.steps}"]
    where = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"torch {torch.__version__} cuda {torch.version.cuda} on {where}; "
          f"model: {' '.join(model_overrides(a))}; {a.steps} RL steps per arm", flush=True)
    rows = []
    for arm in a.arms.split(","):
        cfg = validate(from_dict(apply_overrides(base, [*common, *ARMS[arm]])))
        if a.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        status = train(cfg, a.out / arm, run_id=f"{arm}-s0", arm=arm)
        wall = time.perf_counter() - t0
        shutil.rmtree(a.out / arm / "checkpoint", ignore_errors=True)  # ~10 GB at the default size: keep the tables only
        row = summarize(arm, a.out / arm, (torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else float("nan")), wall)
        row["status"] = status
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(a.out / "summary.csv", index=False)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
