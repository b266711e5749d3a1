"""moe_lab.integrations.trl inside TRL's GRPOTrainer, observed by the tests' own hooks on the experts modules
(the ids each experts module actually received), never through the replay machinery's own records.

Tiny models (2 MoE layers, width 32, 4 experts, top-2), left-padded sort prompts of unequal length, 2-4 TRL steps.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import HfArgumentParser

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from moe_lab.algos.ratio_metrics import policy_metrics, rollout_mismatch  # noqa: E402
from moe_lab.config import from_dict, validate  # noqa: E402
from moe_lab.integrations import metric_row  # noqa: E402
from moe_lab.integrations.trl import MoEGRPOConfig, MoEGRPOTrainer  # noqa: E402
from moe_lab.models import build_model, moe_layers  # noqa: E402
from moe_lab.rl.dp_split import reduction_of, reductions  # noqa: E402
from moe_lab.routing import expert_change  # noqa: E402
from moe_lab.tasks import get_task  # noqa: E402
from trl_spy import match_rows  # noqa: E402  (rows matched by tokens, shared with the other TRL tests)

TASKS = {n: get_task(validate(from_dict({"task": {"name": "sort", "length": n, "eval_size": 8}})).task) for n in (3, 4, 5)}
TOKENIZER = TASKS[4].tokenizer


def tiny_model(family: str):
    cfg = validate(from_dict({"model": {"family": family, "num_layers": 2, "hidden_size": 32, "num_heads": 2,
                                        "num_kv_heads": 1, "num_experts": 4, "top_k": 2, "moe_intermediate_size": 32,
                                        "intermediate_size": 64}}))
    return build_model(cfg.model, len(TOKENIZER), pad_token_id=0, bos_token_id=1, eos_token_id=2)


def reward(prompts, completions, **_):
    return [TASKS[len(p) - 1].reward(p, c) for p, c in zip(prompts, completions)]


def dataset(seed: int = 0):
    """Sort prompts of 3, 4 and 5 digits mixed: every generation batch is left-padded to unequal lengths."""
    rng = np.random.default_rng(seed)
    prompts = [p for _ in range(4) for n in (3, 4, 5) for p in TASKS[n].sample_prompts(1, rng)]
    return datasets.Dataset.from_dict({"prompt": prompts})


def config_kwargs(tmp_path, mode: str, **over) -> dict:
    """Off-policy by default (steps_per_generation=2, one microbatch per optimizer step): TRL runs its old pass
    and the second microbatch of each generation trains on weights one update away from it."""
    kw = dict(output_dir=str(tmp_path), routing_replay=mode, per_device_train_batch_size=4, num_generations=4,
              steps_per_generation=2, gradient_accumulation_steps=1, max_completion_length=6, learning_rate=0.05,
              max_steps=2, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
              gradient_checkpointing=True, beta=0.0, seed=0, shuffle_dataset=False)
    return {**kw, **over}


def trainer(tmp_path, family="qwen3_moe", mode="old", **over):
    kw = config_kwargs(tmp_path, mode, **over)
    torch.manual_seed(0)
    return MoEGRPOTrainer(model=tiny_model(family), reward_funcs=reward, args=MoEGRPOConfig(**kw),
                          train_dataset=dataset(), processing_class=TOKENIZER)


class Spy:
    """The tests' own hooks: per model call (input ids, attention mask, grad mode), the ids every experts module
    received (runs after the call's own, e.g. checkpointing's recompute in backward, are kept apart) and the
    router's own top-k (its raw output, seen before any other hook of the router)."""

    def __init__(self, model):
        self.calls: list[dict] = []
        self.handles = [model.register_forward_pre_hook(self._call, with_kwargs=True)]
        experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
        routers = [layer.router for layer in moe_layers(model)]
        assert len(experts) == len(routers) == 2
        for pos, (ex, router) in enumerate(zip(experts, routers)):
            self.handles.append(ex.register_forward_pre_hook(lambda m, a, pos=pos: self._ids("used", pos, a[1])))
            h = router.register_forward_hook(lambda m, a, out, pos=pos: self._ids("own", pos, out[2]), prepend=True)
            self.handles.append(h)

    def _call(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        self.calls.append(dict(ids=ids.detach().clone(), mask=kwargs.get("attention_mask"),
                               grad=torch.is_grad_enabled(), used=[[], []], own=[[], []]))

    def _ids(self, kind, pos, ids_NK):
        self.calls[-1][kind][pos].append(ids_NK.detach().clone())

    def remove(self):
        for h in self.handles:
            h.remove()

    def ids_LBSK(self, call: dict, kind: str, run: int = 0) -> torch.Tensor:
        B, S = call["ids"].shape
        return torch.stack([call[kind][pos][run].reshape(B, S, -1) for pos in range(2)]).sort(-1).values

    def full_calls(self, grad: bool, seq_len: int) -> list[dict]:
        return [c for c in self.calls if c["grad"] == grad and c["ids"].shape[1] == seq_len]


def loss_calls(spy: Spy) -> list[dict]:
    return [c for c in spy.calls if c["grad"]]


def old_vs_loss(spy: Spy, kind: str = "used") -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(old-pass experts, loss-forward experts, real-token mask) per loss call, rows matched by their tokens."""
    out = []
    for call in loss_calls(spy):
        S = call["ids"].shape[1]
        old = spy.full_calls(False, S)
        old_ids = torch.cat([c["ids"] for c in old])
        old_LBSK = torch.cat([spy.ids_LBSK(c, "used") for c in old], dim=1)
        rows = match_rows(call["ids"], old_ids)
        out.append((old_LBSK[:, rows], spy.ids_LBSK(call, kind), call["mask"].bool()))
    return out


def run(t) -> Spy:
    spy = Spy(t.model)
    try:
        t.train()
    finally:
        spy.remove()
    return spy


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_r2_loss_forward_uses_the_old_pass_experts(tmp_path, family):
    t = trainer(tmp_path, family, "old", learning_rate=0.5)
    spy = run(t)
    pairs = old_vs_loss(spy)
    assert len(pairs) == 2
    for old_LBSK, used_LBSK, mask_BS in pairs:
        assert torch.equal(old_LBSK[:, mask_BS], used_LBSK[:, mask_BS])
    # gradient checkpointing: the recompute in backward (a second run of each experts module) used them too
    for call, (old_LBSK, _, mask_BS) in zip(loss_calls(spy), pairs):
        assert all(len(runs) == 2 for runs in call["used"])
        assert torch.equal(old_LBSK[:, mask_BS], spy.ids_LBSK(call, "used", run=1)[:, mask_BS])
    # after one update at lr 0.5 the routers would choose otherwise on the second microbatch (the latent change)
    second_old, _, mask = pairs[1]
    own = spy.ids_LBSK(loss_calls(spy)[1], "own")
    assert not torch.equal(second_old[:, mask], own[:, mask])


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_without_replay_the_loss_forward_routes_differently_after_a_large_update(tmp_path, family):
    spy = run(trainer(tmp_path, family, "none", learning_rate=0.5))
    (old0, used0, mask0), (old1, used1, mask1) = old_vs_loss(spy)
    assert torch.equal(old0[:, mask0], used0[:, mask0])  # same weights as the old pass: same experts
    assert not torch.equal(old1[:, mask1], used1[:, mask1])  # one update later: moved


def generation_experts(spy: Spy, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(full token rows, experts (L, B, S-1, k)) of the generate() call: its prefill plus one column per step."""
    gen = [c for c in spy.calls if not c["grad"] and c["ids"].shape[1] != seq_len]
    prefill = [i for i, c in enumerate(gen) if c["ids"].shape[1] > 1]
    assert len(prefill) == 1
    cols = [spy.ids_LBSK(c, "used") for c in gen]
    ids = torch.cat([gen[0]["ids"]] + [c["ids"] for c in gen[1:]], dim=1)
    return ids, torch.cat(cols, dim=2)


def test_r3_loss_forward_uses_the_generation_experts_on_left_padded_rows(tmp_path):
    t = trainer(tmp_path, "qwen3_moe", "rollout", learning_rate=0.5)
    spy = run(t)
    for call in loss_calls(spy):
        B, S = call["ids"].shape
        assert bool((call["mask"][:, 0] == 0).any()), "some prompts must be left-padded"
        gen_ids, gen_LBSK = generation_experts(spy, S)
        rows = match_rows(call["ids"][:, :S - 1], gen_ids)
        used = spy.ids_LBSK(call, "used")[:, :, :S - 1]  # the last column scores nothing: never generated
        mask = call["mask"][:, :S - 1].bool()
        assert torch.equal(gen_LBSK[:, rows, :S - 1][:, mask], used[:, mask])


def test_position_ids_make_training_forwards_number_tokens_as_generation(tmp_path):
    """Left-padded rows. generate() numbers each row's real tokens from 0 (the pads' columns do not count);
    TRL's training forwards pass no position_ids, so transformers would number every column 0..S-1. With
    moe_position_ids (the default) every training forward receives generate()'s numbering, read here by the
    tests' own hook on the decoder (what the model actually got). Positions, not log-prob gaps, are compared:
    how far the two numberings move log-probs is rounding (RoPE sees relative positions), and rounding depends on
    the kernels (~4e-8 mean |d log p| with AVX512 kernels, ~1.5e-4 with ATen AVX2 + MKL_CBWR=COMPATIBLE)."""
    for on in (True, False):
        t = trainer(tmp_path / str(on), "qwen3_moe", "none", moe_position_ids=on, max_steps=1)
        seen = []  # (attention mask, position ids) of every call that reads a whole sequence (no decode step)
        hook = t.model.model.register_forward_pre_hook(
            lambda m, a, kw: seen.append((kw["attention_mask"], kw.get("position_ids")))
            if kw.get("input_ids") is not None and kw.get("attention_mask") is not None
            and kw["input_ids"].shape[1] == kw["attention_mask"].shape[1] else None, with_kwargs=True)
        t.train()
        hook.remove()
        gen_mask, gen_pos = seen[0]  # generate()'s prefill: the padded prompts
        assert (gen_mask == 0).any(), "the generation batch must hold left-padded rows"
        real = gen_mask.bool()
        assert gen_pos is not None and torch.equal(gen_pos[real], (gen_mask.long().cumsum(-1) - 1)[real])
        full = [(mask, pos) for mask, pos in seen if mask.shape[1] > gen_mask.shape[1]]  # prompt + completion
        assert full
        for mask, pos in full:
            if on:
                real = mask.bool()
                assert pos is not None and torch.equal(pos[real], (mask.long().cumsum(-1) - 1)[real])
            else:
                assert pos is None


def test_logged_metrics_equal_moe_labs_functions_on_the_hooked_experts(tmp_path):
    """Under R2, routing/expert_change_latent is moe_lab's expert_change between the old pass's experts and the
    router's own choice in the loss forward over the response positions, both seen by the tests' hooks."""
    t = trainer(tmp_path, "qwen3_moe", "old", learning_rate=0.5)
    spy = run(t)
    rows = [r for r in t.state.log_history if "routing/expert_change_latent" in r]
    assert len(rows) == 2
    P = [c for c in spy.calls if not c["grad"]][0]["ids"].shape[1]  # generate()'s prefill: the padded prompts
    for call, row, (old_LBSK, _, mask_BS) in zip(loss_calls(spy), rows, old_vs_loss(spy)):
        S = call["ids"].shape[1]
        resp_BS = torch.zeros_like(mask_BS)
        resp_BS[:, P - 1:S - 1] = mask_BS[:, P:]  # column j scores token j + 1: the completion's columns
        own = spy.ids_LBSK(call, "own")
        assert row["routing/expert_change_latent"] == pytest.approx(expert_change(old_LBSK, own, resp_BS), abs=1e-12)
    assert rows[1]["routing/expert_change_latent"] > 0


def test_metric_functions_are_moe_labs():
    g = torch.Generator().manual_seed(0)
    new, old, roll = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    ours = metric_row.ratio_part(new, old, mask)
    zeros = torch.zeros(3, 5, dtype=torch.bool)
    ref = policy_metrics(new - old, torch.exp(new - old), mask, clip_low=0.2, clip_high=0.2, clip_active_BT=zeros,
                         dual_active_BT=zeros, clamped_BT=zeros)
    assert ours["ratio/token_var"] == pytest.approx(float(ref["ratio/token_var"]), rel=1e-6)
    assert ours["ratio/token_mean"] == pytest.approx(float(ref["ratio/token_mean"]), rel=1e-6)
    mism = rollout_mismatch(roll, old, mask, extended=True)
    d = (roll - old)[mask.bool()]
    assert mism["mismatch/k3"] == pytest.approx(float((torch.exp(-d) + d - 1).mean()), rel=1e-6)
    assert mism["mismatch/abs_diff"] == pytest.approx(float(d.abs().mean()), rel=1e-6)
    assert mism["mismatch/extreme_frac_log5"] == pytest.approx(float((d.abs() > math.log(5)).float().mean()))


def test_every_logged_metric_declares_its_reduction_across_ranks(tmp_path):
    t = trainer(tmp_path, "qwen3_moe", "rollout", max_steps=2, moe_decomp_every=1)
    t.train()
    table = {**reductions(), **metric_row.REDUCTIONS}  # the logged names: per-layer columns by decoder layer
    keys = {k for row in t.state.log_history for k in row if k.split("/")[0] in ("routing", "mismatch", "ratio")}
    assert {"routing/expert_change", "routing/expert_change_latent", "routing/router_shift", "routing/confidence",
            "ratio/token_var", "ratio/routing_share", "mismatch/k3", "mismatch/abs_diff", "mismatch/extreme_frac",
            "mismatch/extreme_frac_log5", "mismatch/expert_change"} <= keys
    for key in keys:
        reduction_of(key, table)  # raises for a metric moe_lab declares no cross-rank reduction for
    assert math.isfinite(t.state.log_history[1]["ratio/routing_share"])


@pytest.mark.parametrize("loss_type,level", [("grpo", "token"), ("dapo", "sequence"), ("dr_grpo", "token"),
                                             ("bnpo", "token"), ("cispo", "token"), ("sapo", "token"),
                                             ("luspo", "sequence"), ("vespo", "token")])
def test_r2_holds_for_every_loss_type(tmp_path, loss_type, level):
    """num_iterations=2 (the same batch twice), gradient checkpointing off: the old pass's experts every time."""
    t = trainer(tmp_path, "qwen3_moe", "old", loss_type=loss_type, importance_sampling_level=level, num_iterations=2,
                steps_per_generation=1, max_steps=2, gradient_checkpointing=False, learning_rate=0.5)
    spy = run(t)
    pairs = old_vs_loss(spy)
    assert len(pairs) == 2
    for old_LBSK, used_LBSK, mask_BS in pairs:
        assert torch.equal(old_LBSK[:, mask_BS], used_LBSK[:, mask_BS])


def test_on_policy_r2_warns_once_and_trains(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer(tmp_path, "qwen3_moe", "old", steps_per_generation=1, max_steps=1)
    ours = [w for w in caught if "cannot act" in str(w.message)]
    assert len(ours) == 1
    t.train()
    row = t.state.log_history[0]
    assert row["ratio/token_var"] == 0.0  # TRL's on-policy ratio is exactly 1
    # the loss forward is the old policy: it is its own reference (the same columns as off-policy runs)
    assert row["routing/expert_change"] == 0.0 and row["routing/router_shift"] == 0.0
    assert 0.0 < row["routing/confidence"] <= 1.0 and "mismatch/expert_change" in row


@pytest.mark.parametrize("field,value,allowed", [("routing_replay", "r3", "none, old, rollout"),
                                                 ("moe_metrics", "yes", "True or False"),
                                                 ("moe_decomp_every", -1, "integer >= 0")])
def test_bad_config_values_are_refused_in_one_line(tmp_path, field, value, allowed):
    with pytest.raises(ValueError) as err:
        MoEGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **{field: value})
    assert field in str(err.value) and allowed in str(err.value) and "\n" not in str(err.value)


def test_rollout_replay_with_vllm_without_routed_experts_is_refused_before_trl_builds(tmp_path):
    """vLLM < 0.22 (here: none installed) returns no routed experts: refused in one line before TRL's __init__
    (which would import vLLM and build the engine)."""
    args = MoEGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, routing_replay="rollout",
                         use_vllm=True)
    with pytest.raises(ValueError, match=r"use_vllm=True needs vllm>=0.22 .*found none") as err:
        MoEGRPOTrainer(model=tiny_model("qwen3_moe"), reward_funcs=reward, args=args, train_dataset=dataset(),
                       processing_class=TOKENIZER)
    assert "\n" not in str(err.value)


