"""Data-parallel RL under torchrun (gloo, CPU): 2 ranks give the 1-rank table; resume; refusals.

Tolerance: 1 and 2 ranks reorder sums (DDP averages two half-batch gradients, metrics are combined from
per-rank parts) and run matmuls on other batch shapes, so values agree to float32 rounding, and how far
depends on the processor's kernels (the suite also runs under ATEN_CPU_CAPABILITY=avx2, MKL_CBWR=COMPATIBLE,
ONEDNN_MAX_CPU_ISA=AVX2, .ci/run). Each kind of quantity gets the tolerance its computation justifies:
- sums and means of like-signed terms (losses, ratios, shares, expert change, grad norm): rtol 1e-5, about
  a hundred float32 ulps (measured <= 1.3e-7 relative with the default kernels);
- means of log-prob differences (the ratio decomposition's d_route/d_weight means, router shift): their terms
  nearly cancel, so a relative tolerance measures the cancellation, not the error; absolute 1e-6, ten float32
  ulps of a log-prob of a few nats (measured: <= 2.8e-8 under both kernel settings, where rtol 1e-5 failed at
  1.2e-4 and 8e-4 relative under the avx2/COMPATIBLE kernels and on an Intel Xeon);
- variances, whose combination subtracts two nearly equal numbers: atol 1e-9 (measured <= 3e-10).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from moe_lab.store import health
from moe_lab.config import ConfigError, apply_overrides, from_dict, load_yaml, validate
from moe_lab.rl.distributed import (check_data_parallel, combine_metrics, group_minibatch_indices, rank_groups,
                                 _resume_state)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = load_yaml(str(ROOT / "experiments" / "smoke.yaml"))
# exact combinations (see moe_lab/rl/dp_split.py); load_* and logratio_var are rank-averaged approximations
COMPARED = ["loss", "ratio/token_mean", "ratio/seq_mean", "ratio/extreme_frac", "clip_frac/out_of_range",
            "clip_frac/seq", "kl/k3", "routing/expert_change", "routing/expert_change_latent", "routing/any_change",
            "reward/mean", "reward/std", "reward/zero_var_groups", "response/length_mean", "policy/entropy",
            "optim/grad_norm", "mismatch/k3", "mismatch/expert_change"]
VARS = ["ratio/token_var", "ratio/seq_var"]
# compared where the run logs them: RSPO's gamma, rollout correction, first divergence
OPTIONAL = ["objective/rspo_gamma_mean", "objective/rspo_floor_frac", "rollout_corr/weight_mean",
            "rollout_corr/weight_max", "rollout_corr/truncated_frac", "rollout_corr/masked_frac", "rollout_corr/ess",
            "ratio/d_route_var", "ratio/d_weight_var", "ratio/d_cov",
            "routing/first_div_none", "routing/first_div_l0", "routing/first_div_l1"]
# means of log-prob differences (nearly cancelling terms): compared with an absolute tolerance only
LOGP_DIFF_MEANS = ["ratio/d_route_mean", "ratio/d_weight_mean", "routing/router_shift",
                   "routing/layer_0/router_shift", "routing/layer_1/router_shift"]
# the new columns' paths: stale epochs, a lagged bf16 rollout corrected by TIS, R3 (old trace = a copy of the
# rollout trace carrying the old router log-probs), RSPO's router-shift weight
CASES = {"default": (), "epochs_tis_rspo": ("rl.epochs=2", "rl.rollout_correction=tis_token",
                                            "rl.rollout_dtype=bfloat16", "rl.algo=rspo", "rl.replay=rollout",
                                            "rl.rollout_lag=1")}


def write_config(tmp: Path, *overrides: str) -> Path:
    data = apply_overrides(SMOKE["base"], [f"coldstart.cache_dir={tmp / 'cache'}", "rl.steps=2", *overrides])
    validate(from_dict(data))
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def torchrun(nproc: int, config: Path, out: Path, **kw) -> subprocess.CompletedProcess | subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "moe_lab.train", str(config), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **kw.pop("env", {})}
    if kw.pop("background", False):
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def assert_same_tables(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert len(a) == len(b) > 0
    assert list(a["update"]) == list(b["update"]) and list(a["epoch"]) == list(b["epoch"])
    for col in COMPARED + [c for c in OPTIONAL if c in a.columns]:
        np.testing.assert_allclose(a[col].to_numpy(float), b[col].to_numpy(float), rtol=1e-5, atol=1e-8,
                                   err_msg=col)
    for col in [c for c in LOGP_DIFF_MEANS if c in a.columns]:
        np.testing.assert_allclose(a[col].to_numpy(float), b[col].to_numpy(float), rtol=0, atol=1e-6, err_msg=col)
    for col in VARS:
        np.testing.assert_allclose(a[col].to_numpy(float), b[col].to_numpy(float), rtol=0, atol=1e-9, err_msg=col)


@pytest.fixture(scope="module", params=list(CASES))
def dp_runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"dp_{request.param}")
    config = write_config(tmp, *CASES[request.param])
    outs = {}
    for n in (1, 2):
        proc = torchrun(n, config, tmp / f"w{n}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        outs[n] = tmp / f"w{n}"
    return config, outs, request.param


def test_two_ranks_give_the_one_rank_table(dp_runs):
    _, outs, case = dp_runs
    one, two = (pd.read_parquet(outs[n] / "metrics.parquet") for n in (1, 2))
    assert_same_tables(one, two)
    # the comparison is not vacuous: the policy moved and its routing changed after the first update
    assert (one["routing/expert_change_latent"] > 0).any() and (one["ratio/token_mean"] != 1).any()
    assert (one["routing/router_shift"] > 0).any()
    if "rl.epochs=2" in CASES[case]:
        assert set(one["epoch"]) == {0, 1} and one["update"].tolist() == list(range(len(one)))
        assert (one["rollout_corr/weight_mean"] != 1).any() and (one["objective/rspo_gamma_mean"] < 1).any()
    for n in (1, 2):
        assert sorted(p.name for p in outs[n].iterdir()) >= ["checkpoint", "config.yaml", "eval.parquet",
                                                             "manifest.json", "metrics.parquet"]
    # the health rules of train.py, on the global rows: the same verdict in the manifest, 1 or 2 ranks
    manifests = [json.loads((outs[n] / "manifest.json").read_text()) for n in (1, 2)]
    health_now = health.replay(health.CollapseParams.from_config(validate(from_dict(SMOKE["base"])).rl),
                               one.to_dict("records")).manifest()
    for m in manifests:
        assert m["status"] == "done" and {k: m[k] for k in health_now} == health_now


def test_a_plain_run_is_a_one_rank_torchrun(dp_runs, tmp_path):
    """moe-lab run samples every prompt group under its own seed and takes the same group-local minibatches as
    torchrun: a plain run's tables equal the 1-rank torchrun's bit for bit (timings and the run id aside)."""
    from moe_lab.rl.distributed import load_run_config
    from moe_lab.rl.loop import train

    config, outs, _ = dp_runs
    assert train(load_run_config(str(config), []), tmp_path / "plain", run_id=outs[1].name) == "done"
    for table in ("metrics.parquet", "eval.parquet"):
        a, b = pd.read_parquet(outs[1] / table), pd.read_parquet(tmp_path / "plain" / table)
        timing = [c for c in a.columns if c.startswith("perf/")]
        pd.testing.assert_frame_equal(a.drop(columns=timing), b.drop(columns=timing), check_exact=True)
    manifest = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    assert manifest["status"] == "done" and "world_size" not in manifest


@pytest.mark.slow
def test_other_world_size_is_refused_on_resume(dp_runs):
    config, outs, _ = dp_runs
    proc = torchrun(2, config, outs[1])
    assert proc.returncode != 0
    assert "written by world size 1; resuming it with world size 2" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_resume_after_sigkill_of_one_rank_reproduces_the_table(dp_runs, tmp_path):
    # with rl.rollout_lag the checkpoint carries the lag queue that every rank reloads
    config = write_config(tmp_path, *CASES[dp_runs[2]], "rl.steps=8", "rl.checkpoint_every=1")
    whole = tmp_path / "whole"
    assert torchrun(2, config, whole).returncode == 0
    run = tmp_path / "killed"
    proc = torchrun(2, config, run, background=True)
    state = run / "checkpoint" / "state.json"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None and not state.exists():
        time.sleep(0.02)
    # freeze torchrun and both ranks at once (their own session) so that the kill cannot race the run's end
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        assert state.exists(), "no checkpoint appeared"
        workers = _children_running_moe_lab(proc.pid)
        assert len(workers) == 2, f"ranks found under torchrun: {workers}"
        os.kill(workers[-1], signal.SIGKILL)  # one rank dies: torchrun ends the other and fails
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # a failed test leaves nothing stopped or running
        raise
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    partial = pd.read_parquet(run / "metrics.parquet")
    assert 0 < len(partial) < len(pd.read_parquet(whole / "metrics.parquet"))
    assert torchrun(2, config, run).returncode == 0
    a, b = pd.read_parquet(whole / "metrics.parquet"), pd.read_parquet(run / "metrics.parquet")
    assert_same_tables(a, b)
    timing = ["run_id", *(c for c in a.columns if c.startswith("perf/"))]
    # same world size, same seeds: bit-identical apart from timings (and the folder name)
    pd.testing.assert_frame_equal(a.drop(columns=timing), b.drop(columns=timing))


def test_nan_on_one_rank_ends_every_rank_at_once(tmp_path):
    """Rank 1 alone sees a NaN loss (MOE_LAB_TEST_NAN_RANK): without the all-reduced flag it would stop its
    updates and wait in the metrics gather while rank 0 waits in the next update's gradient all-reduce (a hang
    until the 30-minute process-group timeout). Both ranks stop at the same update; the run is collapsed."""
    config = write_config(tmp_path, "rl.steps=3")
    t0 = time.monotonic()
    proc = torchrun(2, config, tmp_path / "out", background=True,
                    env={"MOE_LAB_TEST_NAN_RANK": "1", "MOE_LAB_TEST_NAN_STEP": "1"})
    try:
        stdout, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the hang: leave nothing running
        proc.communicate()
        pytest.fail("a NaN on one rank hung the run")
    # torchrun's 0: every rank returned 0, i.e. a finished status on each (1 would be 'failed')
    assert proc.returncode == 0, stdout
    assert time.monotonic() - t0 < 150
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["status"], manifest["collapse_rule"], manifest["collapsed_at"]) == ("collapsed", "non_finite", 1)
    rows = pd.read_parquet(tmp_path / "out" / "metrics.parquet")
    # step 0 whole (2 updates), then step 1's first update only, with rank 1's NaN in the combined loss
    assert rows["step"].tolist() == [0, 0, 1] and rows["loss"].iloc[:2].map(math.isfinite).all()
    assert math.isnan(rows["loss"].iloc[2]) and manifest["steps_done"] == 2


def test_combined_metrics_keep_a_ranks_non_finite_value():
    """grad_norm is the same on every rank, unless one rank's is NaN/inf: the global row must show it."""
    part = {"loss": 1.0, "optim/grad_norm": 2.0, "step": 0}
    assert combine_metrics([(part, 1.0, 1.0), (part, 1.0, 1.0)])["optim/grad_norm"] == 2.0
    bad = {**part, "optim/grad_norm": math.inf}
    assert combine_metrics([(part, 1.0, 1.0), (bad, 1.0, 1.0)])["optim/grad_norm"] == math.inf
    assert math.isnan(combine_metrics([(part, 1.0, 1.0), ({**part, "loss": math.nan}, 1.0, 1.0)])["loss"])


