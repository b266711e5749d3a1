"""`moe-lab volatility`: its figures equal a count made here with our own forward hooks on the routers (not
moe_lab's record()) and our own log-probs, identical checkpoints give exactly 0, text prompts equal their
token ids, and bad input exits 2 with one line before any model is loaded."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from moe_lab import cli
from moe_lab.audit import volatility_run
from moe_lab.config import ModelConfig
from moe_lab.models import build_model
from moe_lab.models.families import FAMILIES
from moe_lab.tasks.tokenizer import build_tokenizer

VOCAB = 48  # the task tokenizer's vocabulary: OLD carries it for the text-prompt test
TINY = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, num_experts=8, top_k=2,
                   moe_intermediate_size=32, intermediate_size=64, max_positions=64)
PROMPTS = [[3 + (i * 7 + j) % 40 for j in range(2 + i % 4)] for i in range(6)]


def _save_pair(root, family: str, **overrides):
    """OLD (random init) and NEW (OLD with every router weight moved by seeded noise), saved with
    save_pretrained; for glm4_moe a real layout: the first decoder layer dense, an MTP layer in the config."""
    model = build_model(dataclasses.replace(TINY, family=family, **overrides), VOCAB)
    if family == "glm4_moe":
        spec, hf = FAMILIES[family], model.config
        hf.first_k_dense_replace, hf.num_hidden_layers, hf.num_nextn_predict_layers = 1, 3, 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = spec.model_cls._from_config(hf, dtype=torch.float32).eval()
    model.save_pretrained(root / "old")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, router in _routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=gen) * 0.3)
    model.save_pretrained(root / "new")
    return root / "old", root / "new"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    out = {}
    for family in ("qwen3_moe", "glm4_moe", "minimax_m2"):
        out[family] = _save_pair(tmp_path_factory.mktemp(family), family)
    build_tokenizer().save_pretrained(out["qwen3_moe"][0])
    return out


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    return path


def _routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer, router) found by class name in each decoder layer: our own search, not moe_layers()."""
    return [(i, m) for i, layer in enumerate(model.model.layers) for m in layer.modules()
            if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))]


def _own_pass(path, sequences) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor]]:
    """Per sequence, alone (no padding): each router's top-k ids at the response positions, seen by our own
    forward hooks, and the fp64 log-prob of each response token."""
    model = FAMILIES[json.loads((path / "config.json").read_text())["model_type"]].model_cls.from_pretrained(path)
    model.eval()
    ids, logps, seen = {i: [] for i, _ in _routers(model)}, [], {}
    hooks = [r.register_forward_hook(lambda mod, inp, out, i=i: seen.__setitem__(i, out[2]))
             for i, r in _routers(model)]
    for row in sequences:
        seq = torch.tensor(row["prompt_ids"] + row["completion_ids"])
        P, S = len(row["prompt_ids"]), len(row["prompt_ids"]) + len(row["completion_ids"])
        with torch.no_grad():
            logits = model(seq[None, :-1]).logits[0].double()
        for i in ids:
            ids[i].append(seen[i].reshape(S - 1, -1)[P - 1:])
        logps.append(F.log_softmax(logits[P - 1:], -1).gather(1, seq[P:, None])[:, 0])
    for h in hooks:
        h.remove()
    return ids, logps


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["volatility", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "minimax_m2"])
def test_volatility_matches_our_own_count_of_changed_experts(family, pairs, prompts_file, tmp_path, capsys):
    old, new = pairs[family]
    code, out, _ = _run(capsys, old, new, "--prompts", prompts_file, "--out", tmp_path, "--batch-size", 1,
                        "--max-new-tokens", 6, "--seed", 3)
    assert code == 0
    table = pd.read_parquet(tmp_path / "volatility.parquet")
    sequences = [json.loads(line) for line in (tmp_path / "sequences.jsonl").read_text().splitlines()]
    assert len(sequences) == len(PROMPTS) and [s["prompt_ids"] for s in sequences] == PROMPTS
    (ids_old, logp_old), (ids_new, logp_new) = _own_pass(old, sequences), _own_pass(new, sequences)
    k, layers = TINY.top_k, list(ids_old)
    assert table[table.scope == "layer"].layer.tolist() == layers  # glm4_moe: decoder layers 1, 2 (0 is dense)
    changed, any_changed = {}, None
    for i in layers:
        a, b = torch.cat(ids_old[i]), torch.cat(ids_new[i])
        overlap = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1)
        changed[i] = ((k - overlap) / k).double()
        any_changed = (overlap < k) if any_changed is None else any_changed | (overlap < k)
        row = table[(table.scope == "layer") & (table.layer == i)].iloc[0]
        assert row.expert_change == pytest.approx(float(changed[i].mean()), abs=1e-12)
        assert row.any_change == pytest.approx(float((overlap < k).double().mean()), abs=1e-12)
    every = table[table.scope == "all"].iloc[0]
    ours = float(torch.stack(list(changed.values())).mean())
    assert every.response_tokens == len(any_changed) and ours > 0
    assert every.expert_change == pytest.approx(ours, abs=1e-12)
    assert every.any_change == pytest.approx(float(any_changed.double().mean()), abs=1e-12)
    d = torch.cat(logp_new) - torch.cat(logp_old)
    assert every.logratio_var == pytest.approx(float(d.var(unbiased=False)), rel=1e-3, abs=1e-9)
    assert 0.0 <= every.routing_share <= 1.0 and every.router_shift > 0
    last = out.strip().splitlines()[-1].split()
    assert last[0] == "expert_change" and float(last[1]) == pytest.approx(ours, rel=1e-5)
    assert (tmp_path / "volatility.png").stat().st_size > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_identical_checkpoints_give_exactly_zero(dtype, pairs, prompts_file, tmp_path, capsys):
    old, _ = pairs["qwen3_moe"]
    twin = tmp_path / "twin"
    shutil.copytree(old, twin)
    code, out, _ = _run(capsys, old, twin, "--prompts", prompts_file, "--out", tmp_path / "out", "--dtype", dtype)
    assert code == 0 and out.strip().splitlines()[-1] == "expert_change 0"
    table = pd.read_parquet(tmp_path / "out" / "volatility.parquet")
    every = table[table.scope == "all"].iloc[0]
    assert every.response_tokens > 0
    for column in ("expert_change", "any_change", "router_shift"):
        assert (table[column] == 0.0).all(), column
    assert every.logratio_var == 0.0 and every.routing_share == 0.0


