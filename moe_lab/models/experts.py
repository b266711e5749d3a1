"""``model.experts_impl: fused``: a routed-experts forward without tokens x top-k x hidden temporaries.

transformers' grouped_mm path gathers every (token, slot) pair's hidden row ([N*K, H]), multiplies, weights and
scatters back, and its CPU kernel loops over all experts. This one walks the experts that received tokens: gather
that expert's rows, gate_up, the family's gate (``_apply_gate``: silu(gate) * up, gpt_oss's clamped swiglu, ...),
the routing weight applied on the narrow intermediate [n_e, I] (down is linear: (h w) W_d + w b_d = w (h W_d + b_d)),
down, index_add into the output. Its own autograd function keeps only the narrow gate_up outputs for the backward
and adds each expert's input gradient into one [N, H] buffer (autograd's gather backward would allocate a full
[N, H] per expert).

Bits: the same math as grouped_mm in another order (the weight multiplies before down, the K contributions add in
expert order): not bit-identical to it, within ~1e-7 relative in fp32 (tests/test_experts_fused.py bounds it at
1e-6 on logits and gradients). Deterministic on CPU and CUDA: a token reaches an expert at most once, so no
per-expert index_add sees a duplicate index, and the experts add in a fixed order (the one combine of small batches
runs on CPU only, where index_add is sequential). Registered through transformers' ``ExpertsInterface`` (the
supported way to add an experts implementation), under ``constants.FUSED_EXPERTS``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from moe_lab.config import constants as C

Tensor = torch.Tensor


class _Plan:
    """Which rows each expert takes: slots sorted by expert (stable: ascending token within an expert), their token
    ids, routing weights and expert ids, and the experts that received any, with their [start, end) in that order."""

    def __init__(self, top_k_index_NK: Tensor, top_k_weights_NK: Tensor, num_experts: int):
        K = top_k_index_NK.shape[-1]
        self.ids_S, self.perm_S = torch.sort(top_k_index_NK.reshape(-1), stable=True)
        self.tok_S = self.perm_S // K
        self.weight_S = top_k_weights_NK.reshape(-1)[self.perm_S]
        # each expert's end in the sorted slots (searchsorted, not bincount: no atomics on CUDA)
        bounds_E = torch.arange(1, num_experts + 1, device=self.ids_S.device, dtype=self.ids_S.dtype)
        self.offs_E = torch.searchsorted(self.ids_S, bounds_E).to(torch.int32)  # _grouped_mm's group ends
        ends = self.offs_E.tolist()  # one host sync per layer
        self.blocks = [(e, a, b) for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends)) if b > a]


def _weights(module: nn.Module) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    up = module.gate_up_proj if module.has_gate else module.up_proj
    up_bias = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias) if module.has_bias else None
    return up, up_bias, module.down_proj, module.down_proj_bias if module.has_bias else None


def _act(module: nn.Module, gu: Tensor) -> Tensor:
    return module._apply_gate(gu) if module.has_gate else module.act_fn(gu)


def _w(weight: Tensor, transposed: bool) -> Tensor:
    """One expert's weight as the right operand of x @ W: stored [in, out] (transposed) or [out, in] (default)."""
    return weight if transposed else weight.t()


# Below this many slot x hidden elements (decode: a few hundred tokens) the per-expert gathers, GEMMs and adds cost
# more in dispatch than an [S, H] buffer costs in memory: on CPU, gather once, torch._grouped_mm (its CPU kernel is
# one mm per expert, so the same bits as the loop) and one index_add. The same bits either way (gathers are exact;
# CPU index_add adds in index order, which is the experts' order; tests/test_experts_fused.py checks it). CUDA's
# index_add on repeated indices is atomic and its grouped_mm another kernel: there everything stays per expert.
SMALL_SLOTS_X_HIDDEN = 1 << 20


def _small(plan: _Plan, hidden_NH: Tensor, params) -> bool:
    # torch <= 2.10's CPU kernel needs 16-byte aligned weights (a memory-mapped checkpoint may not be)
    aligned = all(p is None or p.data_ptr() % 16 == 0 for p in params)
    return (hidden_NH.device.type == "cpu" and hasattr(torch, "_grouped_mm") and aligned
            and plan.ids_S.shape[0] * hidden_NH.shape[-1] <= SMALL_SLOTS_X_HIDDEN)