def _children_running_moe_lab(root_pid: int) -> list[int]:
    """Worker pids under torchrun (its descendants whose command line runs moe_lab.train)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat[1]) == root_pid and "moe_lab.train" in cmd:
            found.append(int(p.name))
    return sorted(found)


# ----------------------------------------------------------------------------- pure pieces


def test_minibatches_do_not_depend_on_the_split():
    """Global minibatch m = the same sequences, whether one rank holds all groups or two hold half each."""
    G, M, n = 4, 2, 4
    one = group_minibatch_indices(rank_groups(n, 0, 1), G, M, seed=3, step=5)
    for m in range(M):
        split = []
        for rank in range(2):
            groups = rank_groups(n, rank, 2)
            idx_B = group_minibatch_indices(groups, G, M, seed=3, step=5)[m]
            split += (idx_B + groups.start * G).tolist()  # local index -> global index
        assert sorted(split) == sorted(one[m].tolist())
        assert len(one[m]) == n * G // M


def test_combined_metrics_equal_the_whole_batch_ones():
    rng = np.random.default_rng(0)
    x = [rng.normal(size=k) for k in (3, 7, 5)]  # per-part token values
    parts = [({"ratio/token_mean": v.mean(), "ratio/token_var": v.var(), "loss": v.sum(), "response/length_max": len(v),
               "reward/mean": v.mean(), "reward/std": v.std(), "perf/update_s": float(i)}, 2.0, float(len(v)))
             for i, v in enumerate(x)]
    out = combine_metrics(parts)
    allx = np.concatenate(x)
    assert math.isclose(out["ratio/token_mean"], allx.mean(), rel_tol=1e-12)
    assert math.isclose(out["ratio/token_var"], allx.var(), rel_tol=1e-12)
    assert math.isclose(out["loss"], np.mean([v.sum() for v in x]), rel_tol=1e-12)  # sequence-weighted
    assert out["response/length_max"] == 7 and out["perf/update_s"] == 2.0
    seq_means = np.array([v.mean() for v in x])  # reward/*: every part is 2 sequences (weights 2, 2, 2)
    assert math.isclose(out["reward/mean"], seq_means.mean(), rel_tol=1e-12)
    want_std = math.sqrt(np.mean([v.std() ** 2 + v.mean() ** 2 for v in x]) - seq_means.mean() ** 2)
    assert math.isclose(out["reward/std"], want_std, rel_tol=1e-12)


def test_combined_ess_equals_the_whole_batch_ess():
    """rollout_corr/ess is not a mean: it is recombined exactly from each part's weight mean, ESS and tokens."""
    import torch

    from moe_lab.algos.rollout_correction import rollout_correction

    g = torch.Generator().manual_seed(0)
    mask_BT = torch.rand(6, 9, generator=g) > 0.3
    old_BT, roll_BT = -torch.rand(6, 9, generator=g) * 3, -torch.rand(6, 9, generator=g) * 3
    _, whole = rollout_correction(old_BT, roll_BT, mask_BT, mode="tis_token")
    parts = []
    for part in (slice(0, 1), slice(1, 4), slice(4, 6)):
        _, m = rollout_correction(old_BT[part], roll_BT[part], mask_BT[part], mode="tis_token")
        parts.append(({k: float(v) for k, v in m.items()}, 1.0, float(mask_BT[part].sum())))
    out = combine_metrics(parts)
    for key in ("rollout_corr/ess", "rollout_corr/weight_mean", "rollout_corr/weight_max",
                "rollout_corr/truncated_frac"):
        assert math.isclose(out[key], float(whole[key]), rel_tol=1e-6), key
    assert not math.isclose(out["rollout_corr/ess"], np.mean([p[0]["rollout_corr/ess"] for p in parts]),
                            rel_tol=1e-3)  # a plain mean would be wrong here


