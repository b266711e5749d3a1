"""The verdict of `moe-lab check-trace` on routes that line up structurally but disagree with the model.

Numerics flip a route only near a tie (trace_report.NEAR_TIE_ROUNDINGS); what disagrees beyond that is
another routing, named by where it sits:

- ``stale-routes``: disagreements far from a tie across the completion (routes of an older policy);
- ``stale-prompt``: far disagreements on the prompt's positions only (a stale prefix cache);
- ``physical-ids``: each MoE layer's ids are a fixed relabelling of the model's (the engine's load balancer's
  physical slots instead of logical experts: vLLM #33013, vllm-ascend #13882);
- ``repeated-rows``: one row at many positions of a sequence where the model routes otherwise (padded rows
  carrying a stale route: SGLang #36404);
- ``layer0-overwritten``: the first layer row disagrees (or a dense row 0 carries ids) while every other
  layer agrees (an MTP / draft router writing its capture into layer 0: vLLM #48622);
- ``low-agreement``: below LOW_AGREEMENT with none of these nor a shift explaining it.
"""

from __future__ import annotations

from collections import Counter

import torch

from moe_lab.audit.trace_report import LOW_AGREEMENT, NEAR_TIE_ROUNDINGS, SHIFT_GAIN, Checked, Tally, set_equal_LS
from moe_lab.audit.trace_run import usable_LS

Tensor = torch.Tensor
# A share of the usable slots disagreeing beyond a near tie that numerics do not reach (a few stray slots of
# a long dump are left to the margin line), and the fewest such slots a verdict rests on.
FAR_SHARE, FAR_MIN = 0.02, 3
REPEAT_MIN = 4  # positions one foreign row must cover to be named
AGREE = 0.9  # "the other layers agree": what a clean trace of a bf16 engine clears with room


