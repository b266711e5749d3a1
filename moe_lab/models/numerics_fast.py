"""Fast batch-variant rollout numerics (``rl.rollout_kernels: batch_variant_fast``): the emulation of
moe_lab/models/numerics.py with the platform's GEMMs instead of the one-row kernel, and its own bits.

What it keeps from ``batch_variant``: the e4m3 fake quantisation (``fake_quant``: torch's own cast, the same
values), the bf16 output of every emulated GEMM and of the MoE combine, and the split-K rule (``split_k_chunks``:
the K chunks follow a GEMM's row count M, each chunk's partial written in the output dtype, the partials summed in
fp32 and the sum rounded once more). What differs: each chunk is one platform GEMM (torch.mm for a linear,
torch._grouped_mm over the experts), not one 1 x K product per row, so the fp32 order of the sums inside a chunk is
the platform's: other bits, at about a bf16 ulp of an output (tests/test_rollout_numerics_fast.py derives the
bound), the same physics.

Declared batch dependence: a row's bits depend on its batch only through the row counts of the GEMMs it goes
through: a linear's split-K chunks follow its M, as in ``batch_variant``; every expert's chunks follow the layer's
token count N (``batch_variant`` keys them on each expert's M_e: a fused-MoE kernel picks one configuration
from the batch's token count, and one chunking per layer lets all experts share one grouped GEMM per chunk);
each expert's GEMM has the platform's bits for its M_e (the slots the batch routes to it, padded below); and the
MoE combine starts from slot N mod k. Two things would add more, and are removed:
- The platform GEMM's row tail. MKL computes rows in micro-tiles and the last M mod 4 rows with another kernel
  (seen with MKL_CBWR=COMPATIBLE on AMD EPYC: a row's bits then depend on its position), so every GEMM's rows
  are zero-padded to a multiple of ``ROW_TILE`` and every real row goes through a full tile. Its bits then
  depend on the padded M, a function of M.
- The activation's vectorised body and scalar tail (an ulp apart): act(gate) * up runs on all experts' rows at
  once, on [rows, I] views whose rows are not contiguous with each other, so the tail falls on the same columns
  of every row whatever its position.
Everything else on the path is exact elementwise rounding or a row-wise gather, whose bits have no position.
"""

from __future__ import annotations

import dataclasses
import types

import torch
from torch import nn

from moe_lab.models.families import family_of_router
from moe_lab.models.numerics import RolloutNumerics, quant_act, split_k_chunks

# rows of every emulated GEMM padded to a multiple of this (module docstring): a multiple of MKL's 4-row tile
ROW_TILE = 8


