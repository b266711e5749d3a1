"""Tasks: rewards, demonstrations, held-out split, determinism and the shared character tokenizer."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from moe_lab.config import TaskConfig
from moe_lab.tasks import TASKS, VOCAB, encode_response, get_task, is_eval_prompt, position_score
from moe_lab.tasks.tokenizer import CHARS

NAMES = tuple(n for n in TASKS if n != "mixture")  # the single tasks; mixture: tests/test_mixture.py
FAST = settings(max_examples=25, deadline=None)


def task(name: str, **kw):
    return get_task(TaskConfig(name=name, **kw))


def small(name: str, partial: bool = False):
    # length 4 (2 for the additions): small enough to write answers by hand, large enough for 32 eval prompts
    return task(name, length=2 if "addition" in name else 4, partial_credit=partial, eval_size=32)


@pytest.fixture(scope="module")
def tasks():
    return {name: task(name) for name in NAMES}


# ----------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("partial", [False, True])
def test_demonstration_gets_full_reward(name, partial):
    t = task(name, partial_credit=partial)
    for p in t.sample_prompts(20, np.random.default_rng(1)) + t.eval_prompts()[:20]:
        assert t.reward(p, t.demonstration(p)) == 1.0


HAND = [  # (task, prompt, completion, exact, partial) worked out by hand
    ("sort", "3141=", "1134", 1.0, 1.0),
    ("sort", "3141=", "1143", 0.0, 2 / 4),
    ("sort", "3141=", "11", 0.0, 2 / 4),
    ("sort", "3141=", "113499", 0.0, 4 / 6),  # running past the answer is penalised
    ("sort", "3141=", "", 0.0, 0.0),
    ("reverse", "abch=", "hcba", 1.0, 1.0),
    ("reverse", "abch=", "abch", 0.0, 0.0),
    ("reverse", "abch=", "hcbb", 0.0, 3 / 4),
    ("addition", "47+85=", "132", 1.0, 1.0),
    ("addition", "47+85=", "131", 0.0, 2 / 3),
    ("addition", "05+03=", "008", 1.0, 1.0),
    ("addition", "05+03=", "8", 0.0, 0.0),  # the answer is zero-padded to length + 1 digits
    ("long_addition", "47+85=", "7+5+0=12,4+8+1=13;132", 1.0, 1.0),
    ("long_addition", "47+85=", "garbage scratchpad;132", 1.0, 1.0),  # only the final answer is graded
    ("long_addition", "47+85=", "7+5+0=12,4+8+1=13;122", 0.0, 2 / 3),
    ("long_addition", "47+85=", "7+5+0=12,4+8+1=13", 0.0, 0.0),  # no answer separator: no answer
    ("long_addition", "47+85=", "1;2;132", 1.0, 1.0),  # the answer follows the last separator
    ("long_copy", "abch=", "abch" * 8, 1.0, 1.0),
    ("long_copy", "abch=", "abch" * 7 + "abcc", 0.0, 31 / 32),
    ("long_copy", "abch=", "abch", 0.0, 4 / 32),  # stopping early: the missing letters count as errors
    ("long_copy", "abch=", "abch" * 9, 0.0, 32 / 36),  # running past the answer is penalised too
]


@pytest.mark.parametrize("name,prompt,completion,exact,partial", HAND)
def test_rewards_by_hand(name, prompt, completion, exact, partial):
    assert small(name).reward(prompt, completion) == exact
    assert small(name, partial=True).reward(prompt, completion) == pytest.approx(partial, abs=1e-12)


def test_long_addition_demonstration_by_hand():
    assert small("long_addition").demonstration("47+85=") == "7+5+0=12,4+8+1=13;132"
    assert small("long_addition").demonstration("00+00=") == "0+0+0=00,0+0+0=00;000"


@pytest.mark.parametrize("name", NAMES)
@FAST
@given(completion=st.text(max_size=200))
def test_garbage_never_crashes_and_stays_in_range(name, completion):
    exact_t, partial_t = small(name), small(name, partial=True)
    prompt = exact_t.eval_prompts()[0]
    exact, partial = exact_t.reward(prompt, completion), partial_t.reward(prompt, completion)
    assert exact in (0.0, 1.0) and 0.0 <= partial <= 1.0
    assert (partial == 1.0) == (exact == 1.0)


@given(a=st.text("0123", max_size=8), b=st.text("0123", max_size=8))
@FAST
def test_position_score_is_one_only_for_the_answer(a, b):
    if not a:
        with pytest.raises(ValueError, match="answer"):
            position_score(a, b)
        return
    score = position_score(a, b)
    assert 0.0 <= score <= 1.0 and (score == 1.0) == (a == b)


@pytest.mark.parametrize("name", NAMES)
def test_malformed_prompt_is_a_value_error(name):
    with pytest.raises(ValueError, match="prompt="):
        small(name).reward("12x=", "12")


def test_answers_satisfy_their_definition(tasks):
    rng = np.random.default_rng(2)
    for p in tasks["sort"].sample_prompts(50, rng):
        ans = tasks["sort"].answer(p)
        assert sorted(ans) == sorted(p[:-1]) and list(ans) == sorted(ans)
    for p in tasks["reverse"].sample_prompts(50, rng):
        assert tasks["reverse"].answer(p)[::-1] + "=" == p
    for p in tasks["addition"].sample_prompts(50, rng):
        a, b = p[:-1].split("+")
        assert int(tasks["addition"].answer(p)) == int(a) + int(b)


def test_long_addition_scratchpad_is_a_consistent_carry_chain(tasks):
    t = tasks["long_addition"]
    for p in t.sample_prompts(30, np.random.default_rng(3)):
        a, b = t.operands(p)
        pad, answer = t.demonstration(p).split(";")
        columns = pad.split(",")
        assert len(columns) == t.length
        carry, digits = 0, []
        for i, col in enumerate(columns):
            x, y, c, total = re.fullmatch(r"(\d)\+(\d)\+(\d)=(\d\d)", col).groups()
            assert (x, y) == (a[-1 - i], b[-1 - i]) and int(c) == carry
            assert int(total) == int(x) + int(y) + int(c)
            carry, digits = int(total[0]), [total[1]] + digits
        assert answer == str(carry) + "".join(digits) == t.answer(p)


# ----------------------------------------------------------------------------- lengths


def test_sort_lengths_match_the_paper_setup(tasks):
    t = tasks["sort"]
    p = t.sample_prompts(1, np.random.default_rng(0))[0]
    assert len(t.tokenizer(p)["input_ids"]) == t.prompt_tokens == 16 + 2  # BOS + 16 digits + "="
    assert len(encode_response(t.tokenizer, t.demonstration(p))) == t.max_new_tokens == 17


@pytest.mark.parametrize("name", NAMES)
def test_max_new_tokens_fits_every_demonstration(name, tasks):
    t = tasks[name]
    lens = {len(encode_response(t.tokenizer, t.demonstration(p)))
            for p in t.sample_prompts(50, np.random.default_rng(4))}
    assert lens == {t.max_new_tokens}  # fixed-width answers: every response has the same length


def test_long_addition_responses_are_long(tasks):
    t = tasks["long_addition"]
    for p in t.sample_prompts(10, np.random.default_rng(5)):
        assert len(encode_response(t.tokenizer, t.demonstration(p))) >= 60


# ----------------------------------------------------------------------------- sampling and split


@pytest.mark.parametrize("name", NAMES)
def test_sampling_is_seeded(name, tasks):
    t = tasks[name]
    first = t.sample_prompts(40, np.random.default_rng(7))
    assert first == t.sample_prompts(40, np.random.default_rng(7))
    assert first != t.sample_prompts(40, np.random.default_rng(8))
    assert all(len(p) == len(first[0]) for p in first)


@pytest.mark.parametrize("name", NAMES)
def test_eval_prompts_are_fixed_distinct_and_held_out(name, tasks):
    t = tasks[name]
    evals = t.eval_prompts()
    assert len(evals) == len(set(evals)) == t.cfg.eval_size
    assert evals == get_task(dataclasses.replace(t.cfg, partial_credit=True)).eval_prompts()
    assert all(is_eval_prompt(p) for p in evals)
    train = t.sample_prompts(3000, np.random.default_rng(9))
    assert not any(is_eval_prompt(p) for p in train)


def test_small_space_train_never_meets_eval():
    # 10^4 sort problems: 3000 draws cover much of the training share, yet none is an eval prompt
    t = small("sort")
    train = set(t.sample_prompts(3000, np.random.default_rng(10)))
    assert len(train) > 1000 and not train & set(t.eval_prompts())


def test_bad_config_is_a_value_error():
    with pytest.raises(ValueError, match="task.name"):
        get_task(TaskConfig(name="division"))
    with pytest.raises(ValueError, match="task.length=3"):
        get_task(TaskConfig(name="sort", length=3))
    with pytest.raises(ValueError, match="n=-1"):
        small("sort").sample_prompts(-1, np.random.default_rng(0))


# ----------------------------------------------------------------------------- tokenizer


def test_vocab_is_shared_with_fixed_special_ids(tasks):
    for t in tasks.values():
        tok = t.tokenizer
        assert len(tok) == len(VOCAB) == 48
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
        assert tok.get_vocab() == VOCAB


@given(text=st.text(CHARS, max_size=40))
@FAST
def test_tokenizer_round_trip(text, tasks):
    tok = tasks["sort"].tokenizer
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert encode_response(tok, text) == ids[1:] + [tok.eos_token_id]


def test_left_padding(tasks):
    tok = tasks["sort"].tokenizer
    prompts = ["12=", "34567=", "8="]
    enc = tok(prompts, padding=True, return_tensors="pt")
    for row, mask, p in zip(enc["input_ids"], enc["attention_mask"], prompts):
        n_pad = enc["input_ids"].shape[1] - len(p) - 1
        assert row[:n_pad].tolist() == [tok.pad_token_id] * n_pad and mask[:n_pad].sum() == 0
        assert row[n_pad:].tolist() == tok(p)["input_ids"] and bool(mask[n_pad:].all())


def test_save_load_round_trip(tmp_path, tasks):
    tok = tasks["long_addition"].tokenizer
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    prompts = tasks["long_addition"].eval_prompts()[:3] + ["1+2=", "abc"]
    assert loaded.padding_side == "left"
    assert loaded(prompts, padding=True)["input_ids"] == tok(prompts, padding=True)["input_ids"]
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
