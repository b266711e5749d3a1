"""`moe-lab check-trace` on the faults the stacks met in 2025-26 and on models with dense and MTP layers.

Clean traces of every served family with a dense first layer pass in every layout (NeMo-RL's placeholder rows
in dense layers are no route); a bf16 engine's clean trace passes while routes of an older policy
(`stale-routes`) and a stale prefix (`stale-prompt`) are named from their router margins; `repeated-rows`,
`physical-ids` and `layer0-overwritten` are named; a layer axis two numberings fit is `ambiguous-layer-axis`
unless the layout or `--layers` pins it; a shift by every offset the config allows is found; an SGLang file
keeps one layer numbering (a cut line reads as cut); a checkpoint that cannot load is bad input."""

from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest
import torch

from moe_lab.audit import trace_report
from moe_lab.cli import main
from moe_lab.formats.routes import RoutedSequence, Routes
from trace_dumps import (EXPERTS, TOP_K, forward_routes, generate_routes, layout_fields, load, older_policy,
                         tiny_checkpoint, tiny_multimodal_qwen35, write_jsonl)
from trace_writers import write_line, write_vllm

PROMPTS = [[1, 5, 7, 9, 3], [1, 11, 12], [1, 4, 4, 8, 20, 31, 6]]
LAYOUTS = ["vllm", "vllm_split", "sglang", "nemo_rl", "prime_rl"]


def _dump(tmp_path_factory, family: str, **overrides):
    path = tiny_checkpoint(tmp_path_factory.mktemp(family) / "ckpt", family, **overrides)
    model, config = load(path)
    return path, config, generate_routes(model, PROMPTS, 7), model


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def dumped(request, tmp_path_factory):
    return _dump(tmp_path_factory, request.param)


@pytest.fixture(scope="module", params=["glm4_moe", "ernie4_5_moe"])
def dense_first(request, tmp_path_factory):
    """GLM-4.5-Air's shape (a dense layer and Glm4MoeConfig's MTP layer) and ERNIE-4.5 (MoE from layer 1)."""
    return _dump(tmp_path_factory, request.param)