@dataclasses.dataclass(frozen=True)
class FastNumerics(RolloutNumerics):
    """``RolloutNumerics`` with platform GEMMs (module docstring); batch-variant by definition."""

    batch_variant: bool = True

    def install(self, model: nn.Module) -> nn.Module:
        """``RolloutNumerics.install``, then the GEMMs left in the copy's precision (routers, gate-like linears,
        lm_head) run on rows padded to ROW_TILE as well: the same values, no position dependence."""
        super().install(model)
        for module in model.modules():
            if "forward" not in module.__dict__ and (isinstance(module, nn.Linear) or family_of_router(module)):
                module.forward = types.MethodType(_row_padded(type(module).forward), module)
        return model

    def gemm(self, x: torch.Tensor, w: torch.Tensor, written: bool = True) -> torch.Tensor:
        """As ``RolloutNumerics.gemm``, each K chunk one torch.mm over the rows padded to ``ROW_TILE``."""
        x_RK = x.flatten(0, -2) if x.dim() > 1 else x[None]
        rows, k = x_RK.shape
        chunks = split_k_chunks(rows, k)
        x_PK = nn.functional.pad(x_RK, (0, 0, 0, -rows % ROW_TILE)) if rows % ROW_TILE else x_RK
        y = self.sum_partials(torch.mm(xc, wc.t()) for xc, wc in
                               zip(torch.tensor_split(x_PK, chunks, -1), torch.tensor_split(w, chunks, -1)))
        y = y[:rows].reshape(*x.shape[:-1], w.shape[0])
        return self.write(y, x.dtype) if written else y

    def sum_partials(self, parts, out: torch.dtype | None = None) -> torch.Tensor:
        """fp32 sum of the partials in order, each written in ``out`` (``out_dtype``) when there are several."""
        parts = list(parts)
        if len(parts) == 1:  # one partial: its rounding is the sum's (``write``)
            return parts[0]
        out = out or self.out_dtype(parts[0].dtype)
        y = parts[0].to(out).float()
        for part in parts[1:]:
            y = y + part.to(out).float()
        return y

    def experts_forward(self, cache: dict):
        return _experts_forward(self, cache)

    def grouped(self, x_PK: torch.Tensor, w: torch.Tensor, tokens: int, ends_E: torch.Tensor, cache: dict):
        """Every expert's rows of x_PK (padded, expert e's end at ends_E[e]) @ w[e]^T, not yet written: the K chunks
        of ``tokens`` rows (split_k_chunks), one torch._grouped_mm per chunk."""
        chunks = split_k_chunks(tokens, x_PK.shape[-1])
        return self.sum_partials(_grouped_mm(xc, wc, ends_E) for xc, wc in
                                 zip(torch.tensor_split(x_PK, chunks, -1), self.chunked_weight(w, chunks, cache)))

    def chunked_weight(self, w: torch.Tensor, chunks: int, cache: dict) -> list[torch.Tensor]:
        """The (quantised) fused-expert weight [E, N, K] as ``chunks`` contiguous [E, K_c, N] right operands of
        torch._grouped_mm (``tensor_split`` of K, each zero-padded by ``_pad_k``), cached with the weight."""
        key = ("chunks", id(w), chunks)
        hit = cache.get(key)
        if hit is None or hit[0] != w._version:
            q = self.weight(w, cache)
            hit = (w._version, [_pad_k(c).transpose(1, 2).contiguous() for c in torch.tensor_split(q, chunks, -1)])
            cache[key] = hit
        return hit[1]


class _Layout:
    """The routed slots in expert order, each expert's rows zero-padded to a multiple of ROW_TILE. ``src_P``: the
    token each padded row takes (``pad_P``: the padding rows); ``pos_NK``: each (token, slot)'s padded row (the
    last padded row + 1, a zero row, for a masked slot); ``ends_E``: each expert's end in the padded rows."""

    def __init__(self, top_k_index_NK: torch.Tensor, num_experts: int):
        N, K = top_k_index_NK.shape
        flat = top_k_index_NK.reshape(-1)
        key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # masked slots sort last
        order = torch.argsort(key, stable=True)
        rows = torch.bincount(key, minlength=num_experts + 1)
        padded = (rows + ROW_TILE - 1) // ROW_TILE * ROW_TILE
        padded[num_experts] = 0
        self.ends_E = torch.cumsum(padded[:num_experts], 0).to(torch.int32)
        self.total = int(self.ends_E[-1])
        key_R = key[order]
        rank_R = torch.arange(N * K, device=flat.device) - (torch.cumsum(rows, 0) - rows)[key_R]  # within its expert
        pos_R = (torch.cumsum(padded, 0) - padded)[key_R] + rank_R
        pos_R = torch.where(key_R < num_experts, pos_R, self.total)
        self.pos_NK = torch.empty_like(pos_R).index_copy_(0, order, pos_R)
        src_P = torch.full((self.total + 1,), N, dtype=torch.long, device=flat.device).index_copy_(
            0, pos_R, order.div(K, rounding_mode="floor"))[:self.total]
        self.pad_P = (src_P == N).nonzero().squeeze(1)
        self.src_P = src_P.clamp_(max=N - 1)  # a padding row takes some token, then is zeroed (``gather``)
        self.masked = bool(self.total in pos_R)

    def gather(self, x_NH: torch.Tensor) -> torch.Tensor:
        """The padded rows: each expert's tokens in order, zeros after them."""
        return x_NH.index_select(0, self.src_P).index_fill_(0, self.pad_P, 0.0)

    def scatter(self, y_PH: torch.Tensor) -> torch.Tensor:
        """Each (token, slot)'s row of y_PH [N * K, H]; a zero row for a masked slot."""
        return (_with_zero_row(y_PH) if self.masked else y_PH).index_select(0, self.pos_NK)


