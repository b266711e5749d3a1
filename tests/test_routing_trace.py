"""Trace container: storage dtypes, row slicing, joining, moving and safetensors round trips."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_lab.routing import Trace, index_dtype


def random_trace(L=2, B=4, S=5, K=2, E=8, weights=True, seed=0, router_logp=False) -> Trace:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(L, B, S, E, generator=gen).argsort(-1)[..., :K].to(index_dtype(E))
    w = torch.rand(L, B, S, K, generator=gen) if weights else None
    lp = -torch.rand(L, B, S, K, generator=gen) * 3 if router_logp else None
    return Trace(ids, w, num_experts=E, family="qwen3_moe", router_logp=lp)


def _same_optional(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def same(a: Trace, b: Trace) -> bool:
    return (torch.equal(a.indices, b.indices) and _same_optional(a.weights, b.weights)
            and _same_optional(a.router_logp_LBTK, b.router_logp_LBTK) and a.num_experts == b.num_experts
            and a.family == b.family)


def test_index_dtype_fits_the_expert_count():
    assert index_dtype(256) == torch.uint8 and index_dtype(257) == torch.int16
    with pytest.raises(ValueError, match="num_experts=0 is out of range"):
        index_dtype(0)


@pytest.mark.parametrize("E,weights,router_logp", [(8, True, False), (8, False, False), (300, True, False),
                                                   (8, True, True), (8, False, True)])
def test_save_load_round_trip(tmp_path, E, weights, router_logp):
    trace = random_trace(E=E, weights=weights, router_logp=router_logp)
    trace.save(tmp_path / "t.safetensors")
    back = Trace.load(tmp_path / "t.safetensors")
    assert same(trace, back) and back.indices.dtype == index_dtype(E)
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as fh:  # plain safetensors with metadata
        meta = fh.metadata()
    assert meta["num_experts"] == str(E) and meta["family"] == "qwen3_moe" and meta["top_k"] == "2"


def test_loading_a_foreign_file_is_refused(tmp_path):
    save_file({"indices": torch.zeros(1, 1, 1, 1, dtype=torch.uint8)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not a moe_lab trace"):
        Trace.load(tmp_path / "x.safetensors")


def test_row_selection_forms_agree():
    trace = random_trace()
    by_list, by_tensor = trace.select([3, 1]), trace[torch.tensor([3, 1])]
    by_mask = trace[torch.tensor([False, True, False, True])]
    assert same(by_list, by_tensor)
    assert torch.equal(by_list.indices[:, 0], trace.indices[:, 3]) and torch.equal(by_list.weights[:, 1],
                                                                                    trace.weights[:, 1])
    assert same(by_mask, trace[[1, 3]]) and same(trace[1:3], trace[[1, 2]])
    assert trace[2].shape == (2, 1, 5, 2) and same(trace[-1], trace[[3]])  # an int keeps the batch axis
    with pytest.raises(ValueError, match="a bool mask needs shape"):
        trace[torch.tensor([True, False])]


def test_cat_restores_the_batch_and_refuses_mismatches():
    trace = random_trace()
    assert same(Trace.cat([trace[:1], trace[1:3], trace[3:]]), trace)
    with pytest.raises(ValueError, match="seq_len: 5 vs 4"):
        Trace.cat([trace, random_trace(S=4)])
    with pytest.raises(ValueError, match="num_experts: 8 vs 300"):
        Trace.cat([trace, random_trace(E=300)])
    with pytest.raises(ValueError, match="weights: True vs False"):
        Trace.cat([trace, random_trace(weights=False)])
    with pytest.raises(ValueError, match="at least one Trace"):
        Trace.cat([])


def test_router_logp_survives_slicing_joining_moving_and_attaching():
    trace = random_trace(router_logp=True)
    lp = trace.router_logp_LBTK
    assert same(Trace.cat([trace[:1], trace[1:3], trace[3:]]), trace)
    assert torch.equal(trace[[3, 1]].router_logp_LBTK, lp[:, [3, 1]])
    assert torch.equal(trace[torch.tensor([False, True, False, True])].router_logp_LBTK, lp[:, [1, 3]])
    assert trace.to("meta").router_logp_LBTK.device.type == "meta"
    assert trace.nbytes == random_trace().nbytes + lp.nbytes
    with pytest.raises(ValueError, match="router_logp: True vs False"):
        Trace.cat([trace, random_trace()])
    bare = random_trace()
    attached = bare.with_router_logp(lp.double())
    assert same(attached, trace) and attached.router_logp_LBTK.dtype == torch.float32 and bare.router_logp_LBTK is None


def test_shape_properties_bytes_and_device():
    trace = random_trace(L=3, B=2, S=4, K=2)
    assert (trace.num_layers, trace.batch_size, trace.seq_len, trace.top_k, len(trace)) == (3, 2, 4, 2, 2)
    assert trace.nbytes == 3 * 2 * 4 * 2 * (1 + 4)  # uint8 ids + float32 weights
    moved = trace.to("meta")
    assert moved.device.type == "meta" and moved.weights.device.type == "meta" and moved.shape == trace.shape


def test_constructor_refuses_wrong_dtypes_and_shapes():
    ids = torch.zeros(1, 2, 3, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="dtype torch.int16 for num_experts=300"):
        Trace(ids, num_experts=300, family="x")
    with pytest.raises(ValueError, match="weights: expected float32 of shape"):
        Trace(ids, torch.zeros(1, 2, 3, 1), num_experts=8, family="x")
    with pytest.raises(ValueError, match="router_logp: expected float32 of shape"):
        Trace(ids, num_experts=8, family="x", router_logp=torch.zeros(1, 2, 3, 2, dtype=torch.float64))
