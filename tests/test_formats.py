"""moe_lab.formats: the layer mapping follows the model's config (checked against the modules transformers
builds), every layout round-trips, missing routes stay a mask (never expert 0), read_vllm keeps its contract,
and an imported trace replays to the same log-probs, bit for bit, as moe_lab's own R3 on the same routes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from moe_lab.formats import nemo_rl, prime_rl, sglang, verl, vllm
from moe_lab.formats.jsonl import detect_line, parse_line, read_input
from moe_lab.formats.layers import AmbiguousLayerAxis, layer_map, layer_maps, moe_layer_indices
from moe_lab.formats.native import save_with_tokens
from moe_lab.formats.routes import Routes, RoutedSequence, to_trace
from moe_lab.routing import record, replay
from trace_dumps import EXPERTS, TOP_K, full_sequence, generate_routes, layout_fields, load, tiny_checkpoint
from trace_writers import write_line, write_nemo_rl, write_prime_rl, write_sglang, write_slime, write_verl, write_vllm

SMALL = dict(vocab_size=16, hidden_size=16, intermediate_size=16, num_attention_heads=2, num_key_value_heads=2,
             num_experts_per_tok=2, max_position_embeddings=32)


def _routers(model) -> list[int]:
    """Decoder layers whose MLP holds a router module (what transformers actually built)."""
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")
            and type(layer.mlp.gate).__name__.endswith(("TopKRouter", "TopkRouter"))]


@pytest.mark.parametrize("config", [
    Qwen3MoeConfig(**SMALL, num_hidden_layers=4, num_experts=4, moe_intermediate_size=8, mlp_only_layers=[0]),
    Qwen3MoeConfig(**SMALL, num_hidden_layers=5, num_experts=4, moe_intermediate_size=8, decoder_sparse_step=2),
    Qwen3MoeConfig(**SMALL, num_hidden_layers=4, num_experts=4, moe_intermediate_size=8, mlp_only_layers=[1, 3]),
    DeepseekV3Config(**SMALL, num_hidden_layers=4, n_routed_experts=4, moe_intermediate_size=8,
                     first_k_dense_replace=2, n_group=1, topk_group=1, q_lora_rank=8, kv_lora_rank=8,
                     qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8),
], ids=["qwen3-mlp_only_0", "qwen3-sparse_step_2", "qwen3-mlp_only_1_3", "deepseek-first_k_2"])
def test_moe_layer_indices_are_the_layers_transformers_builds_as_moe(config):
    cls = Qwen3MoeForCausalLM if config.model_type == "qwen3_moe" else DeepseekV3ForCausalLM
    built = _routers(cls(config))
    assert moe_layer_indices(config) == built
    assert moe_layer_indices(json.loads(config.to_json_string())) == built  # the config.json a checkpoint holds


def test_mtp_layers_are_excluded_and_their_numberings_recognised():
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "first_k_dense_replace": 1,
              "num_nextn_predict_layers": 1, "num_experts_per_tok": 2, "n_routed_experts": 4}
    assert moe_layer_indices(config) == [1, 2, 3]
    assert {k: m.axis_len for k, m in layer_maps(config).items()} == {"moe": 3, "decoder": 4, "moe+mtp": 4,
                                                                       "decoder+mtp": 5}
    assert layer_map(config, 5).dropped == (0, 4)  # the dense layer and the MTP layer
    with pytest.raises(ValueError, match="7 layer rows fit no layer numbering"):
        layer_map(config, 7)


CONFIG = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "mlp_only_layers": [0], "num_local_experts": EXPERTS,
          "num_experts_per_tok": TOP_K, "vocab_size": 48}


def _random_routes(S: int = 9, start_missing: int = 0, seed: int = 0) -> Routes:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(2 * S)]).reshape(2, S, TOP_K)
    mask = torch.rand(2, S, generator=g) > 0.15
    mask[:, :start_missing] = False
    mask[:, -1] = False  # the last token: never fed back
    return Routes(ids.masked_fill(~mask[..., None], -1), mask)


def _seq(routes: Routes) -> RoutedSequence:
    S = routes.num_positions
    return RoutedSequence(torch.arange(3, 3 + S), 4, routes, torch.linspace(-2, -0.1, S - 4).double())


@pytest.mark.parametrize("layout", ["vllm", "vllm_split", "sglang", "nemo_rl", "prime_rl"])
def test_every_jsonl_layout_round_trips(layout):
    seq = _seq(_random_routes())
    line = json.loads(write_line(seq, layout_fields(layout, seq, CONFIG)))
    back = parse_line(line, CONFIG)
    assert back.routes.equals(seq.routes), layout
    assert torch.equal(back.tokens, seq.tokens) and back.prompt_len == seq.prompt_len
    assert torch.equal(back.engine_logprobs, seq.engine_logprobs)
    assert detect_line(line) == ("vllm" if layout == "vllm_split" else layout)


@pytest.mark.parametrize("layers", ["moe", "decoder"])
def test_vllm_sglang_prime_rl_with_a_start_and_either_numbering_round_trip(layers):
    r = _random_routes(start_missing=3)
    S = r.num_positions
    assert vllm.decode_vllm(write_vllm(r, config=CONFIG, layers=layers), config=CONFIG, num_tokens=S).equals(r)
    text = write_sglang(r, config=CONFIG, start=3, layers=layers)
    assert sglang.decode_sglang(text, config=CONFIG, num_tokens=S, start=3).equals(r)
    obj = write_prime_rl(r, config=CONFIG, start=3, layers=layers)
    assert obj["start"] == 3 and obj["dtype"] == "uint8"
    assert prime_rl.decode_prime_rl(obj, config=CONFIG, num_tokens=S).equals(r)
    env = write_nemo_rl(r, config=CONFIG, layers=layers)
    assert env.startswith(f"nrlre1:int16:{S}x{2 if layers == 'moe' else 3}x{TOP_K}:")
    assert nemo_rl.decode_nemo_rl(env, config=CONFIG, num_tokens=S).equals(r)


def test_verl_batch_slime_file_and_moe_lab_trace_file_round_trip(tmp_path):
    seqs = [_seq(_random_routes(S=9, seed=1)), _seq(_random_routes(S=11, seed=2))]
    rows, mask = write_verl([s.routes for s in seqs], config=CONFIG, seq_len=14, prompt_lens=[4, 4],
                                 prompt_width=6)
    back = verl.decode_verl(rows, mask, config=CONFIG)
    assert all(b.equals(s.routes) for b, s in zip(back, seqs))
    write_slime(tmp_path / "rollout_0.pt", seqs, config=CONFIG)
    read = read_input(tmp_path / "rollout_0.pt", CONFIG)
    assert all(r.routes.equals(s.routes) and torch.equal(r.tokens, s.tokens) for r, s in zip(read, seqs))
    assert torch.equal(read[1].engine_logprobs, seqs[1].engine_logprobs)


def test_missing_routes_are_a_mask_never_expert_0():
    rows = torch.tensor([[[0, 0], [3, 5], [0, 0]], [[0, 0], [-1, -1], [2, 7]]])  # [S=2, decoder layers 3, K]
    ids, mask = vllm.read_vllm(rows, config=CONFIG, num_tokens=3)
    assert mask.tolist() == [[True, False, False], [False, True, False]]  # zero row, -1, and a position not covered
    assert (ids[~mask] == -1).all() and ids[0, 0].tolist() == [3, 5] and ids[1, 1].tolist() == [2, 7]
    assert ids.dtype == torch.int64 and mask.dtype == torch.bool and ids.shape == (2, 3, TOP_K)
    top1 = {**CONFIG, "num_experts_per_tok": 1}
    ids1, mask1 = vllm.read_vllm(torch.zeros(2, 2, 1, dtype=torch.int16), config=top1)
    assert mask1.all() and (ids1 == 0).all()  # top_k 1: a zero row IS expert 0 (it cannot be told apart)
    final_placeholder = Routes(torch.tensor([[[4, 6], [0, 1]]] * 2), torch.ones(2, 2, dtype=torch.bool))
    placeholder = write_nemo_rl(final_placeholder, config=CONFIG)
    assert nemo_rl.decode_nemo_rl(placeholder, config=CONFIG).mask_LS[:, 1].logical_not().all()


def test_read_vllm_refuses_rows_past_the_tokens_and_shapes_of_no_numbering():
    rows = torch.randint(1, EXPERTS, (6, 3, TOP_K))
    with pytest.raises(ValueError, match="rows beyond num_tokens=5"):
        vllm.read_vllm(rows, config=CONFIG, num_tokens=5)
    with pytest.raises(ValueError, match=r"4 layer rows fit no layer numbering .*allowed 2 \(moe\), 3 \(decoder\)"):
        vllm.read_vllm(torch.randint(1, EXPERTS, (6, 4, TOP_K)), config=CONFIG)
    with pytest.raises(ValueError, match="num_experts_per_tok=2"):
        vllm.read_vllm(torch.randint(1, EXPERTS, (6, 3, 3)), config=CONFIG)


@pytest.mark.parametrize("line, match", [
    ({"prompt_ids": [1], "completion_ids": [2], "routed_experts": 3}, "int is none of the layouts"),
    ({"prompt_ids": [1], "completion_ids": [2], "routed_experts": "nrlre1:int64:1x2x2:AAAA"}, "allowed int8"),
    ({"prompt_ids": [1], "completion_ids": [2], "routed_experts": "%%%"}, "not valid base64"),
    ({"prompt_ids": "1", "completion_ids": [2], "routed_experts": []}, "prompt_ids: expected a list"),
    ({"prompt_ids": [1], "completion_ids": [2]}, "routed_experts: missing"),
])
def test_a_line_in_no_layout_is_one_clear_error(line, match):
    with pytest.raises(ValueError, match=match):
        parse_line(line, CONFIG)


@pytest.fixture(scope="module")
def model_and_routes(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "q3")
    model, config = load(path)
    return path, model, config


def test_imported_routes_replay_bit_identical_to_moe_lab_r3(model_and_routes, tmp_path):
    """moe_lab records a generation; the test's own hooks record the same one; the hooks' routes go out as a
    vLLM dump and come back in: replaying them gives moe_lab R3's log-probs bit for bit."""
    path, model, config = model_and_routes
    prompt = torch.tensor([[1, 5, 9, 4, 7]])
    torch.manual_seed(3)
    with record(model) as own:
        out = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0)
    torch.manual_seed(3)
    [seq] = generate_routes(model, [prompt[0].tolist()], 6, seed=3)
    assert torch.equal(seq.tokens, out[0])
    dump = write_vllm(seq.routes, config=config, stop=seq.num_tokens - 1)  # [S - 1, 3 decoder layers, K] int16
    routes = vllm.decode_vllm(dump, config=config, num_tokens=seq.num_tokens)
    imported = to_trace([routes], num_experts=EXPERTS, family="qwen3_moe", positions=seq.num_tokens - 1)
    assert torch.equal(imported.indices, own.indices)
    inputs = out[:, :-1]
    with torch.no_grad(), replay(model, own):
        want = torch.log_softmax(model(input_ids=inputs).logits, -1)
    with torch.no_grad(), replay(model, imported):
        got = torch.log_softmax(model(input_ids=inputs).logits, -1)
    assert torch.equal(got, want)
    save_with_tokens(tmp_path / "t.safetensors", own, out, torch.ones_like(out))
    [native] = read_input(tmp_path / "t.safetensors", config)
    assert torch.equal(native.routes.ids_LSK, routes.ids_LSK) and torch.equal(native.routes.mask_LS, routes.mask_LS)


