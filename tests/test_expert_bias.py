"""Expert-bias updates (issue 41): DeepSeek-V3's / Megatron-LM's rule on hand-made loads, the loads a replayed
forward counts, bfloat16 counts (Megatron-LM #7081), and the bias as model state in the RL loop (checkpoint,
resume, rollout copy, rate 0, replay)."""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pandas as pd
import pytest
import safetensors.torch
import torch
from test_train import kill_and_resume, tiny

from moe_lab.config import constants as C
from moe_lab.config import ConfigError, ModelConfig, validate
from moe_lab.models import build_model, correction_biases, moe_layers
from moe_lab.models.families import FAMILIES
from moe_lab.rl import step as step_mod
from moe_lab.rl.coldstart import cache_key, cold_start
from moe_lab.rl.components import Components, RolloutLag
from moe_lab.rl.expert_bias import ExpertBias, bias_step
from moe_lab.rl.loop import train
from moe_lab.routing import record, replay
from moe_lab.routing.bias_counts import ExpertCounts, counted_ids, own_choice_LBSK, router_logits

pytestmark = pytest.mark.filterwarnings("ignore:cold start stopped:RuntimeWarning")

RATE = 2.0 ** -10  # a power of two: sums of +-RATE are exact in fp32, so "an integer multiple" is exact
DEEPSEEK = ("model.family=deepseek_v3", f"rl.bias_update_rate={RATE}")


def _model(family: str = "deepseek_v3", layers: int = 2):
    cfg = ModelConfig(family=family, num_layers=layers, hidden_size=32, num_heads=2, num_kv_heads=1, num_experts=4,
                      top_k=2, moe_intermediate_size=16, intermediate_size=32)
    return build_model(cfg, vocab_size=16)


def _rule(counts: list[float], rate: float) -> list[float]:
    """The rule written out per expert: rate if the load is below the mean, -rate above, 0 at it."""
    mean = sum(counts) / len(counts)
    return [rate if c < mean else -rate if c > mean else 0.0 for c in counts]


def _ids(*rows: list[int]) -> torch.Tensor:
    """ids_LBSK of one layer and one sequence, one row of k ids per position."""
    return torch.tensor(rows, dtype=torch.uint8)[None, None]


# --------------------------------------------------------------------------- the rule


def test_update_equals_the_rule_on_hand_made_counts():
    """Two forwards of one optimizer step, padding excluded: layer 0 loads 3, 2, 2, 1 (mean 2: a tie for experts
    1 and 2), layer 1 loads 2, 2, 2, 2 (all ties)."""
    model = _model()
    bias = ExpertBias(model, RATE)
    before = [b.clone() for b in bias.biases]
    first = torch.cat([_ids([0, 1], [0, 2], [0, 3], [1, 2]), _ids([0, 1], [2, 3], [0, 1], [2, 3])])
    bias.count(first, torch.tensor([[1, 1, 1, 0]]))  # the 4th position is padding
    bias.count(torch.cat([_ids([1, 2]), _ids([2, 3])]), torch.tensor([[1]]))
    metrics = bias.update()
    moved = [(b - b0).tolist() for b, b0 in zip(bias.biases, before)]
    assert moved == [_rule([3, 2, 2, 1], RATE), _rule([2, 2, 2, 2], RATE)] == [[-RATE, 0, 0, RATE], [0] * 4]
    assert metrics["routing/bias_step_abs_mean"] == RATE * 2 / 8
    assert metrics["routing/bias_abs_mean"] == float(torch.cat([b.abs() for b in bias.biases]).mean())
    assert bias.counts.counts_LE.sum() == 0, "the counts restart after every optimizer step"


def test_bias_step_is_the_rule_per_layer_with_ties_and_rate():
    counts_LE = torch.tensor([[5.0, 5.0, 5.0, 5.0], [0.0, 7.0, 2.0, 3.0], [4.0, 4.0, 1.0, 7.0]])
    for rate in (RATE, 1e-3, 0.5):
        expected = torch.tensor([_rule(row, rate) for row in counts_LE.tolist()], dtype=torch.float32)
        assert torch.equal(bias_step(counts_LE, rate), expected), rate


def test_bfloat16_counts_flip_the_sign_as_megatron_7081():
    """One forward routes 256 tokens to expert 0 and 258 to expert 1, four more forwards one token each to
    expert 0: 260 vs 258. fp32: expert 1 is below the mean (+rate). bfloat16 accumulates 256 + 1 -> 256 four
    times, so it sees 256 vs 258 (and a mean of 256 after bf16's own rounding of the sum): expert 1 above (-rate)."""
    signs = {}
    for dtype in (torch.float32, torch.bfloat16):
        counts = ExpertCounts(1, 2, dtype)
        counts.add(torch.tensor([0] * 256 + [1] * 258).view(1, 1, -1, 1), torch.ones(1, 514))
        for _ in range(4):
            counts.add(torch.tensor([0]).view(1, 1, 1, 1), torch.ones(1, 1))
        signs[dtype] = torch.sign(bias_step(counts.take(), 1.0)).tolist()[0]
    assert signs[torch.float32] == _rule([260, 258], 1.0) == [-1.0, 1.0]
    assert signs[torch.bfloat16][1] == -1.0, signs  # the sign flip of #7081
    assert signs[torch.bfloat16] != signs[torch.float32]


