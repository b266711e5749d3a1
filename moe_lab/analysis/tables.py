"""Read experiment folders into tidy frames, and the reductions over steps and seeds (pandas only, no torch).

``moe_lab.analysis.results`` (the summary table) and ``moe_lab.analysis.stability`` build on it.

Layout read (written by the runner, see docs/metrics.md)::

    <experiment>/runs/<run_id>/{config.yaml, manifest.json, metrics.parquet, eval.parquet}

``load_runs`` gives one row per minibatch update (metrics) and one per evaluation (eval), each carrying
every resolved config field as a column named by its dotted path ("rl.clip_low", "model.num_experts"),
the manifest's "status" as moe_lab/store/run_folder.py reads it ('collapsed' for a run a collapse rule stopped,
including a 'failed' manifest that a collapse rule wrote without that status; 'unverified' for a finished manifest whose tables
do not hold the rows the run committed, which the runner runs again) and "reason", its "collapsed_at" (step, NaN = never) and "collapse_rule" ("" = none;
see moe_lab/store/health.py), and derived columns: "arm_base" (the arm without its sweep label), "factor" and
"level" (the label's field(s) and value(s): 'grpo__rl.router_noise=0.1' -> 'rl.router_noise', '0.1'; None
without a label), "rl.clip_low_resolved" / "rl.clip_high_resolved" (the clip range in force: a config's None
means the paper's default for the algorithm, which a sweep plot needs as a number).
A run folder whose manifest records no collapse fields (or a running or crashed run, whose manifest
is not final) gets them recomputed from its metrics table with its config's collapse rules (their
defaults where the config lacks them): the rules are a pure function of the logged rows, so this is
what the run would have recorded.
Nothing here unpickles: YAML goes through the safe loader (yaml_io.load_yaml), parquet through pandas/pyarrow.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from moe_lab.store import health
from moe_lab.analysis.stats import ci_columns
from moe_lab.config import upgrade_run_config
from moe_lab.config.constants import PAPER_CLIP
from moe_lab.store.run_folder import RunFolder, experiment_name, runs_under
from moe_lab.store.status import FINISHED, STATUS_FAILED
ID_COLUMNS = ("run_id", "arm", "algo", "replay", "seed")
RUN_KEYS = ("experiment", "run_id")  # a run is unique by these two when several experiments are loaded
SUMMARY_EVAL = ("eval/acc_greedy", "eval/acc_sampled")
SUMMARY_METRICS = ("clip_frac/active", "clip_frac/out_of_range", "ratio/token_var", "ratio/extreme_frac",
                   "routing/expert_change", "routing/expert_change_latent", "reward/mean")
ENV_RESULTS = "MOE_LAB_RESULTS"



# --------------------------------------------------------------------------- loading


def base_arm(arm: str) -> str:
    """The arm without its sweep label: 'grpo__rl.router_lr_mult=10' -> 'grpo'."""
    return str(arm).split("__", 1)[0]


def arm_factor_level(arm: str) -> tuple[str | None, str | None]:
    """The sweep label's factor and level: 'grpo__updates=16' -> ('updates', '16'); several fields join
    with '+' and ',' ('grpo__rl.clip_low=0.1__rl.clip_high=0.13' -> ('rl.clip_low+rl.clip_high', '0.1,0.13'));
    (None, None) without a label."""
    _, _, label = str(arm).partition("__")
    if not label:
        return None, None
    pairs = [p.partition("=") for p in label.split("__")]
    return "+".join(k for k, _, _ in pairs), ",".join(v for _, _, v in pairs)


def flatten(data: dict, prefix: str = "") -> dict:
    """{'rl': {'clip_low': 0.2}} -> {'rl.clip_low': 0.2}."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def find_run_dirs(path: str | Path) -> list[Path]:
    """Run folders under an experiment folder, a runs/ folder, or a run folder itself (which subfolders are runs:
    run_folder.runs_under, the runner's answer)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"path: {str(path)!r} is not a folder; expected an experiment folder, a runs/ folder "
                         "or a run folder")
    return runs_under(path)


def _read_run(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both frames of one run with its config/manifest columns; raises on a missing or unreadable file."""
    run = RunFolder(run_dir)
    if not run.manifest_path.is_file():
        raise FileNotFoundError(f"no {run.manifest_path.name}")
    config, manifest = run.config(upgraded=False), run.manifest
    metrics = pd.read_parquet(run.metrics_path)
    evals = pd.read_parquet(run.eval_path) if run.eval_path.exists() else pd.DataFrame()
    run_cols = {k: manifest.get(k) for k in ID_COLUMNS}
    run_cols.update({k: v for k, v in flatten(upgrade_run_config(config)).items() if k not in ID_COLUMNS})
    run_cols.update(status=run.verified_status(), reason=manifest.get("reason", ""),
                    experiment=experiment_name(run_dir), run_dir=str(run_dir))
    run_cols.update(_collapse(manifest, config, metrics))
    return _with_run_columns(metrics, run_cols), _with_run_columns(evals, run_cols)


