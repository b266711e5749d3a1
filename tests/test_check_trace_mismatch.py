"""check-trace's mismatch report. Engine log-probs are read from every stack's own field, written as each stack
holds them (tests/trace_writers.py), strictly; the engine's log-probs equal to the trainer's give zero mismatch
and no fault; the trainer's plus known noise give that noise's k1/k2/k3, NeMo-RL's seq_mult_prob_error and
verl's TIS shares, computed here from the noise alone; routes of another checkpoint (the engine's router bias
moved) give a mismatch that replaying the trace's routes removes; the verl- and NeMo-RL-named metrics equal
those stacks' functions, re-written here from their code (and verl's own, when verl is installed)."""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from moe_lab.algos import mismatch_metrics as mm
from moe_lab.audit import check_trace
from moe_lab.cli import main
from moe_lab.formats.jsonl import read_input
from trace_dumps import full_sequence, generate_routes, layout_fields, load, tiny_checkpoint, write_jsonl
from trace_writers import write_line, write_slime

PROMPTS = [[1, 5, 7, 9, 3], [1, 11, 12], [1, 4, 4, 8, 20, 31, 6]]
STACKS = ["moe_lab", "verl", "slime", "nemo_rl", "prime_rl", "sglang", "vllm", "openai"]
CONFIG = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "mlp_only_layers": [0], "num_local_experts": 8,
          "num_experts_per_tok": 2, "vocab_size": 48}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("qwen") / "ckpt", "qwen3_moe")
    model, config = load(path)
    return path, model, config, generate_routes(model, PROMPTS, 7)


def _synthetic(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 48, (9,), generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(2 * 8)]).reshape(2, 8, 2)
    return full_sequence(tokens, 4, ids, 9, -torch.rand(5, generator=g, dtype=torch.float64) * 4)


@pytest.mark.parametrize("stack", STACKS)
def test_engine_logprobs_are_read_from_every_stacks_field(tmp_path, stack):
    seq = _synthetic()
    (tmp_path / "d.jsonl").write_text(write_line(seq, layout_fields("vllm", seq, CONFIG), stack) + "\n")
    [back] = read_input(tmp_path / "d.jsonl", CONFIG)
    assert back.engine_logprobs.dtype == torch.float64 and torch.equal(back.engine_logprobs, seq.engine_logprobs)
    write_slime(tmp_path / "rollout_0.pt", [seq], config=CONFIG)
    [back] = read_input(tmp_path / "rollout_0.pt", CONFIG)
    assert torch.equal(back.engine_logprobs, seq.engine_logprobs)


def _broken(field: str, value):
    return lambda line: {**line, field: value}


