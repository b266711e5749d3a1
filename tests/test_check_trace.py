"""`moe-lab check-trace`: a clean dump of generation routes (recorded with the test's own hooks, on tiny
checkpoints whose first layer is dense) gives agreement 1.0 and exit 0 in every layout, also when it ends one
position early; each injected fault is named and exits 1; replay that does not reach the experts is a fault;
bad input is one line and exit 2, before any model is loaded."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from moe_lab.audit import check_trace
from moe_lab.cli import main
from moe_lab.formats.native import save_with_tokens
from moe_lab.routing import record
from trace_dumps import full_sequence, generate_routes, layout_fields, load, tiny_checkpoint, write_jsonl
from trace_writers import write_line, write_slime, write_vllm

PROMPTS = [[1, 5, 7, 9, 3], [1, 11, 12], [1, 4, 4, 8, 20, 31, 6]]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def dumped(request, tmp_path_factory):
    """(checkpoint dir, its config.json, generation routes of PROMPTS)."""
    path = tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    model, config = load(path)
    return path, config, generate_routes(model, PROMPTS, 7)


def _run(capsys, file, model_dir, *extra) -> tuple[int, str, str]:
    code = main(["check-trace", str(file), "--model", str(model_dir), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def _agreement(out: str) -> float:
    last = out.strip().splitlines()[-1]
    assert last.startswith("agreement "), last
    return float(last.split()[1])


@pytest.mark.parametrize("layout", ["vllm", "vllm_split", "sglang", "nemo_rl", "prime_rl"])
def test_a_clean_generation_dump_agrees_fully_in_every_layout(dumped, tmp_path, capsys, layout):
    path, config, seqs = dumped
    assert all(not s.routes.mask_LS[:, -1].any() for s in seqs)  # generate() never forwards its last token
    code, out, err = _run(capsys, write_jsonl(tmp_path / "d.jsonl", seqs, layout, config), path)
    assert (code, err) == (0, ""), out
    assert _agreement(out) == 1.0 and "fault:" not in out
    assert "last position not covered: 3 of 3 sequences" in out
    assert "missing 0.0000" in out and "replay: experts run equal the trace's on" in out
    assert "mismatch (replayed): 21 tokens" in out  # the engine log-probs each line carries


def test_a_full_length_teacher_forced_trace_agrees_too(dumped, tmp_path, capsys):
    """Routes of every position (a teacher-forced forward over all tokens, the test's own hooks)."""
    path, config, seqs = dumped
    model, _ = load(path)
    full = []
    for s in seqs:
        [again] = generate_routes(model, [s.tokens.tolist()], 1)  # its prefill covers all of s's tokens
        full.append(full_sequence(s.tokens, s.prompt_len, again.routes.ids_LSK[:, : s.num_tokens], s.num_tokens))
    assert all(f.routes.mask_LS.all() for f in full)
    code, out, _ = _run(capsys, write_jsonl(tmp_path / "f.jsonl", full, "vllm", config), path)
    assert code == 0 and _agreement(out) == 1.0 and "last position not covered: 0 of 3" in out


def _vllm_rows(seq, config) -> np.ndarray:
    """vLLM's decoder-layer rows [S - 1, 3, K] of a generation (row 0 is the dense layer: zeros)."""
    return write_vllm(seq.routes, config=config, stop=seq.num_tokens - 1).astype(np.int64)


def _inject(fault: str, rows: np.ndarray) -> tuple[np.ndarray, int]:
    """(rows with the fault, routed_experts_start_len to declare)."""
    rows = rows.copy()
    if fault == "layer-shift":  # the MoE rows written one decoder row too early: the dense row 0 gets layer 1's
        rows[:, :-1], rows[:, -1] = rows[:, 1:].copy(), 0
    elif fault == "position-shift":  # rows of positions 1.. sent as if they started at 0
        rows = rows[1:]
    elif fault == "missing-layer":
        rows[:, 2] = 0
    elif fault == "zeroed-rows":
        rows[2:4, 1] = 0
    elif fault == "trace-too-long":
        rows = np.concatenate([rows, rows[-2:]])
    elif fault == "missing-positions":
        rows[1:3] = 0
    return rows, 0


@pytest.mark.parametrize("fault", ["layer-shift", "position-shift", "missing-layer", "zeroed-rows",
                                   "trace-too-long", "missing-positions"])
def test_each_injected_fault_is_named_and_exits_1(dumped, tmp_path, capsys, fault):
    path, config, seqs = dumped
    lines = []
    for s in seqs:
        rows, _ = _inject(fault, _vllm_rows(s, config))
        lines.append(write_line(s, {"routed_experts": rows.tolist()}))
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = _run(capsys, tmp_path / "bad.jsonl", path)
    assert code == 1 and err == "", out
    named = [line.split(":")[1].strip() for line in out.splitlines() if line.startswith("fault:")]
    assert fault in named, out
    assert out.strip().splitlines()[-1].startswith("agreement ")


def test_routes_of_the_completion_only_are_named(dumped, tmp_path, capsys):
    """vLLM's per-choice rows without the prompt's (prompt_routed_experts dropped), read from position 0."""
    path, config, seqs = dumped
    lines = [write_line(s, {"routed_experts": _vllm_rows(s, config)[s.prompt_len:].tolist()}) for s in seqs]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    code, out, _ = _run(capsys, tmp_path / "c.jsonl", path)
    assert code == 1 and "fault: completion-only:" in out, out


def test_routes_of_a_sglang_start_are_accepted_and_a_wrong_start_is_a_position_shift(dumped, tmp_path, capsys):
    path, config, seqs = dumped
    good, bad = [], []
    for s in seqs:
        rows = _vllm_rows(s, config)[:, 1:]  # SGLang: MoE layers only, positions [start, S - 1)
        b64 = lambda r: base64.b64encode(np.ascontiguousarray(r).astype("<i4").tobytes()).decode()  # noqa: E731
        good.append(write_line(s, {"routed_experts": b64(rows[2:]), "routed_experts_start_len": 2}))
        bad.append(write_line(s, {"routed_experts": b64(rows[2:]), "routed_experts_start_len": 1}))
    (tmp_path / "good.jsonl").write_text("\n".join(good) + "\n")
    (tmp_path / "bad.jsonl").write_text("\n".join(bad) + "\n")
    code, out, _ = _run(capsys, tmp_path / "good.jsonl", path)
    assert code == 0 and _agreement(out) == 1.0
    code, out, _ = _run(capsys, tmp_path / "bad.jsonl", path)
    assert code == 1 and "fault: position-shift" in out


def test_moe_lab_trace_files_and_slime_dumps_are_read(dumped, tmp_path, capsys):
    path, config, seqs = dumped
    model, _ = load(path)
    prompt = torch.tensor([PROMPTS[0]])
    with record(model) as trace:
        out_ids = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    save_with_tokens(tmp_path / "t.safetensors", trace, out_ids, torch.ones_like(out_ids))
    code, out, _ = _run(capsys, tmp_path / "t.safetensors", path)
    assert code == 0 and _agreement(out) == 1.0
    write_slime(tmp_path / "rollout_0.pt", seqs, config=config)
    code, out, _ = _run(capsys, tmp_path / "rollout_0.pt", path)
    assert code == 0 and _agreement(out) == 1.0 and "layout slime" in out


def test_replay_that_does_not_reach_the_experts_is_a_fault(dumped, tmp_path, capsys, monkeypatch):
    """A MoE block that routes on its own and ignores its router module's (replayed) output: R3 silently
    does nothing - check-trace's experts probe sees the experts run the block's own choice."""
    path, config, seqs = dumped
    if config["model_type"] != "qwen3_moe":
        pytest.skip("one family is enough for the block patch")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mq

    def own_routing(self, hidden_states):
        B, S, H = hidden_states.shape
        flat = hidden_states.view(-1, H)
        self.gate(flat)  # the router module still runs (its hooks fire), but its output is dropped
        probs = torch.softmax(torch.nn.functional.linear(flat, self.gate.weight).float(), -1)
        w, ids = probs.topk(self.gate.top_k, -1)
        return self.experts(flat, ids, (w / w.sum(-1, keepdim=True)).to(flat.dtype)).reshape(B, S, H)

    monkeypatch.setattr(mq.Qwen3MoeSparseMoeBlock, "forward", own_routing)
    rows = [_vllm_rows(s, config) for s in seqs]
    for r in rows:  # routes the model would never choose: replay must force them, and here it cannot
        r[:, 1:] = (r[:, 1:] + 1) % 8
    (tmp_path / "other.jsonl").write_text("".join(write_line(s, {"routed_experts": r.tolist()}) + "\n"
                                                  for s, r in zip(seqs, rows)))
    code, out, _ = _run(capsys, tmp_path / "other.jsonl", path)
    assert code == 1 and "fault: replay-no-effect" in out, out


@pytest.mark.parametrize("case, match", [
    ("no_file", "FILE=.*no such file"),
    ("not_a_layout", "line 1: routed_experts: int is none of the layouts"),
    ("bad_layers", "line 1: routed_experts: 5 layer rows fit no layer numbering"),
    ("not_json", "line 1: not JSON"),
    ("a_number", "line 1: a JSON number, expected a JSON object"),
    ("an_array", "line 1: a JSON array, expected a JSON object"),
    ("no_model", "--model=.*no config.json"),
    ("unsupported", "model_type='llama' is not a family moe_lab serves"),
])
def test_bad_input_is_one_line_exit_2_and_loads_no_model(dumped, tmp_path, capsys, monkeypatch, case, match):
    path, config, seqs = dumped
    monkeypatch.setattr(check_trace, "_load", lambda *a: pytest.fail("loaded a model on bad input"))
    file, model_dir = tmp_path / "d.jsonl", path
    s = seqs[0]
    lines = {"not_a_layout": write_line(s, {"routed_experts": 3}),
             "bad_layers": write_line(s, {"routed_experts": [[[1, 2]] * 5] * 4}),
             "not_json": "{oops", "a_number": "3", "an_array": "[1, 2]"}
    if case in lines:
        file.write_text(lines[case] + "\n")
    elif case != "no_file":
        file.write_text(write_line(s, layout_fields("vllm", s, config)) + "\n")
    if case == "no_model":
        model_dir = tmp_path / "nowhere"
    if case == "unsupported":
        model_dir = tmp_path / "llama"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, out, err = _run(capsys, file, model_dir)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert __import__("re").search(match, err), err


def test_a_device_this_machine_lacks_is_bad_input_before_any_work(dumped, tmp_path, capsys, monkeypatch):
    path, config, seqs = dumped
    monkeypatch.setattr(check_trace, "_load", lambda *a: pytest.fail("loaded a model on bad input"))
    file = write_jsonl(tmp_path / "d.jsonl", seqs, "vllm", config)
    code, out, err = _run(capsys, file, path, "--device", "xyz")
    assert (code, out) == (2, "") and "--device=xyz: not a device" in err
    if not torch.cuda.is_available():
        code, _, err = _run(capsys, file, path, "--device", "cuda")
        assert code == 2 and "--device=cuda: torch sees no CUDA device" in err
