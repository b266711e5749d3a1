"""The RL loop end to end on a tiny model: schema, replay exactness, determinism, resume after SIGKILL."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from moe_lab.store import health
from moe_lab.config import apply_overrides, from_dict, load_yaml, validate
from moe_lab.launch.experiment import expand
from moe_lab.algos.ratio_metrics import DECOMP_KEYS
from moe_lab.launch.runner import run_experiment
from moe_lab.rl.loop import TrainState, train

ROOT = Path(__file__).resolve().parents[1]
SMOKE = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
TIMING = [c for c in ("perf/rollout_s", "perf/old_s", "perf/update_s", "perf/step_s", "perf/tokens_per_s",
                      "perf/wall_s", "perf/eval_s")]
REQUIRED = ["run_id", "arm", "algo", "replay", "seed", "step", "epoch", "minibatch", "update", "loss",
            "clip_frac/out_of_range", "clip_frac/active", "clip_frac/low", "clip_frac/high", "clip_frac/seq",
            "ratio/token_mean", "ratio/token_var", "ratio/logratio_var", "ratio/seq_mean", "ratio/seq_var",
            "ratio/extreme_frac", "kl/k3", "routing/expert_change", "routing/expert_change_latent",
            "routing/any_change", "routing/layer_0/expert_change", "routing/layer_1/expert_change",
            "routing/load_max_violation", "routing/router_shift", "routing/layer_0/router_shift",
            "routing/layer_1/router_shift", "reward/mean", "reward/std", "reward/zero_var_groups",
            "response/length_mean", "policy/entropy", "optim/grad_norm", "optim/lr", "perf/tokens_per_s",
            "perf/wall_s", "mismatch/k3", "mismatch/extreme_frac", "mismatch/expert_change"]


def tiny(tmp_path: Path, *overrides: str):
    data = apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}",
                                           "task.partial_credit=true", *overrides])
    return validate(from_dict(data))


def _table(run_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "metrics.parquet").drop(columns=TIMING, errors="ignore")


def _documented(column: str, table: str) -> bool:
    generic = re.sub(r"_l\d+$", "_l{l}", re.sub(r"layer_\d+", "layer_{i}", column))
    generic = re.sub(r"^reward/mean_\w+$", "reward/mean_{task}", generic)  # a mixture's sub-task rewards
    return f"`{generic}`" in table or f"`{column}`" in table


def test_smoke_every_arm_has_the_schema_and_finite_values(tmp_path):
    table = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    exp = dict(SMOKE, base=apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}"]))
    statuses = run_experiment(exp, tmp_path / "smoke", jobs=1, progress=False, echo=lambda *_: None)
    assert set(statuses.values()) == {"done"}, statuses
    for cell in expand(exp):
        df = pd.read_parquet(tmp_path / "smoke" / "runs" / cell.run_id / "metrics.parquet")
        # without an old-policy forward (rl.old_logp=rollout) there is no rollout-vs-train mismatch to measure
        required = [c for c in REQUIRED if cell.config.rl.old_logp == "old_forward" or not c.startswith("mismatch/")]
        missing = [c for c in required if c not in df.columns]
        assert not missing, f"{cell.run_id} lacks {missing}"
        rl = cell.config.rl
        assert len(df) == 3 * rl.minibatches * rl.epochs  # steps x updates per rollout batch
        undocumented = [c for c in df.columns if not _documented(c, table)]
        assert not undocumented, f"columns missing from docs/metrics.md: {undocumented}"
        # the ratio decomposition runs on every rl.decomp_every-th update (u + 1 divisible by it), NaN elsewhere
        every = cell.config.rl.decomp_every
        runs = (df["update"] + 1) % every == 0 if every else pd.Series(False, index=df.index)
        for col in DECOMP_KEYS:
            assert df.loc[runs, col].map(math.isfinite).all() and df.loc[~runs, col].isna().all(), (cell.run_id, col)
        # a mixture's reward/mean_{task} is NaN in a step that drew none of that sub-task (documented)
        per_task = [c for c in df.columns if c.startswith("reward/mean_")]
        assert all(df[c].notna().any() for c in per_task), cell.run_id
        numeric = df.drop(columns=[*DECOMP_KEYS, *per_task]).select_dtypes("number")
        assert numeric.notna().all().all() and numeric.map(math.isfinite).all().all(), cell.run_id
        ev = pd.read_parquet(tmp_path / "smoke" / "runs" / cell.run_id / "eval.parquet")
        assert list(ev["step"]) == [0, 2, 3]


@pytest.mark.parametrize("replay,dtype", [("old", "float32"), ("rollout", "bfloat16")])
def test_replay_first_minibatch_is_exactly_on_policy(tmp_path, replay, dtype):
    """Before any update the forced routing is the one logp_old was computed with: ratio 1, no change.

    With a bf16 rollout, R3 forces routing that differs from the trainer's free choice; it holds only
    because the old-policy forward follows the rollout routing too.
    """
    # One minibatch: the first update sees the whole rollout batch, as the old-policy pass did.
    # 128 responses: enough tokens for the bf16 rollout's routing to differ from the trainer's somewhere.
    cfg = tiny(tmp_path, f"rl.replay={replay}", f"rl.rollout_dtype={dtype}", "rl.steps=1", "rl.minibatches=1",
               "rl.prompts_per_step=16", "rl.group_size=8")
    train(cfg, tmp_path / "run", run_id="r")
    first = pd.read_parquet(tmp_path / "run" / "metrics.parquet").iloc[0]
    # routing/expert_change is 0 by construction under replay (the forced routing against itself); what can
    # fail is the router's own (latent) choice before any update:
    if replay == "old":  # same weights, same inputs: it is the recorded old-policy routing
        assert first["routing/expert_change_latent"] == 0.0
    else:  # it is the trainer's free routing, whose distance to the rollout's is mismatch/expert_change
        assert first["mismatch/expert_change"] > 0  # so ratio 1 below is not a trivial consequence of equal routings
        assert first["routing/expert_change_latent"] == pytest.approx(first["mismatch/expert_change"], abs=1e-12)
    assert first["routing/router_shift"] == pytest.approx(0.0, abs=1e-6)  # router not moved yet
    assert first["ratio/token_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["ratio/token_var"] == pytest.approx(0.0, abs=1e-10)
    assert first["clip_frac/out_of_range"] == 0.0


def test_fp32_rollout_routing_equals_old_policy_routing_so_r3_equals_r2(tmp_path):
    """generate() with the KV cache and the teacher-forced forward route identically in fp32."""
    tables = {}
    for mode in ("old", "rollout"):
        train(tiny(tmp_path, f"rl.replay={mode}", "rl.steps=2"), tmp_path / mode, run_id="x")
        tables[mode] = _table(tmp_path / mode).drop(columns=["replay"])
    assert (tables["old"]["mismatch/expert_change"] == 0).all()
    pd.testing.assert_frame_equal(tables["old"], tables["rollout"])


@pytest.mark.parametrize("replay", ["none", "rollout"])
def test_loss_gets_the_router_gamma_of_its_own_forward(tmp_path, monkeypatch, replay):
    """Each update passes policy_loss exp(-shift) of that very forward (RSPO's gamma): the logged
    routing/router_shift is its masked mean of -log gamma; spying on the call changes no metric."""
    import moe_lab.rl.step as step

    cfg = tiny(tmp_path, f"rl.replay={replay}", "rl.steps=2")
    train(cfg, tmp_path / "plain", run_id="p")
    seen = []

    real_loss = step.policy_loss

    def spying_loss(*args, **kwargs):
        seen.append((kwargs["router_gamma_BT"], args[3]))
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(step, "policy_loss", spying_loss)
    train(cfg, tmp_path / "gamma", run_id="p")
    table = _table(tmp_path / "gamma")
    pd.testing.assert_frame_equal(table, _table(tmp_path / "plain"))
    assert len(seen) == len(table) == 4
    for (gamma_BT, mask_BT), logged in zip(seen, table["routing/router_shift"]):
        assert bool(((gamma_BT > 0) & (gamma_BT <= 1)).all()) and bool((gamma_BT[~mask_BT] == 1).all())
        assert float(-gamma_BT.log()[mask_BT].mean()) == pytest.approx(logged, rel=1e-4, abs=1e-6)
    first = table["minibatch"] == 0  # each step's first update: the router is still the old pass's one
    assert (table.loc[first, "routing/router_shift"].abs() < 1e-6).all()
    assert (table.loc[~first, "routing/router_shift"] > 0).all()  # the optimizer step moved the routers


def test_gspo_clips_more_than_grpo_at_the_papers_ranges(tmp_path):
    means = {}
    for algo in ("grpo", "gspo"):
        cfg = tiny(tmp_path, f"rl.algo={algo}", "rl.steps=2", "rl.minibatches=4", "rl.group_size=8",
                   "rl.prompts_per_step=4")
        train(cfg, tmp_path / algo, run_id=algo)
        means[algo] = pd.read_parquet(tmp_path / algo / "metrics.parquet")["clip_frac/active"].mean()
    assert means["gspo"] > means["grpo"], means


def test_same_seed_gives_identical_tables(tmp_path):
    cfg = tiny(tmp_path, "rl.algo=gspo_token", "rl.steps=2")
    train(cfg, tmp_path / "a", run_id="x")
    train(cfg, tmp_path / "b", run_id="x")
    pd.testing.assert_frame_equal(_table(tmp_path / "a"), _table(tmp_path / "b"))
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert (manifest["collapsed_at"], manifest["collapse_rule"]) == (None, None)  # a healthy run: no collapse


def _launch(cfg_path: Path, run_dir: Path) -> subprocess.Popen:
    code = ("import sys; from moe_lab.config import from_dict, load_yaml; from moe_lab.rl.loop import train; "
            "train(from_dict(load_yaml(sys.argv[1])), sys.argv[2], run_id='k')")
    return subprocess.Popen([sys.executable, "-c", code, str(cfg_path), str(run_dir)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def kill_and_resume(cfg, tmp_path: Path) -> Path:
    """Run cfg uninterrupted into tmp_path/ref, then in a subprocess SIGKILLed at its first checkpoint and
    resumed in-process into tmp_path/killed; assert both tables (timing aside) are equal. Returns the
    names of the files the killed run's checkpoint held when it was killed."""
    from moe_lab.config import dump_yaml

    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(dump_yaml(cfg))
    train(cfg, tmp_path / "ref", run_id="k")  # also warms the cold-start cache
    proc = _launch(cfg_path, tmp_path / "killed")
    marker = tmp_path / "killed" / "checkpoint" / "state.json"
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run never reached its first checkpoint"
    done_steps = pd.read_parquet(tmp_path / "killed" / "metrics.parquet")["step"].max()
    assert done_steps < cfg.rl.steps - 1, "killed too late to test resuming"
    checkpointed = {p.name for p in marker.parent.iterdir()}
    train(cfg, tmp_path / "killed", run_id="k")
    pd.testing.assert_frame_equal(_table(tmp_path / "ref"), _table(tmp_path / "killed"))
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "ref" / "eval.parquet").drop(columns=TIMING, errors="ignore"),
                                  pd.read_parquet(tmp_path / "killed" / "eval.parquet").drop(columns=TIMING, errors="ignore"))
    return checkpointed


