"""check-trace and volatility at scale: the chunked log-prob pass equals a full log-softmax; the output head
runs only for sequences carrying engine log-probs, over their completion only; --dtype auto is the
checkpoint's own dtype; --device auto is accelerate's device_map and reports what --device cpu reports (and
is bad input without accelerate); volatility never holds OLD and NEW at once and gives the figures it gives
with both loaded."""

from __future__ import annotations

import gc
import importlib.util
import json
import weakref

import pytest
import torch
import torch.nn.functional as F

from moe_lab.audit import check_trace, trace_run, volatility_run
from moe_lab.cli import main
from moe_lab.config import ModelConfig
from moe_lab.formats.routes import RoutedSequence
from moe_lab.models import build_model, checkpoint_dtype, load_model
from trace_dumps import VOCAB, generate_routes, load, tiny_checkpoint, write_jsonl

PROMPTS = [[1, 5, 7, 9, 3], [1, 11, 12], [1, 4, 4, 8, 20, 31, 6]]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe") / "ckpt", "qwen3_moe")
    model, config = load(path)
    return path, model, config, generate_routes(model, PROMPTS, 7)


def _run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["check-trace", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_chunked_log_prob_pass_equals_a_full_log_softmax(dumped, monkeypatch):
    _, model, _, seqs = dumped
    tokens, start = seqs[2].tokens, 5
    with torch.no_grad():
        full = F.log_softmax(model(input_ids=tokens[None]).logits[0, :-1].double(), -1)
    want = full.gather(1, tokens[1:, None])[:, 0]
    monkeypatch.setattr(trace_run, "LOGP_CHUNK_ELEMENTS", 3 * VOCAB)  # 3 positions a chunk: 4 chunks here
    got = trace_run.free_pass(model, tokens, torch.device("cpu"), logp_from=start).token_logp_S
    assert got.dtype == torch.float64 and torch.equal(got[:start], torch.zeros(start, dtype=torch.float64))
    torch.testing.assert_close(got[start:], want[start - 1:], atol=1e-5, rtol=0)
    assert trace_run.free_pass(model, tokens, torch.device("cpu")).token_logp_S is None


def _counting_head(monkeypatch) -> list[int]:
    """Rows the loaded model's output head computes, over the whole command."""
    rows: list[int] = []
    original = check_trace._load

    def load_and_count(*args):
        model = original(*args)
        model.get_output_embeddings().register_forward_hook(lambda m, a, o: rows.append(a[0].shape[-2]))
        return model
    monkeypatch.setattr(check_trace, "_load", load_and_count)
    return rows


def test_the_head_runs_only_for_completions_that_carry_engine_log_probs(dumped, tmp_path, capsys, monkeypatch):
    path, _, config, seqs = dumped
    rows = _counting_head(monkeypatch)
    no_logp = [RoutedSequence(s.tokens, s.prompt_len, s.routes, None, s.where) for s in seqs]
    code, out, _ = _run(capsys, write_jsonl(tmp_path / "plain.jsonl", no_logp, "vllm", config), "--model", path)
    assert code == 0 and "mismatch: no engine log-probs" in out and rows == []
    one = [seqs[0], *no_logp[1:]]  # only the first line carries them
    code, out, _ = _run(capsys, write_jsonl(tmp_path / "one.jsonl", one, "vllm", config), "--model", path)
    completion = seqs[0].num_tokens - seqs[0].prompt_len
    assert code == 0 and sum(rows) == 2 * completion  # free and replayed passes, completion positions only
    assert f"mismatch (replayed): {completion} tokens" in out


def test_dtype_auto_is_the_checkpoints_own(dumped, tmp_path, capsys, monkeypatch):
    path, model, config, seqs = dumped
    bf16 = tmp_path / "bf16"
    load(path)[0].to(torch.bfloat16).save_pretrained(bf16)
    assert checkpoint_dtype(path) == torch.float32 and checkpoint_dtype(bf16) == torch.bfloat16
    seen = []
    original = check_trace._load
    monkeypatch.setattr(check_trace, "_load", lambda *a: seen.append(original(*a)) or seen[-1])
    dump = write_jsonl(tmp_path / "d.jsonl", seqs, "vllm", config)
    for ckpt, extra, want in ((bf16, (), torch.bfloat16), (bf16, ("--dtype", "float32"), torch.float32),
                              (path, (), torch.float32)):
        code, _, err = _run(capsys, dump, "--model", ckpt, *extra)
        assert code in (0, 1) and err == ""
        assert {p.dtype for p in seen[-1].parameters()} == {want}
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), "dtype": "int8"}))
    monkeypatch.setattr(check_trace, "_load", lambda *a: pytest.fail("loaded a model on bad input"))
    code, out, err = _run(capsys, dump, "--model", odd)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1 and "dtype='int8'" in err


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate not installed")
def test_device_auto_is_accelerates_device_map_and_reports_what_cpu_reports(dumped, tmp_path, capsys, monkeypatch):
    path, _, config, seqs = dumped
    import moe_lab.models

    maps = []
    original = moe_lab.models.load_model
    monkeypatch.setattr(moe_lab.models, "load_model", lambda *a, **k: maps.append(k["device_map"]) or original(*a, **k))
    dump = write_jsonl(tmp_path / "d.jsonl", seqs, "vllm", config)
    cpu = _run(capsys, dump, "--model", path)
    auto = _run(capsys, dump, "--model", path, "--device", "auto")
    assert maps == [None, "auto"] and auto == cpu and cpu[0] == 0


def test_device_auto_without_accelerate_is_one_line_before_loading(dumped, tmp_path, capsys, monkeypatch):
    path, _, config, seqs = dumped
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else find(name, *a))
    monkeypatch.setattr(check_trace, "_load", lambda *a: pytest.fail("loaded a model on bad input"))
    code, out, err = _run(capsys, write_jsonl(tmp_path / "d.jsonl", seqs, "vllm", config), "--model", path,
                          "--device", "auto")
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1
    assert "--device=auto" in err and "pip install accelerate" in err


def test_volatility_holds_one_checkpoint_at_a_time_and_measures_what_both_loaded_give(tmp_path, monkeypatch):
    tiny = ModelConfig(family="qwen3_moe", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, num_experts=8,
                       top_k=2, moe_intermediate_size=32, intermediate_size=64, max_positions=64)
    model = build_model(tiny, VOCAB)
    model.save_pretrained(tmp_path / "old")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(tmp_path / "new")
    prompts = [[3 + (i * 7 + j) % 40 for j in range(2 + i % 4)] for i in range(5)]
    kw = dict(max_new_tokens=6, temperature=1.0, seed=0, batch_size=2)
    both = volatility_run.measure(load_model(tmp_path / "old"), load_model(tmp_path / "new"), prompts, **kw)
    alive_at_load, loaded = [], []

    def tracked(*args, **kwargs):
        gc.collect()
        alive_at_load.append(sum(ref() is not None for ref in loaded))
        out = load_model(*args, **kwargs)
        loaded.append(weakref.ref(out))
        return out
    monkeypatch.setattr(volatility_run, "load_model", tracked)
    one_at_a_time = volatility_run.run(tmp_path / "old", tmp_path / "new", prompts, dtype="auto", device="cpu", **kw)
    assert alive_at_load == [0, 0]  # NEW is loaded once OLD is gone
    assert one_at_a_time.per_layer == both.per_layer and one_at_a_time.summary == both.summary
    assert one_at_a_time.sequences == both.sequences and both.summary["expert_change"] > 0
