"""decode_responses: each row's text is the tokenizer's decode of its response tokens before the first EOS, with
special tokens and spaces dropped (the batched decode must not let rows leak into each other)."""

import torch

from moe_lab.rl.rollout import _response_mask, decode_responses
from moe_lab.tasks.tokenizer import build_tokenizer


def test_each_row_is_its_own_decode():
    tok = build_tokenizer()
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        B, N = (int(x) for x in torch.randint(1, 40, (2,), generator=gen))
        new_BN = torch.randint(0, len(tok), (B, N), generator=gen)  # specials (pad, bos, eos, unk) included
        resp_BN = _response_mask(new_BN, tok.eos_token_id)
        want = []
        for ids, keep in zip(new_BN.tolist(), resp_BN.tolist()):
            kept = [t for t, k in zip(ids, keep) if k and t != tok.eos_token_id]
            want.append(tok.decode(kept, skip_special_tokens=True).replace(" ", ""))
        assert decode_responses(tok, new_BN, resp_BN) == want


def test_rows_after_eos_and_empty_rows():
    tok = build_tokenizer()
    digits = [tok.convert_tokens_to_ids(c) for c in "0123"]
    new_BN = torch.tensor([[digits[0], tok.eos_token_id, digits[1]],
                           [tok.eos_token_id, digits[2], digits[3]],
                           [digits[3], digits[2], digits[1]]])
    assert decode_responses(tok, new_BN, _response_mask(new_BN, tok.eos_token_id)) == ["0", "", "321"]