def _collapse(manifest: dict, config: dict, metrics: pd.DataFrame) -> dict:
    """collapsed_at (NaN = never) and collapse_rule of a run: the manifest's where it is final, else
    recomputed from its rows. Not final: a manifest without the field, a
    running run, or one that failed on an exception (its manifest still holds the value from the start of
    that attempt, while its rows went on). ``manifest``: RunFolder.manifest."""
    status = manifest.get("status")
    final = status in FINISHED or (status == STATUS_FAILED and "traceback" not in manifest)
    if "collapsed_at" in manifest and final:
        at, rule = manifest["collapsed_at"], manifest.get("collapse_rule") or ""
    elif "reward/mean" in metrics and len(metrics):
        params = health.CollapseParams.from_config(config.get("rl") or {})
        order = [c for c in ("step", "minibatch") if c in metrics]
        state = health.replay(params, metrics.sort_values(order, kind="stable").to_dict("records"))
        at, rule = state.collapsed_at, state.collapse_rule
    else:
        at, rule = None, ""
    return {"collapsed_at": math.nan if at is None else float(at), "collapse_rule": rule}


def _with_run_columns(frame: pd.DataFrame, run_cols: dict) -> pd.DataFrame:
    # The rows' own id columns win where present (they are what the runner logged); config fields fill the rest.
    new = {k: [v] * len(frame) for k, v in run_cols.items() if k not in frame.columns}
    return pd.concat([frame.reset_index(drop=True), pd.DataFrame(new, index=range(len(frame)))], axis=1)


def _numeric_or_none(values: pd.Series) -> bool:
    present = values.dropna()
    return len(present) > 0 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present)


