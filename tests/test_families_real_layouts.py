"""The families whose real checkpoints are laid out unlike the tiny all-MoE builds (dense first layers, MTP fields,
hybrid attention) or keep routing state outside the router (MiniMax-M2), on checkpoints of that layout, saved
with save_pretrained and loaded back: record/replay bit-exact (fp32 and bf16), select()/gate_weights() bit-exact
with non-zero correction biases, the MoE layers moe_lab finds equal to the decoder layers that hold a router and to
formats.layers' rule, MiniMax-M2's block-held bias followed through copies, and the refused families refused with
their reason. (The tiny builds of every family run through the parametrised tests of test_models/test_routing/
test_replay_variants/test_routing_logp.)"""

from __future__ import annotations

import copy
import json
from typing import Callable

import pytest
import torch
from transformers import (DeepseekV32Config, Dots1Config, Ernie4_5_MoeConfig, Glm4MoeConfig, MiniMaxM2Config,
                          PretrainedConfig, Qwen3NextConfig)
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from moe_lab.cli import main as cli_main
from moe_lab.formats import layers as formats_layers
from moe_lab.models import load_model, moe_layers
from moe_lab.models.families import FAMILIES, REFUSED, get_family
from moe_lab.routing import record, replay
from trace_dumps import generate_routes, write_jsonl

VOCAB = 32
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
HYBRID = dict(head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, layer_types=["linear_attention", "linear_attention", "full_attention"],
              num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=16)
SIGMOID = dict(n_routed_experts=8, moe_intermediate_size=16, n_shared_experts=1, n_group=2, topk_group=1)


# family -> a 3-layer config with the family's real layout: which layers are dense, MTP fields, attention kinds
REAL_LAYOUTS: dict[str, Callable[[], PretrainedConfig]] = {
    # GLM-4.5: first layer dense, one MTP layer in the config
    "glm4_moe": lambda: Glm4MoeConfig(**COMMON, **SIGMOID, first_k_dense_replace=1, num_nextn_predict_layers=1,
                                      head_dim=8),
    "dots1": lambda: Dots1Config(**COMMON, **SIGMOID, first_k_dense_replace=1, sliding_window=None),
    # DeepSeek-V3.2: MLA + DSA indexer, first layer dense
    "deepseek_v32": lambda: DeepseekV32Config(**{**COMMON, "num_key_value_heads": 4}, **SIGMOID,
                                              first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
                                              qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4,
                                              index_n_heads=2, index_head_dim=8, index_topk=64),
    # hybrid attention, and a dense layer through mlp_only_layers
    "qwen3_next": lambda: Qwen3NextConfig(**COMMON, **HYBRID, mlp_only_layers=[1]),
    "qwen3_5_moe": lambda: Qwen3_5MoeTextConfig(**COMMON, **HYBRID),
    # ERNIE-4.5: the first layer dense (moe_layer_start_index=1), shared experts
    "ernie4_5_moe": lambda: Ernie4_5_MoeConfig(**COMMON, moe_num_experts=8, moe_intermediate_size=16,
                                               moe_num_shared_experts=1, moe_layer_start_index=1),
    "minimax_m2": lambda: MiniMaxM2Config(**{**COMMON, "intermediate_size": 16}, num_local_experts=8, head_dim=8),
}


def set_correction_biases(model, seed: int = 3) -> None:
    """Non-zero choice-only biases, wherever the family keeps them (router, or MiniMax-M2's block)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buf in [*model.named_buffers(), *model.named_parameters()]:  # ERNIE's is a parameter
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> directory of a saved real-layout checkpoint with random weights and non-zero biases."""
    out = {}
    for family, layout in REAL_LAYOUTS.items():
        spec = FAMILIES[family]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = spec.model_cls._from_config(layout(), attn_implementation=spec.attn_impl,
                                                dtype=torch.float32)
        set_correction_biases(model)
        out[family] = tmp_path_factory.mktemp(family) / "ckpt"
        model.save_pretrained(out[family])
    return out


def tokens(B: int = 3, S: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def router_layers(model, router_cls) -> list[int]:
    """Decoder layers whose module tree holds a router of this class, seen on the model, not in its config."""
    return [i for i, layer in enumerate(model.model.layers) if any(isinstance(m, router_cls) for m in layer.modules())]


@pytest.mark.parametrize("family", list(REAL_LAYOUTS))
def test_moe_layers_are_the_router_layers_and_the_formats_rule(family, checkpoints):
    model = load_model(checkpoints[family])
    found = [layer.layer_idx for layer in moe_layers(model)]
    seen = router_layers(model, FAMILIES[family].router_cls)
    assert found == seen and 0 < len(seen)
    assert formats_layers.moe_layer_indices(model.config) == seen
    as_saved = json.loads((checkpoints[family] / "config.json").read_text())
    assert formats_layers.moe_layer_indices(as_saved) == seen  # the config.json a reader gets, as a dict
    if family in ("glm4_moe", "dots1", "deepseek_v32", "qwen3_next", "ernie4_5_moe"):
        assert len(seen) == 2  # the dense layer is really dense
    if family == "glm4_moe":  # the MTP layer is counted once and is no decoder layer
        assert formats_layers.num_mtp_layers(model.config) == formats_layers.num_mtp_layers(as_saved) == 1
        assert len(model.model.layers) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(REAL_LAYOUTS))
