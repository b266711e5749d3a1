"""What the integration's columns mean and when it refuses: per-layer columns named by the DECODER layer (a
dense first layer shifts them), the same columns in every configuration, values combined across microbatches by
their token counts, the TRL version switch, and a dense model refused before TRL builds anything."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

import test_trl_integration as T  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl_spy import old_vs_loss, train  # noqa: E402

from moe_lab.integrations.trl import MoEGRPOConfig, MoEGRPOTrainer  # noqa: E402
from moe_lab.models.families import FAMILIES  # noqa: E402
from moe_lab.routing import expert_change  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
SIZES = dict(vocab_size=len(T.TOKENIZER), hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, intermediate_size=64, **SPECIAL)


def dense_first_model():
    """A user's model: AutoModelForCausalLM.from_config, decoder layer 0 dense (mlp_only_layers), 1-2 MoE."""
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0])
    return AutoModelForCausalLM.from_config(cfg)


def config(tmp_path, **over):
    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, steps_per_generation=2,
              gradient_accumulation_steps=1, max_completion_length=6, learning_rate=0.5, max_steps=2, logging_steps=1,
              report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, beta=0.0, seed=0,
              shuffle_dataset=False)
    return MoEGRPOConfig(**{**kw, **over})


def ours(row: dict) -> set[str]:
    return {k for k in row if k.split("/")[0] in ("routing", "mismatch", "ratio")}


def test_per_layer_columns_are_named_by_decoder_layer(tmp_path):
    t = MoEGRPOTrainer(model=dense_first_model(), reward_funcs=T.reward, args=config(tmp_path, routing_replay="none"),
                       train_dataset=T.dataset(), processing_class=T.TOKENIZER)
    spy = train(t)
    assert spy.layer_idx == [1, 2]
    rows = [r for r in t.state.log_history if "routing/expert_change" in r]
    per_layer = {k for k in rows[0] if k.startswith("routing/layer_")}
    assert per_layer == {f"routing/layer_{i}/{m}" for i in (1, 2) for m in ("expert_change", "router_shift",
                                                                             "confidence")}
    P = [c for c in spy.calls if not c["grad"]][0]["ids"].shape[1]  # generate()'s prefill: the padded prompts
    for row, (old, used, mask) in zip(rows, old_vs_loss(spy)):
        resp = torch.zeros_like(mask)
        resp[:, P - 1:-1] = mask[:, P:]  # column j scores token j + 1: the completion's columns
        for pos, decoder_layer in enumerate(spy.layer_idx):
            want = expert_change(old[pos:pos + 1], used[pos:pos + 1], resp)
            assert row[f"routing/layer_{decoder_layer}/expert_change"] == pytest.approx(want, abs=1e-12)
    assert rows[1]["routing/layer_2/expert_change"] > 0


CONFIGS = {"none off-policy": dict(routing_replay="none"), "R2 off-policy": dict(routing_replay="old"),
           "R3 off-policy": dict(routing_replay="rollout"),
           "R3 weights": dict(routing_replay="rollout", routing_replay_weights=True),
           "none on-policy": dict(routing_replay="none", steps_per_generation=1),
           "R2 on-policy": dict(routing_replay="old", steps_per_generation=1),
           "R3 on-policy": dict(routing_replay="rollout", steps_per_generation=1),
           "R2 weights on-policy": dict(routing_replay="old", steps_per_generation=1, routing_replay_weights=True)}


def test_the_same_columns_in_every_configuration(tmp_path):
    seen = {}
    for name, over in CONFIGS.items():
        over = dict(over)
        with warnings.catch_warnings():  # on-policy R2 warns that it cannot act (tested elsewhere)
            warnings.simplefilter("ignore")
            t = T.trainer(tmp_path / name.replace(" ", "_"), "qwen3_moe", over.pop("routing_replay"), **over,
                          max_steps=1)
        t.train()
        seen[name] = ours(t.state.log_history[0])
    first = seen["none off-policy"]
    assert {"routing/router_shift", "routing/layer_0/router_shift", "routing/aux_loss",
            "mismatch/expert_change"} <= first
    assert len(first) == 19  # 5 mismatch, 2 ratio, 6 routing, 3 per layer x 2 MoE layers
    assert all(keys == first for keys in seen.values()), {n: sorted(k ^ first) for n, k in seen.items()}