@pytest.mark.parametrize("overrides", [("rl.replay=rollout",),
                                       # PR2's predictor heads live in the model's buffers: saved and resumed with it
                                       ("rl.replay=predictive", "rl.replay_gate=0.5", "rl.router_lr_mult=10"),
                                       # a new objective with rollout correction: nothing of either lives outside the checkpoint
                                       ("rl.algo=sapo", "rl.rollout_correction=icepop", "rl.rollout_dtype=bfloat16")])
def test_sigkill_mid_run_resumes_to_the_uninterrupted_table(tmp_path, overrides):
    cfg = tiny(tmp_path, "rl.steps=8", "rl.checkpoint_every=2", "rl.eval_every=3", *overrides,
               *HAIR_TRIGGER)  # the health state must survive the resume too
    kill_and_resume(cfg, tmp_path)
    ref, killed = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("ref", "killed"))
    assert ref["collapsed_at"] is not None and ref["status"] == "done"
    assert (killed["collapsed_at"], killed["collapse_rule"]) == (ref["collapsed_at"], ref["collapse_rule"])


# Soft reward rule on a hair trigger: any step whose reward is below 99% of the best so far fires it.
HAIR_TRIGGER = ("rl.collapse_window=1", "rl.collapse_drop=0.99", "rl.collapse_patience=1", "rl.collapse_min_best=0")