def _grouped_mm(x_PK: torch.Tensor, w_EKN: torch.Tensor, ends_E: torch.Tensor) -> torch.Tensor:
    """x rows [ends[e-1], ends[e]) @ w[e] for every expert: torch._grouped_mm (on CPU one mm per group), or that
    loop where it is missing."""
    x_PK = _pad_k(x_PK).contiguous()
    if x_PK.device.type == "cpu" and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x_PK, w_EKN, offs=ends_E)
    y = x_PK.new_zeros(x_PK.shape[0], w_EKN.shape[-1])
    start = 0
    for e, end in enumerate(ends_E.tolist()):
        if end > start:
            torch.mm(x_PK[start:end], w_EKN[e], out=y[start:end])
        start = end
    return y


def _row_padded(forward):
    """``forward`` of a linear or router on its input's rows flattened and zero-padded to ROW_TILE; every output
    that has a row per padded row is cut back (a linear's to its input's leading shape)."""
    def padded(self, x: torch.Tensor, *args, **kwargs):
        x_RH = x.reshape(-1, x.shape[-1])
        rows, pad = x_RH.shape[0], -x_RH.shape[0] % ROW_TILE
        out = forward(self, nn.functional.pad(x_RH, (0, 0, 0, pad)) if pad else x_RH, *args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out[:rows].reshape(*x.shape[:-1], out.shape[-1])
        return type(out)(t[:rows] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows + pad else t
                         for t in out)
    return padded


def _pad_k(t: torch.Tensor) -> torch.Tensor:
    """K (the last dim) zero-padded to a multiple of 16 bytes (torch._grouped_mm needs 16-byte strides). The
    padded terms are exact zeros, so each sum keeps its value."""
    pad = -t.shape[-1] % (16 // t.element_size())
    return nn.functional.pad(t, (0, pad)) if pad else t


def _with_zero_row(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, t.shape[-1])])


def _experts_forward(numerics: FastNumerics, cache: dict):
    """The fused experts' forward of numerics._experts_forward on padded grouped GEMMs (module docstring); every
    expert's GEMMs take the K chunks of the layer's token count N (split_k_chunks(N, K)), as a fused-MoE kernel
    picks one configuration from the batch's token count."""
    def forward(self, hidden_NH: torch.Tensor, top_k_index_NK: torch.Tensor, top_k_weights_NK: torch.Tensor):
        N, K = top_k_index_NK.shape
        layout = _Layout(top_k_index_NK, self.gate_up_proj.shape[0])
        if not layout.total:  # every slot masked
            return hidden_NH.new_zeros(hidden_NH.shape)
        x_NH = quant_act(hidden_NH) if numerics.float8 else hidden_NH
        x_PH = layout.gather(x_NH)
        gate_up_P2I = numerics.write(numerics.grouped(x_PH, self.gate_up_proj, N, layout.ends_E, cache),
                                     hidden_NH.dtype)
        gate, up = gate_up_P2I.chunk(2, dim=-1)  # [P, I] views, rows 2I apart (module docstring)
        inter_PI = self.act_fn(gate) * up
        if numerics.float8:
            inter_PI = quant_act(inter_PI)
        y_PH = numerics.write(numerics.grouped(inter_PI, self.down_proj, N, layout.ends_E, cache), hidden_NH.dtype)
        out_NKH = layout.scatter(y_PH).reshape(N, K, -1)
        out_NKH = out_NKH * top_k_weights_NK.unsqueeze(-1).to(out_NKH.dtype)
        first = N % K
        total = out_NKH[:, first]
        for j in range(1, K):
            total = total + out_NKH[:, (first + j) % K]
        return total.to(numerics.out_dtype(total.dtype)).to(total.dtype)  # the fused-MoE kernel's output
    return forward


def rollout_numerics(rollout_dtype: str, rollout_kernels: str) -> RolloutNumerics:
    """The numerics of a rollout copy from its config fields (rl.rollout_dtype, rl.rollout_kernels)."""
    float8 = rollout_dtype == "float8"
    if rollout_kernels == "batch_variant_fast":
        return FastNumerics(float8=float8)
    return RolloutNumerics(float8=float8, batch_variant=rollout_kernels == "batch_variant")