def _stack(weight_EIO: Tensor, transposed: bool) -> Tensor:
    """All experts' weights as _grouped_mm's right operand [E, in, out]."""
    return weight_EIO if transposed else weight_EIO.transpose(1, 2)


def _up(module, plan: _Plan, hidden_NH: Tensor, up: Tensor, up_bias: Tensor | None, small: bool) -> Tensor:
    """gate_up of every slot, [S, 2I] in the plan's order: per expert, its rows gathered and multiplied."""
    if small:
        gu_SO = torch._grouped_mm(hidden_NH.index_select(0, plan.tok_S), _stack(up, module.is_transposed),
                                  offs=plan.offs_E)
        return gu_SO if up_bias is None else gu_SO.add_(up_bias[plan.ids_S])
    gu_SO = hidden_NH.new_empty(plan.ids_S.shape[0], up.shape[-1] if module.is_transposed else up.shape[-2])
    for e, a, b in plan.blocks:
        torch.mm(hidden_NH.index_select(0, plan.tok_S[a:b]), _w(up[e], module.is_transposed), out=gu_SO[a:b])
    return gu_SO if up_bias is None else gu_SO.add_(up_bias[plan.ids_S])


def _forward(module, plan: _Plan, hidden_NH: Tensor, params) -> tuple[Tensor, Tensor]:
    """(output [N, H], gate_up [S, 2I]); the K contributions of a token add in fp32 at least (grouped_mm sums
    them in one reduction)."""
    up, up_bias, down, down_bias = params
    small = _small(plan, hidden_NH, params)
    gu_SO = _up(module, plan, hidden_NH, up, up_bias, small)
    w_S1 = plan.weight_S.to(gu_SO.dtype).unsqueeze(-1)
    hw_SI = _act(module, gu_SO) * w_S1  # the routing weight on the narrow intermediate
    acc_dtype = torch.promote_types(hidden_NH.dtype, torch.float32)
    out_NH = torch.zeros(hidden_NH.shape, dtype=acc_dtype, device=hidden_NH.device)
    if small:
        y_SH = torch._grouped_mm(hw_SI, _stack(down, module.is_transposed), offs=plan.offs_E)
        if down_bias is not None:
            y_SH += w_S1 * down_bias[plan.ids_S]
        return out_NH.index_add_(0, plan.tok_S, y_SH.to(acc_dtype)).to(hidden_NH.dtype), gu_SO
    for e, a, b in plan.blocks:
        y = hw_SI[a:b] @ _w(down[e], module.is_transposed)
        if down_bias is not None:
            y += w_S1[a:b] * down_bias[e]
        out_NH.index_add_(0, plan.tok_S[a:b], y.to(acc_dtype))
    return out_NH.to(hidden_NH.dtype), gu_SO


class _FusedExperts(torch.autograd.Function):
    """Forward as ``_forward``, keeping only the narrow gate_up [S, 2I]; the backward per expert for the GEMMs, the
    gate's own derivative by autograd over all slots at once (every family's ``_apply_gate`` as it is written)."""

    @staticmethod
    def forward(ctx, hidden_NH, top_k_weights_NK, module, plan, *params):
        out_NH, gu_SO = _forward(module, plan, hidden_NH, params)
        ctx.module, ctx.plan, ctx.weights_shape = module, plan, top_k_weights_NK.shape
        ctx.save_for_backward(hidden_NH, gu_SO, *params)
        return out_NH

    @staticmethod
    def backward(ctx, grad_NH):
        hidden_NH, gu_SO, *params = ctx.saved_tensors
        module, plan = ctx.module, ctx.plan
        grads = [torch.zeros_like(p) if p is not None else None for p in params]
        with torch.enable_grad():
            gu_leaf = gu_SO.detach().requires_grad_()
            h_SI = _act(module, gu_leaf)
        d_hw_SI, d_w_S = _down_backward(module, plan, grad_NH.to(gu_SO.dtype), h_SI.detach(), params, grads)
        d_w_S = d_w_S + (d_hw_SI * h_SI.detach()).sum(-1)
        (d_gu_SO,) = torch.autograd.grad(h_SI, gu_leaf, d_hw_SI * plan.weight_S.to(gu_SO.dtype).unsqueeze(-1))
        grad_hidden_NH = _up_backward(module, plan, hidden_NH, d_gu_SO, params, grads)
        grad_weights_S = torch.empty_like(d_w_S)
        grad_weights_S[plan.perm_S] = d_w_S  # back to the [N, K] slots
        return (grad_hidden_NH, grad_weights_S.to(plan.weight_S.dtype).reshape(ctx.weights_shape), None, None, *grads)


