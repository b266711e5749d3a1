"""The character-level tokenizer shared by every task.

One fixed vocabulary for all tasks, so a model's embedding size never depends on the task and a
warmed-up model can be saved and reloaded together with its tokenizer (``save_pretrained`` /
``from_pretrained``). A prompt encodes as BOS + its characters (the post-processor adds the BOS);
a response as its characters + EOS (see :func:`encode_response`).
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3: build_model() is called with pad=0, bos=1, eos=2
# No task writes a space: rollout.decode_responses() strips spaces (robust to decoders that join tokens
# with one), so a space inside an answer would be lost. It stays in the vocabulary for free-form text.
CHARS = string.digits + string.ascii_lowercase + " +-=,;:|"
VOCAB = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}


def _backend() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token=UNK))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    # Every character is its own word; the WordLevel model then maps it to its id (unknown -> <unk>).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, VOCAB[BOS])])
    tok.decoder = decoders.Fuse()  # concatenate characters, no separator
    return tok


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh tokenizer: pad=0, bos=1, eos=2, unk=3, left padding (prompts end where generation starts)."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_backend(), pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                        unk_token=UNK, padding_side="left", clean_up_tokenization_spaces=False)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    return tokenizer


def load_tokenizer(path: str):
    """The tokenizer saved beside a checkpoint (offline), set up for RL: left padding, a pad token.

    Our own cold-start folders hold the character tokenizer; a real checkpoint brings its own (BPE etc.),
    and the tasks then speak through it: prompts and answers are plain text either way.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"model.checkpoint={path!r}: no tokenizer could be loaded from it ({err})") from None
    tokenizer.padding_side = "left"  # prompts must end where generation starts
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise ValueError(f"model.checkpoint={path!r}: its tokenizer has no EOS token; responses could never end")
    return tokenizer


def task_tokenizer(checkpoint: str | None):
    """The character tokenizer for a model built from a config, the checkpoint's own otherwise."""
    return build_tokenizer() if checkpoint is None else load_tokenizer(checkpoint)


def encode_response(tokenizer, text: str) -> list[int]:
    """Token ids of a response: its characters, then EOS (no BOS)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
