"""Router log-probabilities in traces (record/replay/probe) and RSPO's router shift and gamma."""

import math

import pytest
import torch

from moe_lab.models.families import FAMILIES
from moe_lab.models.families.routers import sigmoid_router_logp
from moe_lab.models import moe_layers, position_ids_from_mask
from moe_lab.routing import Trace, record, replay, router_gamma, router_logp_probe, router_shift
from test_routing import ALL, TINY, perturb_routers, tiny_model, tokens


def family_logp(family: str, logits_NE: torch.Tensor) -> torch.Tensor:
    """Written from the definitions, in float64: log-softmax over all experts; DeepSeek: log(s_e / sum_j s_j)."""
    x = logits_NE.double()
    if FAMILIES[family].router_logp is sigmoid_router_logp:  # DeepSeek-V3 and the other sigmoid routers
        s = torch.sigmoid(x)
        return (s / s.sum(-1, keepdim=True)).log()
    return x - x.exp().sum(-1, keepdim=True).log()


class RouterInputs:
    """Captures each router's input of one (teacher-forced) call, to run the router module again by hand."""

    def __init__(self, model):
        self.layers, self.inputs = moe_layers(model), {}
        self.handles = [layer.router.register_forward_hook(self._hook(pos)) for pos, layer in enumerate(self.layers)]

    def _hook(self, pos):
        def hook(module, inputs, output):
            self.inputs.setdefault(pos, inputs[0].detach().clone())
        return hook

    def logits_LNE(self) -> list[torch.Tensor]:
        for h in self.handles:
            h.remove()
        with torch.no_grad():
            return [layer.router(self.inputs[pos])[0] for pos, layer in enumerate(self.layers)]


def manual_logp_LBSE(model, family, x, ctx=None) -> tuple[torch.Tensor, object]:
    """The family's log-probs (float64) from a manual forward of each router module on its captured input."""
    cap = RouterInputs(model)
    with torch.no_grad(), (ctx if ctx is not None else record(model)) as handle:
        model(x)
    B, S = x.shape
    return torch.stack([family_logp(family, lg).reshape(B, S, -1) for lg in cap.logits_LNE()]), handle


@pytest.mark.parametrize("family", ALL)
def test_recorded_router_logp_is_the_routers_log_prob_at_the_chosen_ids(family):
    model, x = tiny_model(family), tokens()
    with torch.no_grad(), record(model) as plain:
        logits_plain = model(x).logits
    dense_LBSE, trace = manual_logp_LBSE(model, family, x, record(model, router_logp=True))
    assert plain.router_logp_LBTK is None  # off by default: nothing kept
    assert torch.equal(trace.indices, plain.indices) and torch.equal(trace.weights, plain.weights)
    lp = trace.router_logp_LBTK
    assert lp.dtype == torch.float32 and lp.shape == trace.shape and not lp.requires_grad
    want = dense_LBSE.gather(-1, trace.indices.long())
    torch.testing.assert_close(lp.double(), want, rtol=0, atol=1e-5)
    assert bool((lp <= 0).all())
    # keeping log-probs changes no forward value
    with torch.no_grad(), record(model, router_logp=True), router_logp_probe(model):
        assert torch.equal(model(x).logits, logits_plain)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_unchanged_router_has_zero_shift_under_free_routing_and_replay(family):
    model, x = tiny_model(family), tokens()
    with torch.no_grad(), record(model, router_logp=True) as old:
        model(x)
    mask = torch.ones(x.shape, dtype=torch.bool)
    with torch.no_grad(), record(model) as free, router_logp_probe(model) as current:  # a second forward
        model(x)
    shift_BS, metrics = router_shift(old, current.at(old.indices), mask)
    assert torch.equal(free.indices, old.indices) and bool((shift_BS == 0).all())
    assert metrics["routing/router_shift"] == 0.0 and torch.equal(router_gamma(shift_BS), torch.ones_like(shift_BS))
    with torch.no_grad(), replay(model, old, router_logp=True) as handle, router_logp_probe(model) as probe:
        model(x)
    assert torch.equal(handle.router_logp_LBTK, old.router_logp_LBTK)
    assert torch.equal(handle.router_logp_at(old.indices), probe.at(old.indices))
    assert torch.equal(handle.latent.router_logp_LBTK, old.router_logp_LBTK)  # its own choice = the old one
    assert router_shift(old, handle.router_logp_LBTK, mask)[1]["routing/router_shift"] == 0.0


