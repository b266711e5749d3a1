"""`moe_lab.audit.verify_replay`: the example of docs/traces.md ("In a trainer's test"), run as written on a
tiny checkpoint with batches laid out as verl, NeMo-RL and prime-rl lay them out, gives the verdict the
`check-trace` command gives for a dump of the same sequences (the same report lines, agreement and fault
names), clean and faulty; the per-layer [A, N, K] form and Routes give the same verdict; the model's train
mode is restored; a batch that does not fit is one ValueError."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_lab.audit import ReplayVerdict, assert_replay_ok, verify_replay
from moe_lab.cli import main
from moe_lab.formats.routes import RoutedSequence
from trace_dumps import generate_routes, load, tiny_checkpoint, write_jsonl
from trace_writers import encode, write_line, write_verl, write_vllm

PROMPTS = [[1, 5, 7, 9, 3], [1, 11, 12], [1, 4, 4, 8, 20, 31, 6]]
DOC = Path(__file__).resolve().parents[1] / "docs" / "traces.md"


def _doc_example() -> dict:
    """The python block under "In a trainer's test", executed as written."""
    text = DOC.read_text(encoding="utf-8").split("## In a trainer's test", 1)[1]
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("qwen3_moe") / "ckpt", "qwen3_moe")
    model, config = load(path)
    seqs = [RoutedSequence(s.tokens, s.prompt_len, s.routes, None, s.where)  # no engine log-probs: a trainer's
            for s in generate_routes(model, PROMPTS, 7)]                   # batch has none to compare
    return path, model, config, seqs


def _command(capsys, tmp_path, seqs, path, config, rows=None) -> tuple[int, list[str]]:
    """check-trace on a JSONL dump of ``seqs`` (vLLM rows, or the given rows per sequence): (exit, the lines
    after its header)."""
    if rows is None:
        file = write_jsonl(tmp_path / "d.jsonl", seqs, "vllm", config)
    else:
        file = tmp_path / "d.jsonl"
        file.write_text("".join(write_line(s, {"routed_experts": r.tolist()}) + "\n" for s, r in zip(seqs, rows)))
    capsys.readouterr()
    code = main(["check-trace", str(file), "--model", str(path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("check-trace: ")
    return code, out[1:]


def _verl_batch(seqs, config, shift: bool = False) -> dict:
    """verl's layout: prompts right-aligned in a prompt block, responses after it, every decoder layer."""
    width, longest = max(s.prompt_len for s in seqs), max(s.num_tokens - s.prompt_len for s in seqs)
    routed, mask = write_verl([s.routes for s in seqs], config=config, seq_len=width + longest,
                              prompt_lens=[s.prompt_len for s in seqs], prompt_width=width)
    if shift:  # the MoE rows written one decoder row too early (verl #5037's kind of bug)
        routed[:, :, :-1], routed[:, :, -1] = routed[:, :, 1:].clone(), 0
    input_ids = torch.zeros_like(mask)
    for b, s in enumerate(seqs):
        input_ids[b, mask[b].bool()] = s.tokens
    return {"routed_experts": routed, "input_ids": input_ids, "attention_mask": mask}


def _vllm_rows(seq, config, shift: bool = False) -> np.ndarray:
    rows = write_vllm(seq.routes, config=config, stop=seq.num_tokens - 1).astype(np.int64)
    if shift:
        rows[:, :-1], rows[:, -1] = rows[:, 1:].copy(), 0
    return rows


def test_the_verl_example_gives_the_commands_verdict(setup, tmp_path, capsys):
    path, model, config, seqs = setup
    verdict = _doc_example()["check_verl_batch"](model, _verl_batch(seqs, config))
    code, lines = _command(capsys, tmp_path, seqs, path, config)
    assert code == 0 and verdict.ok and isinstance(verdict, ReplayVerdict)
    assert list(verdict.lines) == lines and verdict.agreement == 1.0


def test_a_shifted_layer_axis_is_the_same_fault_as_the_command_and_fails_the_assertion(setup, tmp_path, capsys):
    path, model, config, seqs = setup
    batch = _verl_batch(seqs, config, shift=True)
    verdict = verify_replay(model, batch["routed_experts"], batch["input_ids"], attention_mask=batch["attention_mask"])
    code, lines = _command(capsys, tmp_path, seqs, path, config, [_vllm_rows(s, config, shift=True) for s in seqs])
    assert code == 1 and not verdict.ok
    assert list(verdict.lines) == lines
    assert "layer-shift" in verdict.fault_names
    assert verdict.fault_names == [line.split(":")[1].strip() for line in lines if line.startswith("fault:")]
    with pytest.raises(AssertionError, match="layer-shift") as caught:
        _doc_example()["check_verl_batch"](model, batch)
    assert str(verdict) in str(caught.value)