def _run(capsys, file, model_dir, *extra) -> tuple[int, str, str]:
    code = main(["check-trace", str(file), "--model", str(model_dir), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def _named(out: str) -> list[str]:
    return [line.split(":")[1].strip() for line in out.splitlines() if line.startswith("fault:")]


def _agreement(out: str) -> float:
    return float(out.strip().splitlines()[-1].split()[1])


def _rows_file(path, seqs, rows_list) -> object:
    path.write_text("".join(write_line(s, {"routed_experts": r.tolist()}) + "\n" for s, r in zip(seqs, rows_list)))
    return path


def _decoder_rows(seq, config) -> np.ndarray:
    """vLLM's rows [S - 1, every decoder layer, K] of a generation (dense rows zero)."""
    return write_vllm(seq.routes, config=config, stop=seq.num_tokens - 1).astype(np.int64)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_clean_traces_of_dense_first_families_pass_in_every_layout(dense_first, tmp_path, capsys, layout):
    path, config, seqs, _ = dense_first
    code, out, err = _run(capsys, write_jsonl(tmp_path / "d.jsonl", seqs, layout, config), path)
    assert (code, err) == (0, ""), out
    assert _agreement(out) == 1.0 and "fault:" not in out


def test_a_multimodal_qwen3_5_moe_checkpoint_is_served_through_its_text_model(tmp_path, capsys):
    from transformers import Qwen3_5MoeForCausalLM

    path = tiny_multimodal_qwen35(tmp_path / "qwen35")
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    text_model = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = {"model_type": "qwen3_5_moe_text", **json.loads((path / "config.json").read_text())["text_config"]}
    seqs = generate_routes(text_model, PROMPTS[:2], 5)
    capsys.readouterr()  # the test's own saving and loading
    code, out, err = _run(capsys, write_jsonl(tmp_path / "d.jsonl", seqs, "vllm", config), path)
    assert (code, err) == (0, ""), out
    assert _agreement(out) == 1.0  # the routes of the checkpoint's own language weights, not a fresh init


def test_nemo_rl_placeholder_rows_in_dense_layers_are_no_route(dense_first, tmp_path, capsys):
    """NeMo-RL writes 0..K-1 in the dense rows: read as carrying ids, those rows would be a fault."""
    path, config, seqs, _ = dense_first
    env = layout_fields("nemo_rl", seqs[0], config)["routed_experts"]
    from moe_lab.formats.nemo_rl import decode_nemo_rl, parse_envelope
    rows = parse_envelope(env)
    assert rows.shape[1] == config["num_hidden_layers"] and (rows[:, 0] == torch.arange(TOP_K)).all()
    routes = decode_nemo_rl(env, config=config, num_tokens=seqs[0].num_tokens)
    assert routes.dropped_nonzero == () and routes.equals(seqs[0].routes)


def test_glm_shape_axis_is_pinned_by_the_layout_or_an_empty_row_or_named_ambiguous(tmp_path_factory, tmp_path,
                                                                                    capsys):
    """decoder (3 rows) and moe+mtp (3 rows) read the same bytes: vLLM pins decoder; rows of an unpinned
    layout (verl) whose row 0 is [0, 0] at every token (no top-k router writes that) are the decoder axis;
    where no row decides, ambiguous-layer-axis with the flag named; --layers picks; a missing layer is
    missing-layer; the routes one row early are a layer shift, never a clean moe+mtp reading."""
    path, config, seqs, _ = _dump(tmp_path_factory, "glm4_moe")
    rows = [_decoder_rows(s, config) for s in seqs]
    clean = _rows_file(tmp_path / "c.jsonl", seqs, rows)
    code, out, _ = _run(capsys, clean, path, "--format", "verl")
    assert code == 0 and _agreement(out) == 1.0 and "layer axis decoder" in out, out
    undecided = [r.copy() for r in rows]
    for r in undecided:  # row 0 carries ids at one position: neither reading is excluded
        r[0, 0] = r[0, 1]
    code, out, _ = _run(capsys, _rows_file(tmp_path / "u.jsonl", seqs, undecided), path, "--format", "verl")
    assert code == 1 and _named(out) == ["ambiguous-layer-axis"], out
    assert "--layers decoder|moe+mtp" in out
    code, out, _ = _run(capsys, clean, path, "--format", "verl", "--layers", "decoder")
    assert code == 0 and _agreement(out) == 1.0, out
    missing = [r.copy() for r in rows]
    for r in missing:
        r[:, 2] = 0
    code, out, err = _run(capsys, _rows_file(tmp_path / "m.jsonl", seqs, missing), path)
    assert code == 1 and "missing-layer" in _named(out) and err == "", out
    early = [np.concatenate([r[:, 1:], np.zeros_like(r[:, :1])], axis=1) for r in rows]
    code, out, _ = _run(capsys, _rows_file(tmp_path / "e.jsonl", seqs, early), path)
    assert code == 1 and "layer-shift" in _named(out), out


def test_a_layer_shift_by_the_dense_count_is_found(tmp_path_factory, tmp_path, capsys):
    """first_k_dense_replace=3: the MoE rows written 3 rows early (the dense layers not counted)."""
    path, config, seqs, _ = _dump(tmp_path_factory, "deepseek_v3", num_hidden_layers=8, first_k_dense_replace=3)
    shifted = []
    for s in seqs:
        r = _decoder_rows(s, config)
        shifted.append(np.concatenate([r[:, 3:], np.zeros_like(r[:, :3])], axis=1))
    code, out, _ = _run(capsys, _rows_file(tmp_path / "s.jsonl", seqs, shifted), path)
    assert code == 1 and "MoE layer i+3" in out and "layer-shift" in _named(out), out


def test_an_sglang_file_keeps_one_layer_numbering_and_a_cut_line_reads_as_cut(dumped, tmp_path, capsys):
    path, config, seqs, _ = dumped
    lines = [layout_fields("sglang", s, config) for s in seqs]
    flat = np.frombuffer(base64.b64decode(lines[2]["routed_experts"]), dtype="<i4")
    A = config["num_hidden_layers"]
    cut = next(n for n in range(flat.size - 1, 0, -1) if n % ((A - 1) * TOP_K) == 0 and n % (A * TOP_K))
    lines[2]["routed_experts"] = base64.b64encode(flat[:cut].tobytes()).decode()  # fits the MoE-only numbering
    (tmp_path / "s.jsonl").write_text("".join(write_line(s, f) + "\n" for s, f in zip(seqs, lines)))
    code, out, _ = _run(capsys, tmp_path / "s.jsonl", path)
    assert code == 1 and _named(out) == ["trace-too-short"], out
    assert "layer axis decoder" in out.splitlines()[0]


def _mixed(seqs, prompt_from, rest_from) -> list[RoutedSequence]:
    """Routes of ``prompt_from`` on the prompt's positions and of ``rest_from`` after (a prefix cache)."""
    out = []
    for s, p, r in zip(seqs, prompt_from, rest_from):
        ids = r.routes.ids_LSK.clone()
        ids[:, : s.prompt_len] = p.routes.ids_LSK[:, : s.prompt_len]
        out.append(RoutedSequence(s.tokens, s.prompt_len, Routes(ids, r.routes.mask_LS.clone()), s.engine_logprobs,
                                  s.where))
    return out


def test_a_bf16_engine_passes_while_older_routes_are_stale_by_their_margins(dumped, tmp_path, capsys):
    path, config, seqs, model = dumped
    bf16 = forward_routes(model, seqs, torch.bfloat16)
    code, out, _ = _run(capsys, write_jsonl(tmp_path / "b.jsonl", bf16, "vllm", config), path)
    assert code == 0 and "fault:" not in out, out
    margin = next(line for line in out.splitlines() if line.startswith("router margin"))
    assert margin.endswith("(no disagreement)") or " 0 beyond " in margin, margin
    old = forward_routes(older_policy(model, 0.3), seqs)
    code, out, _ = _run(capsys, write_jsonl(tmp_path / "o.jsonl", old, "vllm", config), path)
    assert 0.55 <= _agreement(out) <= 0.85  # the fixture: ~15% of the experts changed
    assert code == 1 and _named(out) == ["stale-routes"], out
    stale_prefix = _mixed(seqs, old, seqs)
    code, out, _ = _run(capsys, write_jsonl(tmp_path / "p.jsonl", stale_prefix, "vllm", config), path)
    assert code == 1 and _named(out) == ["stale-prompt"], out


def test_rows_repeated_over_padding_are_named(dumped, tmp_path, capsys):
    """SGLang #36404: one row copied over positions the model routes otherwise."""
    path, config, seqs, _ = dumped
    rows = [_decoder_rows(s, config) for s in seqs]
    rows[2][6:12] = rows[2][1]
    code, out, _ = _run(capsys, _rows_file(tmp_path / "r.jsonl", seqs, rows), path)
    assert code == 1 and "repeated-rows" in _named(out) and "line 3" in out, out


def test_physical_expert_ids_are_named_with_their_permutation(dumped, tmp_path, capsys):
    """vLLM #33013: each MoE layer's ids relabelled by a fixed permutation (the load balancer's slots)."""
    path, config, seqs, _ = dumped
    g = torch.Generator().manual_seed(5)
    perms = [torch.randperm(EXPERTS, generator=g).numpy() for _ in range(config["num_hidden_layers"])]
    rows = []
    for s in seqs:
        r = _decoder_rows(s, config)
        for a in range(1, r.shape[1]):  # the MoE rows (row 0 is the dense layer's zeros)
            r[:, a] = perms[a][r[:, a]]
        rows.append(r)
    code, out, _ = _run(capsys, _rows_file(tmp_path / "p.jsonl", seqs, rows), path)
    assert code == 1 and _named(out) == ["physical-ids"], out
    shown = int(perms[1][0])
    assert f"MoE layer 0: {{" in out and (f"{shown}: 0" in out or shown == 0), out


def _draft_ids(seq, seed: int = 9) -> np.ndarray:
    """A draft / MTP router of its own (random weights on one-hot tokens): top-k ids per fed position."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(64, EXPERTS, generator=g)[seq.tokens[:-1]]
    return scores.topk(TOP_K, -1).indices.numpy()


@pytest.mark.parametrize("layout", ["decoder", "moe"])
def test_a_draft_router_overwriting_layer_0_is_named(dumped, tmp_path, capsys, layout):
    """vLLM #48622. decoder: the dense row 0 carries the draft's ids; moe: MoE layer 0's row holds them."""
    path, config, seqs, _ = dumped
    rows = []
    for s in seqs:
        r = write_vllm(s.routes, config=config, stop=s.num_tokens - 1, layers=layout).astype(np.int64)
        r[:, 0] = _draft_ids(s)
        rows.append(r)
    code, out, _ = _run(capsys, _rows_file(tmp_path / "l.jsonl", seqs, rows), path)
    assert code == 1 and _named(out) == ["layer0-overwritten"], out


def test_every_fault_name_is_documented():
    doc = (__import__("pathlib").Path(__file__).parents[1] / "docs" / "traces.md").read_text()
    assert [f for f in trace_report.FAULTS if f"`{f}`" not in doc] == []


@pytest.mark.parametrize("case", ["config_only", "truncated", "mismatched"])
def test_a_checkpoint_that_cannot_load_is_bad_input_in_one_line(dumped, tmp_path, capsys, case):
    path, config, seqs, _ = dumped
    ckpt = tmp_path / "ckpt"
    if case == "config_only":
        ckpt.mkdir()
        shutil.copy(path / "config.json", ckpt / "config.json")
    else:
        shutil.copytree(path, ckpt)
    if case == "truncated":
        weights = ckpt / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    if case == "mismatched":
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["moe_intermediate_size"] = 24
        (ckpt / "config.json").write_text(json.dumps(cfg))
    code, out, err = _run(capsys, write_jsonl(tmp_path / "d.jsonl", seqs, "vllm", config), ckpt)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"--model={ckpt}" in err and ("model.safetensors" in err or case == "config_only"), err


def test_the_rounding_scale_of_a_tie_is_two_bf16_spacings_for_softmax_and_less_for_sigmoid_routers():
    """Moving the k-th and (k+1)-th logits one bf16 spacing (of the row's largest |logit|) toward each other
    erases 2 spacings of a softmax router's log-prob margin (the normaliser cancels) and (sigmoid(-z_k) +
    sigmoid(-z_k+1)) spacings of a sigmoid router's (d log sigmoid(z) / dz = sigmoid(-z))."""
    from moe_lab.audit.trace_run import tie_scale_S
    from moe_lab.models.families.routers import sigmoid_router_logp, softmax_router_logp

    z = torch.tensor([[3.0, 1.5, 1.25, -0.5], [-6.0, 0.7, 0.2, 0.1]])
    spacing = torch.tensor([2.0 ** -7 * 2, 2.0 ** -7 * 4])  # bf16 eps times 2^floor(log2 max|z|): 3 -> 2, 6 -> 4
    assert torch.allclose(tie_scale_S(softmax_router_logp, z, 2), 2 * spacing, rtol=1e-4)
    pair = torch.tensor([[1, 2], [2, 3]])  # the 2nd and 3rd largest of each row
    want = torch.sigmoid(-z.gather(1, pair)).sum(1) * spacing
    assert torch.allclose(tie_scale_S(sigmoid_router_logp, z, 2), want, rtol=2e-2)
