"""Routing metrics: expert change between two routings, gate drift, expert load balance.

Pure tensor functions. Inputs are Traces or raw index tensors ids_LBSK; ``mask`` is (B, S) bool or 0/1 over
positions (e.g. the response mask) and every mean is over masked positions only. Work is vectorised with a
bitmask over the E experts per layer (a Python loop over layers only, never over tokens), which bounds
memory to one layer's (B, S, E) mask at a time.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moe_lab.algos import reductions as R

Tensor = torch.Tensor
# across ranks (moe_lab/algos/reductions.py): shares of response tokens by tokens; load metrics are per part
# (their max by max, the entropy only averaged: the global load is not the parts' mean)
REDUCTIONS = {
    "routing/expert_change": R.TOKEN_MEAN, "routing/any_change": R.TOKEN_MEAN, "routing/gate_drift": R.TOKEN_MEAN,
    "routing/layer_*/expert_change": R.TOKEN_MEAN, "routing/router_shift": R.TOKEN_MEAN,
    "routing/layer_*/router_shift": R.TOKEN_MEAN, "routing/load_entropy": R.TOKEN_MEAN,
    "routing/layer_*/load_entropy": R.TOKEN_MEAN, "routing/load_max_violation": R.MAX,
    "routing/layer_*/load_max_violation": R.MAX,
    # shares of response tokens (confidence: a token mean of the top-1 probability); the specialisation
    # indices (mutual informations) are only averaged over ranks
    "routing/confidence": R.TOKEN_MEAN, "routing/confidence_l*": R.TOKEN_MEAN, "routing/first_div_*": R.TOKEN_MEAN,
    "routing/specialization": R.TOKEN_MEAN, "routing/specialization_l*": R.TOKEN_MEAN,
    "routing/task_specialization": R.TOKEN_MEAN, "routing/task_specialization_l*": R.TOKEN_MEAN,
}


def _ids(x: Any, name: str) -> Tensor:
    ids = x if isinstance(x, Tensor) else getattr(x, "indices", x)  # (Tensor.indices is a sparse-tensor method)
    if not isinstance(ids, Tensor) or ids.dim() != 4 or ids.is_floating_point():
        raise ValueError(f"{name}: expected a Trace or an integer tensor ids_LBSK of 4 dims, got "
                         f"{type(ids).__name__} {tuple(getattr(ids, 'shape', ()))}")
    return ids


def _mask_BS(mask: Tensor | None, ids_LBSK: Tensor) -> Tensor:
    B, S = ids_LBSK.shape[1:3]
    if mask is None:
        return torch.ones(B, S, dtype=torch.bool, device=ids_LBSK.device)
    if tuple(mask.shape) != (B, S):
        raise ValueError(f"mask: expected shape (B, S)=({B}, {S}) of the traces, got {tuple(mask.shape)}")
    return mask.to(device=ids_LBSK.device).bool()


def _num_experts(*traces: Any) -> int:
    known = [t.num_experts for t in traces if not isinstance(t, Tensor) and hasattr(t, "num_experts")]
    if known:
        return int(known[0])
    return int(max(_ids(t, "trace").max().item() for t in traces)) + 1


def _bitmask_BSE(ids_BSK: Tensor, num_experts: int, name: str) -> Tensor:
    """(B, S, E) bool: which experts a position uses. Rejects duplicate ids within a position's top-k."""
    mask_BSE = torch.zeros(*ids_BSK.shape[:-1], num_experts, dtype=torch.bool, device=ids_BSK.device)
    mask_BSE.scatter_(-1, ids_BSK.long(), True)
    if not bool((mask_BSE.sum(-1) == ids_BSK.shape[-1]).all()):
        raise ValueError(f"{name}: a position lists the same expert twice in its top-k")
    return mask_BSE


def _dense_BSE(ids_BSK: Tensor, w_BSK: Tensor, num_experts: int) -> Tensor:
    dense_BSE = torch.zeros(*ids_BSK.shape[:-1], num_experts, dtype=torch.float32, device=ids_BSK.device)
    return dense_BSE.scatter_(-1, ids_BSK.long(), w_BSK.float())


def _check_pair(old: Any, new: Any) -> tuple[Tensor, Tensor]:
    ids_old, ids_new = _ids(old, "old"), _ids(new, "new")
    if ids_old.shape != ids_new.shape:
        raise ValueError(f"old/new: trace shapes (L, B, S, K) differ: {tuple(ids_old.shape)} vs {tuple(ids_new.shape)}")
    return ids_old, ids_new.to(ids_old.device)