def test_values_are_combined_across_microbatches_by_their_token_counts(tmp_path):
    """Two microbatches per optimizer step (off-policy: 4 of them per generation): the logged token means are
    weighted by each microbatch's response tokens and the ratio variance follows the law of total variance,
    not TRL's unweighted mean of the microbatches' values."""
    t = T.trainer(tmp_path, "qwen3_moe", "none", gradient_accumulation_steps=2, steps_per_generation=4, max_steps=1)
    parts, add = [], t._moe_row.add
    t._moe_row.add = lambda metrics, n_seq, n_tok: (parts.append((dict(metrics), n_tok)), add(metrics, n_seq, n_tok))
    t.train()
    row = t.state.log_history[0]
    assert len(parts) == 2 and parts[0][1] != parts[1][1]
    n = [p[1] for p in parts]
    for key in ("ratio/token_mean", "routing/expert_change_latent", "routing/confidence", "mismatch/abs_diff"):
        weighted = sum(p[0][key] * w for p, w in zip(parts, n)) / sum(n)
        assert row[key] == pytest.approx(weighted, rel=1e-9)
    mean = row["ratio/token_mean"]
    var = sum((p[0]["ratio/token_var"] + (p[0]["ratio/token_mean"] - mean) ** 2) * w for p, w in zip(parts, n)) / sum(n)
    assert row["ratio/token_var"] == pytest.approx(var, rel=1e-9)
    plain = (parts[0][0]["routing/confidence"] + parts[1][0]["routing/confidence"]) / 2
    assert row["routing/confidence"] != pytest.approx(plain, rel=1e-9)
    assert row["routing/layer_0/confidence"] == pytest.approx(
        sum(p[0]["routing/confidence_l0"] * w for p, w in zip(parts, n)) / sum(n), rel=1e-9)


def run_python(body: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k != "MOE_LAB_ALLOW_UNTESTED_TRL"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**env, **(env_extra or {})})


UNTESTED = "import trl; trl.__version__ = '1.17.0'\nimport moe_lab.integrations.trl\nprint('imported')\n"


def test_an_untested_trl_is_refused_with_the_pip_command_and_the_switch():
    done = run_python(UNTESTED)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and last.startswith("ImportError: ")
    assert "found trl 1.17.0" in last and "pip install 'trl>=1.16,<1.17'" in last
    assert "MOE_LAB_ALLOW_UNTESTED_TRL=1" in last


def test_moe_lab_allow_untested_trl_turns_the_refusal_into_a_warning():
    done = run_python(UNTESTED, {"MOE_LAB_ALLOW_UNTESTED_TRL": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-1500:]
    assert done.stderr.count("found trl 1.17.0") == 1 and "MOE_LAB_ALLOW_UNTESTED_TRL=1" in done.stderr


def test_a_dense_model_is_refused_before_trl_builds_anything(tmp_path, monkeypatch):
    def built(*a, **k):
        raise AssertionError("GRPOTrainer.__init__ ran")

    monkeypatch.setattr(GRPOTrainer, "__init__", built)
    dense = AutoModelForCausalLM.from_config(Qwen3Config(**{**SIZES, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM has no MoE router of a supported family") as err:
        MoEGRPOTrainer(model=dense, reward_funcs=T.reward, args=config(tmp_path / "out"))
    said = [str(err.value)]
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="model_type='qwen3', not an MoE family") as err:
        MoEGRPOTrainer(model=str(tmp_path / "dense"), reward_funcs=T.reward, args=config(tmp_path / "out"))
    said.append(str(err.value))
    for line in said:  # short: the count from the registry, the list in the docs (not the names of every family)
        assert "\n" not in line and f"the {len(FAMILIES)} MoE families" in line and "docs/trl.md#models" in line
        assert not [name for name in FAMILIES if name in line]