def test_to_trace_refuses_missing_routes():
    r = _random_routes()
    with pytest.raises(ValueError, match="missing routes"):
        to_trace([r], num_experts=EXPERTS, family="qwen3_moe")
    full = full_sequence(torch.arange(4), 2, torch.tensor([[[1, 2]] * 4] * 2), 4).routes
    assert to_trace([full], num_experts=EXPERTS, family="qwen3_moe").shape == (2, 1, 4, TOP_K)


def test_numberings_of_one_length_are_pinned_by_the_layout_by_an_empty_row_or_named_as_ambiguous():
    """One dense layer and one MTP layer (GLM-4.5-Air's shape): `decoder` and `moe+mtp` both have 3 rows. vLLM
    writes the backbone only (pinned: `decoder`). An unpinned layout (verl rows) is decided by a row that is
    [0, 0] at every position - a placeholder no top-k router writes - when one reading keeps it as an MoE layer
    and the other drops it; where no such row decides, both readings and the flag are named; `layers=` picks."""
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "first_k_dense_replace": 1,
              "num_nextn_predict_layers": 1, "num_experts_per_tok": 2, "n_routed_experts": 8}
    rows = torch.tensor([[[0, 0], [1, 2], [3, 4]], [[0, 0], [5, 6], [7, 1]]])
    mask = torch.ones(1, 2, dtype=torch.long)
    for r in (rows, rows.roll(-1, dims=1)):  # the decoder axis, and the same routes one row early
        assert vllm.decode_vllm(r, config=config).layer_kind == "decoder"
    [dec] = verl.decode_verl(rows[None], mask, config=config)  # row 0 empty: only `decoder` drops it
    assert dec.layer_kind == "decoder" and dec.ids_LSK[:, 0].tolist() == [[1, 2], [3, 4]]
    [mtp] = verl.decode_verl(rows.roll(-1, dims=1)[None], mask, config=config)  # row 2 empty: `moe+mtp` drops it
    assert mtp.layer_kind == "moe+mtp" and mtp.ids_LSK[:, 0].tolist() == [[1, 2], [3, 4]]
    for undecided in (rows.clone(), torch.zeros_like(rows)):  # no empty row, and every row empty
        undecided[1, 0] = torch.tensor([2, 3]) if undecided.any() else 0
        with pytest.raises(AmbiguousLayerAxis, match=r"decoder and moe\+mtp .*--layers decoder\|moe\+mtp") as err:
            verl.decode_verl(undecided[None], mask, config=config)
        assert err.value.kinds == ["decoder", "moe+mtp"]
    one = {**config, "num_experts_per_tok": 1}  # top_k 1: a 0 is expert 0, no evidence of an empty row
    with pytest.raises(AmbiguousLayerAxis):
        verl.decode_verl(rows[..., :1][None], mask, config=one)
    shifted = verl.decode_verl(rows.roll(-1, dims=1)[None], mask, config=config, layers="moe+mtp")[0]
    assert shifted.layer_kind == "moe+mtp" and shifted.ids_LSK[:, 0].tolist() == [[1, 2], [3, 4]]