@pytest.mark.parametrize("override, field", [("rl.prompts_per_step=3", "rl.prompts_per_step"),
                                             ("rl.group_size=3", "rl.group_size"),
                                             ("rl.loss_agg=token-mean", "rl.loss_agg"),
                                             ("rl.whiten=batch", "rl.whiten"),
                                             ("rl.replay=predictive", "rl.replay"),
                                             ("rl.rollout_seeding=sequential", "rl.rollout_seeding")])
def test_what_cannot_split_is_refused_in_one_line(override, field):
    cfg = validate(from_dict(apply_overrides(SMOKE["base"], [override])))
    with pytest.raises(ConfigError, match=field) as err:
        check_data_parallel(cfg, 2)
    assert "\n" not in str(err.value)


def test_checkpoint_of_other_world_size_is_refused(monkeypatch, tmp_path):
    from moe_lab.rl import distributed

    saved = {"step": 2, "rows": 4, "eval_rows": 1, "wall_s": 0.5}
    monkeypatch.setattr(distributed.checkpoint, "load", lambda *a: {**saved, "world_size": 2})
    assert _resume_state(tmp_path, None, None, 2).to_dict() == {**saved, "world_size": 2}
    with pytest.raises(ConfigError, match="world size 2; resuming it with world size 1"):
        _resume_state(tmp_path, None, None, 1)
    monkeypatch.setattr(distributed.checkpoint, "load", lambda *a: saved)
    with pytest.raises(ConfigError, match="single-process run"):
        _resume_state(tmp_path, None, None, 1)