def test_soft_collapse_is_recorded_and_stops_the_run_only_when_asked(tmp_path):
    go_on = train(tiny(tmp_path, "rl.steps=4", *HAIR_TRIGGER), tmp_path / "go_on", run_id="x")
    stop = train(tiny(tmp_path, "rl.steps=4", *HAIR_TRIGGER, "rl.stop_on_collapse=true"), tmp_path / "stop",
                 run_id="x")
    rows = pd.read_parquet(tmp_path / "go_on" / "metrics.parquet").to_dict("records")
    expected = health.replay(health.CollapseParams(window=1, drop=0.99, patience=1, min_best=0.0), rows)
    manifest = json.loads((tmp_path / "go_on" / "manifest.json").read_text())
    assert expected.collapse_rule == "reward_drop" and 0 < expected.collapsed_at < 3, "pick a tighter trigger"
    assert (go_on, manifest["collapsed_at"], manifest["collapse_rule"]) == ("done", expected.collapsed_at,
                                                                            "reward_drop")
    assert manifest["steps_done"] == 4
    stopped = json.loads((tmp_path / "stop" / "manifest.json").read_text())
    assert stop == stopped["status"] == "collapsed"  # final, like 'done': a stop by a collapse rule is a result
    assert stopped["reason"].startswith(f"reward collapsed at step {expected.collapsed_at}")
    assert stopped["collapsed_at"] == expected.collapsed_at and stopped["steps_done"] == expected.collapsed_at + 1
    cut = _table(tmp_path / "go_on")
    pd.testing.assert_frame_equal(_table(tmp_path / "stop"), cut[cut["step"] <= expected.collapsed_at])
    # the stopped run's last evaluation is of the policy it stopped with, at the step after its last update
    evals = pd.read_parquet(tmp_path / "stop" / "eval.parquet")
    assert evals["step"].tolist()[-1] == expected.collapsed_at + 1