@pytest.mark.parametrize("change, match", [
    (_broken("completion_logprobs", [-0.5] * 4), r"completion_logprobs: expected 5 numbers .*got 4 entries"),
    (_broken("rollout_log_probs", ["x"] * 5), r"rollout_log_probs: expected 5 numbers"),
    (_broken("generation_logprobs", [-0.5] * 7), r"generation_logprobs: expected 5 numbers .* or 9 .*got 7"),
    (_broken("completion_logprobs", [-0.5, 0.7, -1.0, -1.0, -1.0]), r"completion_logprobs\[1\]=0.7: expected a finite log-prob"),
    (lambda line: {**line, "output_token_logprobs": [[-0.1, t + 1, None] for t in line["completion_ids"]]},
     r"output_token_logprobs\[0\]: token id \d+, the completion's token there is \d+"),
    (lambda line: {**line, "logprobs": [{"999": -0.1}] * 5}, r"logprobs\[0\]: no entry for the completion's token"),
    (_broken("logprobs", {"top": 1}), r"logprobs: an object without content or token_logprobs"),
])
def test_a_log_prob_field_that_does_not_fit_is_one_error_naming_file_line_and_field(tmp_path, change, match):
    seq = _synthetic()
    seq.engine_logprobs = None
    line = json.loads(write_line(seq, layout_fields("vllm", seq, CONFIG)))
    (tmp_path / "d.jsonl").write_text(json.dumps(change(line)) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl line 1: " + match):
        read_input(tmp_path / "d.jsonl", CONFIG)


def test_slime_log_probs_of_another_length_are_refused(tmp_path):
    seq = _synthetic()
    seq.engine_logprobs = seq.engine_logprobs[:3]
    write_slime(tmp_path / "rollout_0.pt", [seq], config=CONFIG)
    with pytest.raises(ValueError, match=r"rollout_0.pt sample 0: rollout_log_probs: expected 5 numbers"):
        read_input(tmp_path / "rollout_0.pt", CONFIG)


def _trainer_logp(model, seq) -> torch.Tensor:
    """The trainer's log-probs of the completion tokens, from the test's own teacher-forced forward (float32
    logits and log-softmax, as check-trace's head pass)."""
    with torch.no_grad():
        logits = model(input_ids=seq.tokens[None]).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(1, seq.tokens[1:, None]).squeeze(1).double()
    return logp[seq.prompt_len - 1:]


def _report(capsys, tmp_path, file, model_dir, *extra) -> tuple[int, str, dict]:
    code = main(["check-trace", str(file), "--model", str(model_dir), "--json", str(tmp_path / "r.json"), *extra])
    out, err = capsys.readouterr()
    assert err == "", err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["lines"] == out.strip().splitlines()[1:]  # the JSON holds what was printed after the header
    return code, out, report


def test_engine_logprobs_equal_to_the_trainers_give_zero_mismatch_and_no_fault(qwen, tmp_path, capsys):
    path, model, config, seqs = qwen
    for s in seqs:
        s.engine_logprobs = _trainer_logp(model, s)
    code, out, report = _report(capsys, tmp_path, write_jsonl(tmp_path / "d.jsonl", seqs, "vllm", config, "verl"), path)
    assert code == 0 and "fault:" not in out and report["faults"] == [], out
    m = report["mismatch"]
    assert m["tokens"] == 21 and m["verdict"].startswith("mismatch verdict: none")
    for name in ("free", "replayed"):
        t = m[name]["token"]
        assert t["k3"] < 1e-12 and t["abs_delta_max"] < 1e-5 and t["abs_delta_above_ln2"] == 0.0
        assert m[name]["nemo_rl"]["seq_mult_prob_error"] == pytest.approx([1.0] * 3, abs=1e-5)
        assert all(v == 0.0 for level in ("rollout_is=token", "rollout_is=sequence", "rollout_rs=token_k1",
                                          "rollout_rs=seq_sum_k1") for v in m[name]["tis"][level].values())
    assert m["routing"]["router_disagreement"] == {"layer 1": 0.0, "layer 2": 0.0}


@pytest.mark.parametrize("stack", ["moe_lab", "nemo_rl", "sglang"])
def test_the_trainers_logprobs_plus_known_noise_give_the_k3_of_that_noise(qwen, tmp_path, capsys, stack):
    path, model, config, seqs = qwen
    rng = np.random.default_rng(7)
    noise = []
    for s in seqs:
        trainer = _trainer_logp(model, s)
        eps = rng.normal(0.0, 0.6, trainer.numel())
        eps = np.minimum(eps, -trainer.numpy() - 1e-3)  # an engine's log-prob stays below 0
        assert np.abs(np.abs(eps) - math.log(2)).min() > 1e-4  # no token on the ln 2 boundary
        s.engine_logprobs = trainer + torch.from_numpy(eps)
        noise.append(eps)
    code, out, report = _report(capsys, tmp_path, write_jsonl(tmp_path / "n.jsonl", seqs, "vllm", config, stack), path)
    eps = np.concatenate(noise)  # d = logp_trainer - logp_engine = -eps
    want = {"k1": eps.mean(), "k2": (eps ** 2 / 2).mean(), "k3": (np.exp(-eps) - 1 + eps).mean(),
            "abs_delta_mean": np.abs(eps).mean(), "abs_delta_above_ln2": (np.abs(eps) > math.log(2)).mean()}
    m = report["mismatch"]
    for name in ("free", "replayed"):
        t = m[name]["token"]
        assert {k: t[k] for k in want} == pytest.approx(want, abs=1e-6)
        assert t["ratio_outside_half_two"] == t["abs_delta_above_ln2"]
        assert m[name]["nemo_rl"]["seq_mult_prob_error"] == pytest.approx([np.exp(np.abs(e)).mean() for e in noise],
                                                                          rel=1e-6)
        seq_sums = np.array([-e.sum() for e in noise])
        assert m[name]["tis"]["rollout_is=token"]["rollout_corr/rollout_is_ratio_fraction_high"] == \
            pytest.approx((np.exp(-eps) > 2).mean())
        assert m[name]["tis"]["rollout_rs=seq_sum_k1"]["rollout_corr/rollout_rs_seq_sum_k1_seq_masked_fraction"] == \
            pytest.approx((np.abs(seq_sums) > math.log(2)).mean())
    assert m["routing"]["share_removed"] == pytest.approx(0.0, abs=1e-6)
    for i, (row, e) in enumerate(zip(m["per_sequence"], noise), 1):  # each line's own k3, named by its line
        assert row["where"].endswith(f"n.jsonl line {i}") and row["tokens"] == e.size
        assert row["k3_free"] == pytest.approx((np.exp(-e) - 1 + e).mean(), abs=1e-6)
    assert m["verdict"].startswith("mismatch verdict: numerics is the larger source"), m["verdict"]


def test_routes_of_another_checkpoint_give_a_routing_share_that_replay_removes(tmp_path_factory, tmp_path, capsys):
    """DeepSeek-V3's router picks with its correction bias but weighs without it: an engine whose bias moved
    routes otherwise with the same weights, so replaying its routes gives the trainer the engine's forward."""
    path = tiny_checkpoint(tmp_path_factory.mktemp("ds") / "ckpt", "deepseek_v3")
    model, config = load(path)
    engine = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, b in engine.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=g))
    seqs = generate_routes(engine, PROMPTS, 7)
    _, out, report = _report(capsys, tmp_path, write_jsonl(tmp_path / "r.jsonl", seqs, "vllm", config), path)
    m = report["mismatch"]
    r = m["routing"]
    assert r["k3_free"] > 1e-6 and r["k3_replayed"] < 1e-3 * r["k3_free"] and r["share_removed"] > 0.99
    assert r["k3_removed_by_replay"] == pytest.approx(r["k3_free"] - r["k3_replayed"])
    assert all(v > 0 for v in r["router_disagreement"].values())
    assert m["verdict"].startswith("mismatch verdict: routing is the larger source"), m["verdict"]
    assert m["verdict"] in out