# --------------------------------------------------------------------------- which experts are counted


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 16, (4, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of one row
    return ids, mask


def _loads(ids_LBSK: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    counts = ExpertCounts(ids_LBSK.shape[0], 4)
    counts.add(ids_LBSK, mask)
    return counts.take()


def test_free_and_replayed_counts_are_equal_without_replay_and_differ_under_it():
    model = _model()
    ids, mask = _batch()
    with torch.no_grad(), record(model) as trace, router_logits(model) as logits:
        model(input_ids=ids, attention_mask=mask)
    # without replay both modes count the recorded choice, which is the router's own top-k on its scores
    assert torch.equal(counted_ids("free", trace, trace), counted_ids("replayed", trace, trace))
    assert torch.equal(_loads(own_choice_LBSK(model, logits, tuple(ids.shape)), mask), _loads(trace.indices, mask))
    # a bias the router now obeys (expert 3 first everywhere): replaying the recorded ids, the router's own
    # choice includes expert 3 on every token, the ids that ran do not
    for layer in moe_layers(model):
        layer.family.bias(layer.router).copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    with torch.no_grad(), replay(model, trace) as handle:
        model(input_ids=ids, attention_mask=mask)
    assert torch.equal(handle.used.indices, trace.indices), "replay ran other ids than the recorded ones"
    free, replayed = (_loads(counted_ids(mode, handle.used, handle.latent), mask) for mode in C.BIAS_COUNTS)
    assert torch.equal(replayed, _loads(trace.indices, mask))
    assert torch.equal(free[:, 3], mask.sum().float().expand(free.shape[0]))  # expert 3 on every real token
    assert not torch.equal(free, replayed)


# --------------------------------------------------------------------------- families and configuration


def test_every_bias_family_exposes_its_bias_and_no_other_does():
    assert {name for name, spec in FAMILIES.items() if spec.bias is not None} == set(C.BIAS_FAMILIES)
    for name in C.BIAS_FAMILIES:
        model = _model(name, layers=1)
        biases = correction_biases(model)
        layers = moe_layers(model)
        assert len(biases) == len(layers) and all(not b.requires_grad for b in biases.values()), name
        # the tensor the router chooses with: moving it moves the choice
        ids, mask = _batch()
        with torch.no_grad(), record(model) as before:
            model(input_ids=ids, attention_mask=mask)
        for b in biases.values():
            b.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]).view_as(b))
        with torch.no_grad(), record(model) as after:
            model(input_ids=ids, attention_mask=mask)
        assert bool((after.indices == 3).any(-1).all()) and not torch.equal(before.indices, after.indices), name


@pytest.mark.parametrize("field", ["rl.bias_update_rate", "coldstart.bias_update_rate"])
def test_a_family_without_bias_refuses_a_rate(tmp_path, field):
    for family in sorted(set(C.FAMILIES) - set(C.BIAS_FAMILIES)):
        with pytest.raises(ConfigError, match=f"{field}=0.001: model.family={family} has no expert correction bias"):
            tiny(tmp_path, f"model.family={family}", f"{field}=0.001")
    validate(tiny(tmp_path, "model.family=glm4_moe", f"{field}=0.001"))


def test_count_options_need_a_rate_and_the_cold_start_key_moves_only_with_its_rate(tmp_path):
    with pytest.raises(ConfigError, match="rl.bias_counts=replayed"):
        tiny(tmp_path, "model.family=deepseek_v3", "rl.bias_counts=replayed")
    base = tiny(tmp_path, "model.family=deepseek_v3")
    assert cache_key(tiny(tmp_path, *DEEPSEEK, "rl.bias_counts=replayed", "rl.bias_count_dtype=bfloat16")) \
        == cache_key(base)
    assert cache_key(tiny(tmp_path, "model.family=deepseek_v3", "coldstart.bias_update_rate=0.001")) != cache_key(base)


# --------------------------------------------------------------------------- the RL loop


def _final_biases(run_dir) -> dict[str, torch.Tensor]:
    state = safetensors.torch.load_file(str(run_dir / "checkpoint" / "model.safetensors"))
    return {k: v for k, v in state.items() if k.endswith("e_score_correction_bias")}