def test_train_refuses_a_folder_holding_another_config(tmp_path):
    from moe_lab.config import ConfigError

    train(tiny(tmp_path, "rl.steps=1"), tmp_path / "run", run_id="a")
    with pytest.raises(ConfigError, match="different config"):
        train(tiny(tmp_path, "rl.steps=1", "rl.algo=gspo"), tmp_path / "run", run_id="a")


def test_existing_run_folder_is_not_overwritten_silently(tmp_path):
    from moe_lab.config import ConfigError

    base = apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp_path / 'cache'}", "rl.steps=1"])
    exp = {"base": base, "arms": {"grpo": {}}, "seeds": [0]}
    run_experiment(exp, tmp_path / "e", jobs=1, progress=False, echo=lambda *_: None)
    with pytest.raises(ConfigError, match="--overwrite"):
        run_experiment(exp, tmp_path / "e", jobs=1, progress=False, overrides=["rl.lr=0.5"], echo=lambda *_: None)
    lines = []
    run_experiment(exp, tmp_path / "e", jobs=1, progress=False, echo=lines.append)
    assert "1 done" in lines[0]


def test_train_state_reads_and_writes_the_same_state_json_keys():
    """Checkpoint compatibility: a fresh state is the dict runs always wrote; a saved state (with the keys other
    writers add, world_size and tables) comes back unchanged, key order included."""
    assert TrainState().to_dict() == {"step": 0, "rows": 0, "eval_rows": 0, "wall_s": 0.0}
    saved = {"step": 4, "rows": 8, "eval_rows": 2, "wall_s": 1.5, "world_size": 2,
             "tables": {"metrics.parquet": {"rows": 8, "sha256": "ab"}}}
    state = TrainState.from_dict(saved)
    assert (state.step, state.rows, state.eval_rows, state.wall_s) == (4, 8, 2, 1.5)
    assert list(state.to_dict().items()) == list(saved.items())
    assert TrainState.from_dict(None) == TrainState()
