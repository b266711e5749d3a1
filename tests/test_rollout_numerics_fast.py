"""The fast batch-variant rollout numerics (rl.rollout_kernels=batch_variant_fast; moe_lab/models/numerics_fast.py):
e4m3 values of torch's own cast, a row whose bits depend on its batch only through the declared row counts, the
same bits twice, and GEMM outputs within the rounding that separates them from the exact emulation's
(batch_variant). CI runs these under both kernel settings (the default and ATEN_CPU_CAPABILITY=avx2
MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2, whose MKL computes a GEMM's last M mod 4 rows with another kernel)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_rollout_numerics import setup, tiny

from moe_lab.config import ConfigError
from moe_lab.models.numerics import BLOCK, FP8_MAX, RolloutNumerics, fake_quant, split_k_chunks
from moe_lab.models.numerics_fast import ROW_TILE, FastNumerics, rollout_numerics
from moe_lab.rl.loop import make_rollout_policy

U32 = 2.0 ** -24  # fp32 unit roundoff
BF16_HALF_ULP = 2.0 ** -8  # bf16 rounding to nearest moves a value by at most this times its magnitude


def torch_cast_quant(x: torch.Tensor, block_rows: int) -> torch.Tensor:
    """e4m3 fake quantisation written out with torch's own cast, block by block (no padding: shapes divide)."""
    out = torch.empty_like(x)
    for r in range(0, x.shape[0], block_rows):
        for c in range(0, x.shape[1], BLOCK):
            block = x[r:r + block_rows, c:c + BLOCK]
            scale = block.abs().max() / FP8_MAX
            out[r:r + block_rows, c:c + BLOCK] = (block / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale
    return out


def gemm_bound(xq: torch.Tensor, wq: torch.Tensor, chunks: int, got: torch.Tensor, other: torch.Tensor):
    """How far two emulated GEMMs of the same quantised operands may lie apart when they differ only in the fp32
    order of the sums inside each K chunk. Each chunk's fp32 sum of n products is within gamma_n * S_c of the
    exact one in any order (S_c = sum of |x_i w_i|, gamma_n = n u / (1 - n u)), so two orders differ by at most
    2 gamma_n S_c; with several chunks each partial is then rounded to bf16 (at most half an ulp, 2^-8 of its
    magnitude, on either side), the partials added in fp32 (u of the running sum, twice) and the sum rounded to
    bf16 (half an ulp of either result)."""
    bound = BF16_HALF_ULP * (got.abs() + other.abs())
    for xc, wc in zip(torch.tensor_split(xq.double(), chunks, -1), torch.tensor_split(wq.double(), chunks, -1)):
        n = xc.shape[-1]
        s_c = xc.abs() @ wc.abs().t()
        gamma = n * U32 / (1 - n * U32)
        part = 2 * gamma * s_c
        if chunks > 1:
            part = part + 2 * BF16_HALF_ULP * ((xc @ wc.t()).abs() + gamma * s_c) * (1 + 2 ** -7)
        bound = bound + part
    if chunks > 1:
        bound = bound + 2 * 2 * U32 * (xq.double().abs() @ wq.double().abs().t()) * (1 + 2 ** -6)
    return bound.float()


@pytest.mark.parametrize("rows", [3, 4, 5, 12, 13, 14])  # 1, 2 and 3 K chunks; padded to ROW_TILE or not
def test_fast_gemm_uses_torchs_e4m3_cast_and_stays_within_the_fp32_order_of_the_exact_gemm(rows):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 4 * BLOCK, generator=gen), torch.randn(BLOCK, 4 * BLOCK, generator=gen) * 3
    xq, wq = torch_cast_quant(x, 1), torch_cast_quant(w, BLOCK)
    fast, exact = FastNumerics(float8=True), RolloutNumerics(float8=True, batch_variant=True)
    assert torch.equal(fast.weight(w, {}), wq) and torch.equal(fake_quant(x, 1), xq)
    got, want = fast.matmul(x, fast.weight(w, {})), exact.matmul(x, exact.weight(w, {}))
    assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())  # written in bf16
    assert ((got - want).abs() <= gemm_bound(xq, wq, split_k_chunks(rows, x.shape[-1]), got, want)).all()
    # an activation rounded any other way (here: no quantisation) lands outside that bound somewhere
    unquantised = fast.gemm(x, wq)
    assert not ((unquantised - want).abs() <= gemm_bound(xq, wq, split_k_chunks(rows, 128), unquantised, want)).all()