def test_overrides_may_follow_out(tmp_path):
    from moe_lab.rl.distributed import build_parser, load_run_config

    args = build_parser().parse_intermixed_args([str(write_config(tmp_path)), "--out", "d", "rl.steps=5"])
    assert args.out == "d" and load_run_config(args.config, args.overrides).rl.steps == 5


def _group_batch(P: int, N: int, G: int = 2, L: int = 2, K: int = 2, seed: int = 0, router_logp: bool = False):
    """RolloutBatch of one prompt group: prompt length P, N generated columns, a trace on T = P + N - 1."""
    import torch

    from moe_lab.rl.rollout import RolloutBatch
    from moe_lab.routing import Trace

    g = torch.Generator().manual_seed(seed)
    S, T = P + N, P + N - 1
    resp = torch.zeros(G, T, dtype=torch.bool)
    resp[:, P - 1:] = True
    ids = torch.randint(3, 9, (G, S), generator=g)
    trace = Trace(torch.randint(0, 4, (L, G, T, K), generator=g).to(torch.uint8), torch.rand(L, G, T, K, generator=g),
                  num_experts=4, family="qwen3_moe")
    if router_logp:
        trace = trace.with_router_logp(-torch.rand(L, G, T, K, generator=g))
    return RolloutBatch(["p"] * G, ["c"] * G, ids, torch.ones(G, S, dtype=torch.long), resp,
                        torch.rand(G, T, generator=g), trace, resp.sum(-1))