def test_text_prompts_are_their_token_ids(pairs, tmp_path, capsys):
    old, new = pairs["qwen3_moe"]
    tokenizer = build_tokenizer()
    texts = ["12+3", "7+40=", "999"]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ids))
    runs = [_run(capsys, old, new, "--prompts", tmp_path / f"{name}.jsonl", "--out", tmp_path / name)
            for name in ("text", "ids")]
    assert runs[0][0] == runs[1][0] == 0 and runs[0][1] == runs[1][1]


def _llama(path):
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)
    return path


BAD = {
    "missing prompts": (lambda p, t: [p["old"], p["new"], "--prompts", t / "nope.jsonl"], "it does not exist"),
    "unsupported family": (lambda p, t: [_llama(t / "llama"), p["new"], "--prompts", p["file"]],
                           "model_type='llama', not a supported MoE family: allowed qwen3_moe"),
    "other expert count": (lambda p, t: [p["old"], p["e4"], "--prompts", p["file"]],
                           "expected the same routing shape, got num_experts 8 vs 4"),
    "other family": (lambda p, t: [p["old"], p["glm"], "--prompts", p["file"]],
                     "expected checkpoints of one family, got qwen3_moe vs glm4_moe"),
    "no prompt_ids": (lambda p, t: [p["new"], p["new"], "--prompts", p["nokey"]],
                      "line 2: expected a JSON object with prompt_ids, a non-empty list of token ids"),
    "id out of vocab": (lambda p, t: [p["old"], p["new"], "--prompts", p["big"]],
                        r"line 1: prompt_ids: expected token ids in \[0, 48\)"),
    "bad count": (lambda p, t: [p["old"], p["new"], "--prompts", p["file"], "--max-new-tokens", 0],
                  "--max-new-tokens=0: expected an integer >= 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_line_before_loading(case, pairs, prompts_file, tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(volatility_run, "load_model", no_loading)
    e4_old, _ = _save_pair(tmp_path / "e4", "qwen3_moe", num_experts=4)
    (tmp_path / "nokey.jsonl").write_text('{"prompt_ids": [3, 4]}\n{"text_ids": [3, 4]}\n')
    (tmp_path / "big.jsonl").write_text('{"prompt_ids": [3, 48]}\n')
    paths = dict(old=pairs["qwen3_moe"][0], new=pairs["qwen3_moe"][1], e4=e4_old, glm=pairs["glm4_moe"][0],
                 file=prompts_file, nokey=tmp_path / "nokey.jsonl", big=tmp_path / "big.jsonl")
    argv, message = BAD[case]
    argv = argv(paths, tmp_path)
    capsys.readouterr()  # the setup's own save_pretrained progress bars
    code, out, err = _run(capsys, *argv, "--out", tmp_path / "out")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("moe-lab volatility: error: ")
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "out").exists()
