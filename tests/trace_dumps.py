"""Tiny MoE checkpoints and generation routes recorded with the tests' OWN hooks (not moe_lab's record()),
written in every layout moe_lab.formats reads: the shared material of tests/test_formats.py and
tests/test_check_trace.py."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM,
                          Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from moe_lab.formats.routes import Routes, RoutedSequence
from trace_writers import write_line, write_nemo_rl, write_prime_rl, write_sglang, write_vllm, write_vllm_split

VOCAB, TOP_K, EXPERTS = 48, 2, 8
_GATE = re.compile(r"\.layers\.(\d+)\.mlp\.gate$")


CLASSES = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
           "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
           "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
           "ernie4_5_moe": (Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM)}
_DEEPSEEK = dict(n_routed_experts=EXPERTS, moe_intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=2,
                 n_shared_experts=1)


def _family_fields(family: str) -> dict:
    """Each family's first decoder layer dense, as in the released models."""
    if family == "qwen3_moe":
        return dict(num_experts=EXPERTS, moe_intermediate_size=16, mlp_only_layers=[0], decoder_sparse_step=1,
                    norm_topk_prob=True)
    if family == "deepseek_v3":
        return dict(_DEEPSEEK, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
                    qk_nope_head_dim=4, v_head_dim=8,
                    # transformers builds no MTP layer; 0 keeps "decoder" and "moe+mtp" of different lengths
                    # (one dense and one MTP layer would give both 3 rows: glm4_moe below is that shape)
                    num_nextn_predict_layers=0)
    if family == "glm4_moe":  # GLM-4.5-Air's shape: a dense first layer and Glm4MoeConfig's default MTP layer
        return dict(_DEEPSEEK, head_dim=8)
    if family == "ernie4_5_moe":
        return dict(moe_num_experts=EXPERTS, moe_intermediate_size=16, moe_layer_start_index=1, moe_layer_end_index=-1,
                    moe_layer_interval=1, moe_num_shared_experts=0)
    raise ValueError(family)


def tiny_checkpoint(path: Path, family: str = "qwen3_moe", seed: int = 0, **overrides) -> Path:
    """3 decoder layers (``overrides`` may change that), the first dense: qwen3_moe mlp_only_layers=[0];
    deepseek_v3 and glm4_moe first_k_dense_replace=1; ernie4_5_moe moe_layer_start_index=1."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=TOP_K, max_position_embeddings=64,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config_cls, cls = CLASSES[family]
    config = config_cls(**{**common, **_family_fields(family), **overrides})
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # spread the router weights so that choices are not near ties
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return path


def tiny_multimodal_qwen35(path: Path, seed: int = 0) -> Path:
    """A Qwen3.5-MoE checkpoint as released (model_type qwen3_5_moe: a vision tower and text_config), tiny."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=TOP_K, max_position_embeddings=64, num_experts=EXPERTS,
                moe_intermediate_size=16, shared_expert_intermediate_size=16, head_dim=8, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1)
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return path


def load(path: Path):
    config = json.loads((path / "config.json").read_text())
    return CLASSES[config["model_type"]][1].from_pretrained(path, dtype=torch.float32).eval(), config


def generate_routes(model, prompts: list[list[int]], new_tokens: int, seed: int = 0) -> list[RoutedSequence]:
    """Sample a completion per prompt with the KV cache; each router's output ids kept by the test's own
    forward hooks, over the S - 1 positions generate() forwards. Engine log-probs from the raw logits."""
    gates = _gates(model)
    out = []
    for i, prompt in enumerate(prompts):
        calls: list[list[torch.Tensor]] = [[] for _ in gates]
        hooks = [mod.register_forward_hook(lambda _m, _a, o, l=l: calls[l].append(o[2].detach().clone()))
                 for l, mod in enumerate(gates)]
        torch.manual_seed(seed + i)
        try:
            # an explicit mask: generate() would otherwise mask every token equal to pad_token_id
            gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=True, top_k=0, top_p=1.0, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        finally:
            for h in hooks:
                h.remove()
        tokens = gen.sequences[0]
        ids_LSK = torch.stack([torch.cat(c).reshape(-1, TOP_K) for c in calls]).long()
        S = tokens.numel()
        logp = torch.stack([torch.log_softmax(lg[0].double(), -1)[t]
                            for lg, t in zip(gen.logits, tokens[len(prompt):])])
        out.append(full_sequence(tokens, len(prompt), ids_LSK, S, logp, f"prompt {i}"))
    return out