@pytest.mark.parametrize("router_logp", [False, True])
def test_joined_groups_keep_every_token_at_its_place(router_logp):
    """Groups of other prompt and response lengths: prompts left-padded, responses right-padded, masks off;
    the trace (router log-probs included) and the sampler's log-probs each at their place."""
    from moe_lab.rl.groups import join_batches

    parts = [_group_batch(3, 4, seed=1, router_logp=router_logp), _group_batch(5, 2, seed=2, router_logp=router_logp)]
    b = join_batches(parts, pad_token_id=0)
    assert b.input_ids_BS.shape == (4, 5 + 4) and b.logp_rollout_BT.shape == (4, 8)
    assert (b.trace.router_logp_LBTK is None) == (not router_logp)
    for r, (d, left) in enumerate([(parts[0], 2), (parts[0], 2), (parts[1], 0), (parts[1], 0)]):
        i = r % 2
        S, T = d.input_ids_BS.shape[1], d.logp_rollout_BT.shape[1]
        assert (b.input_ids_BS[r, left:left + S] == d.input_ids_BS[i]).all()
        assert (b.input_ids_BS[r, :left] == 0).all() and (b.attention_mask_BS[r, :left] == 0).all()
        assert (b.attention_mask_BS[r, left:] == 1).all()  # right padding attends, as generate() pads after EOS
        assert (b.logp_rollout_BT[r, left:left + T] == d.logp_rollout_BT[i]).all()
        assert (b.logp_rollout_BT[r, :left] == 0).all() and (b.logp_rollout_BT[r, left + T:] == 0).all()  # padding
        assert (b.response_mask_BT[r, left:left + T] == d.response_mask_BT[i]).all()
        assert b.response_mask_BT[r].sum() == d.response_mask_BT[i].sum() == b.response_len_B[r]  # padding never counts
        assert (b.trace.indices[:, r, left:left + T] == d.trace.indices[:, i]).all()
        assert (b.trace.weights[:, r, left:left + T] == d.trace.weights[:, i]).all()
        if router_logp:
            assert (b.trace.router_logp_LBTK[:, r, left:left + T] == d.trace.router_logp_LBTK[:, i]).all()
        pad = b.trace.indices[:, r, :left]
        assert (pad[..., 0] != pad[..., 1]).all()  # pad positions still hold a valid (distinct) top-k