def _derived(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.copy()  # one consolidated block: the column inserts below would otherwise warn of fragmentation
    for col in frame.columns[frame.dtypes == object]:
        if _numeric_or_none(frame[col]):  # an optional number (rl.clip_low: None or a float): NaN stands for None
            frame[col] = frame[col].astype(float)
    if "arm" in frame:
        frame["arm_base"] = frame["arm"].map(base_arm)
        factor_level = frame["arm"].map(arm_factor_level)
        frame["factor"], frame["level"] = factor_level.str[0], factor_level.str[1]
    algo = frame.get("rl.algo", frame.get("algo"))
    for i, side in enumerate(("low", "high")):
        col = f"rl.clip_{side}"
        given = pd.to_numeric(frame[col], errors="coerce") if col in frame else pd.Series(np.nan, index=frame.index)
        default = algo.map(lambda a: PAPER_CLIP.get(a, (np.nan, np.nan))[i]) if algo is not None else np.nan
        frame[f"{col}_resolved"] = given.fillna(default).astype(float) if len(frame) else given.astype(float)
    return frame


def load_runs(path: str | Path | Sequence[str | Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(metrics_df, eval_df) of every readable run under path (or each path of a list).

    A run folder with a missing or unreadable config.yaml, manifest.json or metrics.parquet is skipped with
    a warning (e.g. a run killed before its first flush); a run without eval.parquet contributes no eval rows.
    """
    paths = [path] if isinstance(path, (str, Path, os.PathLike)) else list(path)
    metrics, evals = [], []
    for run_dir in (d for p in paths for d in find_run_dirs(p)):
        try:
            m, e = _read_run(run_dir)
        except Exception as exc:  # noqa: BLE001 - one unreadable run must not hide the others
            warnings.warn(f"skipping run {run_dir}: {type(exc).__name__}: {exc}", stacklevel=2)
            continue
        metrics.append(m)
        evals.append(e)
    if not metrics:
        warnings.warn(f"no readable runs under {', '.join(map(str, paths))}", stacklevel=2)
    return _concat(metrics), _concat(evals)


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in (*ID_COLUMNS, "step", "status")})
    return _derived(pd.concat(frames, ignore_index=True))


def reference_dir(sub: str = "", start: str | Path | None = None) -> Path:
    """results/reference (or $MOE_LAB_RESULTS) / sub: the env var wins, else the nearest results/reference
    found walking up from start (default: the working directory)."""
    env = os.environ.get(ENV_RESULTS)
    if env:
        return Path(env) / sub
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "results" / "reference").is_dir():
            return folder / "results" / "reference" / sub
    raise ValueError(f"{ENV_RESULTS}: not set and no results/reference above {here}; set it to a folder "
                     "holding paper/, clip_sweep/, volatility_sweep/")


# --------------------------------------------------------------------------- aggregation


def run_keys(df: pd.DataFrame) -> list[str]:
    return [c for c in RUN_KEYS if c in df.columns]


def check_columns(df: pd.DataFrame, cols: Iterable[str], arg: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{arg}: column(s) {missing} not in the frame; available: {sorted(map(str, df.columns))}")


def per_run_step(df: pd.DataFrame, metric: str, by: Sequence[str] = ("arm",)) -> pd.DataFrame:
    """One value per run and step: the mean of that step's minibatch rows (columns by, run keys, step, metric)."""
    by = list(by)
    check_columns(df, [*by, "step", metric, *run_keys(df)], "metric/by")
    keys = list(dict.fromkeys([*by, *run_keys(df), "step"]))
    return df.groupby(keys, dropna=False, sort=True)[metric].mean().reset_index()


def per_step(df: pd.DataFrame, metric: str, by: Sequence[str] = ("arm",)) -> pd.DataFrame:
    """Per group and step, the mean over runs (seeds) and its 95% band: columns by..., step, mean, lo, hi, n."""
    by = list(by)
    runs = per_run_step(df, metric, by)
    out = ci_columns(runs.groupby([*by, "step"], dropna=False, sort=True)[metric])
    return out.reset_index()


def last_frac_means(df: pd.DataFrame, metrics: Sequence[str], by: Sequence[str], last_frac: float) -> pd.DataFrame:
    """Per run, the mean of each metric over the last ceil(last_frac * steps) of that run's steps."""
    keys = list(dict.fromkeys([*by, *run_keys(df)]))
    present = [m for m in metrics if m in df.columns]
    steps = df.groupby(keys, dropna=False, sort=True)["step"]
    rank = steps.rank(method="dense", ascending=False)  # 1 = the run's last step
    n_keep = np.ceil(last_frac * steps.transform("nunique")).clip(lower=1)
    tail = df[rank <= n_keep]
    out = tail.groupby(keys, dropna=False, sort=True)[present].mean() if present else \
        tail.groupby(keys, dropna=False, sort=True).size().to_frame("_n").drop(columns="_n")
    return out.reindex(columns=list(metrics)).reset_index()


def final_values(df: pd.DataFrame, metrics: Sequence[str], by: Sequence[str]) -> pd.DataFrame:
    """Per run, each metric at that run's last logged step (e.g. the final evaluation)."""
    keys = list(dict.fromkeys([*by, *run_keys(df)]))
    present = [m for m in metrics if m in df.columns]
    last = df[df["step"] == df.groupby(keys, dropna=False)["step"].transform("max")]
    out = last.groupby(keys, dropna=False, sort=True)[present].mean()
    return out.reindex(columns=list(metrics)).reset_index()