def _gates(model) -> list:
    found = [(int(m.group(1)), mod) for n, mod in model.named_modules() if (m := _GATE.search(n))]
    return [mod for _, mod in sorted(found, key=lambda t: t[0])]


@torch.no_grad()
def forward_routes(model, seqs: list[RoutedSequence], dtype: torch.dtype | None = None) -> list[RoutedSequence]:
    """The routes an engine running ``model`` (in ``dtype``: torch.bfloat16 is a bf16 engine) returns for each
    sequence's tokens: one forward over the S - 1 tokens it is fed, ids kept by the test's own hooks."""
    engine = copy.deepcopy(model).to(dtype) if dtype is not None else model
    out = []
    for s in seqs:
        calls: list[torch.Tensor] = []
        hooks = [g.register_forward_hook(lambda _m, _a, o: calls.append(o[2].detach().clone()))
                 for g in _gates(engine)]
        try:
            engine(input_ids=s.tokens[None, :-1])
        finally:
            for h in hooks:
                h.remove()
        ids_LSK = torch.stack([c.reshape(-1, TOP_K) for c in calls]).long()
        out.append(full_sequence(s.tokens, s.prompt_len, ids_LSK, s.num_tokens, s.engine_logprobs, s.where))
    return out


def older_policy(model, sigma: float, seed: int = 0):
    """A copy of ``model`` whose routers sit where they were some updates ago: each router weight moved by
    Gaussian noise of ``sigma`` times its own scale."""
    old = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in _gates(old):
            gate.weight.add_(torch.randn(gate.weight.shape, generator=g) * sigma * gate.weight.std())
    return old


def full_sequence(tokens, prompt_len, ids_LSK, S, logp=None, where="") -> RoutedSequence:
    """RoutedSequence over S positions; positions past the recorded ids are missing (mask False, ids -1)."""
    L, n, K = ids_LSK.shape
    ids = torch.full((L, S, K), -1, dtype=torch.long)
    ids[:, :n] = ids_LSK
    mask = torch.zeros(L, S, dtype=torch.bool)
    mask[:, :n] = True
    return RoutedSequence(tokens.clone(), prompt_len, Routes(ids, mask), logp, where)


def layout_fields(layout: str, seq: RoutedSequence, config: dict) -> dict:
    """A JSONL line's routed-experts fields for ``seq`` in ``layout`` (the writers of tests/trace_writers.py)."""
    r, n = seq.routes, seq.num_tokens
    stop = int(r.mask_LS.any(0).nonzero().max()) + 1 if r.mask_LS.any() else 0
    if layout == "vllm":  # every decoder layer, zeros in the dense one (the form verl #5037 met)
        return {"routed_experts": write_vllm(r, config=config, stop=stop).tolist()}
    if layout == "vllm_split":  # the OpenAI server: the prompt's rows on the response, the rest on the choice
        prompt_rows, rest = write_vllm_split(r, config=config, prompt_len=seq.prompt_len, layers="moe", stop=stop)
        return {"prompt_routed_experts": prompt_rows, "routed_experts": rest}
    if layout == "sglang":  # SGLang's capture buffer: every decoder layer (num_hidden_layers)
        return {"routed_experts": write_sglang(r, config=config, stop=stop, layers="decoder"),
                "routed_experts_start_len": 0}
    if layout == "nemo_rl":  # every decoder layer, NeMo-RL's placeholder route in the dense ones and the last row
        return {"routed_experts": write_nemo_rl(r, config=config, layers="decoder", stop=n)}
    if layout == "prime_rl":
        return {"routed_experts": write_prime_rl(r, config=config, stop=stop, layers="decoder")}
    raise ValueError(layout)


def write_jsonl(path: Path, sequences: list[RoutedSequence], layout: str, config: dict,
                logprobs: str = "moe_lab") -> Path:
    """``logprobs``: the stack whose field carries the engine's log-probs (trace_writers.write_logprobs)."""
    path.write_text("".join(write_line(s, layout_fields(layout, s, config), logprobs) + "\n" for s in sequences))
    return path