def test_every_documented_metric_declares_its_reduction_and_an_undeclared_one_is_refused():
    """Each metric's reduction across ranks is declared where it is made (its module's REDUCTIONS): every
    row metric of docs/metrics.md has one, and a metric without one stops the combination, naming it."""
    import re

    from moe_lab.rl.dp_split import reduction_of, reductions

    table = reductions()
    documented = set(re.findall(r"^\| `([a-z_]+/[a-z_{}0-9/]+)`", (ROOT / "docs" / "metrics.md").read_text(), re.M))
    row_metrics = {m.replace("{i}", "0") for m in documented if not m.startswith("eval/")}
    assert len(row_metrics) > 40
    for metric in sorted(row_metrics):
        reduction_of(metric, table)  # raises KeyError when undeclared
    part = ({"reward/mean": 1.0, "new/undeclared_metric": 2.0}, 8.0, 40.0)
    with pytest.raises(KeyError, match="new/undeclared_metric"):
        combine_metrics([part, part])


def test_a_run_folder_written_before_per_group_seeding_reads_as_sequential(tmp_path):
    """A config.yaml without rl.rollout_seeding was written by code that sampled sequentially: the runner and
    the results tables read it so (never as a run of the new default), while a user config without the field
    means the default."""
    from moe_lab.analysis.tables import load_runs
    from moe_lab.config import dump_yaml, upgrade_run_config
    from moe_lab.store.runlog import config_state

    current = validate(from_dict(SMOKE["base"]))
    assert current.rl.rollout_seeding == "per_group"
    old = yaml.safe_load(dump_yaml(current))
    del old["rl"]["rollout_seeding"]
    run = tmp_path / "exp" / "runs" / "r0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(old), encoding="utf-8")
    assert upgrade_run_config(old)["rl"]["rollout_seeding"] == "sequential"
    assert config_state(run, dump_yaml(current)) == "other"
    legacy = validate(from_dict(apply_overrides(SMOKE["base"], ["rl.rollout_seeding=sequential"])))
    assert config_state(run, dump_yaml(legacy)) == "same"
    (run / "manifest.json").write_text(json.dumps({"run_id": "r0", "status": "done"}), encoding="utf-8")
    pd.DataFrame({"step": [0], "reward/mean": [0.5]}).to_parquet(run / "metrics.parquet")
    metrics, _ = load_runs(tmp_path / "exp")
    assert metrics["rl.rollout_seeding"].tolist() == ["sequential"]