def test_a_trace_file_without_its_tokens_and_a_pickle_are_refused_in_one_line(tmp_path):
    from moe_lab.routing import Trace

    Trace(torch.zeros(2, 1, 4, TOP_K, dtype=torch.uint8), num_experts=EXPERTS, family="qwen3_moe").save(
        tmp_path / "bare.safetensors")
    with pytest.raises(ValueError, match="a moe_lab trace without its tokens"):
        read_input(tmp_path / "bare.safetensors", CONFIG)
    torch.save({"samples": [{"tokens": [1, 2], "response_length": 1, "rollout_routed_experts": object()}]},
               tmp_path / "rollout_0.pt")
    with pytest.raises(ValueError, match="not a slime debug rollout file readable without running code"):
        read_input(tmp_path / "rollout_0.pt", CONFIG)


def test_verl_rows_in_jsonl_are_read_with_format_verl(tmp_path):
    seq = _seq(_random_routes(seed=4))
    rows = write_vllm(seq.routes, config=CONFIG).tolist()
    (tmp_path / "v.jsonl").write_text(write_line(seq, {"routed_experts": rows}) + "\n")
    [back] = read_input(tmp_path / "v.jsonl", CONFIG, "verl")
    assert back.routes.layout == "verl" and back.routes.equals(seq.routes)