def verdict(checked: list[Checked], t: Tally, num_experts: int, faults: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``faults`` (structural ones and shifts) with the agreement verdict added; a detector that explains a
    structural line replaces it."""
    names = {n for n, _ in faults}
    out = list(faults)
    layer0 = _layer0_overwritten(checked, t)
    if layer0:
        out = [f for f in out if not (f[0] == "dense-rows-carry-ids" and _only_row0(checked))] + [layer0]
    repeated = _repeated_rows(checked, num_experts)
    out += repeated
    if names & {"layer-shift", "position-shift", "completion-only"}:
        return out
    physical = _physical_ids(checked, num_experts, t.agreement)
    if physical:
        return out + [physical]
    if t.agreement < LOW_AGREEMENT:
        return out + [("low-agreement", f"only {t.agreement:.4f} of the routed slots match the model's own choice "
                                        "and no shift explains it: another checkpoint, or other tokens?")]
    keep = torch.ones(t.far_LR.shape[0], dtype=torch.bool)
    keep[0] = not layer0
    return out + ([] if repeated else _stale(t, keep))


def _stale(t: Tally, keep_L: Tensor) -> list[tuple[str, str]]:
    far_R, use_R = t.far_LR[keep_L].sum(0), t.usable_LR[keep_L].sum(0)
    share = [float(f) / float(u) if int(u) else 0.0 for f, u in zip(far_R, use_R)]
    stale = [int(f) >= FAR_MIN and s >= FAR_SHARE for f, s in zip(far_R, share)]
    detail = (f"prompt {int(far_R[0])} of {int(use_R[0])} slots ({share[0]:.1%}), completion {int(far_R[1])} of "
              f"{int(use_R[1])} ({share[1]:.1%}) disagree beyond {NEAR_TIE_ROUNDINGS:g} bf16 roundings of a tie, "
              "where numerics cannot flip a route")
    if stale[1]:
        return [("stale-routes", f"{detail}: the routes come from another policy (an older checkpoint's router?)")]
    if stale[0]:
        return [("stale-prompt", f"{detail}: the prompt's routes are stale while the completion's are the "
                                 "model's (a prefix cache holding routes of an older policy?)")]
    return []


def _layer_agreement(t: Tally, l: int) -> float:
    return float(t.agree_L[l]) / float(t.usable_L[l]) if int(t.usable_L[l]) else float("nan")


def _only_row0(checked: list[Checked]) -> bool:
    return {row for c in checked for row in c.seq.routes.dropped_nonzero} == {0}


def _layer0_overwritten(checked: list[Checked], t: Tally) -> tuple[str, str] | None:
    L = t.agree_L.shape[0]
    rest = float(t.agree_L[1:].sum()) / float(t.usable_L[1:].sum()) if int(t.usable_L[1:].sum()) else float("nan")
    if _only_row0(checked) and int(t.usable_L.sum()) and float(t.agree_L.sum()) >= AGREE * float(t.usable_L.sum()):
        return ("layer0-overwritten", "layer row 0, a dense layer by the model's config, carries expert ids while "
                                      f"every MoE layer agrees ({t.agreement:.4f}): a draft / MTP router's capture "
                                      "written into layer 0 (vLLM #48622)")
    first = _layer_agreement(t, 0)
    if L >= 2 and rest >= AGREE and first < LOW_AGREEMENT and int(t.far_LR[0].sum()) >= FAR_MIN:
        return ("layer0-overwritten", f"the first MoE layer agrees {first:.4f}, far from ties, while the others "
                                      f"agree {rest:.4f}: a draft / MTP router's capture overwrote layer 0's "
                                      "(vLLM #48622)")
    return None


def _sorted_rows(c: Checked, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(positions usable in every layer, the trace's rows there [P, L, K] sorted, the model's)."""
    r = c.seq.routes
    pos = usable_LS(r.ids_LSK, r.mask_LS, num_experts).all(0).nonzero().squeeze(1)
    sort = lambda ids_LSK: ids_LSK[:, pos].sort(-1).values.transpose(0, 1)  # noqa: E731
    return pos, sort(r.ids_LSK), sort(c.free.ids_LSK)


def _repeated_rows(checked: list[Checked], num_experts: int) -> list[tuple[str, str]]:
    """One row (every layer's top-k) at REPEAT_MIN or more positions of a sequence where the model routes
    otherwise, and more often than the model's own rows repeat there (chance: same tokens, same routes)."""
    hits = []
    for c in checked:
        pos, trace_PLK, model_PLK = _sorted_rows(c, num_experts)
        if pos.numel() < REPEAT_MIN:
            continue
        keys = [tuple(row.flatten().tolist()) for row in trace_PLK]
        own = max(Counter(tuple(row.flatten().tolist()) for row in model_PLK).values())
        key, n = Counter(keys).most_common(1)[0]
        at = [i for i, k in enumerate(keys) if k == key]
        foreign = sum(int(not torch.equal(trace_PLK[i], model_PLK[i])) for i in at)
        if n >= REPEAT_MIN and foreign >= REPEAT_MIN and n > 2 * own:
            hits.append(f"{c.seq.where}: one row at {n} positions ({int(pos[at[0]])}..{int(pos[at[-1]])}), "
                        f"{foreign} of them where the model routes otherwise (its own rows repeat at most {own}x)")
    if not hits:
        return []
    return [("repeated-rows", f"{len(hits)} of {len(checked)} sequences; first: {hits[0]}: padded or reused rows "
                              "carrying a stale route (SGLang #36404)")]


def _physical_ids(checked: list[Checked], num_experts: int, identity: float) -> tuple[str, str] | None:
    """Per MoE layer, the relabelling trace id -> model id that co-occurs most; a fault when it is a
    permutation (not the identity) under which the routes agree far better than as read."""
    L, E = checked[0].seq.routes.num_layers, num_experts
    co_LEE = torch.zeros(L, E, E, dtype=torch.long)  # [layer, trace id, model id]
    for c in checked:
        r = c.seq.routes
        use = usable_LS(r.ids_LSK, r.mask_LS, E)
        for l in range(L):
            a, b = r.ids_LSK[l][use[l]], c.free.ids_LSK[l][use[l]]
            co_LEE[l].index_put_((a[:, :, None].expand(-1, -1, b.shape[1]).reshape(-1),
                                  b[:, None, :].expand(-1, a.shape[1], -1).reshape(-1)),
                                 torch.ones(a.numel() * b.shape[1], dtype=torch.long), accumulate=True)
    seen_LE = co_LEE.sum(-1) > 0
    perm_LE = co_LEE.argmax(-1)
    for l in range(L):
        mapped = perm_LE[l][seen_LE[l]]
        if mapped.unique().numel() != mapped.numel():
            return None  # two ids onto one expert: not a relabelling
    if bool((perm_LE[seen_LE] == torch.arange(E).expand(L, E)[seen_LE]).all()):
        return None
    agree = total = 0
    for c in checked:
        r = c.seq.routes
        use = usable_LS(r.ids_LSK, r.mask_LS, E)
        relabelled = torch.stack([perm_LE[l][r.ids_LSK[l].clamp(0, E - 1)] for l in range(L)])
        agree += int((set_equal_LS(relabelled, c.free.ids_LSK) & use).sum())
        total += int(use.sum())
    mapped = agree / total if total else 0.0
    if not (mapped >= AGREE and mapped >= identity + SHIFT_GAIN):
        return None
    moved = {l: {int(i): int(perm_LE[l, i]) for i in range(E) if seen_LE[l, i] and int(perm_LE[l, i]) != i}
             for l in range(L)}
    shown = "; ".join(f"MoE layer {l}: {m}" for l, m in moved.items() if m)
    return ("physical-ids", f"the ids agree {mapped:.4f} after a fixed relabelling per layer (trace id: model "
                            f"id) vs {identity:.4f} as read - physical expert slots of the engine's load balancer, "
                            f"not logical experts (vLLM #33013): {shown[:600]}")