def _batch(seed: int = 0):
    """Ragged [B, T] log-probs with a token far out of band (the +-20 exponent clamps are exercised)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 11
    engine = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5
    trainer = engine + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8
    trainer[1, 2] = engine[1, 2] + 25.0
    lengths = torch.tensor([11, 3, 7, 1, 9])
    mask = torch.arange(T)[None] < lengths[:, None]
    return engine, trainer, mask


def _verl_masked_mean(values, mask, axis=None):
    """verl.utils.torch_functional.masked_mean: sum(values * mask) / (mask.sum() + 1e-8)."""
    return (values * mask).sum(axis) / (mask.sum(axis) + 1e-8)


def _verl_offpolicy(old, rollout, mask):
    """verl's compute_offpolicy_metrics (verl/trainer/ppo/rollout_corr_helper.py), re-written from its code."""
    mask = mask.double()
    mean_train, mean_roll = _verl_masked_mean(old, mask, -1), _verl_masked_mean(rollout, mask, -1)
    log_ratio = old - rollout
    diff = mean_roll - mean_train
    rho = torch.exp(log_ratio.clamp(-20, 20))
    seq = (log_ratio * mask).sum(-1).clamp(-20, 20)
    return {"training_ppl": torch.exp(-mean_train).mean(), "training_log_ppl": (-mean_train).mean(),
            "kl": _verl_masked_mean(rollout - old, mask), "k3_kl": _verl_masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
            "rollout_ppl": torch.exp(-mean_roll).mean(), "rollout_log_ppl": (-mean_roll).mean(),
            "log_ppl_diff": diff.mean(), "log_ppl_abs_diff": diff.abs().mean(), "log_ppl_diff_max": diff.max(),
            "log_ppl_diff_min": diff.min(), "ppl_ratio": torch.exp(diff).mean(),
            "chi2_token": _verl_masked_mean(rho.square(), mask) - 1.0, "chi2_seq": torch.exp(2.0 * seq).mean() - 1.0}


