"""R3 in TRL's GRPOTrainer with a model and tokenizer of your own (docs/trl.md): no moe_lab helper builds them.

The model comes from ``AutoModelForCausalLM`` (``from_config`` of a tiny Qwen3-MoE, or ``--checkpoint`` a local
folder), the tokenizer is built here from a character vocabulary with the ``tokenizers`` library, the reward is
a plain function. Only the trainer is moe_lab's: ``routing_replay="rollout"`` (R3), its routing metrics printed
at the end, and their plot written (per-layer expert change and router shift, mismatch k3) to ``--plot``
(default ``routing.png`` in the current folder).
Off-policy on purpose (steps_per_generation=4): otherwise TRL's ratio is 1 and routing barely moves.

    pip install "moe_lab[trl]"
    python examples/trl_transformers_model.py [--steps 16] [--checkpoint DIR] [--plot routing.png]
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig

from moe_lab.integrations.trainer_state_plot import draw
from moe_lab.integrations.trl import MoEGRPOConfig, MoEGRPOTrainer

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3
SHOWN = {"reward": "reward", "routing/expert_change_latent": "latent_chg", "routing/router_shift": "shift",
         "routing/confidence": "confidence", "routing/aux_loss": "aux_loss", "mismatch/k3": "mismatch_k3",
         "mismatch/expert_change": "mismatch_chg"}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Every digit and '=' is a token; a prompt starts with <s>; left padding (prompts end where generation starts)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + list("0123456789="))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.add_special_tokens(SPECIAL)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", padding_side="left")


def tiny_moe(tok: PreTrainedTokenizerFast, checkpoint: str | None):
    if checkpoint:
        return AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
                            num_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(config)


def sort_reward(prompts, completions, **_):
    """Share of positions holding the sorted digit (partial credit)."""
    out = []
    for prompt, completion in zip(prompts, completions):
        want = "".join(sorted(prompt.rstrip("=")))
        out.append(sum(a == b for a, b in zip(completion.strip(), want)) / len(want))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32, help="optimizer steps (4 per generation)")
    ap.add_argument("--checkpoint", default=None, help="a local transformers MoE checkpoint (default: a tiny one)")
    ap.add_argument("--plot", default="routing.png", help="where to write the routing plot")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = char_tokenizer()
    rng = random.Random(0)
    data = Dataset.from_dict({"prompt": ["".join(rng.choices("0123456789", k=4)) + "=" for _ in range(64)]})
    with tempfile.TemporaryDirectory() as out_dir:
        config = MoEGRPOConfig(output_dir=out_dir, routing_replay="rollout", per_device_train_batch_size=8,
                               num_generations=8, steps_per_generation=4, max_completion_length=5, learning_rate=3e-3,
                               max_steps=args.steps, logging_steps=4, beta=0.0, report_to="none", use_cpu=True,
                               save_strategy="no", disable_tqdm=True, seed=0)
        trainer = MoEGRPOTrainer(model=tiny_moe(tok, args.checkpoint), reward_funcs=sort_reward, args=config,
                                 train_dataset=data, processing_class=tok)
        trainer.train()
    # the same plot as `python -m moe_lab.integrations.trainer_state_plot <checkpoint>/trainer_state.json`, or as
    # RoutingPlotCallback() in `callbacks` writes to <output_dir>/routing.png
    print("plot:", draw(trainer.state.log_history, args.plot))
    print("routing_replay=rollout (R3): per logging window of 4 optimizer steps, combined by token counts")
    print("step " + " ".join(f"{label:>12s}" for label in SHOWN.values()))
    for row in trainer.state.log_history:
        if "routing/confidence" in row:
            print(f"{row['step']:4d} " + " ".join(f"{row.get(name, float('nan')):12.4g}" for name in SHOWN))


if __name__ == "__main__":
    main()
