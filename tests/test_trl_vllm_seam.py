"""R3 with TRL's colocated vLLM engine, tested at the seam (vLLM is not installable here; no GPU): a stand-in
engine with vLLM's documented interface returns, per completion, ``routed_experts`` [tokens, layers, top_k] int16
(vLLM >= 0.22; the last sampled token never forwarded) = the experts its own forwards ran, seen by the tests'
hooks. The loss forwards must run exactly those experts. A real vLLM on a GPU is not exercised here."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("trl")

import test_trl_columns as C  # noqa: E402
import test_trl_integration as T  # noqa: E402
from trl_spy import LayerSpy, train  # noqa: E402

from moe_lab.integrations.trl import MoEGRPOTrainer, vllm  # noqa: E402


class StandInEngine:
    """vLLM's LLM at the seam: generate([{"prompt_token_ids": ...}], sampling_params, use_tqdm) -> RequestOutputs;
    routed experts only when built with enable_return_routed_experts=True, as vLLM does. Generates with the
    policy itself (a colocated engine holds the synced weights), one prompt at a time (no padding)."""

    def __init__(self, model, max_tokens: int, enable_return_routed_experts: bool = False, **_):
        self.model, self.max_tokens, self.routed = model, max_tokens, enable_return_routed_experts
        self.sequences: list[tuple[list[int], torch.Tensor]] = []  # (prompt + completion, routes) of every output

    def _one(self, prompt: list[int]):
        spy = LayerSpy(self.model)
        try:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                          do_sample=True, max_new_tokens=self.max_tokens, output_scores=True,
                                          return_dict_in_generate=True, pad_token_id=0, eos_token_id=2)
        finally:
            spy.remove()
        completion = out.sequences[0, len(prompt):].tolist()
        logps = [float(torch.log_softmax(s[0].float(), -1)[tok]) for s, tok in zip(out.scores, completion)]
        # the experts each forward ran (prefill, then one row per decode step): [tokens, decoder layers, top_k],
        # a dense decoder layer's rows left 0 as vLLM leaves them
        moe_SLK = torch.cat([torch.stack([call["ids_used"][pos][0] for pos in range(len(spy.layer_idx))], dim=1)
                             for call in spy.calls])
        routes = torch.zeros(moe_SLK.shape[0], self.model.config.num_hidden_layers, moe_SLK.shape[2], dtype=torch.int16)
        routes[:, spy.layer_idx] = moe_SLK.to(torch.int16)
        self.sequences.append((prompt + completion, routes))
        lp = [{tok: types.SimpleNamespace(logprob=v, rank=1)} for tok, v in zip(completion, logps)]
        done = types.SimpleNamespace(token_ids=completion, logprobs=lp,
                                     routed_experts=routes.numpy() if self.routed else None)
        return types.SimpleNamespace(prompt_token_ids=prompt, outputs=[done])

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        return [self._one(p["prompt_token_ids"]) for p in prompts]


class StandInGeneration:
    """TRL's VLLMGeneration at the seam: the same generate() contract, calling ``llm.generate`` as TRL's does."""

    def __init__(self, llm):
        self.llm = llm

    def sync_weights(self):  # the stand-in engine generates with the policy's own weights
        pass

    def generate(self, prompts, images, num_generations, profiler):
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=None, use_tqdm=False)
        completions = [c for o in outputs for c in o.outputs]
        logprobs = [[[next(iter(d.values())).logprob] for d in c.logprobs] for c in completions]
        return [o.prompt_token_ids for o in outputs], [c.token_ids for c in completions], logprobs, None


def test_the_engine_is_built_with_routed_experts_and_keeps_its_outputs():
    module, sink = types.SimpleNamespace(LLM=StandInEngine), vllm.EngineOutputs()
    with vllm.routed_llm(module, sink, on=True):
        llm = module.LLM(model=T.tiny_model("qwen3_moe"), max_tokens=3)
    assert module.LLM is StandInEngine  # restored after TRL's construction
    assert isinstance(llm, vllm.RoutedLLM) and llm.routed and llm.max_tokens == 3  # attributes pass through
    outputs = llm.generate([{"prompt_token_ids": [1, 5, 6]}])
    assert sink.outputs == outputs and outputs[0].outputs[0].routed_experts.dtype.name == "int16"
    with vllm.routed_llm(module, sink, on=False):
        assert module.LLM is StandInEngine


@pytest.mark.parametrize("dense_first", [False, True], ids=["all-moe", "dense-layer-0"])
def test_r3_with_a_stand_in_vllm_engine_runs_the_engines_experts(tmp_path, monkeypatch, dense_first):
    monkeypatch.setattr(vllm, "vllm_version", lambda: "0.22.0")
    if dense_first:
        t = MoEGRPOTrainer(model=C.dense_first_model(), reward_funcs=T.reward,
                           args=C.config(tmp_path, routing_replay="rollout"), train_dataset=T.dataset(),
                           processing_class=T.TOKENIZER)
    else:
        t = T.trainer(tmp_path, "qwen3_moe", "rollout", learning_rate=0.5)
    t.use_vllm = t.args.use_vllm = True  # what TRL's __init__ sets with use_vllm=True, without importing vLLM
    module, sink = types.SimpleNamespace(LLM=StandInEngine), t._moe_engine
    with vllm.routed_llm(module, sink, on=vllm.wants_routes(t.args)):  # as in MoEGRPOTrainer.__init__
        engine = module.LLM(model=t.model, max_tokens=t.args.max_completion_length)
    t.vllm_generation, t._last_loaded_step = StandInGeneration(engine), -1
    spy = train(t)
    losses = [c for c in spy.calls if c["grad"]]
    assert len(losses) == 2 and engine._llm.sequences
    pool = {tuple(tokens): routes for tokens, routes in engine._llm.sequences}
    checked = 0
    for call in losses:
        used = spy.LBSK(call, "ids_used")  # (L, B, S, K) sorted
        for b in range(call["ids"].shape[0]):
            real = call["mask"][b].nonzero().flatten()
            routes = pool[tuple(call["ids"][b, real].tolist())]  # [p + c - 1, decoder layers, K]
            n = routes.shape[0]
            want = routes[:, spy.layer_idx].long().permute(1, 0, 2).sort(-1).values
            assert torch.equal(used[:, b, real[:n]], want)
            checked += n
    assert checked > 0
    rows = [r for r in t.state.log_history if "mismatch/expert_change" in r]
    assert len(rows) == 2 and all(r["routing/expert_change"] == 0.0 for r in rows)


@pytest.mark.parametrize("version,over,says", [
    (None, {}, "needs vllm>=0.22"), ("0.21.1", {}, "found 0.21.1"),
    ("0.22.0", {"vllm_mode": "server"}, "allowed: vllm_mode='colocate'"),
    ("0.22.0", {"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size=1"),
    ("0.22.0", {"routing_replay_weights": True}, "allowed there: routing_replay_weights=False")])
def test_r3_with_vllm_is_refused_in_one_line_where_routes_cannot_come_back(tmp_path, monkeypatch, version, over, says):
    monkeypatch.setattr(vllm, "vllm_version", lambda: version)
    args = types.SimpleNamespace(use_vllm=True, routing_replay="rollout", vllm_mode="colocate",
                                 vllm_tensor_parallel_size=1, routing_replay_weights=False)
    for key, value in over.items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match=says) as err:
        vllm.check_rollout_with_vllm(args)
    assert "\n" not in str(err.value)


def test_a_route_missing_for_a_forwarded_token_is_refused():
    routes = torch.zeros(5, 2, 2, dtype=torch.int16)
    routes[:, :, 1] = 1
    routes[3] = -1  # no route for token 3 (e.g. not captured)
    done = types.SimpleNamespace(token_ids=[7, 8, 2], routed_experts=routes.numpy())
    out = [types.SimpleNamespace(prompt_token_ids=[1, 5, 6], outputs=[done])]
    config = T.tiny_model("qwen3_moe").config  # 2 MoE layers, top-2
    with pytest.raises(ValueError, match="miss 1 of 5 positions"):
        vllm.rollout_of(out, config, [0, 1], 4)
    routes[3] = routes[2]
    rollout = vllm.rollout_of(out, config, [0, 1], 4)
    assert rollout.prompt_lens == [3] and tuple(rollout.rows[0].shape) == (2, 5, 2)


def test_for_the_metrics_alone_missing_routes_leave_the_column_out_with_a_warning():
    routes = torch.full((5, 2, 2), -1, dtype=torch.int16)  # nothing captured
    out = [types.SimpleNamespace(prompt_token_ids=[1, 5, 6],
                                 outputs=[types.SimpleNamespace(token_ids=[7, 8, 2], routed_experts=routes.numpy())])]
    config = T.tiny_model("qwen3_moe").config
    with pytest.warns(UserWarning, match="mismatch/expert_change left out"):
        assert vllm.engine_rollout(out, config, [0, 1], 4, strict=False) is None
    with pytest.raises(ValueError, match="miss 5 of 5 positions"):
        vllm.engine_rollout(out, config, [0, 1], 4, strict=True)
