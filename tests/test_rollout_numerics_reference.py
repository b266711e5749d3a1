"""The rollout numerics (moe_lab/models/numerics.py) give the bits of their first formulation, kept here as
``reference_*``: a fake quantisation through padded blocks, a split-K matmul that quantises its own input, and a
per-expert loop (torch.where(index == e)) writing every (token, slot) output before the combine. The fast path
batches what is exact row by row or element by element; these tests hold it to the reference bit for bit."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from moe_lab.config import ModelConfig
from moe_lab.models import build_model
from moe_lab.models.numerics import BLOCK, FP8_MAX, RolloutNumerics, fake_quant, row_gemm, split_k_chunks


def reference_fake_quant(x: torch.Tensor, block_rows: int, block_cols: int = BLOCK) -> torch.Tensor:
    shape = x.shape
    x2 = x.float().reshape(-1, shape[-2] if x.dim() > 1 else 1, shape[-1])
    n, r, c = x2.shape
    pr, pc = -r % block_rows, -c % block_cols
    blocks = nn.functional.pad(x2, (0, pc, 0, pr)).reshape(n, (r + pr) // block_rows, block_rows,
                                                            (c + pc) // block_cols, block_cols)
    amax = blocks.abs().amax(dim=(2, 4), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * scale
    return q.reshape(n, r + pr, c + pc)[:, :r, :c].reshape(shape)


def reference_matmul(numerics: RolloutNumerics, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = numerics.out_dtype(x.dtype)
    if numerics.float8:
        x = reference_fake_quant(x.reshape(-1, x.shape[-1]), 1).reshape(x.shape).to(x.dtype)
    x_RK = x.reshape(-1, x.shape[-1])
    chunks = split_k_chunks(*x_RK.shape) if numerics.batch_variant else 1
    acc = None
    for xc, wc in zip(torch.tensor_split(x_RK, chunks, dim=-1), torch.tensor_split(w, chunks, dim=-1)):
        y = row_gemm(xc, wc).to(out).float()
        acc = y if acc is None else acc + y
    return acc.to(out).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def reference_weight(numerics: RolloutNumerics, w: torch.Tensor) -> torch.Tensor:
    return reference_fake_quant(w.detach(), BLOCK).to(w.dtype) if numerics.float8 else w


def reference_experts(numerics: RolloutNumerics, experts, hidden_NH, top_k_index_NK, top_k_weights_NK):
    N, K = top_k_index_NK.shape
    w_up, w_down = reference_weight(numerics, experts.gate_up_proj), reference_weight(numerics, experts.down_proj)
    out_NKH = torch.zeros(N, K, hidden_NH.shape[-1], dtype=hidden_NH.dtype)
    for e in torch.unique(top_k_index_NK).tolist():
        if e < 0 or e >= w_up.shape[0]:
            continue
        tok, slot = torch.where(top_k_index_NK == e)
        gate, up = reference_matmul(numerics, hidden_NH[tok], w_up[e]).chunk(2, dim=-1)
        y = reference_matmul(numerics, experts.act_fn(gate) * up, w_down[e])
        out_NKH[tok, slot] = y * top_k_weights_NK[tok, slot, None].to(y.dtype)
    first = N % K if numerics.batch_variant else 0
    total = out_NKH[:, first]
    for j in range(1, K):
        total = total + out_NKH[:, (first + j) % K]
    return total.to(numerics.out_dtype(total.dtype)).to(total.dtype)


def reference_install(numerics: RolloutNumerics, model: nn.Module) -> nn.Module:
    """The fast install, then every replaced forward swapped for its reference: the same modules, the old maths."""
    numerics.install(model)
    for module in model.modules():
        if "forward" not in module.__dict__:
            continue
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(
                lambda self, x: (lambda y: y if self.bias is None else y + self.bias)(
                    reference_matmul(numerics, x, reference_weight(numerics, self.weight))), module)
        else:
            module.forward = types.MethodType(
                lambda self, h, idx, wts: reference_experts(numerics, self, h, idx, wts), module)
    return model


# (float8, batch_variant) for each emulated setting: float8 with batch_variant off and on, batch_variant alone
SETTINGS = [(True, False), (True, True), (False, True)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("shape", [(5, 7), (3, 40, 64), (33, 16), (70, 100), (2, 1, 96)])
@pytest.mark.parametrize("block_rows", [1, BLOCK])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fake_quant_equals_the_reference(shape, block_rows, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 3).to(dtype)
    x[..., :1] = 0  # an all-zero column (and, at width <= BLOCK... rows of tiles with a zero)
    assert torch.equal(fake_quant(x, block_rows), reference_fake_quant(x, block_rows))


@pytest.mark.parametrize("float8, batch_variant", SETTINGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [16, 40, 128])
def test_matmul_equals_the_reference(float8, batch_variant, dtype, k):
    numerics, gen = RolloutNumerics(float8, batch_variant), torch.Generator().manual_seed(k)
    w = reference_weight(numerics, torch.randn(24, k, generator=gen).to(dtype))
    for rows in range(1, 7):  # every split_k_chunks count
        x = torch.randn(rows, k, generator=gen).to(dtype)
        assert torch.equal(numerics.matmul(x, w), reference_matmul(numerics, x, w))


def tiny(family: str, top_k: int) -> nn.Module:
    return build_model(ModelConfig(family=family, num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
                                   num_experts=8, top_k=top_k, moe_intermediate_size=16, intermediate_size=48,
                                   max_positions=64), 48).eval()


@pytest.mark.parametrize("float8, batch_variant", SETTINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_equal_the_reference_with_masked_slots(float8, batch_variant, dtype):
    numerics = RolloutNumerics(float8, batch_variant)
    model = numerics.install(tiny("qwen3_moe", 3).to(dtype))
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 4, 13):
        hidden = torch.randn(tokens, 64, generator=gen).to(dtype)
        index = torch.randint(-1, 9, (tokens, 3), generator=gen)  # -1 and 8: masked slots (no expert)
        weights = torch.rand(tokens, 3, generator=gen).to(dtype)
        got = experts(hidden, index, weights)
        assert torch.equal(got, reference_experts(numerics, experts, hidden, index, weights))


@pytest.mark.parametrize("family, top_k", [("qwen3_moe", 3), ("deepseek_v3", 2), ("qwen2_moe", 3)])
@pytest.mark.parametrize("float8, batch_variant", SETTINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_model_logits_equal_the_reference_in_every_batch(family, top_k, float8, batch_variant, dtype):
    base = tiny(family, top_k).to(dtype)
    fast = RolloutNumerics(float8, batch_variant).install(copy.deepcopy(base))
    ref = reference_install(RolloutNumerics(float8, batch_variant), copy.deepcopy(base))
    for batch in (1, 2, 5):
        ids = torch.randint(3, 40, (batch, 11), generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            assert torch.equal(fast(ids).logits, ref(ids).logits)