def _hand_shift(old_LBSE, new_LBSE, ids_LBSK, mask_BS):
    """Loop-by-loop: per token, mean over layers and old experts of |log p_new - log p_old|; metric means."""
    L, B, S, K = ids_LBSK.shape
    shift = torch.zeros(B, S, dtype=torch.float64)
    layer_sum = [0.0] * L
    for b in range(B):
        for s in range(S):
            if not mask_BS[b, s]:
                continue
            for l in range(L):
                d = sum(abs(float(new_LBSE[l, b, s, e] - old_LBSE[l, b, s, e])) for e in ids_LBSK[l, b, s].tolist()) / K
                shift[b, s] += d / L
                layer_sum[l] += d
    n = int(mask_BS.sum())
    return shift, float(shift.sum()) / n, [v / n for v in layer_sum]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("forced", [False, True])
def test_perturbed_router_shift_equals_a_hand_computation(family, forced):
    model, x = tiny_model(family), tokens()
    old_LBSE, old = manual_logp_LBSE(model, family, x, record(model, router_logp=True))
    perturb_routers(model, scale=0.3)
    mask = torch.ones(x.shape, dtype=torch.bool)
    mask[0, :3] = False
    cap = RouterInputs(model)
    with torch.no_grad(), (replay(model, old) if forced else record(model)), router_logp_probe(model) as current:
        model(x)
    new_LBSE = torch.stack([family_logp(family, lg).reshape(*x.shape, -1) for lg in cap.logits_LNE()])
    shift_BS, metrics = router_shift(old, current.at(old.indices), mask)
    want_BS, want_mean, want_L = _hand_shift(old_LBSE, new_LBSE, old.indices, mask)
    torch.testing.assert_close(shift_BS.double(), want_BS, rtol=1e-5, atol=1e-5)
    assert metrics["routing/router_shift"] > 0 and metrics["routing/router_shift"] == pytest.approx(want_mean, 1e-5)
    for l, want in enumerate(want_L):
        assert metrics[f"routing/layer_{l}/router_shift"] == pytest.approx(want, rel=1e-5)
    gamma_BS = router_gamma(shift_BS)
    assert bool(((gamma_BS > 0) & (gamma_BS <= 1)).all()) and bool((gamma_BS[mask] < 1).any())
    assert bool((gamma_BS[~mask] == 1).all())  # masked positions carry no weight change


def test_router_shift_exact_values_mask_and_refusals():
    old_LBSK = torch.log(torch.tensor([[[[0.5, 0.25], [0.5, 0.5]]], [[[0.25, 0.25], [0.1, 0.1]]]]))  # (2, 1, 2, 2)
    new_LBSK = old_LBSK + torch.tensor([[[[0.2, -0.4], [1.0, 1.0]]], [[[0.0, 0.6], [3.0, 3.0]]]])
    mask = torch.tensor([[True, False]])
    shift_BS, m = router_shift(old_LBSK, new_LBSK, mask)
    # token 0: layer 0 mean(|0.2|, |-0.4|) = 0.3, layer 1 mean(0, 0.6) = 0.3 -> 0.3; token 1 masked -> 0
    torch.testing.assert_close(shift_BS, torch.tensor([[0.3, 0.0]]))
    assert m == pytest.approx({"routing/router_shift": 0.3, "routing/layer_0/router_shift": 0.3,
                               "routing/layer_1/router_shift": 0.3})
    assert router_gamma(shift_BS)[0, 0].item() == pytest.approx(math.exp(-0.3))
    assert math.isnan(router_shift(old_LBSK, new_LBSK, torch.zeros(1, 2, dtype=torch.bool))[1]["routing/router_shift"])
    ids = torch.zeros(2, 1, 2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="carries no router_logp"):
        router_shift(Trace(ids, num_experts=8, family="qwen3_moe"), new_LBSK)
    with pytest.raises(ValueError, match="new_logp_LBSK: expected"):
        router_shift(old_LBSK, new_LBSK[:, :, :1])