def _change_stats(old: Any, new: Any, mask: Tensor | None) -> dict[str, Any]:
    """Per-layer sums over masked positions: changed share (1 - overlap/k), any-layer change, gate drift."""
    ids_old, ids_new = _check_pair(old, new)
    mask_BS = _mask_BS(mask, ids_old)
    E, K = _num_experts(old, new), ids_old.shape[-1]
    w_old, w_new = (None if isinstance(t, Tensor) else getattr(t, "weights", None) for t in (old, new))
    with_w = w_old is not None and w_new is not None
    change_L, router_L, drift_sum, drift_n = [], [], 0.0, 0
    any_BS = torch.zeros_like(mask_BS)
    for l in range(ids_old.shape[0]):
        a_BSE, b_BSE = _bitmask_BSE(ids_old[l], E, "old"), _bitmask_BSE(ids_new[l], E, "new")
        both_BSE = a_BSE & b_BSE & mask_BS[..., None]
        overlap_BS = both_BSE.sum(-1)
        change_L.append(((K - overlap_BS) * mask_BS).sum().item() / K)
        router_L.append(int(((overlap_BS < K) & mask_BS).sum().item()))
        any_BS |= (overlap_BS < K) & mask_BS
        if with_w:
            diff_BSE = _dense_BSE(ids_old[l], w_old[l], E) - _dense_BSE(ids_new[l], w_new[l].to(w_old.device), E)
            drift_sum += diff_BSE.abs()[both_BSE].sum().item()
            drift_n += int(both_BSE.sum().item())
    return dict(tokens=int(mask_BS.sum().item()), change_L=change_L, router_L=router_L, any=int(any_BS.sum().item()),
                with_w=with_w, drift_sum=drift_sum, drift_n=drift_n)


def expert_change(old: Any, new: Any, mask: Tensor | None = None) -> float:
    """Mean over masked positions, layers and top-k slots of 1 - |K_old ∩ K_new| / k (nan if mask is empty)."""
    st = _change_stats(old, new, mask)
    n = st["tokens"] * len(st["change_L"])
    return sum(st["change_L"]) / n if n else math.nan


def routing_metrics(old: Any, new: Any, mask: Tensor | None = None, prefix: str = "routing/") -> dict[str, float]:
    """expert_change (overall and per layer), any_change (share of positions with any layer changed) and,
    when both have weights, gate_drift (mean |w_old - w_new| over experts both routings kept)."""
    st = _change_stats(old, new, mask)
    n, L = st["tokens"], len(st["change_L"])
    out = {f"{prefix}expert_change": sum(st["change_L"]) / (n * L) if n else math.nan,
           f"{prefix}any_change": st["any"] / n if n else math.nan}
    for l, change in enumerate(st["change_L"]):
        out[f"{prefix}layer_{l}/expert_change"] = change / n if n else math.nan
    if st["with_w"]:
        out[f"{prefix}gate_drift"] = st["drift_sum"] / st["drift_n"] if st["drift_n"] else math.nan
    return out


def router_mismatch(rollout: Any, train: Any, mask: Tensor | None = None) -> dict[str, float]:
    """The R3 paper's (arXiv:2510.11370) routing mismatch table between two routings of the same tokens:
    expert_change (share of activated experts), router_change (share of (token, MoE layer) routers whose top-k
    SET differs), any_change (share of tokens with at least one such layer), routers_per_token (differing
    routers per token: router_change x L) and layer_{l}/router_change; nan on an empty mask."""
    st = _change_stats(rollout, train, mask)
    n, L = st["tokens"], len(st["router_L"])
    if not n:
        return {key: math.nan for key in ("expert_change", "router_change", "any_change", "routers_per_token")}
    out = {"expert_change": sum(st["change_L"]) / (n * L), "router_change": sum(st["router_L"]) / (n * L),
           "any_change": st["any"] / n, "routers_per_token": sum(st["router_L"]) / n}
    out.update({f"layer_{l}/router_change": changed / n for l, changed in enumerate(st["router_L"])})
    return out


def expert_load_LE(ids_LBSK: Tensor, num_experts: int, mask: Tensor | None = None) -> Tensor:
    """Token-slot assignments per layer and expert over masked positions, float (L, E)."""
    mask_BS = _mask_BS(mask, ids_LBSK)
    L, B, S, K = ids_LBSK.shape
    weight_LN = mask_BS[None, :, :, None].expand(L, B, S, K).reshape(L, -1).float()
    load_LE = torch.zeros(L, num_experts, dtype=torch.float32, device=ids_LBSK.device)
    return load_LE.scatter_add_(1, ids_LBSK.reshape(L, -1).long(), weight_LN)