def test_loaded_checkpoint_records_and_replays_bit_exactly(family, dtype, checkpoints):
    model, x = load_model(checkpoints[family], dtype=dtype), tokens()
    with torch.no_grad():
        plain = model(x).logits
    with torch.no_grad(), record(model) as trace:
        recorded = model(x).logits
    assert torch.equal(recorded, plain) and trace.family == family
    assert trace.shape == (len(moe_layers(model)), 3, 9, 2)
    with torch.no_grad(), replay(model, trace) as handle:
        replayed = model(x).logits
    assert torch.equal(replayed, plain)
    assert torch.equal(handle.latent.indices, trace.indices) and torch.equal(handle.latent.weights, trace.weights)


@pytest.mark.parametrize("family", list(REAL_LAYOUTS))
def test_select_and_gate_weights_match_the_router_with_biases(family, checkpoints):
    model, spec = load_model(checkpoints[family]), get_family(family)
    seen = []
    handles = [layer.router.register_forward_hook(lambda mod, inp, out: seen.append((mod, out)))
               for layer in moe_layers(model)]
    with torch.no_grad():
        model(tokens())
    for h in handles:
        h.remove()
    biased = any(n.endswith("e_score_correction_bias") for n, _ in [*model.named_buffers(), *model.named_parameters()])
    for router, (logits_NE, weights_NK, ids_NK) in seen:
        sel_w, sel_ids = spec.select(router, logits_NE)
        assert torch.equal(sel_ids, ids_NK) and torch.equal(sel_w, weights_NK)
        assert torch.equal(spec.gate_weights(router, logits_NE, ids_NK), weights_NK)
        if biased:  # the bias really moved the choice somewhere, so the test above saw it act
            plain_ids = torch.topk(spec.router_logp(logits_NE), router.top_k, dim=-1).indices
            assert not torch.equal(plain_ids.sort(-1).values, ids_NK.sort(-1).values)


def test_minimax_bias_is_read_from_the_block_of_each_copy(checkpoints):
    model = load_model(checkpoints["minimax_m2"])
    spec, block = get_family("minimax_m2"), model.model.layers[0].mlp
    X_NH = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    moe_layers(model)  # links each router to its block
    assert torch.equal(block.gate(X_NH)[2], block.gate(X_NH, block.e_score_correction_bias)[2])
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].mlp.e_score_correction_bias.fill_(0.0)
        twin.model.layers[0].mlp.e_score_correction_bias[:2] = 10.0  # experts 0 and 1 always chosen
    logits_NE = block.gate(X_NH)[0]
    assert sorted(spec.select(twin.model.layers[0].mlp.gate, logits_NE)[1][0].tolist()) == [0, 1]
    assert torch.equal(spec.select(block.gate, logits_NE)[1], block.gate(X_NH)[2])  # the original is untouched
    assert "moe_lab_block" not in "".join(model.state_dict())  # the link is no weight


@pytest.mark.parametrize("family", list(REAL_LAYOUTS))
def test_check_trace_agrees_with_routes_recorded_by_our_own_hooks(family, checkpoints, tmp_path, capsys):
    """Generation routes kept by the test's own router hooks, written as vLLM does (every decoder layer, zeros
    in the dense ones): check-trace finds every slot in agreement and no fault, on each family's layout."""
    path = checkpoints[family]
    model = FAMILIES[family].model_cls.from_pretrained(path, dtype=torch.float32).eval()
    config = json.loads((path / "config.json").read_text())
    routes = generate_routes(model, [[1, 5, 7, 9, 3], [1, 11, 12]], 6)
    dump = write_jsonl(tmp_path / "dump.jsonl", routes, "vllm", config)
    code = cli_main(["check-trace", str(dump), "--model", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    last = out.strip().splitlines()[-1].split()
    assert last[0] == "agreement" and float(last[1]) == 1.0, out


@pytest.mark.parametrize("family", list(REFUSED))
def test_refused_families_say_why(family, tmp_path):
    with pytest.raises(ValueError, match=f"family='{family}' is not supported: .*"):
        get_family(family)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": family}))
    with pytest.raises(ValueError, match=f"model_type='{family}', which is refused: " + REFUSED[family][:30]):
        load_model(tmp_path)