def _verl_tis(old, rollout, mask, c):
    """verl 0.9.1's fractions, re-written from its code: compute_is_metrics (rollout_is token / sequence) and
    compute_rollout_rejection_mask's token_k1 and seq_sum_k1 options at threshold "c" (bounds [1/c, c])."""
    m = mask.double()
    log_ratio = old - rollout
    raw = torch.exp(log_ratio.clamp(-20, 20))
    seq = (log_ratio * m).sum(-1, keepdim=True)
    k1 = -log_ratio.clamp(-20, 20)
    keep_tok = ((k1 >= math.log(1 / c)) & (k1 <= math.log(c))).double()
    seq_k1 = (k1 * m).sum(-1)
    keep_seq = ((seq_k1 >= math.log(1 / c)) & (seq_k1 <= math.log(c)))[:, None].expand_as(m).double()
    valid = m.sum(-1) > 0

    def rs(option, keep):
        seq_keep = (~((keep == 0) & m.bool())).all(-1).double()
        return {f"rollout_corr/rollout_rs_{option}_masked_fraction": _verl_masked_mean(1 - keep, m),
                f"rollout_corr/rollout_rs_{option}_seq_masked_fraction": ((1 - seq_keep) * valid).sum() / valid.sum()}
    return {"rollout_is=token": {"rollout_corr/rollout_is_ratio_fraction_high": _verl_masked_mean((raw > c).double(), m),
                                 "rollout_corr/rollout_is_ratio_fraction_low": _verl_masked_mean((raw < 1 / c).double(), m)},
            "rollout_is=sequence": {"rollout_corr/rollout_is_ratio_fraction_high": (seq > math.log(c)).double().mean(),
                                    "rollout_corr/rollout_is_ratio_fraction_low": (seq < math.log(1 / c)).double().mean()},
            "rollout_rs=token_k1": rs("token_k1", keep_tok), "rollout_rs=seq_sum_k1": rs("seq_sum_k1", keep_seq)}


@pytest.mark.parametrize("threshold", [2.0, 1.3])
def test_verl_named_metrics_equal_verls_functions_on_the_same_tensors(threshold):
    engine, trainer, mask = _batch()
    ours = mm.verl_offpolicy(engine, trainer, mask)
    ref = {f"rollout_corr/{k}": float(v) for k, v in _verl_offpolicy(trainer, engine, mask).items()}
    assert ours == pytest.approx(ref, rel=1e-7, abs=1e-9)
    ours_tis = mm.verl_tis(engine, trainer, mask, threshold)
    ref_tis = _verl_tis(trainer, engine, mask, threshold)
    assert set(ours_tis) == set(ref_tis)
    for level, ref_level in ref_tis.items():
        assert ours_tis[level] == pytest.approx({k: float(v) for k, v in ref_level.items()}, abs=1e-9), level
    assert 0 < ours_tis["rollout_rs=token_k1"]["rollout_corr/rollout_rs_token_k1_masked_fraction"] < 1  # both occur


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed here")
@pytest.mark.parametrize("threshold", [2.0, 1.3])
def test_verl_named_metrics_equal_verl_itself(threshold):
    from verl.trainer.ppo import rollout_corr_helper as verl_rc

    engine, trainer, mask = _batch()
    m = mask.double()
    ours = mm.verl_offpolicy(engine, trainer, mask)
    theirs = verl_rc.compute_offpolicy_metrics(old_log_prob=trainer, rollout_log_prob=engine, response_mask=m)
    assert ours == pytest.approx({f"rollout_corr/{k}": float(v) for k, v in theirs.items()}, rel=1e-7, abs=1e-7)  # verl takes these means in float32
    tis = mm.verl_tis(engine, trainer, mask, threshold)
    for level in ("token", "sequence"):
        _, got = verl_rc.compute_rollout_correction_weights(trainer - engine, m, rollout_is=level,
                                                            rollout_is_threshold=threshold)
        assert tis[f"rollout_is={level}"] == pytest.approx(
            {f"rollout_corr/{k}": got[k] for k in ("rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low")},
            abs=1e-7)  # verl takes these shares in float32
    for option in ("token_k1", "seq_sum_k1"):
        _, got = verl_rc.compute_rollout_rejection_mask(trainer - engine, m, rollout_rs=option,
                                                        rollout_rs_threshold=str(threshold))
        assert tis[f"rollout_rs={option}"] == pytest.approx(
            {f"rollout_corr/{k}": got[k] for k in (f"rollout_rs_{option}_masked_fraction",
                                                    f"rollout_rs_{option}_seq_masked_fraction")}, abs=1e-7)  # verl takes these means in float32


