"""A policy loaded from a local checkpoint directory, with the tokenizer saved beside it, runs end to end."""

from __future__ import annotations

import pandas as pd
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from moe_lab.algos.ratio_metrics import DECOMP_KEYS
from moe_lab.config import ModelConfig, apply_overrides, from_dict, validate
from moe_lab.models import build_model
from moe_lab.tasks import get_task, load_tokenizer
from moe_lab.rl.loop import train

CHARS = "0123456789abcdefghijklmnopqrstuvwxyz+=,;:|-"


def foreign_tokenizer() -> PreTrainedTokenizerFast:
    """Not ours: other ids, no pad token, no BOS, extra tokens (as a real checkpoint's would differ)."""
    vocab = {"<unk>": 0, "<extra_0>": 1, "<eos>": 2, **{c: 10 + i for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def test_checkpoint_with_its_own_tokenizer_trains(tmp_path):
    ckpt = tmp_path / "ckpt"
    tok = foreign_tokenizer()
    cfg_model = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, num_experts=4, top_k=2,
                            moe_intermediate_size=32, intermediate_size=64)
    model = build_model(cfg_model, 64, pad_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                        eos_token_id=tok.eos_token_id)
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)

    loaded = load_tokenizer(str(ckpt))
    assert loaded.padding_side == "left" and loaded.pad_token == "<eos>"
    task = get_task(from_dict({"task": {"name": "sort", "length": 6}}).task, loaded)
    prompt = task.eval_prompts()[0]
    assert task.reward(prompt, task.answer(prompt)) == 1.0

    data = apply_overrides({}, [f"model.checkpoint={ckpt}", "model.num_layers=2", "task.length=6",
                                "task.partial_credit=true", "task.eval_size=8", f"coldstart.cache_dir={tmp_path / 'c'}",
                                "coldstart.target_accuracy=0.0", "coldstart.max_steps=0", "rl.steps=2",
                                "rl.prompts_per_step=2", "rl.group_size=4", "rl.minibatches=2", "rl.replay=old"])
    cfg = validate(from_dict(data))
    assert train(cfg, tmp_path / "run", run_id="ckpt") == "done"
    df = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    assert len(df) == 4 and df["routing/expert_change"].iloc[0] == 0.0
    # every column is filled, but the ratio decomposition's on the updates rl.decomp_every skips (NaN there)
    assert df.drop(columns=[c for c in DECOMP_KEYS if c in df]).select_dtypes("number").notna().all().all()