def test_the_fields_reach_trls_command_line_parser(tmp_path):
    """As TRL's own config fields: documented (help) and checked (choices) by HfArgumentParser / TrlParser."""
    parser = HfArgumentParser(MoEGRPOConfig)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--routing_replay", "rollout",
                                                  "--moe_decomp_every", "4", "--use_cpu", "--report_to", "none"])
    assert (args.routing_replay, args.moe_decomp_every, args.moe_metrics) == ("rollout", 4, True)
    helps = {a.dest: a.help for a in parser._actions}
    assert all(helps[name] for name in ("routing_replay", "moe_metrics", "moe_decomp_every", "moe_position_ids"))
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--routing_replay", "r3"])


def test_the_example_runs(tmp_path):
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "examples/trl_grpo_replay.py", "--replay", "old", "--steps", "8"],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MPLCONFIGDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    table = done.stdout[done.stdout.index("routing_replay=old"):].splitlines()
    assert table[1].split()[:3] == ["step", "reward", "change"] and table[2].split()[0] == "8"


def test_r2_with_a_kl_term_leaves_trls_reference_model_alone(tmp_path):
    """beta > 0: TRL loads a separate reference model (from the policy's folder) whose forwards are never hooked;
    the policy's loss forwards still run the old pass's experts."""
    from moe_lab.models import load_model

    tiny_model("qwen3_moe").save_pretrained(tmp_path / "policy")
    args = MoEGRPOConfig(output_dir=str(tmp_path / "out"), routing_replay="old", per_device_train_batch_size=4,
                         num_generations=4, steps_per_generation=2, max_completion_length=6, learning_rate=0.5,
                         max_steps=2, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                         disable_tqdm=True, beta=0.1, seed=0)
    t = MoEGRPOTrainer(model=load_model(tmp_path / "policy"), reward_funcs=reward, args=args,
                       train_dataset=dataset(), processing_class=TOKENIZER)
    spy = run(t)
    pairs = old_vs_loss(spy)
    assert len(pairs) == 2 and t.ref_model is not None
    for old_LBSK, used_LBSK, mask_BS in pairs:
        assert torch.equal(old_LBSK[:, mask_BS], used_LBSK[:, mask_BS])
    assert t.state.log_history[1]["kl"] > 0