def test_seq_mult_prob_error_is_nemo_rls_on_the_sequences_full_rows():
    """NeMo-RL's compute_and_apply_seq_logprob_error_masking, re-written from its code, on full-sequence rows
    (token 0 has no log-prob: [:, 1:]), equals ours on the completion tokens."""
    engine, trainer, mask = _batch(1)
    B, T = engine.shape
    prompt = 3  # each row: 3 prompt tokens (token_mask 0) then its completion tokens
    gen, prev, token_mask = (torch.zeros(B, prompt + T, dtype=torch.float64) for _ in range(3))
    gen[:, prompt:], prev[:, prompt:], token_mask[:, prompt:] = engine, trainer, mask.double()
    gen[:, 1:prompt], prev[:, 1:prompt] = -0.3, -2.0  # the prompt's entries never count
    lp_error = torch.abs(gen[:, 1:] - prev[:, 1:])
    m = token_mask[:, 1:] * torch.ones(B, dtype=torch.float64)[:, None]  # token_mask * sample_mask
    theirs = (torch.exp(lp_error * m) * m).sum(-1) / m.sum(-1).clamp(min=1)
    assert torch.allclose(mm.seq_mult_prob_error(engine, trainer, mask), theirs.double(), rtol=1e-12)


def test_a_threshold_out_of_range_is_bad_input_before_any_model_is_loaded(qwen, tmp_path, capsys, monkeypatch):
    path, _, config, seqs = qwen
    monkeypatch.setattr(check_trace, "_load", lambda *a: pytest.fail("loaded a model on bad input"))
    file = write_jsonl(tmp_path / "d.jsonl", seqs, "vllm", config)
    for extra, match in ((("--tis-threshold", "1"), "--tis-threshold=1.0: allowed a finite number > 1"),
                         (("--seq-error-threshold", "0.5"), "--seq-error-threshold=0.5"),
                         (("--json", str(tmp_path / "no" / "r.json")), "--json=.*its folder does not exist")):
        code = main(["check-trace", str(file), "--model", str(path), *extra])
        out, err = capsys.readouterr()
        assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1
        assert __import__("re").search(match, err), err


def test_per_token_rows_average_to_the_per_sequence_figures_and_replay_the_models_own_log_probs_exactly(
        qwen, tmp_path, capsys):
    """The per-token rows are the terms of the per-sequence and token-level means (one sequence's rows average
    to its k3, their max |d| is its max, all rows average to token.k3 and -k1); a dump whose engine log-probs are
    the model's own replayed ones (written, read back as float64) gives d = 0 exactly on every replayed row."""
    path, model, config, seqs = qwen
    _, _, first = _report(capsys, tmp_path, write_jsonl(tmp_path / "g.jsonl", seqs, "vllm", config), path)
    m = first["mismatch"]
    rows = m["per_token"]
    assert len(rows) == m["tokens"] == sum(s.engine_logprobs.numel() for s in seqs)
    for name in ("free", "replayed"):
        assert all(r[f"delta_{name}"] == r[f"logp_trainer_{name}"] - r["logp_engine"] for r in rows)
        d = np.array([r[f"delta_{name}"] for r in rows])
        assert np.mean([r[f"k3_{name}"] for r in rows]) == pytest.approx(m[name]["token"]["k3"], rel=1e-9, abs=1e-15)
        assert -d.mean() == pytest.approx(m[name]["token"]["k1"], rel=1e-9, abs=1e-15)
        for seq_row in m["per_sequence"]:
            mine = [r for r in rows if r["where"] == seq_row["where"]]
            assert [r["position"] for r in mine] == list(range(seq_row["tokens"]))
            assert np.mean([r[f"k3_{name}"] for r in mine]) == pytest.approx(seq_row[f"k3_{name}"], rel=1e-9,
                                                                             abs=1e-15)
            assert max(abs(r[f"delta_{name}"]) for r in mine) == seq_row[f"abs_delta_max_{name}"]
    assert [r["token"] for r in rows] == [t for s in seqs for t in s.tokens[s.prompt_len:].tolist()]
    assert m["routing"]["k3_free"] > 0 or m["routing"]["k3_replayed"] > 0  # generate()'s logits are not the head's

    replayed = iter(r["logp_trainer_replayed"] for r in rows)
    for s in seqs:
        s.engine_logprobs = torch.tensor([next(replayed) for _ in range(s.engine_logprobs.numel())],
                                         dtype=torch.float64)
    _, _, again = _report(capsys, tmp_path, write_jsonl(tmp_path / "own.jsonl", seqs, "vllm", config), path)
    m = again["mismatch"]
    assert [r["delta_replayed"] for r in m["per_token"]] == [0.0] * len(rows)
    assert [r["k3_replayed"] for r in m["per_token"]] == [0.0] * len(rows)
    assert m["replayed"]["token"]["k3"] == 0.0 and m["routing"]["k3_replayed"] == 0.0