def load_stats(load_LE: Tensor) -> dict[str, Tensor]:
    """Per layer: share of the busiest expert, how far it is above uniform (share * E - 1), normalised entropy
    of the load (1 = uniform; 0 = one expert), unused experts. All-zero rows (no tokens) give nan."""
    E = load_LE.shape[1]
    share_LE = load_LE / load_LE.sum(1, keepdim=True)
    plogp_LE = torch.where(share_LE > 0, share_LE * share_LE.log(), torch.zeros_like(share_LE))
    max_share_L = share_LE.max(1).values
    entropy_L = -plogp_LE.sum(1) / math.log(E) if E > 1 else torch.ones_like(max_share_L)
    entropy_L = torch.where(torch.isnan(max_share_L), max_share_L, entropy_L)
    return dict(max_share=max_share_L, max_violation=max_share_L * E - 1, entropy=entropy_L,
                unused=(load_LE == 0).sum(1))


def load_metrics(trace: Any, mask: Tensor | None = None, prefix: str = "routing/") -> dict[str, float]:
    """load_max_violation (max over layers of busiest share * E - 1) and load_entropy (mean over layers of
    the normalised entropy of the expert load), plus both per layer."""
    ids = _ids(trace, "trace")
    st = load_stats(expert_load_LE(ids, _num_experts(trace), mask))
    out = {f"{prefix}load_max_violation": st["max_violation"].max().item(),
           f"{prefix}load_entropy": st["entropy"].mean().item()}
    for l in range(ids.shape[0]):
        out[f"{prefix}layer_{l}/load_max_violation"] = st["max_violation"][l].item()
        out[f"{prefix}layer_{l}/load_entropy"] = st["entropy"][l].item()
    return out


def router_shift(old: Any, new_logp_LBSK: Tensor, mask: Tensor | None = None,
                 prefix: str = "routing/") -> tuple[Tensor, dict[str, float]]:
    """RSPO's router shift (arXiv:2510.23027): how far the router moved on the experts the OLD routing chose.

    ``old``: a Trace carrying ``router_logp_LBTK`` (or that tensor); ``new_logp_LBSK``: the current router's
    log-probs at the same (old) ids, e.g. ``RouterLogp.at(old.indices)``. Returns (shift_BS, metrics):
    shift_BS = mean over layers and old top-k experts of |log p_new(e) - log p_old(e)|, 0 off the mask (so
    its gamma is 1 there), detached fp32; metrics: ``router_shift`` = its mean over masked positions, and
    ``layer_{i}/router_shift`` per layer (means over the k slots and masked positions; nan on an empty mask).
    """
    old_LBSK = old if isinstance(old, Tensor) else getattr(old, "router_logp_LBTK", None)
    if old_LBSK is None:
        raise ValueError("old: the reference trace carries no router_logp; record it with "
                         "record(..., router_logp=True) or replay(..., router_logp=True)")
    if old_LBSK.dim() != 4 or tuple(new_logp_LBSK.shape) != tuple(old_LBSK.shape):
        raise ValueError(f"new_logp_LBSK: expected the old log-probs' shape (L, B, S, K)={tuple(old_LBSK.shape)}, "
                         f"got {tuple(new_logp_LBSK.shape)}")
    mask_BS = _mask_BS(mask, old_LBSK)
    with torch.no_grad():
        d_LBS = (new_logp_LBSK.detach().float().to(old_LBSK.device) - old_LBSK.float()).abs().mean(-1)
        d_LBS = torch.where(mask_BS, d_LBS, torch.zeros_like(d_LBS))
        shift_BS = d_LBS.mean(0)
        n = mask_BS.sum()
        per_layer_L = d_LBS.sum((1, 2)) / n  # nan (0/0) on an empty mask, like the other routing metrics
    values = torch.cat([(shift_BS.sum() / n).reshape(1), per_layer_L]).tolist()  # one sync
    out = {f"{prefix}router_shift": values[0]}
    out.update({f"{prefix}layer_{l}/router_shift": v for l, v in enumerate(values[1:])})
    return shift_BS, out


def router_gamma(shift_BS: Tensor) -> Tensor:
    """RSPO's per-token router-shift weight gamma = exp(-shift) in (0, 1] (the floor is the objective's)."""
    return torch.exp(-shift_BS)


