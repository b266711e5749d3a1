"""Rollout numerics: the FP8 and batch-variant kernels of an inference engine, emulated on the rollout copy.

``RolloutNumerics(float8, batch_variant).install(model)`` replaces the forward of the rollout copy's non-router
linear layers and fused experts (instance attributes of that copy only: the trained policy and every other model
keep their own forwards). Nothing is installed when both are off, so the default rollout keeps its bits.

float8: e4m3 fake quantisation (``fake_quant``: x / scale -> float8_e4m3fn -> float32 * scale, scale = amax / 448
per block, in fp32) of the weights and the activations entering every quantised GEMM, as DeepSeek-V3's FP8 recipe
and vLLM/SGLang's block-FP8 serving run them. Quantised: attention projections (q/k/v/o, MLA's a/b projections),
routed experts (fused ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], blocks within each expert; the
activations into both expert GEMMs: the routed tokens and act(gate) * up) and shared-expert MLPs. Kept in the
copy's precision (fp32): the router (its logits decide the top-k, and FP8 stacks keep the gate in bf16/fp32),
gate-like linears (``*_gate``, e.g. Qwen2-MoE's shared_expert_gate), embeddings, lm_head and norms, which those
stacks also leave unquantised. Blocks: DeepSeek-V3 uses 128 x 128 weight blocks and 1 x 128 activation tiles on
widths of 7168; moe_lab's models are 32-256 wide, where a 128 block would be one scale per matrix, so blocks here
are ``BLOCK`` = 32 (32 x 32 weights, 1 x 32 activation tiles): a few scales per row, as at full size.
Outputs: real FP8 GEMMs (DeepGEMM, vLLM/SGLang's w8a8 block-scaled kernels) accumulate in fp32 and write their
output in bf16, so every emulated GEMM's output, and the MoE combine's (the fused-MoE kernel's output), is rounded
to bf16 (``OUT_DTYPE``) before the fp32 copy carries on: the rollout sees that rounding as a real FP8 engine does.
The residual stream, attention softmax and norms stay fp32 (a real engine runs them in bf16: this emulation
adds less noise there than it has).

batch_invariant (the default): with float8 the emulated GEMMs take every row through the same one-row kernel
(``row_gemm``), so a sequence's bits do not depend on its batch; a float32 or bfloat16 rollout keeps the platform's
kernels untouched (today's bits), which on CPU are NOT batch-invariant: MKL's GEMM bits depend on the row count.

batch_variant: the reductions depend on the batch, as in an engine whose kernels are not batch-invariant (vLLM
#57016, Megatron-LM #7562). Every emulated GEMM becomes a split-K matmul whose number of K chunks follows its row
count M (``split_k_chunks``; for an expert, M = the tokens the batch routes to it). Each chunk's partial product
is rounded to the rollout's output dtype (bf16 under float8 and for a bf16 copy, fp32 for an fp32 copy) before the
partials are summed in fp32 and the sum rounded once more, as a split-K kernel that writes its partials in bf16
(or adds them with bf16 atomics) does. Why rounded partials: summing fp32 partials in another order moves a
result by ~1e-7 relative, which a bf16 output rounding hides in all but a few elements; with bf16 partials a
sequence's GEMM outputs move by up to about a bf16 ulp when its batch (M) changes, the size of the batch
dependence an engine's bf16 outputs carry. This is the strong end of that dependence (an engine whose split-K
reduce is fp32 moves fewer elements); even so it moved the mismatch table by less than its step-to-step spread
(results/reference/rollout_mismatch/LOG.md, the calibration). The MoE combine sums the k weighted expert
outputs starting from slot M mod k; floating-point addition commutes, so at k = 2 the combine order cannot
change a bit: there the batch dependence comes from the split-K GEMMs alone.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import nn

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 32  # weight blocks BLOCK x BLOCK, activation tiles 1 x BLOCK (see the module docstring)
OUT_DTYPE = torch.bfloat16  # what an FP8 GEMM writes (fp32 accumulation, bf16 output)


def fake_quant(x: torch.Tensor, block_rows: int, block_cols: int = BLOCK) -> torch.Tensor:
    """e4m3 fake quantisation of the last two dims of ``x`` in (block_rows x block_cols) blocks, one scale
    amax / 448 per block (an all-zero block keeps scale 1); returns fp32. block_rows=1: activation tiles."""
    shape = x.shape
    if x.numel() == 0:  # a width-0 weight (model.shared_expert=false) has no block to scale: nothing to round
        return x.float()
    x2 = x.float().reshape(-1, shape[-2] if x.dim() > 1 else 1, shape[-1])
    n, r, c = x2.shape
    # a block wider than the matrix is the matrix: its zero padding would change no amax and is dropped after
    block_rows, block_cols = min(block_rows, r), min(block_cols, c)
    pr, pc = -r % block_rows, -c % block_cols
    padded = nn.functional.pad(x2, (0, pc, 0, pr)) if pr or pc else x2
    blocks = padded.reshape(n, (r + pr) // block_rows, block_rows, (c + pc) // block_cols, block_cols)
    amax = blocks.abs().amax(dim=(2, 4), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    q = e4m3_to_float32((blocks / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)).mul_(scale)
    q = q.reshape(n, r + pr, c + pc)
    return (q[:, :r, :c] if pr or pc else q).reshape(shape)


# Every float8_e4m3fn bit pattern's float32 value, from torch's own conversion (so the same bits, NaNs included).
# Why a table: on CPU (torch 2.13) the float8 -> float32 cast runs element by element, 1.2 ms for 295k values,
# most of fake_quant's time; a gather from this table took 0.18 ms.
_E4M3_FLOAT32 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


def e4m3_to_float32(q: torch.Tensor) -> torch.Tensor:
    """``q.to(torch.float32)`` of float8_e4m3fn values, bit for bit (a table lookup on CPU)."""
    if q.device.type != "cpu":
        return q.to(torch.float32)
    return _E4M3_FLOAT32.index_select(0, q.view(torch.uint8).reshape(-1).int()).view(q.shape)


def quant_act(x: torch.Tensor) -> torch.Tensor:
    """Activations in 1 x BLOCK tiles along the last (reduction) dim, back in x's dtype."""
    flat = x.flatten(0, -2) if x.dim() > 1 else x[None]  # reshape(-1, 0) is ambiguous for a width-0 input
    return fake_quant(flat, 1).reshape(x.shape).to(x.dtype)


