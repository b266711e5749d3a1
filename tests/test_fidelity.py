"""`moe-lab fidelity`: the mismatch samples' properties, the table's statistics and bands, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_lab import cli
from moe_lab.analysis.stats import mean_ci, ratio_ci
from moe_lab.audit import fidelity_run, fidelity_table
from moe_lab.config import ModelConfig, RLConfig, RunConfig, TaskConfig, validate
from moe_lab.models import build_model
from moe_lab.routing import router_mismatch
from moe_lab.tasks import get_task


def setup(**rl):
    cfg = validate(RunConfig(
        model=ModelConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, num_experts=8, top_k=2,
                          moe_intermediate_size=32, intermediate_size=64, max_positions=64),
        task=TaskConfig(name="sort", length=6, eval_size=16), rl=RLConfig(prompts_per_step=3, group_size=4, **rl)))
    task = get_task(cfg.task)
    return cfg, task, build_model(cfg.model, len(task.tokenizer)).eval()


def test_a_float32_sampler_without_emulation_is_the_trainer_no_routing_disagreement():
    cfg, task, policy = setup()
    torch.manual_seed(0)
    samples = fidelity_run.mismatch_samples(policy, task, cfg, 6)
    assert len(samples) == 6 and all(s["tokens"] > 0 for s in samples)
    # the sampler IS the policy (make_rollout_policy): only the KV-cache forward's reduction order differs
    assert all(s["router_change"] == 0 and s["any_change"] == 0 for s in samples)
    assert all(s["k3"] < 1e-9 and s["extreme_ln2"] == 0 for s in samples)
    assert all(s["k3"] == s["k3_replayed"] for s in samples)  # the same routes replayed: the same forward


def test_replaying_routes_that_agree_changes_nothing_and_float8_makes_routers_disagree():
    cfg, task, policy = setup(rollout_dtype="float8", rollout_kernels="batch_variant")
    torch.manual_seed(0)
    samples = fidelity_run.mismatch_samples(policy, task, cfg, 9)
    assert any(s["router_change"] > 0 for s in samples) and all(s["k3"] > 0 for s in samples)
    agree = [s for s in samples if s["any_change"] == 0]
    assert all(s["k3_replayed"] == s["k3"] for s in agree)  # replaying the trainer's own routes is a no-op
    for s in samples:  # any_change counts tokens with >= 1 flipped router: between p and L p
        assert s["router_change"] <= s["any_change"] <= s["layers"] * s["router_change"] + 1e-12


def test_token_share_follows_one_minus_one_minus_p_to_the_L_for_independent_flips():
    L, B, S, E, K, p = 8, 64, 64, 16, 2, 0.05
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(L * B * S)]).reshape(L, B, S, K)
    flip = torch.rand(L, B, S, generator=gen) < p
    other = ids.clone()
    other[..., 0] = torch.where(flip, (ids[..., 0] + 1) % E, ids[..., 0])
    other[..., 0] = torch.where(other[..., 0] == ids[..., 1], (other[..., 0] + 1) % E, other[..., 0])
    table = router_mismatch(ids, other)
    exact_any = float(flip.any(0).float().mean())
    assert table["any_change"] == pytest.approx(exact_any)
    assert table["router_change"] == pytest.approx(float(flip.float().mean()))
    predicted = 1 - (1 - table["router_change"]) ** L
    assert abs(table["any_change"] - predicted) < 0.02  # independence: the identity within sampling noise
    rows = fidelity_table.mismatch_rows([{"tokens": 1, "k3": 1e-3, "k3_replayed": 5e-4, "extreme_ln2": 0.0,
                                          "extreme_ln5": 0.0, "abs_diff": 0.0, "layers": L,
                                          "router_change": table["router_change"] + d,
                                          "any_change": table["any_change"] + d} for d in (-1e-3, 1e-3)], None)
    share = next(r for r in rows if r.key == "token_share")
    assert share.ok and f"{predicted:.3g}" in share.band


def test_ratio_ci_reduces_to_the_mean_interval_when_the_denominator_is_constant():
    a = np.array([1.0, 3.0, 2.0, 6.0, 4.0])
    mean, lo, hi = mean_ci(a)
    for paired in (True, False):
        r, rlo, rhi = ratio_ci(a, np.full(5, 2.0), paired=paired)
        assert (r, rlo, rhi) == pytest.approx((mean / 2, lo / 2, hi / 2))
    assert ratio_ci(3 * a, a, paired=True) == pytest.approx((3.0, 3.0, 3.0))  # an exact multiple: no spread


def test_routing_share_is_one_minus_the_paired_ratio_and_its_band_needs_two_thirds():
    samples = [{"tokens": 1, "k3": k, "k3_replayed": k * f, "extreme_ln2": 0.0, "extreme_ln5": 0.0, "abs_diff": 0.0,
                "router_change": 0.1, "any_change": 0.5, "layers": 8} for k, f in ((1e-3, 0.3), (2e-3, 0.2))]
    row = next(r for r in fidelity_table.mismatch_rows(samples, None) if r.key == "routing_share")
    assert row.value == pytest.approx(1 - (0.3e-3 + 0.4e-3) / 3e-3) and row.lo <= row.value <= row.hi
    assert row.point_ok  # 0.767 >= 2/3; in band only when the whole interval is
    assert row.verdict == ("pass" if row.lo >= 2 / 3 else "edge") and row.ok == (row.lo >= 2 / 3)


@pytest.mark.parametrize("argv", [["fidelity", "no/such/folder"],
                                  ["fidelity", "experiments/rollout_mismatch.yaml", "model.top_k=zero"],
                                  ["fidelity", "experiments/rollout_mismatch.yaml", "rl.no_such_field=1"],
                                  ["fidelity", "experiments/rollout_mismatch.yaml", "--prompts", "1"]])
def test_bad_input_is_one_line_and_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-lab fidelity: error:") and "\n" not in err


def test_a_run_folder_is_read_with_its_config_and_the_overrides(tmp_path):
    from moe_lab.config import ConfigError, dump_yaml

    cfg, _, _ = setup()
    (tmp_path / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
    source = fidelity_run.resolve(str(tmp_path), ["rl.lr=0.002"])
    assert source.cfg.rl.lr == 0.002 and source.cfg.model == cfg.model
    assert source.checkpoint is None  # no checkpoint: the cold start
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a run folder"):
        fidelity_run.resolve(str(tmp_path / "empty"), [])


def test_update_rows_read_the_change_after_one_update_and_the_deeper_half_over_the_shallower():
    def row(step, index, layers, clip, norm=0.5):
        return {"step": step, "index": index, "routing/expert_change": sum(layers) / len(layers),
                "clip_frac/active": clip, "optim/grad_norm": norm,
                **{f"routing/layer_{l}/expert_change": v for l, v in enumerate(layers)}}

    grpo = [row(0, 0, [0, 0, 0, 0], 0.01), row(0, 1, [0.02, 0.04, 0.06, 0.12], 0.01, 2.0), row(0, 2, [0.5] * 4, 0.01),
            row(1, 0, [0, 0, 0, 0], 0.01), row(1, 1, [0.02, 0.02, 0.04, 0.04], 0.01), row(1, 3, [0.3] * 4, 0.01, 3.0)]
    gspo = [row(s, m, [0, 0, 0, 0], 0.5 + 0.01 * s) for s in range(2) for m in range(4)]
    r2 = [row(s, m, [0, 0, 0, 0], 0.005 + 0.001 * s) for s in range(2) for m in range(4)]
    rows = {r.key: r for r in fidelity_table.update_rows(grpo, gspo, r2, grad_clip=1.0)}
    assert rows["expert_change_update"].value == pytest.approx((0.06 + 0.03) / 2)  # the second update's rows only
    assert rows["expert_change_update3"].value == pytest.approx(0.3)
    assert rows["expert_change_depth"].value == pytest.approx((0.09 / 0.03 + 0.04 / 0.02) / 2)
    assert rows["clip_ratio"].value == pytest.approx(0.505 / 0.01)
    assert rows["clip_ratio_replay"].value == pytest.approx(0.505 / 0.0055)
    assert rows["clip_ratio_replay_u3"].value == pytest.approx(0.505 / 0.0055)
    assert rows["grad_clip_share"].value == pytest.approx((1 / 3 + 1 / 3) / 2)  # one of three updates per step
    assert rows["grad_norm_median"].value == pytest.approx(0.5)