def routing_confidence(trace: Any, mask: Tensor | None = None, prefix: str = "routing/") -> dict[str, float]:
    """Probability mass the router puts on the experts it chose: sum over the top-k of exp(router_logp), the
    router's probability over ALL experts (log-softmax, or DeepSeek's sigmoid scores normalised over E).
    ``confidence`` = mean over masked positions and layers, ``confidence_l{l}`` per layer (nan on an empty mask).
    {} when the trace carries no router log-probs (e.g. the rollout's trace)."""
    logp_LBSK = trace if isinstance(trace, Tensor) else getattr(trace, "router_logp_LBTK", None)
    if logp_LBSK is None:
        return {}
    mask_BS = _mask_BS(mask, logp_LBSK)
    with torch.no_grad():
        conf_LBS = logp_LBSK.float().exp().sum(-1)
        per_layer_L = torch.where(mask_BS, conf_LBS, torch.zeros_like(conf_LBS)).sum((1, 2)) / mask_BS.sum()
    values = torch.cat([per_layer_L.mean().reshape(1), per_layer_L]).tolist()
    out = {f"{prefix}confidence": values[0]}
    out.update({f"{prefix}confidence_l{l}": v for l, v in enumerate(values[1:])})
    return out


def first_divergence(ref: Any, new: Any, mask: Tensor | None = None, prefix: str = "routing/") -> dict[str, float]:
    """Share of masked positions whose first MoE layer with a changed expert SET (ref vs new) is l
    (``first_div_l{l}``), and of those where no layer changed (``first_div_none``); they sum to 1."""
    ids_ref, ids_new = _check_pair(ref, new)
    mask_BS = _mask_BS(mask, ids_ref)
    E = _num_experts(ref, new)
    changed_LBS = torch.stack([(_bitmask_BSE(ids_ref[l], E, "ref") != _bitmask_BSE(ids_new[l], E, "new")).any(-1)
                               for l in range(ids_ref.shape[0])])
    any_BS = changed_LBS.any(0)
    first_BS = changed_LBS.to(torch.uint8).argmax(0)  # index of the first True (0 when none: masked by any_BS)
    L, n = ids_ref.shape[0], mask_BS.sum()
    counts = [((first_BS == l) & any_BS & mask_BS).sum() for l in range(L)] + [(~any_BS & mask_BS).sum()]
    values = (torch.stack(counts).double() / n).tolist()
    out = {f"{prefix}first_div_l{l}": v for l, v in enumerate(values[:L])}
    out[f"{prefix}first_div_none"] = values[L]
    return out


def _entropy(p: Tensor) -> Tensor:
    return -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum()


def specialization(trace: Any, labels_BT: Tensor, mask: Tensor | None = None, prefix: str = "routing/",
                   name: str = "specialization") -> dict[str, float]:
    """Normalised mutual information between a position's label (token id, or a per-sequence task tag:
    labels of shape (B,) are broadcast over the columns) and its chosen experts, per layer, over masked
    positions. Each of the k chosen experts counts with weight 1/k; NMI = 2 I(X; E) / (H(X) + H(E))
    (arithmetic-mean normalisation), 0 when H(X) + H(E) = 0 (one label and one expert: nothing to share).
    ``{name}_l{l}`` per layer and ``{name}`` their mean; nan on an empty mask."""
    ids = _ids(trace, "trace")
    mask_BS = _mask_BS(mask, ids)
    L, B, S, K = ids.shape
    labels_BS = labels_BT.to(ids.device)
    labels_BS = labels_BS[:, None].expand(B, S) if labels_BS.dim() == 1 else labels_BS
    if tuple(labels_BS.shape) != (B, S):
        raise ValueError(f"labels_BT: expected shape (B, S)=({B}, {S}) or (B,)=({B},), got {tuple(labels_BT.shape)}")
    E, n = _num_experts(trace), int(mask_BS.sum())
    if n == 0:
        return {f"{prefix}{name}": math.nan, **{f"{prefix}{name}_l{l}": math.nan for l in range(L)}}
    _, x_N = torch.unique(labels_BS[mask_BS], return_inverse=True)
    X = int(x_N.max()) + 1
    nmi_L = []
    for l in range(L):
        e_NK = ids[l][mask_BS].long()
        joint_XE = torch.zeros(X * E, dtype=torch.float64, device=ids.device)
        joint_XE.index_add_(0, (x_N[:, None] * E + e_NK).reshape(-1),
                            torch.full((e_NK.numel(),), 1.0 / (K * n), dtype=torch.float64, device=ids.device))
        p_XE = joint_XE.view(X, E)
        h_x, h_e = _entropy(p_XE.sum(1)), _entropy(p_XE.sum(0))
        mi = h_x + h_e - _entropy(p_XE)
        nmi_L.append(torch.where(h_x + h_e > 0, 2 * mi / (h_x + h_e).clamp_min(1e-300), torch.zeros_like(mi)))
    values = torch.stack(nmi_L).tolist()
    out = {f"{prefix}{name}": sum(values) / L}
    out.update({f"{prefix}{name}_l{l}": v for l, v in enumerate(values)})
    return out