def _cold_biases(cfg) -> dict[str, torch.Tensor]:
    state = safetensors.torch.load_file(str(cold_start(cfg, progress=False) / "model.safetensors"))
    return {k: v for k, v in state.items() if k.endswith("e_score_correction_bias")}


def test_after_n_optimizer_steps_each_bias_moved_an_integer_multiple_of_the_rate_at_most_n(tmp_path):
    cfg = tiny(tmp_path, *DEEPSEEK, "rl.steps=2", "rl.checkpoint_every=2")
    assert train(cfg, tmp_path / "run", run_id="b") == "done"
    n = cfg.rl.steps * cfg.rl.minibatches
    start, end = _cold_biases(cfg), _final_biases(tmp_path / "run")
    assert start and set(start) == set(end)
    for name in start:
        m = (end[name] - start[name]) / RATE
        assert torch.equal(m, m.round()) and bool((m.abs() <= n).all()), (name, m)
    moved = torch.cat([end[k] - start[k] for k in start])
    assert bool((moved != 0).any()), "the bias never moved"
    rows = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    assert rows["routing/bias_abs_mean"].iloc[-1] == pytest.approx(float(torch.cat(list(end.values())).abs().mean()))
    assert ((rows["routing/bias_step_abs_mean"] / RATE) <= 1).all()


def test_rate_zero_leaves_the_bias_bit_identical_and_logs_no_bias_metric(tmp_path):
    # a warmed bias (non-zero), weight decay on: neither the optimizer nor anything else may touch it
    cfg = tiny(tmp_path, "model.family=deepseek_v3", f"coldstart.bias_update_rate={RATE}", "coldstart.max_steps=3",
               "coldstart.target_accuracy=1.0", "rl.steps=2", "rl.checkpoint_every=2", "rl.weight_decay=0.1")
    start = _cold_biases(cfg)
    assert any(bool((b != 0).any()) for b in start.values()), "the cold start did not move the bias"
    assert train(cfg, tmp_path / "run", run_id="z") == "done"
    end = _final_biases(tmp_path / "run")
    assert all(torch.equal(start[k], end[k]) for k in start)
    assert not [c for c in pd.read_parquet(tmp_path / "run" / "metrics.parquet").columns if "bias" in c]


@pytest.mark.parametrize("mode", ["old", "rollout"])
def test_replay_runs_the_forced_ids_exactly_while_the_bias_moves(tmp_path, monkeypatch, mode):
    seen = []
    real = step_mod.routing_ctx

    @contextlib.contextmanager
    def spying(policy, forced, replay_section, gen, router_logp=False):
        with real(policy, forced, replay_section, gen, router_logp) as handle:
            yield handle
        if forced is not None:
            seen.append((forced.indices.clone(), handle.used.indices.clone(), handle.latent.indices.clone()))

    monkeypatch.setattr(step_mod, "routing_ctx", spying)
    cfg = tiny(tmp_path, "model.family=deepseek_v3", "rl.bias_update_rate=0.25", f"rl.replay={mode}",
               "rl.bias_counts=replayed", "rl.steps=2")
    assert train(cfg, tmp_path / "run", run_id="r") == "done"
    assert len(seen) == cfg.rl.steps * cfg.rl.minibatches
    assert all(torch.equal(forced, used) for forced, used, _ in seen)
    # non-vacuous: the moved bias makes the router's own choice differ from the replayed ids
    assert any(not torch.equal(forced, latent) for forced, _, latent in seen)


def test_the_rollout_copy_and_the_lag_queue_carry_the_bias():
    policy = _model()
    rollout = copy.deepcopy(policy).to(torch.bfloat16).requires_grad_(False)
    lagged = Components((RolloutLag(SimpleNamespace(rollout_lag=1)),))
    lagged.step_start(policy)
    lagged.step_end()
    old = {k: v.clone() for k, v in correction_biases(policy).items()}
    for b in correction_biases(policy).values():
        b.add_(0.5)
    lagged.sync_rollout_policy(policy, rollout)  # one step behind: the bias of the snapshot
    assert all(torch.equal(v, old[k].to(torch.bfloat16)) for k, v in correction_biases(rollout).items())
    Components().sync_rollout_policy(policy, rollout)
    now = correction_biases(policy)
    assert all(torch.equal(v, now[k].to(torch.bfloat16)) for k, v in correction_biases(rollout).items())


def test_resume_equals_the_uninterrupted_run_with_the_bias_moving(tmp_path):
    cfg = tiny(tmp_path, *DEEPSEEK, "rl.steps=6", "rl.checkpoint_every=2", "rl.eval_every=3", "rl.replay=rollout",
               "rl.rollout_lag=1")
    kill_and_resume(cfg, tmp_path)
    assert torch.equal(torch.cat(list(_final_biases(tmp_path / "ref").values())),
                       torch.cat(list(_final_biases(tmp_path / "killed").values())))