def split_k_chunks(rows: int, k: int) -> int:
    """K chunks of a batch-variant GEMM with ``rows`` rows: a stand-in for a split-K heuristic keyed on M (only
    that the grouping follows the batch matters), at least 8 elements per chunk."""
    return max(1, min(1 + rows % 3, k // 8))


@dataclass(frozen=True)
class RolloutNumerics:
    """What the rollout copy's GEMMs emulate (module docstring). ``install`` once on the copy; the quantised
    weights are cached per parameter and recomputed whenever the parameter changes (its in-place version)."""

    float8: bool = False
    batch_variant: bool = False

    @property
    def active(self) -> bool:
        return self.float8 or self.batch_variant

    def install(self, model: nn.Module) -> nn.Module:
        """Replace the forwards of ``model``'s quantisable linears and fused experts; refuses experts it cannot
        emulate (biased or transposed layouts: gpt_oss). A no-op when nothing is on."""
        if not self.active:
            return model
        cache: dict[int, tuple[int, torch.Tensor]] = {}
        out_emb = model.get_output_embeddings()
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and module is not out_emb and not name.endswith("gate"):
                module.forward = types.MethodType(_linear_forward(self, cache), module)
            elif _is_fused_experts(module):
                module.forward = types.MethodType(self.experts_forward(cache), module)
            elif getattr(getattr(module, "gate_up_proj", None), "dim", lambda: 0)() == 3:
                raise ValueError(f"rollout numerics: experts {name} ({type(module).__name__}) have a layout "
                                 "(bias or transposed weights) the emulation does not cover")
        return model

    def experts_forward(self, cache: dict):
        """The fused experts' forward these numerics install (``_experts_forward``)."""
        return _experts_forward(self, cache)

    def weight(self, w: torch.Tensor, cache: dict) -> torch.Tensor:
        """The weight the GEMM uses: blockwise e4m3 (per expert for 3-D weights) under float8, else ``w``."""
        if not self.float8:
            return w
        hit = cache.get(id(w))
        if hit is None or hit[0] != w._version:
            hit = (w._version, fake_quant(w.detach(), BLOCK).to(w.dtype))
            cache[id(w)] = hit
        return hit[1]

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype an emulated GEMM writes (its partials under batch_variant included): bf16 under float8, else
        the copy's own dtype."""
        return OUT_DTYPE if self.float8 else dtype

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ w[N, K]^T with activations quantised (float8) and K split by the rows (batch_variant), each
        partial and the sum written in ``out_dtype`` (module docstring), returned in x's dtype."""
        return self.gemm(quant_act(x) if self.float8 else x, w)

    def gemm(self, x: torch.Tensor, w: torch.Tensor, written: bool = True) -> torch.Tensor:
        """``matmul`` of activations already quantised (quant_act works row by row, so rows quantised together and
        then selected have the bits of rows selected and then quantised). ``written=False``: before the last
        rounding to ``out_dtype`` (``write`` applies it), which is elementwise: rows of several GEMMs can take it
        together."""
        x_RK = x.flatten(0, -2) if x.dim() > 1 else x[None]  # not reshape(-1, K): ambiguous when K = 0
        rows, k = x_RK.shape
        chunks = split_k_chunks(rows, k) if self.batch_variant else 1
        if chunks == 1:  # one partial: its rounding to ``out`` is the sum's (rounding twice changes no bit)
            y = row_gemm(x_RK, w)
        else:
            out, y = self.out_dtype(x.dtype), None
            for xc, wc in zip(torch.tensor_split(x_RK, chunks, dim=-1), torch.tensor_split(w, chunks, dim=-1)):
                part = row_gemm(xc, wc).to(out).float()  # the partial as the kernel writes it, summed in fp32
                y = part if y is None else y + part
        y = y.reshape(*x.shape[:-1], w.shape[0])
        return self.write(y, x.dtype) if written else y

    def write(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A GEMM's output as written (``out_dtype`` of activations in ``dtype``), returned in ``dtype``; exact
        for a value already written (fp32 sums of bf16 partials included)."""
        return y.to(self.out_dtype(dtype)).to(dtype)


def row_gemm(x_RK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """x @ w^T with every row through the same one-row kernel (a bmm of R 1 x K by K x N): its bits never depend
    on the other rows. The platform's GEMM does not give that on CPU: MKL blocks by the row count M (and the
    threads), so one row of an [M, K] product has other bits at another M (measured with torch 2.13 CPU)."""
    return torch.bmm(x_RK.unsqueeze(1), w_NK.t().unsqueeze(0).expand(x_RK.shape[0], -1, -1)).squeeze(1)


def _is_fused_experts(module: nn.Module) -> bool:
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(up, nn.Parameter) and isinstance(down, nn.Parameter) and up.dim() == 3
            and not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False)
            and hasattr(module, "act_fn"))


def _linear_forward(numerics: RolloutNumerics, cache: dict):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = numerics.matmul(x, numerics.weight(self.weight, cache))
        return y if self.bias is None else y + self.bias
    return forward


def _experts_forward(numerics: RolloutNumerics, cache: dict):
    """The fused experts' forward (transformers' eager loop: gate, up = x W_gu^T; act(gate) * up; W_d), with the
    numerics' GEMMs per expert and the combine summed over slots in the batch's order.

    Each expert gets the rows it got in the per-expert loop this replaces (``torch.where(index == e)``: its
    (token, slot) pairs in row-major order, so the same row count M for split_k_chunks), and act(gate) * up is
    taken per expert as there (an activation's vectorised body and scalar tail may differ by an ulp). What is
    batched over all experts is exact row by row or element by element: the activation quantisation (per row
    tiles), the rounding of the GEMMs' outputs to ``out_dtype``, the gate-weight product and the scatter. Same
    bits (tests/test_rollout_numerics_reference.py), a fraction of the small tensor ops."""
    def forward(self, hidden_NH: torch.Tensor, top_k_index_NK: torch.Tensor, top_k_weights_NK: torch.Tensor):
        N, K = top_k_index_NK.shape
        w_up, w_down = numerics.weight(self.gate_up_proj, cache), numerics.weight(self.down_proj, cache)
        slot_R, counts = _slots_by_expert(top_k_index_NK, w_up.shape[0])
        if not counts:  # every slot masked
            return hidden_NH.new_zeros(hidden_NH.shape)
        x_NH = quant_act(hidden_NH) if numerics.float8 else hidden_NH
        tok_R = slot_R.div(K, rounding_mode="floor")
        gate_up_R2I = numerics.write(torch.cat([numerics.gemm(x_NH[tok_R[rows]], w_up[e], written=False)
                                                for e, rows in counts]), hidden_NH.dtype)
        inter = []
        for _, rows in counts:  # the activation per expert, on the [M, 2I] block the per-expert loop had
            gate, up = gate_up_R2I[rows].chunk(2, dim=-1)
            inter.append(self.act_fn(gate) * up)
        inter_RI = torch.cat(inter)
        if numerics.float8:
            inter_RI = quant_act(inter_RI)
        y_RH = numerics.write(torch.cat([numerics.gemm(inter_RI[rows], w_down[e], written=False)
                                         for e, rows in counts]), hidden_NH.dtype)
        y_RH = y_RH * top_k_weights_NK.reshape(-1)[slot_R, None].to(y_RH.dtype)
        out_NKH = y_RH.new_zeros(N * K, hidden_NH.shape[-1]).index_copy_(0, slot_R, y_RH).reshape(N, K, -1)
        first = N % K if numerics.batch_variant else 0
        total = out_NKH[:, first]
        for j in range(1, K):
            total = total + out_NKH[:, (first + j) % K]
        return total.to(numerics.out_dtype(total.dtype)).to(total.dtype)  # the fused-MoE kernel's output
    return forward


def _slots_by_expert(top_k_index_NK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[tuple[int, slice]]]:
    """The flat (token * K + slot) indices of every routed slot grouped by expert, row-major within an expert, and
    (expert, its slice of them) for each expert with rows; masked slots (no expert: < 0 or >= E) are left out."""
    flat = top_k_index_NK.reshape(-1)
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    slot_R = torch.argsort(key, stable=True)
    sizes = torch.bincount(key, minlength=num_experts + 1)[:num_experts].tolist()
    counts, start = [], 0
    for e, size in enumerate(sizes):
        if size:
            counts.append((e, slice(start, start + size)))
        start += size
    return slot_R[:start], counts