@pytest.mark.parametrize("family", ALL)
def test_generate_trace_router_logp_equals_teacher_forced(family):
    model = tiny_model(family)
    prompt = tokens(B=3, S=6, seed=2)
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[0, :3], prompt_mask[1, :1] = 0, 0
    prompt = prompt.masked_fill(prompt_mask == 0, 0)
    torch.manual_seed(0)
    with record(model, router_logp=True) as gen_trace:
        seq = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=5, min_new_tokens=5, do_sample=True)
    mask = torch.cat([prompt_mask, torch.ones(3, seq.shape[1] - 6, dtype=prompt_mask.dtype)], dim=1)
    inp, inp_mask = seq[:, :-1], mask[:, :-1]
    with torch.no_grad(), record(model, router_logp=True) as tf_trace:
        model(inp, attention_mask=inp_mask, position_ids=position_ids_from_mask(inp_mask))
    real = inp_mask.bool()
    assert gen_trace.router_logp_LBTK.shape == tf_trace.shape
    assert torch.equal(gen_trace.indices[:, real], tf_trace.indices[:, real])
    torch.testing.assert_close(gen_trace.router_logp_LBTK[:, real], tf_trace.router_logp_LBTK[:, real],
                               rtol=1e-4, atol=1e-5)


def test_probe_refuses_a_missing_call_and_reads_only_matching_ids():
    model, x = tiny_model("qwen3_moe"), tokens()
    with pytest.raises(RuntimeError, match="no call of the model ran"):
        with router_logp_probe(model):
            pass
    with torch.no_grad(), record(model) as trace, router_logp_probe(model) as probe:
        model(x)
    assert probe.logp_LBSE.shape == (TINY.num_layers, *x.shape, TINY.num_experts)
    torch.testing.assert_close(probe.logp_LBSE.exp().sum(-1), torch.ones(TINY.num_layers, *x.shape))
    with pytest.raises(ValueError, match="ids: expected"):
        probe.at(trace[:2].indices)
    with pytest.raises(ValueError, match="router_logp=1: allowed True or False"):
        record(model, router_logp=1)


def test_families_all_have_a_router_logp():
    assert FAMILIES["deepseek_v3"].router_logp is not FAMILIES["qwen3_moe"].router_logp
    assert all(callable(spec.router_logp) for spec in FAMILIES.values())


@pytest.mark.parametrize("forced", [False, True])
def test_probe_under_activation_checkpointing_keeps_one_copy_of_the_forward(forced):
    model, x = tiny_model("qwen3_moe"), tokens()
    with torch.no_grad(), record(model, router_logp=True) as old:
        model(x)
    perturb_routers(model)
    model.train()
    dense = {}
    for checkpointing in (False, True):
        model.activation_checkpointing_enable() if checkpointing else model.activation_checkpointing_disable()
        ctx = replay(model, old) if forced else record(model, router_logp=True)
        with ctx, router_logp_probe(model) as probe:
            model(x, labels=x).loss.backward()  # the recompute runs the routers again inside the contexts
        dense[checkpointing] = probe.logp_LBSE
    assert dense[True].shape == (TINY.num_layers, *x.shape, TINY.num_experts)
    assert torch.equal(dense[True], dense[False])


def test_probe_at_given_ids_keeps_only_those_and_follows_the_kv_cache():
    model = tiny_model("qwen3_moe")
    prompt = tokens(B=2, S=4, seed=3)
    torch.manual_seed(0)
    with record(model, router_logp=True) as gen_trace:
        seq = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, min_new_tokens=4,
                             do_sample=True)
    ids = gen_trace.indices
    torch.manual_seed(0)
    with router_logp_probe(model, ids) as sparse, router_logp_probe(model) as dense:
        again = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, min_new_tokens=4,
                               do_sample=True)
    assert torch.equal(again, seq)
    assert torch.equal(sparse.at(ids), dense.at(ids)) and torch.equal(sparse.at(ids), gen_trace.router_logp_LBTK)
    with pytest.raises(RuntimeError, match="kept only the log-probs at its ids"):
        sparse.logp_LBSE
    with pytest.raises(ValueError, match="kept the log-probs at other ids only"):
        sparse.at(ids.flip(-1))
    with pytest.raises(ValueError, match="ids_LBSK: \\(B, S\\)=\\(2, 7\\) do not cover"):
        with torch.no_grad(), router_logp_probe(model, ids):
            model(seq)