def test_the_nemo_rl_example_gives_the_commands_verdict(setup, tmp_path, capsys):
    """NeMo-RL: [batch, seq, num_moe_layers, topk], right-padded, -1 where vLLM returned no route."""
    path, model, config, seqs = setup
    S = max(s.num_tokens for s in seqs)
    routed = torch.full((len(seqs), S, 2, 2), -1, dtype=torch.long)
    input_ids = torch.zeros(len(seqs), S, dtype=torch.long)
    for b, s in enumerate(seqs):
        routed[b, : s.num_tokens] = encode(s.routes, config, layers="moe", missing=-1)
        input_ids[b, : s.num_tokens] = s.tokens
    data = {"routed_experts": routed, "input_ids": input_ids,
            "input_lengths": torch.tensor([s.num_tokens for s in seqs])}
    verdict = _doc_example()["check_nemo_rl_batch"](model, data)
    code, lines = _command(capsys, tmp_path, seqs, path, config)
    assert code == 0 and list(verdict.lines) == lines


def test_the_prime_rl_example_checks_each_packed_sample_as_the_command_does(setup, tmp_path, capsys):
    """prime-rl: the samples packed in one row, then a padding tail (position_ids restarting, loss_mask False)."""
    path, model, config, seqs = setup
    pad = 3
    routed = torch.cat([encode(s.routes, config, layers="decoder", missing=0) for s in seqs]
                       + [torch.zeros(pad, 3, 2, dtype=torch.long)])[None]
    micro_batch = {"routed_experts": routed,
                   "input_ids": torch.cat([s.tokens for s in seqs] + [torch.zeros(pad, dtype=torch.long)])[None],
                   "position_ids": torch.cat([torch.arange(s.num_tokens) for s in seqs] + [torch.arange(pad)])[None],
                   "loss_mask": torch.cat([torch.ones(s.num_tokens, dtype=torch.bool) for s in seqs]
                                          + [torch.zeros(pad, dtype=torch.bool)])[None]}
    verdicts = _doc_example()["check_prime_rl_micro_batch"](model, micro_batch)
    assert len(verdicts) == len(seqs)
    for s, verdict in zip(seqs, verdicts):
        code, lines = _command(capsys, tmp_path, [s], path, config)
        assert code == 0 and list(verdict.lines) == lines


def test_per_layer_rows_and_routes_objects_give_the_same_verdict(setup):
    """[A, N, K] (Megatron's per-layer target indices; N the real tokens, or every column) and Routes."""
    _, model, config, seqs = setup
    batch = _verl_batch(seqs, config, shift=True)
    routed, ids, mask = batch["routed_experts"], batch["input_ids"], batch["attention_mask"]
    want = verify_replay(model, routed, ids, attention_mask=mask)
    real_ANK = routed[mask.bool()].permute(1, 0, 2)
    every_ANK = routed.reshape(-1, *routed.shape[2:]).permute(1, 0, 2)
    assert verify_replay(model, real_ANK, ids, attention_mask=mask) == want
    assert verify_replay(model, every_ANK, ids, attention_mask=mask) == want
    clean = _verl_batch(seqs, config)
    from_routes = verify_replay(model, [s.routes for s in seqs], clean["input_ids"],
                                attention_mask=clean["attention_mask"])
    assert from_routes == verify_replay(model, clean["routed_experts"], clean["input_ids"],
                                        attention_mask=clean["attention_mask"])


def test_the_models_mode_is_restored_and_does_not_change_the_verdict(setup):
    _, model, config, seqs = setup
    batch = _verl_batch(seqs[:1], config)
    args = (batch["routed_experts"], batch["input_ids"])
    in_eval = verify_replay(model, *args, attention_mask=batch["attention_mask"])
    model.train()
    try:
        in_train = verify_replay(model, *args, attention_mask=batch["attention_mask"])
        assert model.training
    finally:
        model.eval()
    assert in_train == in_eval


def test_min_agreement_fails_a_fault_free_verdict_below_it(setup):
    _, model, config, seqs = setup
    batch = _verl_batch(seqs, config)
    routed = batch["routed_experts"].clone()
    col = batch["attention_mask"][0].nonzero()[2, 0]  # one token of one layer routed elsewhere: no named fault
    routed[0, col, 1] = torch.tensor([e for e in range(8) if e not in routed[0, col, 1].tolist()][:2])
    verdict = assert_replay_ok(model, routed, batch["input_ids"], attention_mask=batch["attention_mask"])
    assert verdict.ok and verdict.agreement < 1.0
    with pytest.raises(AssertionError, match=r"agreement 0\.\d+ < 1\.0"):
        assert_replay_ok(model, routed, batch["input_ids"], attention_mask=batch["attention_mask"], min_agreement=1.0)


@pytest.mark.parametrize("case, match", [
    ("tokens", r"routes: \[layers, tokens, top_k\] \(3, 5, 2\) has 5 tokens"),
    ("rows", r"routes: expected \[batch, seq, layers, top_k\] over input_ids \(1, "),
    ("mask", r"attention_mask: shape"),
])
def test_a_batch_that_does_not_fit_is_one_value_error(setup, case, match):
    _, model, config, seqs = setup
    batch = _verl_batch(seqs, config)
    routed, ids, mask = batch["routed_experts"], batch["input_ids"], batch["attention_mask"]
    if case == "tokens":
        routed, mask = routed[0, :5].permute(1, 0, 2), None
    elif case == "rows":
        ids, mask = ids[:1], mask[:1]
    else:
        mask = mask[:, :-1]
    with pytest.raises(ValueError, match=match):
        verify_replay(model, routed, ids, attention_mask=mask)