def row_shuffle_and_neighbours(fn, x_RK: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fn on the rows shuffled (put back in order), and fn's first half of rows with the others replaced."""
    perm = torch.randperm(x_RK.shape[0], generator=gen)
    shuffled = torch.empty_like(fn(x_RK))
    shuffled[perm] = fn(x_RK[perm])
    half = x_RK.shape[0] // 2
    other = torch.cat([x_RK[:half], torch.randn(x_RK.shape[0] - half, x_RK.shape[1], generator=gen) * 5])
    return shuffled, fn(other)[:half]


@pytest.mark.parametrize("rows", [5, 9, 16, 37, 130])
@pytest.mark.parametrize("float8", [False, True])
def test_fast_gemm_row_bits_depend_on_the_row_count_only(rows, float8):
    """At a fixed row count M (its split-K chunks and padded M), shuffling the rows or replacing the others
    leaves every row's bits as they were; another M may change them (the declared batch dependence)."""
    gen = torch.Generator().manual_seed(rows)
    numerics = FastNumerics(float8=float8)
    for k, n in ((128, 128), (16, 128), (128, 32), (43, 24)):
        x, w = torch.randn(rows, k, generator=gen), numerics.weight(torch.randn(n, k, generator=gen), {})
        ref = numerics.matmul(x, w)
        shuffled, neighbours = row_shuffle_and_neighbours(lambda t: numerics.matmul(t, w), x, gen)
        assert torch.equal(shuffled, ref) and torch.equal(neighbours, ref[:rows // 2])
        assert torch.equal(numerics.matmul(x, w), ref)  # the same bits twice


def experts_of(model):
    return next(m for name, m in model.named_modules() if name.endswith("mlp.experts"))


@pytest.mark.parametrize("float8, dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_fast_experts_row_bits_depend_on_the_experts_row_counts_only(float8, dtype):
    """The fused experts at fixed routing (every expert's M_e fixed): tokens shuffled with their routes, or the
    other tokens' hidden states replaced, leave a token's output bits as they were. A bf16 copy (moe-lab
    fidelity's bf16 row) included: its K chunks of 36 are padded to 16 bytes for torch._grouped_mm."""
    model = FastNumerics(float8=float8).install(tiny(num_experts=8, top_k=3, hidden_size=72).to(dtype))
    experts, gen = experts_of(model), torch.Generator().manual_seed(4)
    N = 46  # 2 K chunks of the 72-wide hidden state, 36 each
    hidden = torch.randn(N, 72, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(N)])
    weights = torch.softmax(torch.randn(N, 3, generator=gen), -1)
    with torch.no_grad():
        ref = experts(hidden, ids, weights)
        perm = torch.randperm(N, generator=gen)
        shuffled = torch.empty_like(ref)
        shuffled[perm] = experts(hidden[perm], ids[perm], weights[perm])
        other = hidden.clone()
        other[N // 2:] = torch.randn(N - N // 2, 72, generator=gen).to(dtype) * 4
        neighbours = experts(other, ids, weights)[:N // 2]
        again = experts(hidden, ids, weights)
    assert torch.equal(shuffled, ref) and torch.equal(neighbours, ref[:N // 2]) and torch.equal(again, ref)


# qwen2_moe is left out as in test_rollout_numerics: its shared-expert gate's sigmoid runs on [N, 1], whose
# vectorised body and scalar tail differ by an ulp, so a token's bits there depend on its position.
@pytest.mark.parametrize("family, top_k", [("qwen3_moe", 2), ("qwen3_moe", 3), ("glm4_moe", 2)])
@pytest.mark.parametrize("float8", [False, True])
def test_fast_model_gives_a_shuffled_batch_the_same_bits_and_another_batch_other_bits(family, top_k, float8):
    base = tiny(family=family, top_k=top_k)
    model = FastNumerics(float8=float8).install(copy.deepcopy(base))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 40, (13, 8), generator=gen)  # 104 rows: 3 K chunks; 12 sequences: 96 rows, 1 chunk
    perm = torch.randperm(13, generator=gen)
    with torch.no_grad():
        ref = model(ids).logits
        shuffled = model(ids[perm]).logits
        again = FastNumerics(float8=float8).install(copy.deepcopy(base))(ids).logits  # a fresh copy: same bits
        fewer = model(ids[:12]).logits[:1]
    assert torch.equal(shuffled, ref[perm]) and torch.equal(again, ref)
    assert not torch.equal(fewer, ref[:1])  # row counts follow the batch, and with them the bits


def test_fast_leaves_the_policy_alone_and_keeps_unquantised_gemms_unquantised():
    """Only the copy's forwards are replaced; routers, gate-like linears and lm_head run on padded rows with
    their own weights (the same values as the platform's GEMM up to the fp32 order)."""
    policy = tiny()
    copy_ = FastNumerics(float8=True).install(copy.deepcopy(policy))
    assert not any("forward" in m.__dict__ for m in policy.modules())
    ids = torch.randint(3, 40, (3, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        h = policy.model(ids).last_hidden_state
        w = policy.lm_head.weight
        gamma = w.shape[1] * U32 / (1 - w.shape[1] * U32)  # any two fp32 orders: within 2 gamma_K sum |h_i w_i|
        assert ((copy_.lm_head(h) - policy.lm_head(h)).abs() <= 2 * gamma * (h.abs() @ w.abs().t())).all()
        assert torch.equal(copy_.lm_head.weight, w)
    assert ROW_TILE % 4 == 0  # a whole number of MKL's 4-row tiles


def test_config_accepts_batch_variant_fast_and_the_rollout_copy_uses_it():
    cfg, _, policy, _ = setup({"rollout_dtype": "float8", "rollout_kernels": "batch_variant_fast"})
    assert rollout_numerics("float8", "batch_variant_fast") == FastNumerics(float8=True)
    assert type(rollout_numerics("float8", "batch_variant")) is RolloutNumerics
    sampler = make_rollout_policy(policy, cfg.rl.section("rollout"))
    experts = experts_of(sampler)
    assert sampler is not policy and experts.forward.__func__.__qualname__.startswith("_experts_forward")
    assert experts.forward.__func__.__module__ == "moe_lab.models.numerics_fast"
    with pytest.raises(ConfigError, match="rollout_kernels=batch_variant_fast"):
        setup({"rollout_kernels": "batch_variant_fast"}, family="gpt_oss")


def test_fast_experts_give_a_token_whose_slots_are_all_masked_exactly_zero():
    """A masked slot (expert id < 0 or >= E, as a capacity limit writes it) reaches no expert: a token with only
    masked slots gets exactly 0, and all slots masked gives zeros."""
    experts = experts_of(FastNumerics(float8=True).install(tiny(num_experts=8, top_k=2)))
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(10, 64, generator=gen)
    ids = torch.randint(0, 8, (10, 2), generator=gen)
    ids[3] = torch.tensor([-1, 8])
    weights = torch.full((10, 2), 0.5)
    with torch.no_grad():
        out = experts(hidden, ids, weights)
        none = experts(hidden, torch.full_like(ids, -1), weights)
    assert torch.equal(out[3], torch.zeros(64)) and out.abs().sum(-1).gt(0).sum() == 9
    assert torch.equal(none, torch.zeros_like(hidden))