def _down_backward(module, plan: _Plan, grad_NH: Tensor, h_SI: Tensor, params, grads) -> tuple[Tensor, Tensor]:
    """y = (h w) W_d (+ w b_d) per expert: adds dW_d (and db_d) into grads; returns (dL/d(h w) [S, I], the bias
    term of dL/dw [S])."""
    _, _, down, down_bias = params
    _, _, g_down, g_down_bias = grads
    d_hw_SI = h_SI.new_empty(h_SI.shape)
    d_w_S = h_SI.new_zeros(h_SI.shape[0])
    w_S = plan.weight_S.to(h_SI.dtype)
    for e, a, b in plan.blocks:
        g = grad_NH.index_select(0, plan.tok_S[a:b])
        hw = h_SI[a:b] * w_S[a:b].unsqueeze(-1)
        g_down[e].addmm_(hw.t(), g) if module.is_transposed else g_down[e].addmm_(g.t(), hw)
        torch.mm(g, _w(down[e], module.is_transposed).t(), out=d_hw_SI[a:b])
        if down_bias is not None:
            g_down_bias[e] += w_S[a:b] @ g
            d_w_S[a:b] = g @ down_bias[e]
    return d_hw_SI, d_w_S


def _up_backward(module, plan: _Plan, hidden_NH: Tensor, d_gu_SO: Tensor, params, grads) -> Tensor:
    """gu = x W_gu (+ b_gu) per expert: adds dW_gu (and db_gu) into grads; returns dL/dx [N, H], each expert's
    rows added into one buffer."""
    up, up_bias, _, _ = params
    g_up, g_up_bias, _, _ = grads
    grad_hidden_NH = torch.zeros_like(hidden_NH)
    for e, a, b in plan.blocks:
        tok, d_gu = plan.tok_S[a:b], d_gu_SO[a:b]
        x = hidden_NH.index_select(0, tok)
        g_up[e].addmm_(x.t(), d_gu) if module.is_transposed else g_up[e].addmm_(d_gu.t(), x)
        if up_bias is not None:
            g_up_bias[e] += d_gu.sum(0)
        grad_hidden_NH.index_add_(0, tok, (d_gu @ _w(up[e], module.is_transposed).t()).to(grad_hidden_NH.dtype))
    return grad_hidden_NH


def fused_experts_forward(module: nn.Module, hidden_NH: Tensor, top_k_index_NK: Tensor,
                          top_k_weights_NK: Tensor) -> Tensor:
    """transformers' experts-forward signature: (experts module, hidden [N, H], expert ids [N, K], weights [N, K])
    -> [N, H]."""
    if getattr(module, "has_post_expert_norm", False) or getattr(module, "_is_expert_parallel", False):
        raise ValueError(f"experts_impl={C.FUSED_EXPERTS!r}: {type(module).__name__} has a post-expert norm or "
                         "expert parallelism, which it does not implement; allowed there: grouped_mm, eager")
    plan = _Plan(top_k_index_NK, top_k_weights_NK, module.num_experts)
    params = _weights(module)
    if torch.is_grad_enabled() and (hidden_NH.requires_grad or top_k_weights_NK.requires_grad
                                    or any(p is not None and p.requires_grad for p in params)):
        return _FusedExperts.apply(hidden_NH, top_k_weights_NK, module, plan, *params)
    return _forward(module, plan, hidden_NH, params)[0]


ExpertsInterface.register(C.FUSED_EXPERTS, fused_experts_forward)

__all__ = ["fused_experts_forward"]
